"""Edge attribution and circuit evaluation: the split forward is the model's own, a circuit
of every edge is the clean run and one of none the corrupt run, patching every edge out of
a head is activation patching of that head, an edge's EAP score is the derivative of the
run with that edge moved toward its corrupt value, exact edge patching is the model with the
downstream input rewritten by hand, and bad input is refused by name."""

import pytest
import torch

import pyattr.patching as P
import pyattr.patching.graph as G
import pyattr.targets as T
import pyattr.toy as toy
import pyattr.toy.circuit as TC
import pyattr.toy.task as task
from pyattr.config import RelevanceRules
from pyattr.patching.circuit import MIB_SIZES, _areas, patched_metrics, prune, top_edges
from pyattr.patching.edges import split_run

from models import tiny_causal_lm


@pytest.fixture(scope="module")
def toy_pairs():
    model, _, _ = toy.load()
    model = model.double()
    pairs = task.pairs(torch.Generator().manual_seed(11), 6, kind="key")
    clean, corrupt, answer, alternative = TC.pair_tensors(pairs)
    return model, clean, corrupt, T.LogitDiff(answer, alternative)


def _tiny_pairs(arch, seed=0):
    # the MoE experts' grouped matmul has no float64 kernel
    model = tiny_causal_lm(arch, dtype=torch.float32 if arch == "mixtral" else torch.float64, seed=seed)
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, 60, (3, 7), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2] = torch.randint(3, 60, (3,), generator=g)
    return model, clean, corrupt, T.LogitDiff([5, 6, 7], [8, 9, 10])


def _context(model, clean, corrupt, metric):
    import pyattr.methods._core as core
    from pyattr.patching.pairs import metric_targets, prepare_pair

    lay = G.layout(model)
    graph = G.build_graph(lay)
    pair = prepare_pair(model, clean, corrupt, None, None, None, "test", alignable=False)
    tgts = metric_targets(metric, clean.shape[0])
    return core, lay, graph, pair, tgts


def _all_in_none_in(model, clean, corrupt, metric):
    core, lay, graph, pair, tgts = _context(model, clean, corrupt, metric)
    with core.attribution_pass(model, RelevanceRules(), False, "test"), torch.no_grad():
        v_c, _, fixed = split_run(model, lay, graph, pair.clean, tgts, "record", check=True)
        v_x, sx, _ = split_run(model, lay, graph, pair.corrupt, fixed, "record")
        m = patched_metrics(model, lay, graph, pair, fixed, torch.stack(sx.acts),
                            torch.stack([graph.valid, torch.zeros_like(graph.valid)]))
    tol = 1e-9 if next(model.parameters()).dtype == torch.float64 else 1e-4
    torch.testing.assert_close(m[0], v_c.double().cpu(), atol=tol, rtol=0)
    torch.testing.assert_close(m[1], v_x.double().cpu(), atol=tol, rtol=0)
    return graph


def test_toy_graph_has_the_edges_eap_defines(toy_pairs):
    model = toy_pairs[0]
    graph = G.build_graph(G.layout(model))
    assert graph.upstream[:6] == ["input", "a0.h0", "a0.h1", "a0.h2", "a0.h3", "m0"]
    assert graph.downstream[:3] == ["a0.h0<q>", "a0.h1<q>", "a0.h2<q>"] and graph.downstream[-1] == "logits"
    # layer 0's 12 q/k/v inputs read the input; m0 reads input + 4 heads; layer 1's 12 read
    # input, 4 heads, m0; m1 reads 10; the logits read all 11
    assert len(graph.edges) == 12 * 1 + 5 + 12 * 6 + 10 + 11 == 110
    names = graph.edge_names()
    assert "a0.h1->a1.h2<k>" in names and "a1.h0->a0.h1<q>" not in names and "m1->logits" in names


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma", "gpt2", "phi3", "mixtral"])
def test_every_edge_kept_is_clean_and_none_kept_is_corrupt(arch):
    model, clean, corrupt, metric = _tiny_pairs(arch)
    graph = _all_in_none_in(model, clean, corrupt, metric)
    lay = G.layout(model)
    assert sum(n.endswith("<k>") for n in graph.downstream) == len(lay.blocks) * lay.kv_heads


