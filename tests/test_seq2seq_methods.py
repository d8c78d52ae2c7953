"""Integrated gradients on encoder–decoder models against an explicit path loop written
here with hooks, and its completeness over source and target prefix."""

import warnings

import pytest
import torch

import pyattr
from models import tiny_seq2seq
from test_seq2seq import ENTRIES, _ids, _oracle_hooks
from pyattr.methods.integrated_gradients import path_points

pytestmark = pytest.mark.usefixtures("one_thread")


def _ig_loop(model, arch, src, dec, token, method, n, rules):
    """Σ_i w_i ∂f/∂z (z = α_i x at both entries), one forward and backward per path point."""
    xs, hooks = {}, []

    def cap(i):
        def pre(mod, args):
            xs[i] = args[0].detach()
        return pre

    for i, p in enumerate(ENTRIES[arch]):
        hooks.append(model.get_submodule(p).register_forward_pre_hook(cap(i)))
    with torch.no_grad():
        model(input_ids=src, decoder_input_ids=dec, use_cache=False)
    for h in hooks:
        h.remove()
    total = [0, 0]
    for a, w in zip(*path_points(method, n)):
        z = {}

        def rep(i, a=a):
            def pre(mod, args):
                z[i] = (xs[i] * a).requires_grad_(True)
                return (z[i], *args[1:])
            return pre

        hooks = [model.get_submodule(p).register_forward_pre_hook(rep(i)) for i, p in enumerate(ENTRIES[arch])]
        hooks += _oracle_hooks(model, rules)
        try:
            with torch.enable_grad():
                f = model(input_ids=src, decoder_input_ids=dec, use_cache=False).logits[:, -1, token].sum()
                g = torch.autograd.grad(f, [z[0], z[1]])
        finally:
            for h in hooks:
                h.remove()
        total = [total[0] + w * g[0], total[1] + w * g[1]]
    return (xs[0] * total[0]).sum(-1), (xs[1] * total[1]).sum(-1)


@pytest.mark.parametrize("rules", ["none", "all"])
@pytest.mark.parametrize("arch", ["t5_gated", "bart", "m2m_100"])
def test_integrated_gradients_equal_the_explicit_path_loop(arch, rules):
    model = tiny_seq2seq(arch)
    src, dec = _ids(arch, seed=13, src=6, tgt=4)
    r = pyattr.integrated_gradients(model, src, target=7, decoder_input_ids=dec, n_steps=5, method="riemann_right",
                                    rules=rules)
    s, t = _ig_loop(model, arch, src, dec, 7, "riemann_right", 5, rules)
    scale = max(s.abs().max().item(), t.abs().max().item())
    # T5's norm takes its variance in float32 even in a float64 model; its plain gradient
    # through that variance differs between batch shapes at float32 rounding
    tol = 1e-6 if arch.startswith("t5") and rules == "none" else 1e-10
    assert (r.source_attribution - s).abs().max() <= tol * scale
    assert (r.target_attribution - t).abs().max() <= tol * scale
    assert r.source_attribution.shape == (2, 6) and r.target_attribution.shape == (2, 4)


def test_integrated_gradients_complete_over_both_sides():
    """Completeness: Σ source + Σ target prefix = f(x) − f(0) as the quadrature converges
    (slowly: the zero baseline sits at a LayerNorm's input)."""
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=13, src=6, tgt=4)
    coarse = pyattr.integrated_gradients(model, src, target=7, decoder_input_ids=dec, n_steps=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pyattr.ConvergenceWarning)   # converged: no warning
        fine = pyattr.integrated_gradients(model, src, target=7, decoder_input_ids=dec, n_steps=512)
    change = (fine.target - fine.baseline_target).abs()
    assert (fine.convergence_delta.abs() <= 1e-4 * change.clamp(min=1)).all()
    assert fine.convergence_delta.abs().max() < coarse.convergence_delta.abs().max()
    # not converged: the completeness check warns, as on one stack
    with pytest.warns(pyattr.ConvergenceWarning, match=r"the attributions miss f\(x\) - f\(baseline\) by .* n_steps=2"):
        pyattr.integrated_gradients(model, src, target=7, decoder_input_ids=dec, n_steps=2)
    with torch.no_grad():
        logits = model(input_ids=src, decoder_input_ids=dec).logits[:, -1, 7]
    assert torch.allclose(fine.target, logits.double(), rtol=1e-12, atol=0)


