"""Targets (``pyattr.targets``), ``grad_outputs``, k targets per row and baselines of
:func:`pyattr.relevance` (DESIGN §7)."""

import pytest
import torch

import pyattr
from models import VOCAB, tiny_causal_lm
from pyattr.targets import Logit, LogitDiff, ModuleOutput

MLP = {"llama": "model.layers.0.mlp", "gpt2": "transformer.h.0.mlp", "bert": "bert.encoder.layer.0.output"}


pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(batch=2, seq=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, seq), generator=g)


def _rel_close(actual, expected, rtol):
    """``|actual − expected| ≤ rtol · max|expected|`` (relative to the field's scale)."""
    scale = float(expected.abs().max())
    err = float((actual.double() - expected.double()).abs().max())
    assert err <= rtol * scale, f"max error {err:.3e} > {rtol:.0e} × {scale:.3e}"


def _conserved(r, w=1.0, rtol=1e-6):
    """|conservation_delta| within ``rtol`` of Σ|relevance| per row: the relevance fields
    are float32, so that is their rounding, whatever the model's dtype."""
    scale = r.relevance.double().abs().flatten(start_dim=r.target.dim()).sum(-1)
    assert (r.conservation_delta.abs() <= rtol * scale).all(), (r.conservation_delta, scale)
    torch.testing.assert_close(
        r.conservation_delta, w * r.target - r.relevance.double().flatten(start_dim=r.target.dim()).sum(-1),
        atol=1e-12, rtol=0,
    )


def _module_output(model, path, ids):
    out = {}
    h = model.get_submodule(path).register_forward_hook(lambda m, a, o: out.__setitem__("o", o))
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        h.remove()
    return out["o"], logits


def _oracle_grad(model, ids, fn):
    """d fn(logits) / d inputs_embeds under the four rules, through use_relevance_rules
    and inputs_embeds: independent of the attribution pass."""
    x = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    with pyattr.use_relevance_rules(model, pyattr.RelevanceRules.all()):
        fn(model(inputs_embeds=x).logits).sum().backward()
    return x.detach(), x.grad


# --------------------------------------------------------------------------- Logit, positions


def test_logit_value_and_position(llama):
    ids = _ids()
    logits = llama(ids).logits.detach()
    r = pyattr.relevance(llama, ids, target=Logit(3))
    # float32 logits: the relevance pass runs the head at the target position only
    torch.testing.assert_close(r.target.float(), logits[:, -1, 3])
    assert torch.equal(r.target_ids, torch.tensor([3, 3]))
    r2 = pyattr.relevance(llama, ids, target=Logit(3, position=2))
    torch.testing.assert_close(r2.target.float(), logits[:, 2, 3])
    # the logit at position 2 depends only on tokens 0..2 (causal)
    assert (r2.token_relevance[:, 3:] == 0).all() and (r2.token_relevance[:, :3] != 0).any()
    # one id per row
    r3 = pyattr.relevance(llama, ids, target=Logit([3, 9], position=0))
    torch.testing.assert_close(r3.target.float(), torch.stack([logits[0, 0, 3], logits[1, 0, 9]]))


def test_plain_target_forms_equal_target_objects(llama):
    ids = _ids()
    a = pyattr.relevance(llama, ids, target=5)
    for t in (Logit(5), [5, 5]):
        b = pyattr.relevance(llama, ids, target=t)
        assert torch.equal(b.relevance, a.relevance) and torch.equal(b.target, a.target)
    # a callable reads the full head's logits: the same logit from another matmul shape
    c = pyattr.relevance(llama, ids, target=lambda out: out.logits[:, -1, 5])
    assert torch.equal(c.relevance, a.relevance)
    torch.testing.assert_close(c.target.float(), a.target.float(), rtol=2e-6, atol=1e-6)
    top = pyattr.relevance(llama, ids)
    assert torch.equal(top.target_ids, llama(ids).logits[:, -1].argmax(-1))
    assert torch.equal(pyattr.relevance(llama, ids, target=Logit(None)).relevance, top.relevance)


def test_relevance_matches_independent_rule_oracle(llama):
    ids = _ids()
    x, g = _oracle_grad(llama, ids, lambda lg: lg[:, -1, 3])
    r = pyattr.relevance(llama, ids, target=Logit(3))
    _rel_close(r.relevance, x * g, 1e-5)


