"""Exact edge patching block by block (``edge_attribution(method="blockwise")``) is exact edge
patching (``edge_effects``, one full split forward per edge) on every graph form the edge
graph reads (separate, grouped and fused projections, norms after the projections, MoE), with
padding, in every batch size; identical pairs give exactly 0; bad input is refused by name."""

import pytest
import torch

import pyattr.patching as P
import pyattr.patching.edges_blockwise as EB
import pyattr.patching.graph as G
import pyattr.targets as T
import pyattr.toy as toy
import pyattr.toy.circuit as TC
import pyattr.toy.task as task
from pyattr.config import RelevanceRules

from models import tiny_causal_lm


def _toy(path=None, n=6, kind="key"):
    model, _, _ = toy.load(path)
    model = model.double()
    clean, corrupt, answer, alternative = TC.pair_tensors(task.pairs(torch.Generator().manual_seed(11), n, kind=kind))
    return model, clean, corrupt, T.LogitDiff(answer, alternative)


def _tiny(arch, seed=0, attn="eager"):
    # the MoE experts' grouped matmul has no float64 kernel
    model = tiny_causal_lm(arch, attn, dtype=torch.float32 if arch == "mixtral" else torch.float64, seed=seed)
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, 60, (3, 7), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2] = torch.randint(3, 60, (3,), generator=g)
    corrupt[1, 5] = 11
    return model, clean, corrupt, T.LogitDiff([5, 6, 7], [8, 9, 10])


def _same(a, b, dtype):
    tol = 1e-6 if dtype == torch.float64 else 2e-4
    scale = max(1.0, float(b.per_pair.abs().max()))
    torch.testing.assert_close(a.per_pair, b.per_pair, atol=tol * scale, rtol=0)
    assert a.edges == b.edges and a.method == "blockwise" and b.method == "exact"
    torch.testing.assert_close(a.clean_metric, b.clean_metric, atol=1e-9 * scale, rtol=0)
    torch.testing.assert_close(a.corrupt_metric, b.corrupt_metric, atol=1e-9 * scale, rtol=0)


@pytest.mark.parametrize("path", [None, toy.INDUCTION_4L_DIR])
@pytest.mark.parametrize("kind", ["key", "value"])
def test_toy_blockwise_edges_are_exact_edge_patching(path, kind):
    model, clean, corrupt, metric = _toy(path, kind=kind)
    exact = P.edge_effects(model, clean, corrupt, metric)
    _same(P.edge_attribution(model, clean, corrupt, metric, method="blockwise"), exact, torch.float64)
    # the effects are not all alike: a test of equality on zeros would pass anything
    assert float(exact.per_pair.abs().max()) > 1.0 and float(exact.per_pair.std()) > 0.01


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma", "gpt2", "phi3", "mixtral"])
def test_blockwise_edges_are_exact_edge_patching_on_every_graph_form(arch):
    # llama: grouped-query attention (2 key-value heads for 4); qwen3: q/k norms after the
    # projections; gpt2: one fused Conv1D; phi3: one fused linear; mixtral: an MoE MLP
    model, clean, corrupt, metric = _tiny(arch)
    dtype = next(model.parameters()).dtype
    exact = P.edge_effects(model, clean, corrupt, metric)
    _same(P.edge_attribution(model, clean, corrupt, metric, method="blockwise"), exact, dtype)
    assert float(exact.per_pair.abs().max()) > 1e-3


def test_blockwise_edges_with_padding_and_any_batch_size():
    # sdpa: transformers' eager attention gives this left-padded row NaN logits (0 · NaN of
    # the padded positions' values), which blockwise refuses (below)
    model, clean, corrupt, metric = _tiny("llama", seed=2, attn="sdpa")
    mask = torch.ones_like(clean)
    mask[0, :2] = 0          # left padding on row 0
    mask[2, -1] = 0          # right padding on row 2
    kw = dict(attention_mask=mask, corrupt_attention_mask=mask)
    exact = P.edge_effects(model, clean, corrupt, metric, **kw)
    for bs in (1, 7, 3 * 5, None):
        got = P.edge_attribution(model, clean, corrupt, metric, method="blockwise", batch_size=bs, **kw)
        _same(got, exact, torch.float64)
    eager = _tiny("llama", seed=2)[0]
    with pytest.raises(ValueError, match=r"metric: the clean run's metric is not finite on row\(s\) \[0\]"):
        P.edge_attribution(eager, clean, corrupt, metric, method="blockwise", **kw)


def test_identical_pairs_give_exactly_zero():
    model, clean, _, metric = _toy(n=4)
    res = P.edge_attribution(model.float(), clean, clean, metric, method="blockwise", batch_size=50)
    assert res.per_pair.shape == (4, 110) and bool((res.per_pair == 0).all())


def test_edges_run_by_the_stage_that_reads_them():
    model = _toy()[0]
    graph = G.build_graph(G.layout(model))
    st = EB.stages(graph)
    names = graph.downstream
    assert [st[names.index(n)] for n in ("a0.h2<k>", "m0", "a1.h0<q>", "m1", "logits")] == [0, 0, 1, 1, 2]
    # layer 1's inputs read the input, 4 heads and m0: most edges run one block or none
    per = [sum(st[d] == s for _, d in graph.edges) for s in range(3)]
    assert per == [12 + 5, 12 * 6 + 10, 11]


@pytest.mark.parametrize("kwargs,msg", [
    ({"method": "blockwise", "rules": RelevanceRules(normalization=True)},
     "rules: method='blockwise' runs the later blocks exactly"),
    ({"method": "blockwise", "steps": 4}, "steps: only method='ig' interpolates"),
    ({"method": "relp", "batch_size": 8}, "batch_size: only method='blockwise'"),
    ({"method": "blockwise", "batch_size": 0}, "batch_size"),
    ({"method": "exact"}, "method: expected one of \\['relp', 'atp', 'ig', 'blockwise'\\]"),
])
def test_bad_arguments_are_refused_by_name(kwargs, msg):
    model, clean, corrupt, metric = _toy(n=2)
    with pytest.raises(ValueError, match=msg):
        P.edge_attribution(model, clean, corrupt, metric, **kwargs)


def test_a_metric_read_inside_a_block_is_refused():
    model, clean, corrupt, _ = _toy(n=2)
    with pytest.raises(ValueError, match="metric: method='blockwise' reads the metric after the last block"):
        P.edge_attribution(model, clean, corrupt, T.ModuleOutput("model.layers.0.mlp"),
                           method="blockwise")


def test_patch_edges_command_blockwise_is_exact(tmp_path, capsys):
    import json

    from pyattr.cli import main

    docs = {}
    for method in ("blockwise", "exact"):
        js = tmp_path / f"{method}.json"
        assert main(["patch", "--edges", "--method", method, "--json", str(js), "--top", "3"]) == 0
        docs[method] = json.loads(js.read_text())
    assert "110 edges scored by blockwise in " in capsys.readouterr().out
    assert docs["blockwise"]["method"] == "blockwise" and len(docs["blockwise"]["edges"]) == 110
    assert [e["edge"] for e in docs["blockwise"]["edges"]] == [e["edge"] for e in docs["exact"]["edges"]]
    assert [e["score"] for e in docs["blockwise"]["edges"]] == pytest.approx(
        [e["score"] for e in docs["exact"]["edges"]], abs=1e-4)