def test_toy_every_edge_kept_is_clean_and_none_kept_is_corrupt(toy_pairs):
    _all_in_none_in(*toy_pairs)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_patching_every_edge_out_of_a_head_is_activation_patching_of_the_head(arch):
    model, clean, corrupt, metric = _tiny_pairs(arch, seed=1)
    core, lay, graph, pair, tgts = _context(model, clean, corrupt, metric)
    exact = P.activation_patching(model, clean, corrupt, metric, nodes="heads", sum_positions=True)
    circuits = []
    names = []
    for l in range(len(lay.blocks)):
        for h, u in enumerate(graph.head_nodes[l]):
            keep = graph.valid.clone()
            keep[u] = False
            circuits.append(keep)
            names.append((l, h))
    with core.attribution_pass(model, RelevanceRules(), False, "test"), torch.no_grad():
        v_c, _, fixed = split_run(model, lay, graph, pair.clean, tgts, "record", check=True)
        _, sx, _ = split_run(model, lay, graph, pair.corrupt, fixed, "record")
        m = patched_metrics(model, lay, graph, pair, fixed, torch.stack(sx.acts), torch.stack(circuits))
    effects = m - v_c.double().cpu()[None]
    for i, (l, h) in enumerate(names):
        torch.testing.assert_close(effects[i].float(), exact["heads"][:, l, h], atol=2e-5, rtol=1e-4)


def _central_differences(model, clean, corrupt, metric, names, eps):
    core, lay, graph, pair, tgts = _context(model, clean, corrupt, metric)
    out = {}
    with core.attribution_pass(model, RelevanceRules(), False, "test"), torch.no_grad():
        _, _, fixed = split_run(model, lay, graph, pair.clean, tgts, "record")
        _, sx, _ = split_run(model, lay, graph, pair.corrupt, fixed, "record")
        acts_x = torch.stack(sx.acts)
        for name in names:
            u, d = graph.edges[graph.edge_names().index(name)]
            runs = []
            for t in (eps, -eps):
                patched = torch.zeros((clean.shape[0], *graph.valid.shape), dtype=torch.float64)
                patched[:, u, d] = t
                v, _, _ = split_run(model, lay, graph, pair.clean, fixed, "patch", corrupt=acts_x, patched=patched)
                runs.append(v.double())
            out[name] = (runs[0] - runs[1]) / (2 * eps)
    return out


def test_eap_score_is_the_derivative_of_the_edge_patched_run():
    """GPT-2's LayerNorm runs in the model's float64, so the central difference is exact to ~1e-9."""
    model, clean, corrupt, metric = _tiny_pairs("gpt2", seed=2)
    res = P.edge_attribution(model, clean, corrupt, metric, method="atp")
    names = ["input->a0.h3<v>", "a0.h3->a1.h1<k>", "a1.h1->logits", "m0->m1", "a0.h0->a1.h2<q>", "input->m0"]
    for name, fd in _central_differences(model, clean, corrupt, metric, names, 1e-5).items():
        torch.testing.assert_close(res.per_pair[:, res.edges.index(name)], fd, atol=1e-8, rtol=1e-7)


def test_toy_eap_score_is_the_derivative_of_the_edge_patched_run(toy_pairs):
    """Llama's RMSNorm computes in float32 whatever the model's dtype: a wider step, a looser bound."""
    model, clean, corrupt, metric = toy_pairs
    res = P.edge_attribution(model, clean, corrupt, metric, method="atp")
    names = ["input->a0.h3<v>", "a0.h3->a1.h1<k>", "a1.h1->logits", "m0->m1", "a0.h0->a1.h2<q>"]
    for name, fd in _central_differences(model, clean, corrupt, metric, names, 1e-2).items():
        torch.testing.assert_close(res.per_pair[:, res.edges.index(name)], fd, atol=2e-4, rtol=2e-3)