def _left_pad(row, n_pad, pad_id=0):
    ids = torch.cat([torch.full((1, n_pad), pad_id, dtype=torch.long), row], 1)
    mask = torch.cat([torch.zeros(1, n_pad, dtype=torch.long), torch.ones_like(row)], 1)
    return ids, mask


def test_last_position_under_left_and_right_padding(llama):
    row, full = _ids(1, 5, seed=1), _ids(1, 7, seed=2)
    ids_l, mask_l = _left_pad(row, 2)
    ids = torch.cat([ids_l, full]), torch.cat([mask_l, torch.ones_like(full)])
    batch = pyattr.relevance(llama, ids[0], attention_mask=ids[1], target=LogitDiff(4, 6))
    alone = pyattr.relevance(llama, row, target=LogitDiff(4, 6))
    other = pyattr.relevance(llama, full, target=LogitDiff(4, 6))
    torch.testing.assert_close(batch.target[0], alone.target[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch.target[1], other.target[0], atol=1e-5, rtol=1e-5)
    _rel_close(batch.relevance[0, 2:], alone.relevance[0], 1e-4)
    assert (batch.token_relevance[0, :2] == 0).all()
    # right padding: -1 is the last real token, not the last column
    ids_r = torch.cat([row, torch.zeros(1, 2, dtype=torch.long)], 1)
    mask_r = torch.cat([torch.ones_like(row), torch.zeros(1, 2, dtype=torch.long)], 1)
    right = pyattr.relevance(llama, ids_r, attention_mask=mask_r, target=Logit(4))
    torch.testing.assert_close(right.target, pyattr.relevance(llama, row, target=Logit(4)).target, atol=1e-5, rtol=1e-5)


def test_position_counts_each_rows_real_tokens(llama):
    """``position=p ≥ 0`` is each row's p-th real token (issue 22: read-outs at fixed
    positions are found per row from the mask): in a row left-padded by 2, position 2
    explains what the row alone explains at 2 (column 4 of the padded batch)."""
    row = _ids(1, 5, seed=3)
    ids, mask = _left_pad(row, 2)
    padded = pyattr.relevance(llama, ids, attention_mask=mask, target=Logit(7, position=2))
    alone = pyattr.relevance(llama, row, target=Logit(7, position=2))
    with torch.no_grad():
        own = llama(row).logits[0, 2, 7].double()
    torch.testing.assert_close(padded.target[0], own, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded.target, alone.target, atol=1e-5, rtol=1e-5)
    _rel_close(padded.relevance[0, 2:], alone.relevance[0], 1e-4)
    with pytest.raises(ValueError, match=r"target: position 5 is outside row 0, which has 5 real tokens"):
        pyattr.relevance(llama, ids, attention_mask=mask, target=Logit(7, position=5))


@pytest.mark.parametrize(
    "target,exc,msg",
    [
        (lambda: Logit(3, position=-7), ValueError, r"position -7 is outside the sequence of length 6"),
        (lambda: Logit(3, position=1.0), ValueError, r"position must be an int"),
        (lambda: Logit(3, position=6), ValueError, r"position 6 is outside the sequence of length 6"),
        (lambda: LogitDiff(3, None), ValueError, r"LogitDiff needs two token ids"),
        (lambda: LogitDiff(3, VOCAB), ValueError, rf"token ids must be in \[0, {VOCAB}\)"),
        (lambda: ModuleOutput("model.layers.0.mpl"), ValueError, r"no module 'model.layers.0.mpl'; nearest: model.layers.0.mlp"),
        (lambda: ModuleOutput(""), TypeError, r"ModuleOutput needs a dotted module path"),
        (lambda: ModuleOutput("model.norm", select=1.5), TypeError, r"select must be None, an int, a tuple"),
        (lambda: ModuleOutput("model.norm", select=(0, 1, 2)), ValueError, r"indexes 3 dimensions after the batch"),
        (lambda: ModuleOutput("model.norm", select=(0, 99)), ValueError, r"out of range for 'model.norm'"),
        (lambda: ModuleOutput("model.norm", select=lambda o: 1.0), TypeError, r"select callable must return a tensor"),
        (lambda: ModuleOutput("model.norm", select=lambda o: o[0]), ValueError, r"keep the batch dimension first"),
        # the embedding lookup runs before the residual stream enters: no gradient path
        (lambda: ModuleOutput("model.embed_tokens"), ValueError, r"does not depend on the inputs"),
        (lambda: [Logit(3), 4], TypeError, r"a list of targets must hold only target objects or callables"),
    ],
)
def test_target_errors(llama, target, exc, msg):
    with pytest.raises(exc, match=msg):
        pyattr.relevance(llama, _ids(), target=target())


# --------------------------------------------------------------------------- LogitDiff, ModuleOutput, callables


def test_logit_diff_is_difference_of_logits(llama):
    ids = _ids()
    d = pyattr.relevance(llama, ids, target=LogitDiff(4, [5, 8]))
    a = pyattr.relevance(llama, ids, target=4)
    b = pyattr.relevance(llama, ids, target=[5, 8])
    torch.testing.assert_close(d.target, a.target - b.target)
    _rel_close(d.relevance, a.relevance - b.relevance, 1e-5)
    assert torch.equal(d.target_ids, torch.tensor([4, 4]))
    # relevance is linear in the target: a LogitDiff of the same token is 0
    z = pyattr.relevance(llama, ids, target=LogitDiff(4, 4))
    assert (z.target == 0).all() and (z.relevance == 0).all()


@pytest.mark.parametrize(
    "select,by_hand",
    [
        (None, lambda o: o.sum((1, 2))),
        (2, lambda o: o[:, 2].sum(-1)),  # Captum: the index after the batch dimension
        ((slice(None), 2), lambda o: o[:, :, 2].sum(-1)),
        ((1, 2), lambda o: o[:, 1, 2]),
        ((slice(1, 4), slice(0, 5)), lambda o: o[:, 1:4, :5].sum((1, 2))),
        (lambda o: o[:, -1, :3] * 2, lambda o: (o[:, -1, :3] * 2).sum(-1)),
    ],
    ids=["none", "int", "slice_col", "neuron", "slices", "callable"],
)
def test_module_output_select(llama, select, by_hand):
    ids = _ids()
    path = "model.layers.1.mlp"
    out, _ = _module_output(llama, path, ids)
    r = pyattr.relevance(llama, ids, target=ModuleOutput(path, select=select))
    torch.testing.assert_close(r.target, by_hand(out).double(), atol=1e-6, rtol=1e-6)
    assert r.target_ids is None
    # the same value written as a callable target: identical relevance
    c = pyattr.relevance(llama, ids, target=ModuleOutput(path, select=lambda o: by_hand(o)))
    torch.testing.assert_close(c.relevance, r.relevance, atol=0, rtol=0)


def test_module_output_of_a_tuple_returning_module():
    """GPT-2's attention returns a tuple; the first tensor is read."""
    m = tiny_causal_lm("gpt2")
    ids = _ids()
    out, _ = _module_output(m, "transformer.h.1.attn", ids)
    first = out[0] if isinstance(out, tuple) else out
    r = pyattr.relevance(m, ids, target=ModuleOutput("transformer.h.1.attn", select=(slice(None), 3)))
    torch.testing.assert_close(r.target, first[:, :, 3].sum(-1).double(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_module_output_padded_row_equals_row_alone(arch):
    """The hidden states of pad tokens are not part of the row: a selection over every
    position reads them as 0, so the padded row explains the row alone's value."""
    m = tiny_causal_lm(arch)
    path = MLP[arch].replace(".0.", ".1.")
    row, other = _ids(1, 5, seed=6), _ids(1, 7, seed=7)
    ids_l, mask_l = _left_pad(row, 2)
    ids, mask = torch.cat([ids_l, other]), torch.cat([mask_l, torch.ones_like(other)])
    for sel in [(slice(None), 3), None, lambda o: o[:, :, :4].sum((1, 2))]:
        t = ModuleOutput(path, select=sel)
        padded = pyattr.relevance(m, ids, attention_mask=mask, target=t)
        alone = pyattr.relevance(m, row, target=t)
        torch.testing.assert_close(padded.target[0], alone.target[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(padded.target[1], pyattr.relevance(m, other, target=t).target[0], atol=1e-5, rtol=1e-5)
        _rel_close(padded.relevance[0, 2:], alone.relevance[0], 1e-4)
        assert (padded.token_relevance[0, :2] == 0).all()


def test_neuron_target_conserves(llama64):
    ids = _ids()
    for path, sel in [("model.layers.1.mlp", (3, 5)), ("model.layers.0.mlp.down_proj", (slice(None), 1)),
                      ("model.norm", None)]:
        r = pyattr.relevance(llama64, ids, target=ModuleOutput(path, select=sel))
        assert float(r.target.abs().min()) > 1e-2
        _conserved(r)


def test_scalar_callable_target(llama):
    ids = _ids()
    r = pyattr.relevance(llama, ids, target=lambda out: out.logits[:, -1, 3].sum())
    per_row = pyattr.relevance(llama, ids, target=3)
    assert r.target.dim() == 0
    # the callable reads the full head's float32 logits, another matmul shape: float32 rounding
    torch.testing.assert_close(r.target, per_row.target.sum(), rtol=2e-6, atol=1e-6)
    _rel_close(r.relevance, per_row.relevance, 1e-6)


# --------------------------------------------------------------------------- grad_outputs


def test_grad_outputs_weight_the_relevance(llama):
    ids = _ids()
    ref = pyattr.relevance(llama, ids, target=3)
    ones = pyattr.relevance(llama, ids, target=3, grad_outputs=torch.ones(2))
    assert torch.equal(ones.relevance, ref.relevance)
    two = pyattr.relevance(llama, ids, target=3, grad_outputs=2 * torch.ones(2))
    torch.testing.assert_close(two.relevance, 2 * ref.relevance, atol=0, rtol=1e-6)
    w = torch.tensor([0.5, -3.0])
    rw = pyattr.relevance(llama, ids, target=3, grad_outputs=w)
    _rel_close(rw.relevance, w.view(2, 1, 1) * ref.relevance, 1e-6)
    torch.testing.assert_close(rw.target, ref.target)  # the target itself is unweighted
    # a list is accepted like a tensor
    assert torch.equal(pyattr.relevance(llama, ids, target=3, grad_outputs=[0.5, -3.0]).relevance, rw.relevance)


def test_grad_outputs_conservation_float64(llama64):
    ids = _ids()
    w = torch.tensor([0.5, -3.0], dtype=torch.float64)
    for t in (Logit(3), LogitDiff(4, 7), ModuleOutput("model.layers.1.mlp", select=(2, 3))):
        r = pyattr.relevance(llama64, ids, target=t, grad_outputs=w)
        _conserved(r, w)


def test_grad_outputs_with_k_targets(llama):
    ids = _ids()
    tk = [Logit(3), ModuleOutput("model.layers.0.mlp", select=(1, 2))]
    w = torch.tensor([[1.0, 2.0], [-1.0, 0.5]])
    rk = pyattr.relevance(llama, ids, target=tk, grad_outputs=w)
    for j, t in enumerate(tk):
        s = pyattr.relevance(llama, ids, target=t, grad_outputs=w[j])
        _rel_close(rk.relevance[j], s.relevance, 1e-5)
        torch.testing.assert_close(rk.conservation_delta[j], s.conservation_delta, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "target,go,exc",
    [
        (3, torch.ones(3), ValueError),
        (3, torch.ones(2, 1), ValueError),
        (3, torch.ones(()), ValueError),
        ([Logit(3), Logit(4)], torch.ones(2), ValueError),
        (3, torch.ones(2, dtype=torch.long), TypeError),
    ],
)
def test_grad_outputs_errors(llama, target, go, exc):
    with pytest.raises(exc, match=r"grad_outputs"):
        pyattr.relevance(llama, _ids(), target=target, grad_outputs=go)


# --------------------------------------------------------------------------- k targets


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_k_targets_equal_separate_calls(arch, attn):
    m = tiny_causal_lm(arch, attn)
    ids = _ids(2, 5)
    tk = [Logit(3), LogitDiff(4, 5), ModuleOutput(MLP[arch], select=(slice(None), 2))]
    rk = pyattr.relevance(m, ids, target=tk)
    assert rk.token_relevance.shape == (3, 2, 5) and rk.relevance.shape == (3, 2, 5, 32)
    assert rk.target.shape == (3, 2) and rk.conservation_delta.shape == (3, 2)
    assert rk.target_ids is None  # ModuleOutput has no token id
    for j, t in enumerate(tk):
        s = pyattr.relevance(m, ids, target=t)
        _rel_close(rk.relevance[j], s.relevance, 1e-5)
        torch.testing.assert_close(rk.target[j], s.target, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(rk.conservation_delta[j], s.conservation_delta, atol=1e-5, rtol=1e-4)
    # k token ids per row
    kid = torch.tensor([[3, 7], [9, 1]])
    rid = pyattr.relevance(m, ids, target=kid)
    assert rid.token_relevance.shape == (2, 2, 5) and torch.equal(rid.target_ids, kid.T)
    s = pyattr.relevance(m, ids, target=[7, 1])
    _rel_close(rid.relevance[1], s.relevance, 1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_k_targets_under_each_backend(backend_name, arch):
    """One batched backward (``is_grads_batched``) through every backend's rule kernels
    (LayerNorm / RMSNorm, gated and plain activations)."""
    m = tiny_causal_lm(arch)
    ids = _ids(2, 4)
    tk = [Logit(3), ModuleOutput(MLP[arch], select=(slice(None), 2))]
    rk = pyattr.relevance(m, ids, target=tk)
    assert rk.backend == backend_name
    for j, t in enumerate(tk):
        _rel_close(rk.relevance[j], pyattr.relevance(m, ids, target=t).relevance, 1e-5)


def test_k_target_forms(llama):
    ids = _ids()
    a = pyattr.relevance(llama, ids, target=torch.tensor([[3, 4], [3, 4]]))
    b = pyattr.relevance(llama, ids, target=[[3, 4], [3, 4]])
    c = pyattr.relevance(llama, ids, target=[Logit(3), Logit(4)])
    d = pyattr.relevance(llama, ids, target=[lambda o: o.logits[:, -1, 3], lambda o: o.logits[:, -1, 4]])
    for r in (b, c, d):
        torch.testing.assert_close(r.relevance, a.relevance, atol=0, rtol=0)
    # one target object in a list is still k = 1 (a leading dimension)
    one = pyattr.relevance(llama, ids, target=[Logit(3)])
    assert one.relevance.shape == (1, 2, 6, 32)
    with pytest.raises(ValueError, match=r"each of k targets must give one value per batch row"):
        pyattr.relevance(llama, ids, target=[Logit(3), lambda o: o.logits[:, -1, 3].sum()])


# --------------------------------------------------------------------------- baselines


def test_zeros_baseline_equals_no_baseline(llama):
    ids = _ids()
    r = pyattr.relevance(llama, ids, target=3)
    z = pyattr.relevance(llama, ids, target=3, baseline="zeros")
    assert torch.equal(z.relevance, r.relevance) and torch.equal(z.target, r.target)
    # a bias-free RMSNorm model maps zero embeddings to zero logits
    assert torch.equal(z.baseline_target, torch.zeros(2, dtype=torch.float64))
    assert torch.equal(z.conservation_delta, r.conservation_delta)
    t = pyattr.relevance(llama, ids, target=3, baseline=torch.zeros(6, 32))
    assert torch.equal(t.relevance, r.relevance)


@pytest.mark.parametrize("shape", [(2, 6, 32), (1, 6, 32), (6, 32)])
def test_tensor_baseline_is_difference_times_gradient(llama, shape):
    ids = _ids()
    x0 = 0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(4))
    x, g = _oracle_grad(llama, ids, lambda lg: lg[:, -1, 3])
    w = torch.tensor([1.0, -2.0])
    r = pyattr.relevance(llama, ids, target=3, baseline=x0, grad_outputs=w)
    _rel_close(r.relevance, (x - x0) * g * w.view(2, 1, 1), 1e-5)
    # f(x0) by running the model on the baseline embeddings
    with torch.no_grad():
        f0 = llama(inputs_embeds=x0.expand(2, 6, 32)).logits[:, -1, 3].double()
    torch.testing.assert_close(r.baseline_target, f0, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(
        r.conservation_delta, w.double() * (r.target - r.baseline_target) - r.relevance.double().sum((1, 2)),
        atol=1e-12, rtol=0,
    )


def test_pad_baseline(llama, monkeypatch):
    ids = _ids()
    monkeypatch.setattr(llama.config, "pad_token_id", None)
    with pytest.raises(ValueError, match=r"pad_token_id"):
        pyattr.relevance(llama, ids, target=3, baseline="pad")
    monkeypatch.setattr(llama.config, "pad_token_id", 2)
    r = pyattr.relevance(llama, ids, target=LogitDiff(3, 4), baseline="pad")
    with torch.no_grad():
        lg = llama(torch.full_like(ids, 2)).logits[:, -1]
    torch.testing.assert_close(r.baseline_target, (lg[:, 3] - lg[:, 4]).double(), atol=1e-6, rtol=1e-5)
    x, g = _oracle_grad(llama, ids, lambda lg: lg[:, -1, 3] - lg[:, -1, 4])
    x0 = llama.get_input_embeddings()(torch.full_like(ids, 2)).detach()
    _rel_close(r.relevance, (x - x0) * g, 1e-5)
    torch.testing.assert_close(
        r.conservation_delta, (r.target - r.baseline_target) - r.relevance.double().sum((1, 2)), atol=1e-12, rtol=0
    )
    # k targets with a baseline: each equals its own call
    rk = pyattr.relevance(llama, ids, target=[LogitDiff(3, 4), Logit(5)], baseline="pad")
    assert rk.baseline_target.shape == (2, 2)
    _rel_close(rk.relevance[0], r.relevance, 1e-5)
    torch.testing.assert_close(rk.baseline_target[0], r.baseline_target)


def test_top1_target_is_fixed_for_the_baseline(llama):
    """``target=None`` picks the top-1 token at the input; f(x0) reads that same token."""
    ids = _ids()
    x0 = torch.randn(6, 32, generator=torch.Generator().manual_seed(5))
    r = pyattr.relevance(llama, ids, baseline=x0)
    with torch.no_grad():
        lg0 = llama(inputs_embeds=x0.expand(2, 6, 32)).logits[:, -1]
    torch.testing.assert_close(r.baseline_target, lg0.gather(1, r.target_ids.view(2, 1)).view(2).double(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "baseline,exc,msg",
    [
        (torch.zeros(2, 6, 31), ValueError, r"baseline of shape \(2, 6, 31\) does not match"),
        (torch.zeros(3, 6, 32), ValueError, r"baseline of shape \(3, 6, 32\)"),
        (torch.zeros(32), ValueError, r"baseline of shape \(32,\)"),
        (torch.zeros(6, 32, dtype=torch.long), TypeError, r"baseline must be a floating tensor"),
        ([0.0] * 32, TypeError, r"baseline must be 'zeros', 'pad' or a tensor"),
        ("ones", ValueError, r"baseline must be 'zeros', 'pad' or a tensor, got 'ones'"),
        (torch.full((6, 32), float("nan")), ValueError, r"baseline holds NaN"),
    ],
)
def test_baseline_errors(llama, baseline, exc, msg):
    with pytest.raises(exc, match=msg):
        pyattr.relevance(llama, _ids(), target=3, baseline=baseline)


def test_top1_token_is_fixed_per_target_at_the_baseline(llama):
    """In a list mixing a top-1 logit with a module target, the baseline pass explains the
    token chosen at the real input for the logit target (not the baseline's own top-1)."""
    ids = _ids()
    x0 = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
    r = pyattr.relevance(llama, ids, target=[Logit(None), ModuleOutput("model.norm")], baseline=x0)
    top1 = llama(ids).logits[:, -1].argmax(-1)
    assert r.target_ids is None  # not every target is a logit
    base_logits = llama(inputs_embeds=x0).logits[:, -1]
    torch.testing.assert_close(r.baseline_target[0], base_logits.gather(1, top1[:, None])[:, 0].double(),
                               rtol=1e-6, atol=1e-6)
    assert not torch.equal(top1, base_logits.argmax(-1))  # the case where the bug showed
