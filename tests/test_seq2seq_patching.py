"""Patching on encoder–decoder models: nodes on both stacks and the decoder's cross-attention.
Exact patching against a loop over the model written here (one forward per node, the
corrupt activation copied in by a hook); AtP and RelP against gradient × activation
difference read with hooks (RelP's LN-rule written as a detach); identical inputs give 0."""

import pytest
import torch
from torch import nn

import pyattr
from models import tiny_seq2seq
from test_seq2seq import _ids, _ln_rule

pytestmark = pytest.mark.usefixtures("one_thread")

#: (node → (path of the module in block i, "input" / "output")) per architecture, written
#: from the modeling files
SITES = {
    "bart": {"encoder.residual": ("model.encoder.layers.{i}", "input"),
             "decoder.residual": ("model.decoder.layers.{i}", "input"),
             "encoder.mlp": ("model.encoder.layers.{i}.fc2", "output"),
             "decoder.attention": ("model.decoder.layers.{i}.self_attn", "output"),
             "decoder.cross_attention": ("model.decoder.layers.{i}.encoder_attn", "output"),
             "decoder.cross_heads": ("model.decoder.layers.{i}.encoder_attn.out_proj", "input")},
    "t5": {"encoder.residual": ("encoder.block.{i}", "input"),
           "decoder.residual": ("decoder.block.{i}", "input"),
           "encoder.mlp": ("encoder.block.{i}.layer.1.DenseReluDense", "output"),
           "decoder.attention": ("decoder.block.{i}.layer.0.SelfAttention", "output"),
           "decoder.cross_attention": ("decoder.block.{i}.layer.1.EncDecAttention", "output"),
           "decoder.cross_heads": ("decoder.block.{i}.layer.1.EncDecAttention.o", "input")},
}
SITES["marian"] = SITES["mbart"] = SITES["m2m_100"] = SITES["bart"]
NODES = ["residual", "mlp", "decoder.attention", "cross_attention", "cross_heads"]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _forward(model, src, dec, token):
    """The logit of ``token`` at the last decoder position."""
    return model(input_ids=src, decoder_input_ids=dec, use_cache=False).logits[:, -1, token]


def _record(model, arch, src, dec, names, layers=2):
    acts, hooks = {}, []
    for n in names:
        for i in range(layers):
            path, where = SITES[arch][n]
            mod = model.get_submodule(path.format(i=i))
            if where == "input":
                hooks.append(mod.register_forward_pre_hook(lambda m, a, k=(n, i): acts.__setitem__(k, a[0])))
            else:
                hooks.append(mod.register_forward_hook(lambda m, a, o, k=(n, i): acts.__setitem__(k, _first(o))))
    try:
        value = _forward(model, src, dec, 7)
    finally:
        for h in hooks:
            h.remove()
    return value, acts


def _patched(model, arch, src, dec, node, layer, fn):
    path, where = SITES[arch][node]
    mod = model.get_submodule(path.format(i=layer))
    if where == "input":
        h = mod.register_forward_pre_hook(lambda m, a: (fn(a[0]), *a[1:]))
    else:
        h = mod.register_forward_hook(lambda m, a, o: (fn(o[0]), *o[1:]) if isinstance(o, tuple) else fn(o))
    try:
        with torch.no_grad():
            return _forward(model, src, dec, 7)
    finally:
        h.remove()