def test_relp_without_rules_is_atp_and_identical_pairs_score_zero(toy_pairs):
    model, clean, corrupt, metric = toy_pairs
    atp = P.edge_attribution(model, clean, corrupt, metric, method="atp")
    off = P.edge_attribution(model, clean, corrupt, metric, method="relp", rules=RelevanceRules())
    assert torch.equal(atp.per_pair, off.per_pair)
    # identical pairs: the clean and the corrupt run are two forwards of the same ids, whose
    # activations another CPU's GEMM kernels may round apart in the last bits (5.7e-16 was
    # seen on an AMD EPYC): zero to float64 rounding of the effects' scale (DESIGN §13)
    tol = 64 * torch.finfo(torch.float64).eps * float(atp.per_pair.abs().max())
    for method in ("atp", "relp", "ig"):
        same = P.edge_attribution(model, clean, clean, metric, method=method, **({"steps": 2} if method == "ig" else {}))
        assert float(same.per_pair.abs().max()) <= tol, method


def test_ig_with_one_step_is_the_gradient_at_the_midpoint(toy_pairs):
    """EAP-IG with one midpoint step: the gradient at the input halfway to the corrupt one.
    In float64 an edge's score equals a central difference of the midpoint run with the
    edge's downstream input moved by ``t·(a_u(corrupt) − a_u(clean))``."""
    import pyattr.methods._core as core
    from pyattr.patching.ig import entry_embeddings

    model, clean, corrupt, metric = toy_pairs
    res = P.edge_attribution(model, clean, corrupt, metric, method="ig", steps=1)
    _, lay, graph, pair, tgts = _context(model, clean, corrupt, metric)
    i = res.edges.index("a0.h3->a1.h1<k>")
    u, d = graph.edges[i]
    with core.attribution_pass(model, RelevanceRules(), False, "test"), torch.no_grad():
        _, sc, fixed = split_run(model, lay, graph, pair.clean, tgts, "record")
        _, sx, _ = split_run(model, lay, graph, pair.corrupt, fixed, "record")
        x_c, x_x = entry_embeddings(model, pair.clean), entry_embeddings(model, pair.corrupt)
        mid = x_c + 0.5 * (x_x - x_c)

        def at_mid():
            return core.tap(pair.clean.entry, pair.clean.where, lambda x: mid.clone(), once=True)

        with at_mid():
            _, sm, _ = split_run(model, lay, graph, pair.clean, fixed, "record")
        # patch mode adds patched · (corrupt − this run's own activation): corrupt := the
        # midpoint run's activations + the clean-to-corrupt difference at u
        target = torch.stack(sm.acts).clone()
        target[u] += sx.acts[u] - sc.acts[u]
        runs = []
        for t in (1e-2, -1e-2):  # Llama's RMSNorm computes in float32
            patched = torch.zeros((clean.shape[0], *graph.valid.shape), dtype=torch.float64)
            patched[:, u, d] = t
            with at_mid():
                v, _, _ = split_run(model, lay, graph, pair.clean, fixed, "patch", corrupt=target, patched=patched)
            runs.append(v.double())
    torch.testing.assert_close(res.per_pair[:, i], (runs[0] - runs[1]) / 2e-2, atol=2e-4, rtol=2e-3)


def test_exact_edge_patching_is_the_model_with_the_logits_input_rewritten(toy_pairs):
    model, clean, corrupt, metric = toy_pairs
    exact = P.edge_effects(model, clean, corrupt, metric)
    # input -> logits patched alone: the final norm reads the clean last residual stream with
    # the clean embeddings swapped for the corrupt ones
    seen = {}
    hooks = [model.model.norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach())),
             model.model.layers[0].register_forward_pre_hook(
                 lambda m, a, k: seen.__setitem__("e", (a[0] if a else k["hidden_states"]).detach()), with_kwargs=True)]
    with torch.no_grad():
        clean_logits = model(clean).logits
        x_clean, e_clean = seen["x"], seen["e"]
        model(corrupt)
        e_corrupt = seen["e"]
        for h in hooks:
            h.remove()
        logits = model.lm_head(model.model.norm(x_clean - e_clean + e_corrupt))
    _, _, answer, alternative = TC.pair_tensors(task.pairs(torch.Generator().manual_seed(11), 6, kind="key"))
    rows = torch.arange(clean.shape[0])
    patched = logits[rows, -1, answer] - logits[rows, -1, alternative]
    base = clean_logits[rows, -1, answer] - clean_logits[rows, -1, alternative]
    i = exact.edges.index("input->logits")
    torch.testing.assert_close(exact.per_pair[:, i], (patched - base).double(), atol=1e-9, rtol=0)