def test_integrated_gradients_refuse_what_is_not_supported_on_encoder_decoders():
    model = tiny_seq2seq("t5")
    src, dec = _ids("t5")
    with pytest.raises(ValueError, match=r"baseline: on encoder–decoder models one of \['zeros', 'pad'\]"):
        pyattr.integrated_gradients(model, src, decoder_input_ids=dec, baseline=torch.zeros(2, 7, 16))
    with pytest.raises(ValueError, match="layer, internal_batch_size, grad_outputs, multiply_by_inputs=False: not "
                                         "supported on encoder–decoder models yet"):
        pyattr.integrated_gradients(model, src, decoder_input_ids=dec, layer="encoder.block.0")
    with pytest.raises(ValueError, match="target: integrated_gradients explains one target per row"):
        pyattr.integrated_gradients(model, src, decoder_input_ids=dec, target=torch.tensor([[1, 2], [3, 4]]))


@pytest.mark.parametrize("arch", ["t5", "bart", "marian"])
def test_layer_relevance_on_both_stacks_equals_the_oracle(arch):
    """x · grad at every block's input of both stacks, under the rules (written as hooks here)."""
    model = tiny_seq2seq(arch)
    src, dec = _ids(arch, seed=14)
    r = pyattr.layer_relevance(model, src, "residual", target=9, decoder_input_ids=dec)
    prefix = "" if arch == "t5" else "model."
    blocks = "block" if arch == "t5" else "layers"
    want = [f"{prefix}{side}.{blocks}.{i}" for side in ("encoder", "decoder") for i in range(2)]
    assert r.paths == want
    seen, hooks = {}, _oracle_hooks(model, "all")

    def keep(path):
        def pre(mod, args):
            if path not in seen:
                args[0].retain_grad()
                seen[path] = args[0]
        return pre

    hooks += [model.get_submodule(p).register_forward_pre_hook(keep(p)) for p in want]
    try:
        with torch.enable_grad():
            model(input_ids=src, decoder_input_ids=dec, use_cache=False).logits[:, -1, 9].sum().backward()
    finally:
        for h in hooks:
            h.remove()
    for p in want:
        expected = (seen[p] * seen[p].grad).detach()
        assert torch.allclose(r[p].relevance, expected, atol=1e-10 * expected.abs().max().item(), rtol=0), p
        assert r[p].where == "input" and r[p].conservation_delta is None
    # the encoder's first block input is relevance()'s source entry (T5, Marian: no norm before it)
    if arch != "bart":
        rel = pyattr.relevance(model, src, target=9, decoder_input_ids=dec)
        assert torch.allclose(r[want[0]].relevance.sum(-1), rel.source_relevance, atol=1e-10, rtol=1e-8)


def test_layer_relevance_refuses_one_stack_shorthands_on_encoder_decoders():
    model = tiny_seq2seq("t5")
    src, dec = _ids("t5")
    with pytest.raises(ValueError, match="layers: the shorthand 'mlp' is not supported on encoder–decoder models yet"):
        pyattr.layer_relevance(model, src, "mlp", decoder_input_ids=dec)
    with pytest.raises(ValueError, match="layers: T5ForConditionalGeneration has no module 'encoder.blok.0'"):
        pyattr.layer_relevance(model, src, ["encoder.blok.0"], decoder_input_ids=dec)


def test_layer_relevance_refuses_layers_it_cannot_describe():
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart")
    with pytest.raises(ValueError, match="layers: 'model.encoder.embed_tokens' is computed before the entries"):
        pyattr.layer_relevance(model, src, ["model.encoder.embed_tokens"], target=7, decoder_input_ids=dec)
    r = pyattr.layer_relevance(model, src, ["residual", "model.encoder.layers.0"], target=7, decoder_input_ids=dec)
    assert r.paths == ["model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0",
                       "model.decoder.layers.1"]
    model.model.decoder.layers[1] = model.model.decoder.layers[0]
    with pytest.raises(ValueError, match="layers: 'model.decoder.layers.0' runs 2 times in one forward"):
        pyattr.layer_relevance(model, src, "residual", target=7, decoder_input_ids=dec)


def test_integrated_gradients_need_one_value_per_row():
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart")
    with pytest.raises(ValueError, match=r"target: integrated_gradients needs one value per row \(2,\), got shape"):
        pyattr.integrated_gradients(model, src, target=lambda o: o.logits[:, -1, 7].sum(), decoder_input_ids=dec)