@pytest.mark.parametrize("arch", ["bart", "t5", "marian", "mbart", "m2m_100"])
def test_exact_patching_equals_the_loop_over_the_model(arch):
    model = tiny_seq2seq(arch)
    src, dec = _ids(arch, seed=31, batch=1, src=5, tgt=3)
    corrupt, _ = _ids(arch, seed=32, batch=1, src=5, tgt=3)
    names = ["encoder.residual", "encoder.mlp", "decoder.cross_attention", "decoder.cross_heads"]
    res = pyattr.patching.activation_patching(model, src, corrupt, 7, nodes=names, decoder_input_ids=dec,
                                              batch_size=5)
    with torch.no_grad():
        clean, _ = _record(model, arch, src, dec, names)
        _, acts_x = _record(model, arch, corrupt, dec, names)
    heads = 4
    for n in names:
        for i in range(2):
            e = res[n][0, i]
            for p in range(e.shape[0]):
                units = range(heads) if n.endswith("heads") else [None]
                for u in units:
                    def fn(t, p=p, u=u):
                        t = t.clone()
                        w = slice(None) if u is None else slice(u * 4, (u + 1) * 4)
                        t[0, p, w] = acts_x[(n, i)][0, p, w]
                        return t
                    want = float(_patched(model, arch, src, dec, n, i, fn)[0] - clean[0])
                    got = float(e[p] if u is None else e[p, u])
                    assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (n, i, p, u, got, want)
    assert res.method == "exact" and res["encoder.residual"].shape == (1, 2, 5)
    assert res["decoder.cross_heads"].shape == (1, 2, 3, 4)
    assert res.dims["decoder.cross_heads"] == ("batch", "layer", "position", "head")


@pytest.mark.parametrize("method", ["atp", "relp"])
@pytest.mark.parametrize("arch", ["bart", "t5", "marian", "mbart", "m2m_100"])
def test_estimates_equal_gradient_times_difference(arch, method):
    model = tiny_seq2seq(arch)
    src, dec = _ids(arch, seed=33, batch=2, src=6, tgt=4)
    corrupt, dec_x = _ids(arch, seed=34, batch=2, src=6, tgt=4)
    names = ["encoder.residual", "decoder.residual", "encoder.mlp", "decoder.attention", "decoder.cross_attention",
             "decoder.cross_heads"]
    res = pyattr.patching.attribution_patching(model, src, corrupt, 7, nodes=names, method=method,
                                               decoder_input_ids=dec, corrupt_decoder_input_ids=dec_x)
    want = _estimate(model, arch, src, corrupt, dec, dec_x, names, method == "relp")
    for (n, i), w in want.items():
        got = res[n][:, i].double()
        assert torch.allclose(got, w.double(), rtol=1e-5, atol=1e-6 * float(w.abs().max().clamp(min=1))), (n, i)
    assert sorted(res.nodes) == sorted(names)


def _estimate(model, arch, src, corrupt, dec, dec_x, names, ln_rule):
    """(a_corrupt − a_clean) · ∂logit/∂a per node (the corrupt run on its own decoder
    inputs), the gradient plain or with the LN-rule written as a detach (RelP's default)."""
    with torch.no_grad():
        _, acts_x = _record(model, arch, corrupt, dec_x, names)
    hooks = [m.register_forward_hook(_ln_rule) for m in model.modules()
             if ln_rule and (isinstance(m, nn.LayerNorm) or type(m).__name__ == "T5LayerNorm")]
    try:
        with torch.enable_grad():
            value, acts = _record(model, arch, src, dec, names)
            keys = list(acts)
            grads = torch.autograd.grad(value.sum(), [acts[k] for k in keys], allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for k, g in zip(keys, grads):
        prod = (acts_x[k] - acts[k].detach()) * (torch.zeros_like(acts[k]) if g is None else g)
        out[k] = prod.view(*prod.shape[:2], 4, -1).sum(-1) if k[0].endswith("heads") else prod.sum(-1)
    return out


def test_identical_clean_and_corrupt_give_exactly_zero():
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=35, batch=2, src=5, tgt=3)
    for call in (lambda: pyattr.patching.activation_patching(model, src, src.clone(), 7, nodes=NODES,
                                                             decoder_input_ids=dec, batch_size=7),
                 lambda: pyattr.patching.attribution_patching(model, src, src.clone(), 7, nodes=NODES,
                                                              decoder_input_ids=dec)):
        res = call()
        assert all(bool((e == 0).all()) for e in res.effects.values())
        assert torch.equal(res.clean_metric, res.corrupt_metric)


