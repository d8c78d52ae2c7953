"""pyattr.patching: activation patching against hand-written patched forwards, attribution
patching (AtP / RelP) against independently computed (a_corrupt − a_clean) · gradient,
exact zeros for identical inputs, alignment, padding, samples and errors."""

import pytest
import torch

import pyattr
from pyattr import patching as P
from pyattr import targets as T
from pyattr.config import RelevanceRules

pytestmark = pytest.mark.usefixtures("one_thread")

NODES = ("residual", "attention", "heads", "mlp", "neurons")
METRIC = T.LogitDiff(3, 5)


def _pair(seed=1, batch=2, seq=7, pos=2, vocab=96):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, vocab, (batch, seq), generator=g)
    corrupt = clean.clone()
    corrupt[:, pos] = (corrupt[:, pos] + 17) % vocab
    return clean, corrupt


# where each node lives in the tiny Llama / BERT (block-relative path, "input" | "output")
SITES = {
    "llama": {"residual": ("", "input"), "attention": ("self_attn", "output"), "heads": ("self_attn.o_proj", "input"),
              "mlp": ("mlp", "output"), "neurons": ("mlp.down_proj", "input")},
    "bert": {"residual": ("", "input"), "attention": ("attention.output.dense", "output"),
             "heads": ("attention.output.dense", "input"), "mlp": ("output.dense", "output"),
             "neurons": ("intermediate", "output")},
}
BLOCKS = {"llama": "model.layers", "bert": "bert.encoder.layer"}


def _module(model, arch, node, layer):
    rel, where = SITES[arch][node]
    path = f"{BLOCKS[arch]}.{layer}" + (f".{rel}" if rel else "")
    return model.get_submodule(path), where


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _capture(model, arch, node, layer, ids):
    """The node's activation (batch, seq, width) in a plain forward of ``ids``."""
    mod, where = _module(model, arch, node, layer)
    got = {}
    def keep(t):
        got.setdefault("a", t.detach().clone())

    if where == "input":
        h = mod.register_forward_pre_hook(lambda m, a, k: keep(a[0] if a else k["hidden_states"]), with_kwargs=True)
    else:
        h = mod.register_forward_hook(lambda m, a, o: keep(_first(o)))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        h.remove()
    return got["a"]


def _patched_metric(model, arch, node, layer, ids, src, pos, sl):
    """Metric of a forward of ``ids`` with the node's activation at ``pos``, units ``sl``,
    taken from ``src``: written by hand with a plain forward hook."""
    mod, where = _module(model, arch, node, layer)

    def patch(t):
        t = t.clone()
        t[:, pos, sl] = src[:, pos, sl]
        return t

    if where == "input":
        def pre(m, a, k):
            if a:
                return (patch(a[0]), *a[1:]), k
            return a, {**k, "hidden_states": patch(k["hidden_states"])}
        h = mod.register_forward_pre_hook(pre, with_kwargs=True)
    else:
        def post(m, a, o):
            return (patch(o[0]), *o[1:]) if isinstance(o, tuple) else patch(o)
        h = mod.register_forward_hook(post)
    try:
        with torch.no_grad():
            out = model(input_ids=ids)
    finally:
        h.remove()
    return out.logits[:, -1, 3] - out.logits[:, -1, 5]


@pytest.fixture(scope="module")
def models():
    from models import tiny_causal_lm

    return {"llama": tiny_causal_lm("llama"), "bert": tiny_causal_lm("bert")}


def _unit_slice(model, node, unit, width):
    if node == "heads":
        d = width // model.config.num_attention_heads
        return slice(unit * d, (unit + 1) * d)
    if node == "neurons":
        return slice(unit, unit + 1)
    return slice(None)