def test_layer_relevance_views_show_both_stacks_with_their_tokens(tmp_path):
    from pyattr.toy import translation as TR

    model, tok = TR.load()
    lr = pyattr.layer_relevance(model, "sun cat red fox", "residual", tokenizer=tok, decoder_input_ids="FOX RED",
                                target="CAT")
    assert lr.sides == ["encoder", "encoder", "decoder", "decoder"]
    assert lr.tokens == [["sun", " cat", " red", " fox", "</s>"]] and lr.decoder_tokens[0][1:] == ["FOX", " RED"]
    assert lr.target_tokens == ["CAT"]
    panels = lr._panels()
    assert [p.rows for p in panels] == [lr.paths[:2], lr.paths[2:]]
    assert panels[0].cols == lr.tokens[0] and panels[1].cols == lr.decoder_tokens[0]
    assert "· decoder · target 'CAT'" in panels[1].title
    frame = lr.to_pandas()
    assert set(frame.layer) == set(lr.paths)
    back = pyattr.load(lr.save(tmp_path / "lr.safetensors"))
    assert back.sides == lr.sides and back.decoder_tokens == lr.decoder_tokens


def test_generation_views_name_their_columns_as_the_relevance_views_do():
    from pyattr.toy import translation as TR

    model, tok = TR.load()
    g = pyattr.generation_relevance(model, "sun cat red fox", tokenizer=tok, max_new_tokens=5)
    cols = g.to_pandas().columns
    assert {"source_token", "decoder_token", "step"} <= set(cols)


def test_integrated_gradients_from_the_pad_baseline_equal_the_explicit_path_loop():
    """baseline='pad': the path from what both entries receive for an all-pad source and
    target prefix (read off the model's own forward) to the input; against a loop written
    here with hooks, and complete as the quadrature converges."""
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=14, src=6, tgt=4)
    pad = model.config.pad_token_id
    x0, hooks = {}, []
    for i, p in enumerate(ENTRIES["bart"]):
        hooks.append(model.get_submodule(p).register_forward_pre_hook(
            lambda mod, args, i=i: x0.__setitem__(i, args[0].detach())))
    with torch.no_grad():
        model(input_ids=torch.full_like(src, pad), decoder_input_ids=torch.full_like(dec, pad), use_cache=False)
        xs = {}
        for h in hooks:
            h.remove()
        hooks = [model.get_submodule(p).register_forward_pre_hook(lambda mod, args, i=i: xs.__setitem__(i, args[0]))
                 for i, p in enumerate(ENTRIES["bart"])]
        model(input_ids=src, decoder_input_ids=dec, use_cache=False)
    for h in hooks:
        h.remove()
    total = [0, 0]
    for a, w in zip(*path_points("riemann_right", 5)):
        z = {}

        def rep(i, a=a):
            def pre(mod, args):
                z[i] = (x0[i] + a * (xs[i] - x0[i])).requires_grad_(True)
                return (z[i], *args[1:])
            return pre

        hs = [model.get_submodule(p).register_forward_pre_hook(rep(i)) for i, p in enumerate(ENTRIES["bart"])]
        try:
            with torch.enable_grad():
                f = model(input_ids=src, decoder_input_ids=dec, use_cache=False).logits[:, -1, 7].sum()
                g = torch.autograd.grad(f, [z[0], z[1]])
        finally:
            for h in hs:
                h.remove()
        total = [total[0] + w * g[0], total[1] + w * g[1]]
    r = pyattr.integrated_gradients(model, src, target=7, decoder_input_ids=dec, n_steps=5, method="riemann_right",
                                    rules="none", baseline="pad")
    want_s, want_t = ((xs[0] - x0[0]) * total[0]).sum(-1), ((xs[1] - x0[1]) * total[1]).sum(-1)
    scale = float(want_s.abs().max())
    assert (r.source_attribution - want_s).abs().max() <= 1e-10 * scale
    assert (r.target_attribution - want_t).abs().max() <= 1e-10 * scale
    fine = pyattr.integrated_gradients(model, src, target=7, decoder_input_ids=dec, n_steps=256, baseline="pad")
    assert (fine.convergence_delta.abs() <= 1e-3 * (fine.target - fine.baseline_target).abs().clamp(min=1)).all()