def test_faithfulness_curve_and_mibs_areas(toy_pairs):
    model, clean, corrupt, metric = toy_pairs
    exact = P.edge_effects(model, clean, corrupt, metric)
    cf = P.circuit_faithfulness(model, clean, corrupt, exact, metric=metric)
    assert cf.sizes.tolist() == list(MIB_SIZES) and cf.edges == 110
    # the ends are the model's own runs: exactly 0 and 1, not the split forward's rounding
    assert cf.edge_counts[-1] == 110 and float(cf.curve[-1]) == 1.0
    assert cf.edge_counts[0] == 0 and float(cf.curve[0]) == 0.0
    cpr, cmd = _areas(cf.sizes, cf.curve)
    assert (cf.cpr, cf.cmd) == (cpr, cmd)
    # trapezoids by hand on a known curve
    xs = torch.tensor([0.1, 0.5, 1.0], dtype=torch.float64)
    assert _areas(xs, torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)) == pytest.approx((0.2 + 0.5, 0.2))
    one = P.circuit_faithfulness(model, clean, corrupt, exact.edges, metric=metric)
    assert float(one.curve[0]) == 1.0 and one.edge_counts.tolist() == [110]


def test_pruning_drops_edges_that_reach_nothing(toy_pairs):
    graph = G.build_graph(G.layout(toy_pairs[0]))
    names = graph.edge_names()
    keep = torch.zeros_like(graph.valid)
    for n in ["input->a0.h3<v>", "a0.h3->a1.h1<k>", "a1.h1->logits", "a0.h2->m0"]:
        u, d = graph.edges[names.index(n)]
        keep[u, d] = True
    kept = prune(graph, keep)
    got = {names[i] for i, (u, d) in enumerate(graph.edges) if kept[u, d]}
    # a0.h2 is reached from no input edge, and m0 reaches no logits: gone; a0.h3 -> a1.h1<k>
    # needs a1.h1 reached through one of its own inputs: only its key is, which counts
    assert got == {"input->a0.h3<v>", "a0.h3->a1.h1<k>", "a1.h1->logits"}
    scores = torch.zeros(len(names), dtype=torch.float64)
    scores[names.index("m1->logits")] = 5.0
    scores[names.index("input->m1")] = -4.0
    top = top_edges(graph, scores, 2)
    assert {names[i] for i, (u, d) in enumerate(graph.edges) if top[u, d]} == {"m1->logits", "input->m1"}


@pytest.mark.parametrize("arch,msg", [
    ("gemma2", "block norms \\['input_layernorm', 'post_attention_layernorm', 'pre_feedforward_layernorm'"),
    ("olmo2", "layer 0's query/key/value projection does not read the attention norm"),
    ("gpt_neox", "attention form 'per_head'"),
    ("bert", "the final norm's input is not the sum of the upstream outputs before it"),
])
def test_architectures_the_graph_does_not_read_are_refused(arch, msg):
    model, clean, corrupt, metric = _tiny_pairs(arch)
    with pytest.raises(ValueError, match=msg):
        P.edge_attribution(model, clean, corrupt, metric, method="atp")


