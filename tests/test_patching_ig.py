"""attribution_patching(method="ig"): EAP-IG against an independent float64 oracle,
zero effects for identical inputs, exact patching where a node's effect is linear."""

import pytest
import torch

from models import tiny_causal_lm
from pyattr.patching import activation_patching, attribution_patching
from pyattr.targets import LogitDiff, ModuleOutput

pytestmark = pytest.mark.usefixtures("one_thread")

CLEAN = torch.tensor([[5, 9, 14, 3, 22, 7], [11, 4, 4, 30, 2, 17]])
CORRUPT = torch.tensor([[5, 9, 20, 3, 22, 7], [11, 4, 4, 30, 8, 17]])


@pytest.fixture(scope="module")
def model64():
    return tiny_causal_lm("llama", dtype=torch.float64)


def _oracle(model, steps, layer):
    """EAP-IG by hand: the MLP output of ``layer``, the logit difference 3 − 7 at the last
    position; embeddings interpolated at the midpoints, plain autograd."""
    emb = model.get_input_embeddings()
    xc, xx = emb(CLEAN).detach(), emb(CORRUPT).detach()
    mlp = model.model.layers[layer].mlp
    acts = {}

    def hook(mod, args, out):
        acts["a"] = out
        return out

    h = mlp.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(inputs_embeds=xc)
            a_c = acts["a"].clone()
            model(inputs_embeds=xx)
            a_x = acts["a"].clone()
        g = torch.zeros_like(a_c)
        for k in range(steps):
            alpha = (k + 0.5) / steps
            logits = model(inputs_embeds=xc + alpha * (xx - xc)).logits[:, -1]
            value = logits[:, 3] - logits[:, 7]
            g += torch.autograd.grad(value.sum(), acts["a"])[0]
    finally:
        h.remove()
    return ((a_x - a_c) * g / steps).sum(-1)  # (batch, seq)


@pytest.mark.parametrize("steps", [1, 5])
def test_ig_equals_the_hand_written_path_average(model64, steps):
    res = attribution_patching(model64, CLEAN, CORRUPT, LogitDiff(3, 7), nodes="mlp", method="ig", steps=steps)
    for layer in range(model64.config.num_hidden_layers):
        want = _oracle(model64, steps, layer)
        torch.testing.assert_close(res["mlp"][:, layer].double(), want, atol=1e-6, rtol=1e-5)


def test_identical_clean_and_corrupt_give_zero_effects():
    model = tiny_causal_lm("llama")
    res = attribution_patching(model, CLEAN, CLEAN.clone(), LogitDiff(3, 7), nodes=["residual", "heads", "mlp"],
                               method="ig", steps=4)
    for node in ("residual", "heads", "mlp"):
        assert torch.equal(res[node], torch.zeros_like(res[node]))


def test_a_node_with_a_linear_effect_gets_exactly_the_patching_effect(model64):
    # the metric is the summed output of the last block's MLP: linear in that node, so the
    # path-averaged gradient is 1 everywhere and the estimate is the exact effect
    last = model64.config.num_hidden_layers - 1
    metric = ModuleOutput(f"model.layers.{last}.mlp")
    est = attribution_patching(model64, CLEAN, CORRUPT, metric, nodes="mlp", method="ig", steps=64)
    exact = activation_patching(model64, CLEAN, CORRUPT, metric, nodes="mlp")
    torch.testing.assert_close(est["mlp"][:, last].double(), exact["mlp"][:, last].double(), atol=1e-6, rtol=1e-6)  # effects are stored in float32


def test_more_steps_converge_and_chunks_change_nothing(model64):
    kw = dict(nodes=["heads", "attention"], method="ig")
    a = attribution_patching(model64, CLEAN, CORRUPT, LogitDiff(3, 7), steps=256, **kw)
    b = attribution_patching(model64, CLEAN, CORRUPT, LogitDiff(3, 7), steps=512, **kw)
    torch.testing.assert_close(a["heads"], b["heads"], atol=1e-5, rtol=1e-4)
    c = attribution_patching(model64, CLEAN, CORRUPT, LogitDiff(3, 7), steps=6, batch_size=5, **kw)
    d = attribution_patching(model64, CLEAN, CORRUPT, LogitDiff(3, 7), steps=6, **kw)
    torch.testing.assert_close(c["attention"], d["attention"], atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("kw, message", [
    ({"method": "atp", "steps": 4}, "steps: only method='ig' interpolates; method='atp' takes no steps"),
    ({"method": "blockwise", "steps": 4}, "steps: only method='ig' interpolates; method='blockwise' takes no steps"),
    ({"method": "relp", "batch_size": 4}, "batch_size: only method='ig' (interpolated rows) and 'blockwise' (patched "
                                          "nodes per block run) batch; method='relp' takes none"),
    ({"method": "ig", "steps": 0}, "steps must be an int ≥ 1, got 0"),
    ({"method": "ig", "batch_size": -1}, "batch_size must be an int ≥ 1, got -1"),
    ({"method": "ig", "alignment": torch.arange(6)}, "alignment: method='ig' interpolates the input embeddings"),
    ({"method": "ig", "rules": object()}, "rules: method='ig' uses the plain gradient"),
    ({"method": "eap"}, "method must be one of ('relp', 'atp', 'atp*', 'ig', 'blockwise'), got 'eap'"),
    ({"method": "ig", "attention_mask": torch.tensor([[1] * 6, [0] + [1] * 5])},
     "method='ig' interpolates the input embeddings position by position, so they must have the same length and mask"),
])
def test_bad_arguments(kw, message):
    model = tiny_causal_lm("llama")
    with pytest.raises(ValueError) as e:
        attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes="mlp", **kw)
    assert message in str(e.value)