def test_sum_positions_sums_the_estimates():
    model = tiny_seq2seq("t5")
    src, dec = _ids("t5", seed=36, batch=2, src=5, tgt=3)
    corrupt, _ = _ids("t5", seed=37, batch=2, src=5, tgt=3)
    per = pyattr.patching.attribution_patching(model, src, corrupt, 7, nodes=NODES, decoder_input_ids=dec)
    tot = pyattr.patching.attribution_patching(model, src, corrupt, 7, nodes=NODES, decoder_input_ids=dec,
                                               sum_positions=True)
    for n in per.nodes:
        assert torch.allclose(tot[n], per[n].sum(2), rtol=1e-6, atol=1e-7)
        assert tot.dims[n] == per.dims[n][:2] + per.dims[n][3:]


def test_translation_toy_finds_the_swapped_word():
    """Swapping one source word: exact patching and RelP both rank the encoder's first
    residual node at that word highest, and the views label both stacks' positions."""
    from pyattr.toy import translation as TR

    model, tok = TR.load()
    cat = tok.convert_tokens_to_ids("CAT")
    kw = dict(nodes=["residual", "cross_heads"], decoder_input_ids="FOX RED", tokenizer=tok)
    exact = pyattr.patching.activation_patching(model, "sun cat red fox", "sun dog red fox", cat, **kw)
    relp = pyattr.patching.attribution_patching(model, "sun cat red fox", "sun dog red fox", cat, **kw)
    for res in (exact, relp):
        node, idx, eff = res.top(1)[0]
        assert node == "encoder.residual" and idx[1] == 1 and eff < -5
    assert exact.decoder_tokens == [["<pad>", "FOX", " RED"]] and exact.tokens == [["sun", " cat", " red", " fox",
                                                                                     "</s>"]]
    frame = exact.to_pandas()
    assert set(frame[frame.panel == frame.panel.unique()[1]].token) == {"<pad>", "FOX", " RED"}


def test_encoder_decoder_patching_refuses_by_name():
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=38, batch=1, src=5, tgt=3)
    P = pyattr.patching
    with pytest.raises(ValueError, match=r"method: on an encoder–decoder model attribution_patching runs \['relp', "
                                         r"'atp'\]"):
        P.attribution_patching(model, src, src, 7, method="atp*", decoder_input_ids=dec)
    with pytest.raises(ValueError, match="alignment: not supported on encoder–decoder models yet"):
        P.attribution_patching(model, src, src, 7, decoder_input_ids=dec, alignment=torch.zeros(1, 5).long())
    with pytest.raises(ValueError, match="sample: not supported on encoder–decoder models yet"):
        P.activation_patching(model, src, src, 7, nodes="neurons", decoder_input_ids=dec, sample=3)
    with pytest.raises(ValueError, match="sum_positions: activation patching on an encoder–decoder model"):
        P.activation_patching(model, src, src, 7, decoder_input_ids=dec, sum_positions=True)
    with pytest.raises(ValueError, match=r"clean and corrupt: their source \(input_ids\) differ in shape"):
        P.attribution_patching(model, src, src[:, :4], 7, decoder_input_ids=dec)
    with pytest.raises(ValueError, match="nodes: 'encoder.cross_heads': the encoder has no cross-attention"):
        P.attribution_patching(model, src, src, 7, nodes="encoder.cross_heads", decoder_input_ids=dec)
    with pytest.raises(ValueError, match="nodes: unknown node type 'middle.mlp'"):
        P.attribution_patching(model, src, src, 7, nodes="middle.mlp", decoder_input_ids=dec)
    from models import tiny_causal_lm

    with pytest.raises(ValueError, match="LlamaForCausalLM is not an encoder–decoder model"):
        P.attribution_patching(tiny_causal_lm("llama"), src, src, 7, decoder_input_ids=dec)