@pytest.mark.parametrize("kwargs,err,msg", [
    ({"method": "eap"}, ValueError, "method: expected one of \\['relp', 'atp', 'ig', 'blockwise'\\]"),
    ({"method": "atp", "steps": 4}, ValueError, "steps: only method='ig' interpolates"),
    ({"method": "atp", "rules": RelevanceRules.all()}, ValueError, "rules: method='atp' uses the plain gradient"),
    ({"method": "ig", "steps": 0}, ValueError, "steps"),
    ({"rules": RelevanceRules.all()}, ValueError, "rules: attention='frozen' is not supported by edge attribution"),
    ({"rules": RelevanceRules(attention="attnlrp")}, ValueError, "rules: attention='attnlrp' is not supported"),
])
def test_bad_arguments_are_refused_by_name(toy_pairs, kwargs, err, msg):
    model, clean, corrupt, metric = toy_pairs
    with pytest.raises(err, match=msg):
        P.edge_attribution(model, clean, corrupt, metric, **kwargs)


def test_bad_circuits_and_sizes_are_refused(toy_pairs):
    model, clean, corrupt, metric = toy_pairs
    with pytest.raises(ValueError, match="sizes: expected increasing fractions"):
        P.circuit_faithfulness(model, clean, corrupt, ["m1->logits"], metric=metric, sizes=[0.5, 0.2])
    with pytest.raises(ValueError, match="sizes: expected increasing fractions"):
        P.circuit_faithfulness(model, clean, corrupt, ["m1->logits"], metric=metric, sizes=[0.0, 1.0])
    with pytest.raises(ValueError, match="are no edges of this model's graph"):
        P.circuit_faithfulness(model, clean, corrupt, ["m9->logits"], metric=metric)
    with pytest.raises(ValueError, match="clean and corrupt give the same mean metric"), pytest.warns(UserWarning):
        P.circuit_faithfulness(model, clean, clean, ["m1->logits"], metric=metric)
    with pytest.warns(UserWarning, match=r"1 of the circuit's edges are on no path from the input to the logits .*"
                                         r"\['a1.h0->logits'\]") as seen:
        lone = P.circuit_faithfulness(model, clean, corrupt, ["a1.h0->logits"], metric=metric)
    assert seen[0].filename == __file__ and lone.edge_counts.tolist() == [0] and float(lone.curve[0]) == 0.0
    kept = P.circuit_faithfulness(model, clean, corrupt, ["input->a1.h0<v>", "a1.h0->logits"], metric=metric)
    assert kept.edge_counts.tolist() == [2]
    with pytest.raises(ValueError, match="edge_attribution: clean and corrupt differ in length \\(10 and 9 tokens\\)"):
        P.edge_attribution(model, clean, corrupt[:, :-1], metric, method="atp")
    with pytest.raises(TypeError, match="edges_or_circuit: expected an EdgeAttributionResult, a PatchingResult, a list of edge names"):
        P.circuit_faithfulness(model, clean, corrupt, "m1->logits", metric=metric)
    with pytest.raises(ValueError, match="sizes: expected increasing fractions of the edges in \\(0, 1\\], got '0.5'"):
        P.circuit_faithfulness(model, clean, corrupt, ["m1->logits"], metric=metric, sizes="0.5")
    one = P.circuit_faithfulness(model, clean, corrupt, P.edge_attribution(model, clean, corrupt, metric),
                                 metric=metric, sizes=[1.0])
    assert torch.isnan(torch.tensor([one.cpr, one.cmd])).all() and float(one.curve[0]) == 1.0


def test_half_precision_models_run(toy_pairs):
    """The observation that the residual stream is the graph's sum allows for the dtype's rounding."""
    model, clean, corrupt, metric = toy_pairs
    half = P.edge_attribution(model.to(torch.bfloat16), clean, corrupt, metric, method="atp")
    model.double()
    full = P.edge_attribution(model, clean, corrupt, metric, method="atp")
    assert float(torch.corrcoef(torch.stack([half.scores, full.scores]))[0, 1]) > 0.95