@pytest.mark.parametrize("arch", ["llama", "bert"])
@pytest.mark.parametrize("node", NODES)
def test_activation_patching_equals_hand_written_patched_forward(models, arch, node):
    model = models[arch]
    clean, corrupt = _pair()
    res = P.activation_patching(model, clean, corrupt, METRIC, nodes=node, batch_size=7)
    with torch.no_grad():
        out = model(input_ids=clean)
    base = out.logits[:, -1, 3] - out.logits[:, -1, 5]
    torch.testing.assert_close(res.clean_metric, base.double())
    n_layers = model.config.num_hidden_layers
    for layer in range(n_layers):
        src = _capture(model, arch, node, layer, corrupt)
        units = {"heads": model.config.num_attention_heads, "neurons": src.shape[-1]}.get(node)
        for pos in (1, 2, 6):
            for unit in ([0, units - 1] if units else [None]):
                sl = _unit_slice(model, node, unit, src.shape[-1])
                want = (_patched_metric(model, arch, node, layer, clean, src, pos, sl) - base).float()
                got = res[node][:, layer, pos] if unit is None else res[node][:, layer, pos, unit]
                # batched copies (batch_size=7) against a forward of the pair: other GEMM shapes,
                # float32 rounding of the logits' scale (9 eps seen with other MKL kernels)
                torch.testing.assert_close(got, want, rtol=1e-5,
                                           atol=64 * torch.finfo(torch.float32).eps * float(out.logits[:, -1].abs().max()))
    assert res.dims[node][:3] == ("batch", "layer", "position")
    extra = {"heads": (model.config.num_attention_heads,), "neurons": (src.shape[-1],)}.get(node, ())
    assert tuple(res[node].shape) == (2, n_layers, 7, *extra)


