"""Node circuits: every node kept is the clean run and none the run with every node patched;
a circuit is the model with the nodes outside it patched by hand (float64); all nodes but
one is activation patching of that one; the search's circuit of one node and of all but one
are the best of their size by exhaustion, and no circuit it reports is beaten by one of its
own passes; bad input is refused by name."""

import itertools

import pytest
import torch

import pyattr.patching as P
import pyattr.targets as T
import pyattr.toy as toy
import pyattr.toy.circuit as TC
import pyattr.toy.task as task
from pyattr.patching.circuit import MIB_SIZES

from models import tiny_causal_lm


def _toy(n=6, kind="key", seed=11):
    model, _, _ = toy.load()
    model = model.double()
    clean, corrupt, answer, alternative = TC.pair_tensors(task.pairs(torch.Generator().manual_seed(seed), n, kind=kind))
    return model, clean, corrupt, T.LogitDiff(answer, alternative)


def _names(model):
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    return [f"a{l}.h{h}" for l in range(layers) for h in range(heads)] + [f"m{l}" for l in range(layers)]


def _by_hand(model, clean, corrupt, metric, keep):
    """The metric with every head (o_proj input slice) and MLP output outside ``keep``
    replaced by the corrupt run's, all positions: hooks written here, not pyattr's."""
    layers = model.model.layers
    hd = model.config.hidden_size // model.config.num_attention_heads
    store = {}

    def record(name):
        def pre(m, args):
            store[name] = args[0].detach().clone()

        def post(m, args, out):
            store[name] = out.detach().clone()
        return pre if name.startswith("o") else post

    hooks = []
    for l, blk in enumerate(layers):
        hooks.append(blk.self_attn.o_proj.register_forward_pre_hook(record(f"o{l}")))
        hooks.append(blk.mlp.register_forward_hook(record(f"m{l}")))
    with torch.no_grad():
        model(corrupt)
    for h in hooks:
        h.remove()
    corrupt_acts = dict(store)

    def patch_o(l):
        def pre(m, args):
            z = args[0].clone()
            for h in range(model.config.num_attention_heads):
                if f"a{l}.h{h}" not in keep:
                    z[..., h * hd:(h + 1) * hd] = corrupt_acts[f"o{l}"][..., h * hd:(h + 1) * hd]
            return (z,)
        return pre

    def patch_m(l):
        def post(m, args, out):
            return out if f"m{l}" in keep else corrupt_acts[f"m{l}"]
        return post

    hooks = []
    for l, blk in enumerate(layers):
        hooks.append(blk.self_attn.o_proj.register_forward_pre_hook(patch_o(l)))
        hooks.append(blk.mlp.register_forward_hook(patch_m(l)))
    try:
        with torch.no_grad():
            logits = model(clean).logits[:, -1]
    finally:
        for h in hooks:
            h.remove()
    rows = torch.arange(clean.shape[0])
    return (logits[rows, metric.a] - logits[rows, metric.b]).double().mean()


def test_node_circuits_are_the_model_with_the_other_nodes_patched_by_hand():
    model, clean, corrupt, metric = _toy()
    names = _names(model)
    assert len(names) == 10
    every = P.circuit_faithfulness(model, clean, corrupt, names, metric=metric)
    assert every.kind == "nodes" and every.edges == 10 and every.edge_counts.tolist() == [10]
    assert float(every.curve[0]) == pytest.approx(1.0, abs=1e-12)
    assert every.clean_metric == pytest.approx(float(_by_hand(model, clean, corrupt, metric, set(names))), abs=1e-9)
    assert every.corrupt_metric == pytest.approx(float(_by_hand(model, clean, corrupt, metric, set())), abs=1e-9)
    for keep in (["a1.h1", "a0.h3"], ["m0", "a1.h0", "a1.h2"], ["a0.h0"]):
        one = P.circuit_faithfulness(model, clean, corrupt, keep, metric=metric)
        want = float(_by_hand(model, clean, corrupt, metric, set(keep)))
        assert float(one.metric[0]) == pytest.approx(want, abs=1e-9)
        f = (want - every.corrupt_metric) / (every.clean_metric - every.corrupt_metric)
        assert float(one.curve[0]) == pytest.approx(f, abs=1e-9) and one.circuits == [sorted(keep, key=names.index)]