def test_results_show_themselves_and_load_back(toy_pairs, tmp_path):
    import pyattr

    model, clean, corrupt, metric = toy_pairs
    edges = P.edge_attribution(model, clean, corrupt, metric, method="atp")
    cf = P.circuit_faithfulness(model, clean, corrupt, edges, metric=metric, sizes=[0.1, 0.5, 1.0])
    for res in (edges, cf):
        html = res._repr_html_()
        assert "<table" in html or "<svg" in html or "<div" in html
        back = pyattr.load(res.save(tmp_path / f"{type(res).__name__}.safetensors"))
        assert type(back) is type(res)
    back = pyattr.load(str(tmp_path / "EdgeAttributionResult.safetensors"))
    assert torch.equal(back.per_pair, edges.per_pair) and back.edges == edges.edges
    assert "m1-&gt;logits" in edges._repr_html_() and "CPR" in cf._repr_html_()
    table = edges.to_pandas()
    assert len(table) >= len(edges.edges)
    # the grid wider than a page scrolls with the strongest rows and columns first (the cut
    # columns held the strongest edges), after the top-edges table
    from pyattr.results.layouts import panels

    grid = next(p for p in panels(edges) if hasattr(p, "cols"))
    strength = lambda vals: max((abs(v) for v in vals if v is not None and v == v), default=0.0)  # noqa: E731
    cols = [strength(c) for c in zip(*grid.values)]
    rows = [strength(r) for r in grid.values]
    assert cols == sorted(cols, reverse=True) and rows == sorted(rows, reverse=True)
    assert sorted(grid.cols) == sorted(edges.downstream) and sorted(grid.rows) == sorted(edges.upstream)
    assert [type(p).__name__ for p in panels(edges)] == ["Graph", "Table", "Matrix"]
    assert edges.top(3) == sorted(((e, float(s)) for e, s in zip(edges.edges, edges.scores)),
                                  key=lambda t: -abs(t[1]))[:3]


def test_circuits_bench_rows_validate():
    import pyattr.bench.circuits as B
    import pyattr.bench.report as report

    rows = B.model_rows("toy", None, "key", 4, repeats=1)
    assert [r["variant"] for r in rows] == [v for v, _ in B.variants()]
    assert rows[0]["pearson"] == pytest.approx(1.0) and rows[0]["top2_equal_exact"] == 1.0
    blockwise = rows[[r["variant"] for r in rows].index("blockwise: exact, block by block")]
    assert blockwise["pearson"] == pytest.approx(1.0) and blockwise["cpr"] == pytest.approx(rows[0]["cpr"], abs=1e-6)
    nodes = B.node_rows("toy", None, "key", 4)
    assert [r["variant"] for r in nodes][-1] == "circuit_search (greedy both ways)"
    assert all(r["nodes"] == 10 and 0 <= r["cpr"] <= 1.5 for r in nodes)
    # the search's circuits are at least as faithful as thresholding's on the pairs it searched
    assert nodes[-1]["cpr"] >= max(r["cpr"] for r in nodes[:-1]) - 1e-9
    report.validate(report.document("circuits", torch.device("cpu"), rows + nodes))
    md = B.markdown(rows + nodes)
    assert "| exact edge patching | 1.000 | 1.00 |" in md and "| toy, key pairs | circuit_search (greedy both ways) | 10 |" in md
    bad = dict(nodes[0], held_out_cpr=float("nan"))
    with pytest.raises(ValueError, match="held_out_cpr"):
        report.validate(report.document("circuits", torch.device("cpu"), rows + [bad]))