def _grads_by_hand(model, arch, node, ids, rules):
    """(activations, gradients) of the node at every layer, in one forward/backward with
    hooks written here (the embeddings made a leaf by hand)."""
    n = model.config.num_hidden_layers
    acts = [None] * n
    handles = []
    for layer in range(n):
        mod, where = _module(model, arch, node, layer)

        def keep(t, layer=layer):
            acts[layer] = t
        if where == "input":
            handles.append(mod.register_forward_pre_hook(
                lambda m, a, k, keep=keep: keep(a[0] if a else k["hidden_states"]), with_kwargs=True))
        else:
            handles.append(mod.register_forward_hook(lambda m, a, o, keep=keep: keep(_first(o))))
    emb = model.get_input_embeddings()
    handles.append(emb.register_forward_hook(lambda m, a, o: o.detach().requires_grad_(True)))
    try:
        with pyattr.use_relevance_rules(model, rules):
            out = model(input_ids=ids)
            metric = out.logits[:, -1, 3] - out.logits[:, -1, 5]
            grads = torch.autograd.grad(metric.sum(), acts, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return [a.detach() for a in acts], grads


def _reduce(model, node, prod):
    if node == "neurons":
        return prod
    if node == "heads":
        h = model.config.num_attention_heads
        return prod.view(*prod.shape[:2], h, -1).sum(-1)
    return prod.sum(-1)


@pytest.mark.parametrize("arch", ["llama", "bert"])
@pytest.mark.parametrize("method", ["atp", "relp"])
def test_attribution_patching_equals_independent_gradient_product(models, arch, method):
    model = models[arch]
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        clean, corrupt = _pair(seed=3)
        rules = RelevanceRules() if method == "atp" else RelevanceRules.all()
        kw = {} if method == "atp" else {"rules": rules}
        res = P.attribution_patching(model, clean, corrupt, METRIC, nodes=NODES, method=method, **kw)
        for node in NODES:
            a_c, g = _grads_by_hand(model, arch, node, clean, rules)
            a_x, _ = _grads_by_hand(model, arch, node, corrupt, rules)
            want = torch.stack([_reduce(model, node, (x - c) * gg) for x, c, gg in zip(a_x, a_c, g)], 1)
            torch.testing.assert_close(res[node], want, atol=1e-6, rtol=1e-5)
    finally:
        for p in model.parameters():
            p.requires_grad_(True)


@pytest.mark.parametrize("method", ["relp", "atp"])
def test_two_forwards_whatever_the_number_of_nodes(models, method):
    model = models["llama"]
    calls = []
    h = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        clean, corrupt = _pair(seed=20, batch=3)
        P.attribution_patching(model, clean, corrupt, METRIC, nodes=NODES, method=method)
    finally:
        h.remove()
    assert len(calls) == 2


def test_relp_differs_from_atp_and_uses_the_rules(models):
    clean, corrupt = _pair(seed=3)
    atp = P.attribution_patching(models["llama"], clean, corrupt, METRIC, nodes="residual", method="atp")
    relp = P.attribution_patching(models["llama"], clean, corrupt, METRIC, nodes="residual", rules=RelevanceRules.all())
    assert not torch.allclose(atp["residual"], relp["residual"])
    assert relp.rules == RelevanceRules.all() and atp.rules is None
    assert "model.layers.0.self_attn.q_proj" in relp.coverage.by_kind["attention"]
    default = P.attribution_patching(models["llama"], clean, corrupt, METRIC, nodes="residual")
    assert default.rules == P.PATCHING_RULES == RelevanceRules(normalization=True)


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_relp_equals_activation_patching_for_a_metric_linear_in_the_node(models, arch):
    """A metric that is a bias-free linear projection of the final residual stream: the
    last block's MLP output enters it linearly, so the exact effect of patching that node
    is w · Δ, which RelP (all rules on) must give exactly."""
    model = models[arch]
    last = model.config.num_hidden_layers - 1
    w = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    if arch == "llama":
        # the final residual stream is the last block's output (before the final norm)
        metric = T.ModuleOutput(f"model.layers.{last}", select=lambda out: out[:, -1] @ w)
        node = "mlp"
    else:
        # BERT is post-norm: its residual stream after the last block is a LayerNorm output;
        # the MLP node (output.dense) enters the LayerNorm's input linearly
        metric = T.ModuleOutput(f"bert.encoder.layer.{last}.output.dense", select=lambda out: out[:, -1] @ w)
        node = "mlp"
    clean, corrupt = _pair(seed=4)
    relp = P.attribution_patching(model, clean, corrupt, metric, nodes=node, rules=RelevanceRules.all())
    exact = P.activation_patching(model, clean, corrupt, metric, nodes=node)
    torch.testing.assert_close(relp[node][:, last], exact[node][:, last], atol=1e-5, rtol=1e-5)
    assert relp[node][:, last].abs().max() > 1e-3  # not trivially zero


@pytest.mark.parametrize("arch", ["llama", "bert"])
@pytest.mark.parametrize("train", [False, True])
def test_identical_inputs_give_exactly_zero_effects(arch, train):
    from models import _cfg
    import transformers

    cfg = _cfg(arch, "eager")
    if arch == "bert":
        cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = 0.3
        model = transformers.BertForMaskedLM(cfg)
    else:
        cfg.attention_dropout = 0.3
        model = transformers.LlamaForCausalLM(cfg)
    model.train(train)
    clean, _ = _pair(seed=6, batch=3)
    mask = torch.ones_like(clean)
    mask[1, :2] = 0 if arch == "llama" else 1
    mask[2, -2:] = 0
    inputs = {"input_ids": clean, "attention_mask": mask}
    for method in ("relp", "atp", "exact"):
        if method == "exact":
            res = P.activation_patching(model, inputs, dict(inputs), T.Logit(3), nodes=NODES, sample=40)
        else:
            res = P.attribution_patching(model, inputs, dict(inputs), T.Logit(3), nodes=NODES, method=method)
        for node in NODES:
            e = torch.nan_to_num(res[node])
            assert torch.equal(e, torch.zeros_like(e)), (method, node, float(e.abs().max()))
        torch.testing.assert_close(res.clean_metric, res.corrupt_metric, atol=0, rtol=0)
    assert model.training is train


def test_sum_positions(models):
    model = models["llama"]
    clean, corrupt = _pair(seed=7)
    per = P.attribution_patching(model, clean, corrupt, METRIC, nodes=("residual", "heads"), method="atp")
    tot = P.attribution_patching(model, clean, corrupt, METRIC, nodes=("residual", "heads"), method="atp", sum_positions=True)
    torch.testing.assert_close(tot["residual"], per["residual"].sum(2))
    torch.testing.assert_close(tot["heads"], per["heads"].sum(2))
    assert tot.dims["heads"] == ("batch", "layer", "head")
    # exact with sum_positions patches every position at once: the corrupt run's metric
    # when the whole residual stream of layer 0 is patched
    ex = P.activation_patching(model, clean, corrupt, METRIC, nodes="residual", sum_positions=True)
    torch.testing.assert_close(ex["residual"][:, 0].double(), ex.corrupt_metric - ex.clean_metric, atol=1e-5, rtol=1e-5)


def test_padded_batch_equals_rows_alone(models):
    model = models["llama"]
    clean, corrupt = _pair(seed=8, batch=2, seq=6)
    short_c, short_x = clean[1, :4], corrupt[1, :4]
    pad = torch.zeros(2, dtype=torch.long)
    c2 = torch.stack([clean[0], torch.cat([pad, short_c])])
    x2 = torch.stack([corrupt[0], torch.cat([pad, short_x])])
    mask = torch.ones_like(c2)
    mask[1, :2] = 0
    batch_c, batch_x = {"input_ids": c2, "attention_mask": mask}, {"input_ids": x2, "attention_mask": mask}
    for method in ("atp", "relp", "exact"):
        if method == "exact":
            both = P.activation_patching(model, batch_c, batch_x, METRIC, nodes=NODES)
            alone = P.activation_patching(model, short_c[None], short_x[None], METRIC, nodes=NODES)
        else:
            both = P.attribution_patching(model, batch_c, batch_x, METRIC, nodes=NODES, method=method)
            alone = P.attribution_patching(model, short_c[None], short_x[None], METRIC, nodes=NODES, method=method)
        for node in NODES:
            torch.testing.assert_close(both[node][1, :, 2:], alone[node][0], atol=2e-5, rtol=1e-4)
            assert torch.equal(both[node][1, :, :2], torch.zeros_like(both[node][1, :, :2]))


def test_alignment_pairs_positions(models):
    """A corrupt input with one extra token at the end: in a causal model the aligned
    positions see the same prefix, so every effect is 0 (to rounding)."""
    model = models["llama"]
    clean, _ = _pair(seed=9, batch=1, seq=6)
    corrupt = torch.cat([clean, torch.tensor([[11]])], 1)
    with pytest.raises(ValueError, match="different lengths .*alignment="):
        P.attribution_patching(model, clean, corrupt, T.Logit(3, position=5))
    align = torch.arange(6)[None]
    for method in ("atp", "exact"):
        if method == "exact":
            res = P.activation_patching(model, clean, corrupt, T.Logit(3, position=5), nodes=NODES, alignment=align)
        else:
            res = P.attribution_patching(model, clean, corrupt, T.Logit(3, position=5), nodes=NODES, method="atp", alignment=align)
        # the corrupt run has 7 positions, the clean one 6: other GEMM shapes, which another
        # CPU's kernels may round apart in the last bits (3.6e-7 with MKL's AVX2 kernels):
        # zero to float32 rounding of the metric's scale (DESIGN §13)
        tol = 64 * torch.finfo(torch.float32).eps * max(1.0, float(res.clean_metric.abs().max()))
        for node in NODES:
            assert float(res[node].abs().max()) <= tol, (method, node, float(res[node].abs().max()))
    # a shifted alignment: corrupt position p+1 patched into clean position p
    shifted = torch.cat([clean[:, :1], clean], 1)
    al = torch.tensor([[1, 2, 3, 4, 5, 6]])
    ex = P.activation_patching(model, clean, shifted, T.Logit(3, position=5), nodes="residual", alignment=al)
    src = _capture(model, "llama", "residual", 1, shifted)[:, 1:]
    with torch.no_grad():
        base = model(input_ids=clean).logits[:, 5, 3]
    mod, _ = _module(model, "llama", "residual", 1)

    def pre(m, a, k):
        t = (a[0] if a else k["hidden_states"]).clone()
        t[:, 3] = src[:, 3]
        return ((t, *a[1:]), k) if a else (a, {**k, "hidden_states": t})
    h = mod.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            want = model(input_ids=clean).logits[:, 5, 3] - base
    finally:
        h.remove()
    torch.testing.assert_close(ex["residual"][:, 1, 3], want.float(), atol=2e-6, rtol=1e-5)
    al_bad = torch.tensor([[0, 1, 2, 3, 4, 7]])
    with pytest.raises(ValueError, match=r"alignment: positions must be in \[0, 7\)"):
        P.activation_patching(model, clean, shifted, T.Logit(3), alignment=al_bad)


def test_neuron_sample(models):
    model = models["llama"]
    clean, corrupt = _pair(seed=10, batch=2, seq=5)
    full = P.activation_patching(model, clean, corrupt, METRIC, nodes=("neurons", "mlp"), batch_size=64)
    part = P.activation_patching(model, clean, corrupt, METRIC, nodes=("neurons", "mlp"), sample=30, seed=3)
    mask = part.sampled["neurons"]
    assert mask.shape == part["neurons"].shape and "mlp" not in part.sampled
    assert mask.sum(dim=(1, 2, 3)).tolist() == [30, 30]
    assert torch.isnan(part["neurons"][~mask]).all()
    torch.testing.assert_close(part["neurons"][mask], full["neurons"][mask], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(part["mlp"], full["mlp"], atol=2e-6, rtol=1e-5)
    again = P.activation_patching(model, clean, corrupt, METRIC, nodes="neurons", sample=30, seed=3)
    assert torch.equal(again.sampled["neurons"], mask)


def test_no_grad_and_package_attribute(models):
    model = models["llama"]
    clean, corrupt = _pair(seed=14)
    want = P.attribution_patching(model, clean, corrupt, METRIC, nodes="heads")
    with torch.no_grad():
        got = pyattr.patching.attribution_patching(model, clean, corrupt, METRIC, nodes="heads")
    assert torch.equal(got["heads"], want["heads"])
    assert all(p.requires_grad for p in model.parameters()) and not model.training


def test_top_and_metrics(models):
    model = models["llama"]
    clean, corrupt = _pair(seed=11, batch=1)
    res = P.attribution_patching(model, clean, corrupt, METRIC, nodes=("residual", "mlp"), method="atp")
    top = res.top(3)
    assert len(top) == 3
    allv = torch.cat([res["residual"].flatten(), res["mlp"].flatten()]).abs()
    assert abs(top[0][2]) == pytest.approx(float(allv.max()))
    node, idx, val = top[0]
    assert float(res[node][(0, *idx)]) == val
    with torch.no_grad():
        lx = model(input_ids=corrupt).logits
    torch.testing.assert_close(res.corrupt_metric, (lx[:, -1, 3] - lx[:, -1, 5]).double())


def test_cosine_metric_on_minilm():
    """The bundled MiniLM with the sentence-embedding metric: padded rows, effects finite,
    and for identical sentences exactly 0."""
    from models import minilm

    tok, model = minilm()
    enc = tok(["a man plays a guitar .", "a dog runs ."], padding=True, return_tensors="pt")
    cor = tok(["a man plays a ladder .", "a cat runs ."], padding=True, return_tensors="pt")
    ref = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    res = P.attribution_patching(model, dict(enc), dict(cor), T.Cosine(ref), nodes=("residual", "heads"))
    assert torch.isfinite(res["heads"]).all() and res["heads"].shape[-1] == 12
    same = P.activation_patching(model, dict(enc), dict(enc), T.Cosine(ref), nodes="attention")
    assert torch.equal(same["attention"], torch.zeros_like(same["attention"]))
    h = model(**enc).last_hidden_state.detach()
    m = enc["attention_mask"].unsqueeze(-1).float()
    pooled = (h * m).sum(1) / m.sum(1)
    torch.testing.assert_close(res.clean_metric, torch.nn.functional.cosine_similarity(pooled, ref[None], dim=-1).double(),
                               atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- errors


def test_errors(models):
    model = models["llama"]
    clean, corrupt = _pair()
    with pytest.raises(ValueError, match="nodes: unknown node type 'head'"):
        P.attribution_patching(model, clean, corrupt, METRIC, nodes="head")
    with pytest.raises(ValueError, match="method must be one of"):
        P.attribution_patching(model, clean, corrupt, METRIC, method="eap-ig")
    with pytest.raises(ValueError, match="rules: method='atp' uses the plain gradient"):
        P.attribution_patching(model, clean, corrupt, METRIC, method="atp", rules=RelevanceRules.all())
    with pytest.raises(ValueError, match="clean has 2 rows and corrupt 1"):
        P.attribution_patching(model, clean, corrupt[:1], METRIC)
    mask = torch.ones_like(clean)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="attention masks differ in row 0"):
        P.attribution_patching(model, {"input_ids": clean, "attention_mask": mask}, corrupt, METRIC)
    with pytest.raises(ValueError, match=r"metric must give one value per row, shape \(2,\)"):
        P.attribution_patching(model, clean, corrupt, lambda out: out.logits[:, -1, 3].sum())
    with pytest.raises(ValueError, match="metric must be one target"):
        P.attribution_patching(model, clean, corrupt, [T.Logit(1), T.Logit(2)])
    with pytest.raises(ValueError, match="batch_size must be an int ≥ 1"):
        P.activation_patching(model, clean, corrupt, METRIC, batch_size=0)
    with pytest.raises(ValueError, match="sample must be an int ≥ 1"):
        P.activation_patching(model, clean, corrupt, METRIC, nodes="neurons", sample=-2)
    with pytest.raises(ValueError, match="sample: a sample is taken of 'neurons' nodes only"):
        P.activation_patching(model, clean, corrupt, METRIC, nodes="heads", sample=5)
    with pytest.raises(RuntimeError, match="inference_mode"):
        with torch.inference_mode():
            P.attribution_patching(model, clean, corrupt, METRIC)
    with pytest.raises(TypeError, match="alignment must be an integer tensor"):
        P.attribution_patching(model, clean, corrupt, METRIC, alignment=[[0, 1]])


def test_unmapped_architecture_is_refused():
    import transformers

    cfg = transformers.OPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                                 max_position_embeddings=32, word_embed_proj_dim=32)
    model = transformers.OPTForCausalLM(cfg).eval()
    clean, corrupt = _pair()
    with pytest.raises(ValueError, match=r"patching needs a mapped architecture.*OPTForCausalLM.*'opt'"):
        P.attribution_patching(model, clean, corrupt, METRIC, method="atp")


# --------------------------------------------------------------------------- AtP*


@pytest.mark.parametrize("arch", ["llama", "bert", "gpt2"])
def test_atp_star_equals_the_qk_fix_written_by_hand(arch):
    """Δr·(g − g_pattern) + Σ (A′ − A)·∂metric/∂A per residual node, with A′ taken from a
    full forward with the node patched by hand (not from the attention module re-run)."""
    from models import tiny_causal_lm

    model = tiny_causal_lm(arch)
    for p in model.parameters():
        p.requires_grad_(False)
    core = {"llama": "self_attn", "bert": "attention.self", "gpt2": "attn"}[arch]
    blocks = {"llama": "model.layers", "bert": "bert.encoder.layer", "gpt2": "transformer.h"}[arch]
    n_layers = model.config.num_hidden_layers
    clean, corrupt = _pair(seed=12, batch=1, seq=6)

    def run(ids, patch=None):
        store, hs = {}, []
        for layer in range(n_layers):
            blk = model.get_submodule(f"{blocks}.{layer}")

            def pre(mod, a, k, layer=layer):
                h = a[0] if a else k["hidden_states"]
                if patch is not None and patch[0] == layer:
                    h = h.clone()
                    h[:, patch[1]] = patch[2]
                store[("r", layer)] = h
                return ((h, *a[1:]), k) if a else (a, {**k, "hidden_states": h})
            hs.append(blk.register_forward_pre_hook(pre, with_kwargs=True))
            hs.append(blk.get_submodule(core).register_forward_hook(
                lambda mod, a, o, layer=layer: store.__setitem__(("w", layer), o[1])))
        hs.append(model.get_input_embeddings().register_forward_hook(lambda mod, a, o: o.detach().requires_grad_(True)))
        try:
            out = model(input_ids=ids)
        finally:
            for h in hs:
                h.remove()
        return out.logits[:, -1, 3] - out.logits[:, -1, 5], store

    try:
        v, st = run(clean)
        rs = [st[("r", i)] for i in range(n_layers)]
        ws = [st[("w", i)] for i in range(n_layers)]
        g = torch.autograd.grad(v.sum(), rs + ws, retain_graph=True)
        gr, dA = g[:n_layers], g[n_layers:]
        gp = [torch.autograd.grad(ws[i], rs[i], dA[i], retain_graph=True)[0] for i in range(n_layers)]
        with torch.no_grad():
            _, stx = run(corrupt)
            want = torch.zeros(n_layers, 6)
            for layer in range(n_layers):
                for p in range(6):
                    src = stx[("r", layer)][0, p]
                    dr = src - rs[layer][0, p]
                    _, sp = run(clean, (layer, p, src))
                    want[layer, p] = dr @ (gr[layer][0, p] - gp[layer][0, p]) + ((sp[("w", layer)] - ws[layer]) * dA[layer]).sum()
        got = P.attribution_patching(model, clean, corrupt, METRIC, nodes=("residual", "mlp"), method="atp*")
        atp = P.attribution_patching(model, clean, corrupt, METRIC, nodes=("residual", "mlp"), method="atp")
    finally:
        for p in model.parameters():
            p.requires_grad_(True)
    torch.testing.assert_close(got["residual"][0], want, atol=2e-6, rtol=1e-5)
    assert not torch.allclose(got["residual"], atp["residual"])  # the fix changed something
    torch.testing.assert_close(got["mlp"], atp["mlp"], atol=0, rtol=0)  # other node types: AtP


def test_atp_star_zero_for_identical_inputs_and_needs_eager():
    from models import tiny_causal_lm

    model = tiny_causal_lm("llama")
    clean, _ = _pair(seed=13, batch=2)
    mask = torch.ones_like(clean)
    mask[0, :2] = 0
    inputs = {"input_ids": clean, "attention_mask": mask}
    res = P.attribution_patching(model, inputs, dict(inputs), METRIC, nodes=NODES, method="atp*")
    for node in NODES:
        assert torch.equal(res[node], torch.zeros_like(res[node])), node
    sdpa = tiny_causal_lm("llama", attn="sdpa")
    with pytest.raises(ValueError, match="method='atp\\*' recomputes the attention pattern.*attn_implementation='eager'"):
        P.attribution_patching(sdpa, clean, clean, METRIC, method="atp*")
    with pytest.raises(ValueError, match="rules: method='atp\\*' uses the plain gradient"):
        P.attribution_patching(model, clean, clean, METRIC, method="atp*", rules=RelevanceRules.all())


# --------------------------------------------------------------------------- found by an adversarial pass


def test_atp_star_runs_its_attention_recomputation_in_eval_mode():
    """The re-run attention modules must not apply attention dropout of a model left in
    train mode: identical inputs give exactly 0 and two calls agree."""
    from models import tiny_causal_lm

    model = tiny_causal_lm("gpt2")
    model.config.attn_pdrop = 0.5
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.5
    model.train()
    ids, other = _pair(seed=15, batch=1, seq=6)
    same = P.attribution_patching(model, ids, ids.clone(), T.Logit(3), nodes="residual", method="atp*")
    assert torch.equal(same["residual"], torch.zeros_like(same["residual"]))
    a = P.attribution_patching(model, ids, other, T.Logit(3), nodes="residual", method="atp*")
    b = P.attribution_patching(model, ids, other, T.Logit(3), nodes="residual", method="atp*")
    assert torch.equal(a["residual"], b["residual"]) and model.training
    model.eval()
    c = P.attribution_patching(model, ids, other, T.Logit(3), nodes="residual", method="atp*")
    assert torch.equal(a["residual"], c["residual"])


def test_a_callable_metric_that_reads_per_row_data_is_refused(models):
    model = models["llama"]
    clean, corrupt = _pair(seed=16, batch=2, seq=5)
    tok = torch.tensor([3, 7])

    def per_row(out):
        return out.logits[torch.arange(out.logits.shape[0]), -1, tok]

    for bs in (2, 3, 32):  # chunks the size of the batch (silent before) and others
        with pytest.raises(ValueError, match="metric: .*copies of clean row 0.*a callable metric must compute each row"):
            P.activation_patching(model, clean, corrupt, per_row, nodes="residual", batch_size=bs)
    ok = P.activation_patching(model, clean, corrupt, T.Logit(tok), nodes="residual", batch_size=2)
    assert torch.isfinite(ok["residual"]).all()


def test_corrupt_metric_is_nan_where_an_alignment_leaves_its_position_out(models):
    model = models["llama"]
    clean, _ = _pair(seed=17, batch=1, seq=7)
    corrupt = clean[:, :5].clone()
    corrupt[0, 1] = (corrupt[0, 1] + 3) % 96
    align = torch.tensor([[0, 1, 2, 3, 4, -1, -1]])
    metric = T.LogitDiff(3, 4, position=6)
    est = P.attribution_patching(model, clean, corrupt, metric, nodes="residual", method="atp", alignment=align)
    ex = P.activation_patching(model, clean, corrupt, metric, nodes="residual", alignment=align)
    for res in (est, ex):
        assert torch.isnan(res.corrupt_metric).all() and torch.isfinite(res.clean_metric).all()
        assert torch.equal(res["residual"][0, :, 5:], torch.zeros(2, 2))
    assert float(ex["residual"][0, 0, 1].abs()) > 0


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama"])
def test_exact_zero_for_identical_inputs_in_float64(arch):
    from models import tiny_causal_lm

    model = tiny_causal_lm(arch, dtype=torch.float64)
    ids, _ = _pair(seed=18, batch=3, seq=6)
    for bs in (1, 4, 7):
        res = P.activation_patching(model, ids, ids.clone(), T.Logit(3), nodes=("residual", "heads"), batch_size=bs)
        for node in ("residual", "heads"):
            assert torch.equal(res[node], torch.zeros_like(res[node])), (bs, node)


def test_top_skips_neurons_that_were_not_patched(models):
    clean, corrupt = _pair(seed=19, batch=1, seq=4)
    res = P.activation_patching(models["llama"], clean, corrupt, METRIC, nodes="neurons", sample=3)
    top = res.top(10)
    assert len(top) == 3 and all(v == v for _, _, v in top)


def test_cosine_target_checks_and_constant_norm():
    from models import minilm

    tok, model = minilm()
    with pytest.raises(ValueError, match="Cosine reference must be finite and nonzero"):
        T.Cosine(torch.zeros(384))
    with pytest.raises(TypeError, match="Cosine reference must be a floating tensor"):
        T.Cosine(torch.ones(384, dtype=torch.long))
    with pytest.raises(ValueError, match="Cosine pooling must be 'mean' or 'cls'"):
        T.Cosine(torch.ones(384), pooling="max")
    enc = dict(tok(["a cat sat .", "dogs run"], padding=True, return_tensors="pt"))
    with pytest.raises(ValueError, match=r"Cosine reference of shape \(8,\) does not match hidden states"):
        pyattr.relevance(model, enc, target=T.Cosine(torch.ones(8)))
    ref = torch.randn(2, 384, generator=torch.Generator().manual_seed(1))
    # at the last hidden state h (mean-pooled into e), Σ h·g = e·∂cos/∂e: 0 for the plain
    # cosine (scale-invariant), the cosine itself when the norm is a constant
    last = "encoder.layer.5"
    plain = pyattr.layer_relevance(model, enc, last, target=T.Cosine(ref), rules=RelevanceRules())
    const = pyattr.layer_relevance(model, enc, last, target=T.Cosine(ref, constant_norm=True), rules=RelevanceRules())
    assert torch.equal(plain.target, const.target)        # the forward is the same
    torch.testing.assert_close(plain[last].relevance.double().sum(dim=(1, 2)), torch.zeros(2, dtype=torch.float64),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(const[last].relevance.double().sum(dim=(1, 2)), const.target, atol=1e-5, rtol=1e-5)
    sub = T.Cosine(ref).rows(torch.tensor([1, 1]), 2)
    assert torch.equal(sub.reference, ref[[1, 1]])


def test_relp_equals_activation_patching_in_float64():
    """The linear-in-the-node case on a float64 model: RelP (all rules) and activation
    patching agree to float32 rounding of the returned effects, at every position."""
    from models import tiny_causal_lm

    model = tiny_causal_lm("llama", dtype=torch.float64)
    w = torch.randn(model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(21))
    metric = T.ModuleOutput("model.layers.1", select=lambda out: out[:, -1] @ w)
    clean, corrupt = _pair(seed=22, batch=2, seq=6, pos=5)
    relp = P.attribution_patching(model, clean, corrupt, metric, nodes="mlp", rules=RelevanceRules.all())
    exact = P.activation_patching(model, clean, corrupt, metric, nodes="mlp")
    torch.testing.assert_close(relp["mlp"][:, 1], exact["mlp"][:, 1], atol=1e-7, rtol=1e-6)
    assert float(exact["mlp"][:, 1, -1].abs().min()) > 1e-3


def test_correlations_of_effects_of_any_shape():
    """pyattr.patching.result.correlations takes two effects of one shape, 2-D or more
    (it raised on them before, issue 45 §6): Pearson and Spearman over every element, as
    scipy computes them on the flattened values, padding's NaN left out."""
    from scipy import stats

    from pyattr.patching.result import correlations

    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    b = a + 0.3 * torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    pr, sr = correlations(a[0], b[0])
    assert pr == pytest.approx(stats.pearsonr(a[0].flatten(), b[0].flatten())[0], abs=1e-12)
    assert sr == pytest.approx(stats.spearmanr(a[0].flatten(), b[0].flatten())[0], abs=1e-12)
    a[:, :, 0] = float("nan")  # a padded position
    pr, sr = correlations(a, b)
    keep = torch.isfinite(a)
    assert pr == pytest.approx(stats.pearsonr(a[keep], b[keep])[0], abs=1e-12)
    assert correlations(torch.ones(2, 3), torch.randn(2, 3, generator=g)) == (None, None)
    with pytest.raises(ValueError, match=r"correlations: est has shape \(2, 3\) and exact \(3, 2\)"):
        correlations(torch.zeros(2, 3), torch.zeros(3, 2))
