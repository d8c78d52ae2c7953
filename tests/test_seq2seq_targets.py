"""Module-output targets on encoder–decoder models: a module of the encoder is read with the
source's positions and padding, one of the decoder with the decoder inputs'; against plain
autograd with hooks, padded rows against the row alone, and targets of both stacks refused."""

import pytest
import torch

import pyattr
from models import tiny_seq2seq
from pyattr.targets import Logit, ModuleOutput
from test_seq2seq import ENTRIES, _ids

pytestmark = pytest.mark.usefixtures("one_thread")

PATHS = {"bart": ("model.encoder.layers.1.fc2", "model.decoder.layers.1.fc2"),
         "t5": ("encoder.block.1.layer.1.DenseReluDense", "decoder.block.1.layer.2.DenseReluDense")}


def _oracle(model, arch, src, dec, path, select):
    """Gradient × input at both entries of Σ_row out[row, select] (plain autograd)."""
    xs, kept, hooks = {}, {}, []
    for i, p in enumerate(ENTRIES[arch]):
        def pre(mod, args, i=i):
            if i in xs:
                return None
            xs[i] = args[0].detach().requires_grad_(True)
            return (xs[i], *args[1:])
        hooks.append(model.get_submodule(p).register_forward_pre_hook(pre))
    hooks.append(model.get_submodule(path).register_forward_hook(lambda m, a, o: kept.__setitem__("o", o)))
    try:
        with torch.enable_grad():
            model(input_ids=src, decoder_input_ids=dec, use_cache=False)
            value = kept["o"][(slice(None), *select)].reshape(src.shape[0], -1).sum(1)
            g = torch.autograd.grad(value.sum(), [xs[0], xs[1]], allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    g = [torch.zeros_like(xs[i]) if g[i] is None else g[i] for i in range(2)]
    return (xs[0] * g[0]).sum(-1).detach(), (xs[1] * g[1]).sum(-1).detach(), value.detach()


@pytest.mark.parametrize("stack", [0, 1])
@pytest.mark.parametrize("arch", ["bart", "t5"])
def test_module_target_of_either_stack_equals_autograd(arch, stack):
    model = tiny_seq2seq(arch)
    src, dec = _ids(arch, seed=41, src=6, tgt=4)
    path = PATHS[arch][stack]
    r = pyattr.relevance(model, src, target=ModuleOutput(path, (2, 3)), decoder_input_ids=dec, rules="none")
    s, t, v = _oracle(model, arch, src, dec, path, (2, 3))
    scale = max(float(s.abs().max()), 1e-12)
    tol = 1e-6 if arch == "t5" else 1e-10   # T5's norm takes its variance in float32
    assert (r.source_relevance - s).abs().max() <= tol * scale
    assert (r.target_relevance - t).abs().max() <= tol * scale
    assert torch.allclose(r.target, v.double(), rtol=1e-10)
    if stack == 0:  # a module of the encoder: nothing of the decoder's inputs reaches it
        assert bool((r.target_relevance == 0).all())
    on = pyattr.relevance(tiny_seq2seq(arch, biases=False), src, target=ModuleOutput(path, (2, 3)),
                          decoder_input_ids=dec)
    assert on.conservation_delta.abs().max() <= 1e-6 * on.target.abs().max()


def test_an_encoder_module_target_reads_the_source_padding():
    """A whole-output encoder target of a right-padded source: each row as alone (the
    source's mask, not the decoder's, zeroes its padded positions)."""
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=42, src=7, tgt=3)
    mask = torch.ones_like(src)
    mask[1, 5:] = 0
    target = ModuleOutput(PATHS["bart"][0])
    both = pyattr.relevance(model, src, target=target, decoder_input_ids=dec, attention_mask=mask)
    alone = pyattr.relevance(model, src[1:, :5], target=target, decoder_input_ids=dec[1:])
    assert torch.allclose(both.target[1], alone.target[0], rtol=1e-9)
    assert torch.allclose(both.source_relevance[1, :5], alone.source_relevance[0], rtol=1e-8, atol=1e-10)
    # integrated gradients, layer relevance and perturbation curves read it the same way
    ig = pyattr.integrated_gradients(model, src, target=target, decoder_input_ids=dec, attention_mask=mask, n_steps=4)
    assert torch.allclose(ig.target, both.target, rtol=1e-10)
    lr = pyattr.layer_relevance(model, src, "model.encoder.layers.0", target=target, decoder_input_ids=dec,
                                attention_mask=mask)
    assert torch.allclose(lr.target, both.target, rtol=1e-10)
    c = pyattr.evaluate.perturbation_curve(model, src, both, target=target, decoder_input_ids=dec,
                                           attention_mask=mask, steps=2)
    assert torch.allclose(c.values[:, 0], both.target, rtol=1e-10)