def test_patch_edges_command(capsys, tmp_path):
    import json

    from pyattr.cli import main

    js = tmp_path / "edges.json"
    assert main(["patch", "--edges", "--method", "atp", "--json", str(js), "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("clean 'sun cat red tree sun cat', corrupt 'sun ant red tree sun cat'; an edge's score")
    assert out[2] == "110 edges scored by atp in " + out[2].split(" in ")[1]
    doc = json.loads(js.read_text())
    assert len(doc["edges"]) == 110 and doc["method"] == "atp"
    # the same numbers as the Python API on the built-in pair
    model, tok, _ = toy.load()
    from pyattr.apps.patch_edges import DEFAULT_CLEAN, DEFAULT_CORRUPT

    c = torch.tensor([tok(DEFAULT_CLEAN)["input_ids"]])
    x = torch.tensor([tok(DEFAULT_CORRUPT)["input_ids"]])
    want = P.edge_attribution(model, c, x, T.Logit(), method="atp")
    assert [e["edge"] for e in doc["edges"]] == want.edges
    # the command loads the model with its default attention kernel, toy.load() with eager
    assert [e["score"] for e in doc["edges"]] == pytest.approx(want.scores.tolist(), abs=1e-5)
    top = want.top(3)
    assert [line.split()[-1] for line in out[3:6]] == [name for name, _ in top]
    assert out[6].startswith("circuits of the top edges run exactly: CPR ")
    assert doc["circuits"]["edges"][-1] == 110


@pytest.mark.parametrize("args,msg", [
    (["--method", "atp*"], "--edges: --method must be one of ['relp', 'atp', 'ig', 'blockwise', 'exact']"),
    (["--nodes", "heads"], "--edges scores every edge of the graph; --nodes does not apply"),
    (["--pair", "x"], "--edges scores a causal LM's edges; --pair does not apply"),
    (["--clean", "sun cat red", "--corrupt", "sun cat"], "--clean is 4 tokens and --corrupt 3"),
])
def test_patch_edges_command_refuses_bad_arguments(args, msg, capsys):
    from pyattr.cli import main

    assert main(["patch", "--edges", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyattr patch: error: ") and msg in err, err


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_edge_effects_on_a_left_padded_float64_batch(arch):
    """transformers' eager attention in float64 leaves NaN where a left-padded row's query
    positions are masked out entirely (its float32 softmax of float64's lowest value is a
    softmax of -inf), and on rotary models the NaN reaches the row's real tokens. The graph
    check reads NaN against the same NaN as equal (it refused the batch before, issue 45 §6):
    the unpadded row equals itself alone, and the padded row gives what the model gives (its
    own metric, NaN where the model's logit is NaN; the row alone where it is finite)."""
    model = tiny_causal_lm(arch, attn="eager", dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(3, 90, (2, 7), generator=g)
    corrupt = clean.clone()
    corrupt[:, 3] = 50
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    metric = T.Logit(5)
    got = P.edge_effects(model, {"input_ids": clean, "attention_mask": mask},
                         {"input_ids": corrupt, "attention_mask": mask}, metric)
    with torch.no_grad():  # the model's own padded forward, positions counted along the mask
        own = model(clean, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -1, 5]
    torch.testing.assert_close(got.clean_metric, own.double(), rtol=0, atol=1e-12, equal_nan=True)
    for row, cut in ((0, 0), (1, 2)):
        alone = P.edge_effects(model, clean[row:row + 1, cut:], corrupt[row:row + 1, cut:], metric)
        if bool(own[row].isnan()):
            assert bool(got.per_pair[row].isnan().all())
        else:
            torch.testing.assert_close(got.per_pair[row], alone.per_pair[0], rtol=1e-9, atol=1e-9)


def test_circuit_ends_are_exact_in_float32():
    """In float32 the split forward's sum rounds differently from the model's own layers; the
    empty circuit and the whole graph still score exactly 0 and 1 (their runs are the corrupt
    and the clean run)."""
    model, _, _ = toy.load()
    pairs = task.pairs(torch.Generator().manual_seed(11), 16, kind="key")
    clean, corrupt, answer, alternative = TC.pair_tensors(pairs)
    metric = T.LogitDiff(answer, alternative)
    relp = P.edge_attribution(model, clean, corrupt, metric)
    cf = P.circuit_faithfulness(model, clean, corrupt, relp, metric=metric, sizes=[0.001, 0.5, 1.0])
    assert cf.edge_counts[0] == 0 and cf.curve[0].item() == 0.0 and cf.curve[-1].item() == 1.0
    assert cf.metric[0].item() == cf.corrupt_metric and cf.metric[-1].item() == cf.clean_metric