def test_the_corrupt_run_reads_the_clean_decoder_inputs_however_they_are_given():
    """decoder_input_ids inside the clean inputs mapping: the corrupt run reads them too (as
    with decoder_input_ids=), not BART's own shift of the corrupt source."""
    model = tiny_seq2seq("bart")
    clean, corrupt = torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.tensor([[5, 6, 30, 8, 9, 10]])
    dec = torch.tensor([[2, 20, 21, 22, 23, 24]])
    for f in (pyattr.patching.activation_patching, pyattr.patching.attribution_patching):
        arg = f(model, clean, corrupt, 3, nodes="mlp", decoder_input_ids=dec)
        mapping = f(model, {"input_ids": clean, "decoder_input_ids": dec}, corrupt, 3, nodes="mlp")
        assert torch.equal(arg.corrupt_metric, mapping.corrupt_metric)
        assert all(torch.equal(arg[n], mapping[n]) for n in arg.nodes)
    with torch.no_grad():
        want = model(input_ids=corrupt, decoder_input_ids=dec).logits[0, -1, 3].double()
    assert torch.allclose(arg.corrupt_metric[0], want, rtol=1e-12)


def test_a_metric_that_reads_other_rows_is_refused_by_exact_patching():
    model = tiny_seq2seq("bart")
    clean, corrupt = torch.tensor([[5, 6, 7, 8], [11, 12, 13, 14]]), torch.tensor([[5, 30, 7, 8], [11, 40, 13, 14]])
    dec = torch.tensor([[2, 20], [2, 22]])
    centred = lambda out: out.logits[:, -1, 3] - out.logits[:, -1, 3].mean()  # noqa: E731
    with pytest.raises(ValueError, match="metric: on .* copies of clean row 0 it gives .* activation patching runs "
                                         "each row as copies of itself"):
        pyattr.patching.activation_patching(model, clean, corrupt, centred, nodes="mlp", decoder_input_ids=dec)


def test_a_word_metric_is_a_target_side_token():
    from pyattr.toy import translation as TR

    model, tok = TR.load()
    kw = dict(nodes="residual", decoder_input_ids="FOX RED", tokenizer=tok)
    word = pyattr.patching.attribution_patching(model, "sun cat red fox", "sun dog red fox", "CAT", **kw)
    ids = pyattr.patching.attribution_patching(model, "sun cat red fox", "sun dog red fox",
                                               tok.convert_tokens_to_ids("CAT"), **kw)
    assert all(torch.equal(word[n], ids[n]) for n in ids.nodes)


@pytest.mark.parametrize("arch", __import__("models").SEQ2SEQ_ARCHS)
def test_every_node_type_on_every_mapped_encoder_decoder(arch):
    """Each mapped type: every node type on both stacks (T5Gemma 2's decoder attends to the
    encoder in its self-attention: no cross nodes), identical inputs give exactly 0, and a
    head node per attention head (4 in the tiny models)."""
    model = tiny_seq2seq(arch)
    src, dec = _ids(arch, seed=47, batch=1, src=5, tgt=3)
    nodes = ["residual", "attention", "heads", "mlp", "neurons"]
    if arch == "prophetnet":  # its decoder blocks hold every predicting stream: refused, the encoder's read
        with pytest.raises(ValueError, match="nodes: 'decoder.residual': .* predicting streams"):
            pyattr.patching.attribution_patching(model, src, src.clone(), 5, nodes=nodes, decoder_input_ids=dec)
        res = pyattr.patching.attribution_patching(model, src, src.clone(), 5, nodes=[f"encoder.{n}" for n in nodes],
                                                   decoder_input_ids=dec)
        assert all(bool((e == 0).all()) for e in res.effects.values()) and len(res.nodes) == 5
        assert res["encoder.heads"].shape == (1, 2, 5, 4)
        return
    if arch != "t5gemma2":
        nodes += ["cross_attention", "cross_heads"]
    res = pyattr.patching.attribution_patching(model, src, src.clone(), 5, nodes=nodes, decoder_input_ids=dec)
    assert all(bool((e == 0).all()) for e in res.effects.values())
    assert res["encoder.heads"].shape == (1, 2, 5, 4) and res["decoder.heads"].shape == (1, 2, 3, 4)
    assert sum(n.startswith("decoder.cross") for n in res.nodes) == (0 if arch == "t5gemma2" else 2)