def test_patching_an_encoder_module_metric():
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=43, batch=1, src=5, tgt=3)
    corrupt, _ = _ids("bart", seed=44, batch=1, src=5, tgt=3)
    metric = ModuleOutput(PATHS["bart"][0], (1, 2))
    res = pyattr.patching.activation_patching(model, src, corrupt, metric, nodes="residual", decoder_input_ids=dec)
    assert bool((res["decoder.residual"] == 0).all())          # the decoder runs after the metric's module
    assert float(res["encoder.residual"].abs().max()) > 0
    est = pyattr.patching.attribution_patching(model, src, corrupt, metric, nodes="residual", decoder_input_ids=dec,
                                               method="atp")
    assert bool((est["decoder.residual"] == 0).all())
    assert torch.allclose(est.clean_metric, res.clean_metric, rtol=1e-10)


def test_targets_of_both_stacks_are_refused():
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=45)
    with pytest.raises(ValueError, match=r"target: relevance\(\) reads targets of one stack at a time, and "
                                         r"'model.encoder.layers.1.fc2' is in the encoder while 'Logit\(3"):
        pyattr.relevance(model, src, target=[ModuleOutput(PATHS["bart"][0]), Logit(3)], decoder_input_ids=dec)
    with pytest.raises(ValueError, match="target: module 'model.encoder.nothing'|has no module 'model.encoder.nothing'"):
        pyattr.relevance(model, src, target=ModuleOutput("model.encoder.nothing"), decoder_input_ids=dec)


def test_a_decoder_layer_for_an_encoder_target_is_refused_by_name():
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=46)
    with pytest.raises(ValueError, match="layers: 'model.decoder.layers.0' is in the decoder, which runs after the "
                                         "encoder module the target reads"):
        pyattr.layer_relevance(model, src, "model.decoder.layers.0", target=ModuleOutput(PATHS["bart"][0], (1, 2)),
                               decoder_input_ids=dec)


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_a_node_at_the_targets_own_tensor_is_not_upstream_of_it(stack):
    """Target: block 0's output; node: block 1's input, the same tensor. Patching block 1's
    input cannot change what was read before it, and the estimates agree (they gave the
    whole difference)."""
    from models import tiny_causal_lm

    if stack == "decoder":  # a decoder-only model: the one-stack path
        model = tiny_causal_lm("llama", dtype=torch.float64)
        clean, corrupt = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[5, 30, 7, 8, 9]])  # causal: at or before 1
        metric, kw, node = ModuleOutput("model.layers.0", (1, 2)), {}, "residual"
    else:
        model = tiny_seq2seq("bart")
        clean, corrupt = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[5, 30, 7, 8, 9]])
        metric, kw, node = ModuleOutput("model.encoder.layers.0", (1, 2)), {"decoder_input_ids": torch.tensor([[2, 20]])}, \
            "encoder.residual"
    exact = pyattr.patching.activation_patching(model, clean, corrupt, metric, nodes="residual", **kw)
    assert bool((exact[node][:, 1] == 0).all())
    for method in ("atp", "relp"):
        est = pyattr.patching.attribution_patching(model, clean, corrupt, metric, nodes="residual", method=method, **kw)
        assert bool((est[node][:, 1] == 0).all()), method
        assert float(est[node][:, 0].abs().max()) > 0     # block 0's input is upstream of the target