def test_all_but_one_node_is_activation_patching_of_that_node():
    model, clean, corrupt, metric = _toy()
    names = _names(model)
    exact = P.activation_patching(model, clean, corrupt, metric, nodes=("heads", "mlp"), sum_positions=True,
                                  progress=False)
    every = P.circuit_faithfulness(model, clean, corrupt, names, metric=metric)
    for name in ("a1.h1", "a0.h2", "m1"):
        res = P.circuit_faithfulness(model, clean, corrupt, [n for n in names if n != name], metric=metric)
        eff = exact["mlp"][:, int(name[1])] if name[0] == "m" else exact["heads"][:, int(name[1]), int(name[-1])]
        assert float(res.metric[0]) - every.clean_metric == pytest.approx(float(eff.double().mean()), abs=1e-6)


def test_circuits_of_top_nodes_at_mibs_sizes():
    model, clean, corrupt, metric = _toy()
    exact = P.activation_patching(model, clean, corrupt, metric, nodes=("heads", "mlp"), sum_positions=True,
                                  progress=False)
    cf = P.circuit_faithfulness(model, clean, corrupt, exact, metric=metric)
    assert cf.kind == "nodes" and cf.sizes.tolist() == list(MIB_SIZES)
    assert cf.edge_counts.tolist() == [int(s * 10) for s in MIB_SIZES]
    names = _names(model)
    mean = torch.cat([exact["heads"].double().mean(0).reshape(-1), exact["mlp"].double().mean(0)])
    ranked = [names[i] for i in mean.abs().argsort(descending=True).tolist()]
    for size, c in zip(MIB_SIZES, cf.circuits):
        assert set(c) == set(ranked[:int(size * 10)])
    assert float(cf.curve[-1]) == pytest.approx(1.0, abs=1e-12) and float(cf.curve[0]) == 0.0
    assert 0.0 < cf.cpr < 1.0 and cf.cmd == pytest.approx(
        float(((cf.sizes[1:] - cf.sizes[:-1]) * ((1 - cf.curve).abs()[1:] + (1 - cf.curve).abs()[:-1]) / 2).sum()))


def _exhaustive(model, clean, corrupt, metric, names, k):
    best = -float("inf")
    for keep in itertools.combinations(names, k):
        best = max(best, float(P.circuit_faithfulness(model, clean, corrupt, list(keep), metric=metric).curve[0]))
    return best


def test_search_is_exhaustive_at_one_node_and_all_but_one_and_beats_top_k():
    model, clean, corrupt, metric = _toy(n=8)
    names = _names(model)
    n = len(names)
    sizes = [k / n for k in range(1, n + 1)]
    found = P.circuit_search(model, clean, corrupt, metric, sizes=sizes)
    assert found.kind == "nodes" and [len(c) for c in found.circuits] == list(range(1, n + 1))
    assert float(found.curve[0]) == pytest.approx(_exhaustive(model, clean, corrupt, metric, names, 1), abs=1e-9)
    assert float(found.curve[-2]) == pytest.approx(_exhaustive(model, clean, corrupt, metric, names, n - 1), abs=1e-9)
    # each reported circuit runs to the reported faithfulness
    for c, f in zip(found.circuits[:3], found.curve[:3]):
        assert float(P.circuit_faithfulness(model, clean, corrupt, c, metric=metric).curve[0]) == pytest.approx(
            float(f), abs=1e-9)
    exact = P.activation_patching(model, clean, corrupt, metric, nodes=("heads", "mlp"), sum_positions=True,
                                  progress=False)
    top = P.circuit_faithfulness(model, clean, corrupt, exact, metric=metric, sizes=sizes)
    assert bool((found.curve >= top.curve - 1e-9).all()) and found.cpr >= top.cpr
    # "cmd": the circuit closest to faithfulness 1 at each size
    near = P.circuit_search(model, clean, corrupt, metric, sizes=sizes, objective="cmd")
    assert bool(((1 - near.curve).abs() <= (1 - top.curve).abs() + 1e-9).all())


def test_node_circuits_on_other_architectures():
    model = tiny_causal_lm("gpt2", dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(3, 60, (3, 7), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2] = torch.randint(3, 60, (3,), generator=g)
    metric = T.LogitDiff([5, 6, 7], [8, 9, 10])
    found = P.circuit_search(model, clean, corrupt, metric, nodes=("attention", "mlp"), sizes=[0.5, 1.0])
    assert found.edges == 2 * model.config.n_layer and float(found.curve[-1]) == pytest.approx(1.0, abs=1e-12)
    assert all(n.startswith(("attn", "m")) for n in found.circuits[-1])


def test_node_circuit_results_show_themselves_and_load_back(tmp_path):
    import pyattr

    model, clean, corrupt, metric = _toy(n=4)
    found = P.circuit_search(model, clean, corrupt, metric, sizes=[0.2, 0.5, 1.0])
    html = found._repr_html_()
    assert "fraction of nodes" in html and " ".join(found.circuits[0]) in html
    back = pyattr.load(found.save(tmp_path / "c.safetensors"))
    assert back.kind == "nodes" and back.circuits == found.circuits and torch.equal(back.curve, found.curve)
    # a file written before the class moved to pyattr.patching.circuit_result (and before
    # it had kind and circuits) still loads
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(tmp_path / "c.safetensors"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    doc = meta["pyattr"].replace("pyattr.patching.circuit_result:", "pyattr.patching.circuit:")
    doc = doc.replace('"kind": "nodes", ', "").replace('"kind": "nodes"', "")
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata={**meta, "pyattr": doc})
    old = pyattr.load(tmp_path / "old.safetensors")
    assert type(old) is P.CircuitFaithfulness and torch.equal(old.curve, found.curve)


def test_a_list_of_heads_is_a_circuit_among_heads_and_mlps():
    model, clean, corrupt, metric = _toy(n=4)
    heads = P.circuit_faithfulness(model, clean, corrupt, ["a1.h1"], metric=metric)
    both = P.circuit_faithfulness(model, clean, corrupt, ["a1.h1"], metric=metric, nodes=("heads", "mlp"))
    assert heads.edges == 10 and torch.equal(heads.curve, both.curve)
    assert float(heads.metric[0]) == pytest.approx(float(_by_hand(model, clean, corrupt, metric, {"a1.h1"})), abs=1e-9)
    attn = P.circuit_faithfulness(model, clean, corrupt, ["attn1", "m0"], metric=metric)
    assert attn.edges == 4 and attn.circuits == [["attn1", "m0"]]
    only_heads = P.circuit_faithfulness(model, clean, corrupt, ["a1.h1"], metric=metric, nodes="heads")
    assert only_heads.edges == 8


def test_bad_node_circuits_are_refused_by_name():
    model, clean, corrupt, metric = _toy(n=2)
    with pytest.raises(ValueError, match="nodes: node circuits are made of \\['heads', 'attention', 'mlp'\\]"):
        P.circuit_search(model, clean, corrupt, metric, nodes=("residual", "mlp"))
    with pytest.raises(TypeError, match="progress must be a bool, got 'yes'"):
        P.circuit_search(model, clean, corrupt, metric, progress="yes")
    with pytest.raises(ValueError, match="objective: expected 'cpr'"):
        P.circuit_search(model, clean, corrupt, metric, objective="area")
    with pytest.raises(ValueError, match="sizes: expected increasing fractions"):
        P.circuit_search(model, clean, corrupt, metric, sizes=[0.5, 0.1])
    with pytest.raises(ValueError, match="are no nodes of this model"):
        P.circuit_faithfulness(model, clean, corrupt, ["a0.h9"], metric=metric)
    with pytest.raises(ValueError, match="are no nodes of this model"):
        P.circuit_faithfulness(model, clean, corrupt, ["m0"], metric=metric, nodes=("heads",))
    with pytest.raises(ValueError, match="nodes: only node circuits \\(a list of node names\\)"):
        P.circuit_faithfulness(model, clean, corrupt, ["a0.h0->logits"], metric=metric, nodes=("heads",))
    with pytest.raises(ValueError, match="the names mix heads \\('a0.h1'\\) and attention blocks"):
        P.circuit_faithfulness(model, clean, corrupt, ["a0.h1", "attn1"], metric=metric)
    per_pos = P.attribution_patching(model, clean, corrupt, metric, nodes=("heads",))
    with pytest.raises(ValueError, match="pass a patching result computed with sum_positions=True"):
        P.circuit_faithfulness(model, clean, corrupt, per_pos, metric=metric)
    resid = P.attribution_patching(model, clean, corrupt, metric, nodes=("residual",), sum_positions=True)
    with pytest.raises(ValueError, match="edges_or_circuit: node circuits are made of"):
        P.circuit_faithfulness(model, clean, corrupt, resid, metric=metric)
    with pytest.raises(ValueError, match="nodes: a PatchingResult's circuits are made of its own node types"):
        P.circuit_faithfulness(model, clean, corrupt, P.attribution_patching(
            model, clean, corrupt, metric, nodes=("heads",), sum_positions=True), metric=metric, nodes=("heads",))
    other = P.attribution_patching(toy.load(toy.INDUCTION_4L_DIR)[0].double(), clean, corrupt, metric,
                                   nodes=("heads", "mlp"), sum_positions=True)
    with pytest.raises(ValueError, match="the 'heads' effects have shape \\(4, 4\\) per pair, and this model has "
                                         "\\(2, 4\\)"):
        P.circuit_faithfulness(model, clean, corrupt, other, metric=metric)
    with pytest.raises(ValueError, match="the clean run and the run with every node patched give the same"):
        P.circuit_search(model, clean, clean, metric)


def test_metrics_that_mix_rows_are_refused_wherever_rows_run_in_other_batches():
    model, clean, corrupt, metric = _toy(n=4)
    mixed = lambda out: out.logits[:, -1, 5] - out.logits[:, -1, 7].mean()   # noqa: E731  (reads every row)
    calls = {
        "edge_attribution(method='blockwise')": lambda: P.edge_attribution(model, clean, corrupt, mixed,
                                                                           method="blockwise"),
        "edge_effects": lambda: P.edge_effects(model, clean, corrupt, mixed),
        "circuit_faithfulness": lambda: P.circuit_faithfulness(model, clean, corrupt, ["a1.h1"], metric=mixed),
        "circuit_search": lambda: P.circuit_search(model, clean, corrupt, mixed),
        "attribution_patching(method='blockwise')": lambda: P.attribution_patching(
            model, clean, corrupt, mixed, nodes="heads", method="blockwise"),
    }
    for caller, call in calls.items():
        with pytest.raises(ValueError, match=rf"metric: row 3 gives .* in a batch of rows \[3\] .*; "
                                             rf"{caller.replace('(', '.').replace(')', '.')} runs rows in other batches"):
            call()
    flipped = lambda out: out.logits[:, -1, 5] - out.logits[:, -1, 7].flip(0)  # noqa: E731  (another row's logit)
    with pytest.raises(ValueError, match=r"metric: row 3 gives .*; edge_attribution.method='blockwise'. runs rows"):
        P.edge_attribution(model, clean, corrupt, flipped, method="blockwise")
    per_row = lambda out: out.logits[:, -1, 5] - out.logits[:, -1, 7]          # noqa: E731
    a = P.circuit_search(model, clean, corrupt, per_row, sizes=[0.2, 1.0])
    b = P.circuit_search(model, clean, corrupt, per_row, sizes=[0.2, 1.0], batch_size=3, progress=False)
    assert torch.allclose(a.curve, b.curve, atol=1e-9) and a.circuits == b.circuits


def test_hooks_the_edge_graph_would_skip_are_refused():
    import copy

    model, clean, corrupt, metric = _toy(n=2)
    hooked = copy.deepcopy(model)
    for mod, where in ((hooked.model.layers[1].input_layernorm, "model.layers.1.input_layernorm"),
                       (hooked.model.layers[0].self_attn.q_proj, "model.layers.0.self_attn.q_proj"),
                       (hooked.model.layers[1].self_attn.o_proj, "model.layers.1.self_attn.o_proj")):
        h = mod.register_forward_hook(lambda m, a, o: o * 1.3)
        for call in (lambda: P.edge_attribution(hooked, clean, corrupt, metric, method="blockwise"),
                     lambda: P.edge_attribution(hooked, clean, corrupt, metric),
                     lambda: P.edge_effects(hooked, clean, corrupt, metric),
                     lambda: P.circuit_faithfulness(hooked, clean, corrupt, ["m1->logits"], metric=metric)):
            with pytest.raises(ValueError, match=f"model: '{where}' has a forward hook; the edge graph norms"):
                call()
        h.remove()
    # without the hooks the copy is the model
    torch.testing.assert_close(P.edge_effects(hooked, clean, corrupt, metric).per_pair,
                               P.edge_effects(model, clean, corrupt, metric).per_pair, atol=1e-12, rtol=0)
    # node circuits run the model as it is: a hook acts in every run
    h = hooked.model.layers[1].input_layernorm.register_forward_hook(lambda m, a, o: o * 1.3)
    keep = {"a0.h3", "a1.h1"}
    got = P.circuit_faithfulness(hooked, clean, corrupt, sorted(keep), metric=metric)
    assert float(got.metric[0]) == pytest.approx(float(_by_hand(hooked, clean, corrupt, metric, keep)), abs=1e-9)
    h.remove()


def test_circuit_lists_and_scores_are_checked():
    model, clean, corrupt, metric = _toy(n=2)
    empty = P.circuit_faithfulness(model, clean, corrupt, [], metric=metric, nodes=("heads", "mlp"))
    assert empty.kind == "nodes" and empty.edge_counts.tolist() == [0] and float(empty.curve[0]) == 0.0
    with pytest.raises(ValueError, match="the list mixes edge names \\('a0.h0->m0'\\) and node names \\('a0.h1'\\)"):
        P.circuit_faithfulness(model, clean, corrupt, ["a0.h1", "a0.h0->m0"], metric=metric)
    with pytest.raises(TypeError, match="edges_or_circuit: names must be strings .*, got int 3"):
        P.circuit_faithfulness(model, clean, corrupt, ["a0.h1", 3], metric=metric)
    gen = P.circuit_search(model, clean, corrupt, metric, sizes=(x for x in [0.5, 1.0]))
    assert gen.sizes.tolist() == [0.5, 1.0]
    res = P.activation_patching(model, clean, corrupt, metric, nodes=("heads", "mlp"), sum_positions=True,
                                progress=False)
    res.effects["heads"][0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="the effects of \\['a1.h2'\\] are not finite"):
        P.circuit_faithfulness(model, clean, corrupt, res, metric=metric)
    edges = P.edge_attribution(model, clean, corrupt, metric)
    edges.scores[3] = float("inf")
    with pytest.raises(ValueError, match=f"the scores of \\['{edges.edges[3]}'\\] are not finite"):
        P.circuit_faithfulness(model, clean, corrupt, edges, metric=metric)
    with pytest.raises(ValueError, match="circuit_search: clean and corrupt differ in their attention masks; a node "
                                         "circuit patches position p"):
        mask = torch.ones_like(clean)
        mask[0, 0] = 0
        P.circuit_search(model, clean, corrupt, metric, attention_mask=mask, corrupt_attention_mask=torch.ones_like(mask))
