"""Bad input raises a clear error naming the argument."""

import pytest
import torch

import pyattr
from pyattr.ops import gated_activation, layer_norm, rms_norm
from pyattr.rules import half_rule, identity_rule

X = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))  # drawn at import: its own seed


@pytest.mark.parametrize(
    "call,exc,msg",
    [
        (lambda: layer_norm(X, torch.ones(7)), ValueError, r"weight must have shape \(hidden_size,\) = \(8,\)"),
        (lambda: layer_norm(X, None, torch.ones(2, 8)), ValueError, r"bias must have shape \(hidden_size,\)"),
        (lambda: rms_norm(X, torch.ones(9)), ValueError, r"weight must have shape \(hidden_size,\) = \(8,\)"),
        (lambda: layer_norm(X.long()), TypeError, "x must be a floating tensor"),
        (lambda: rms_norm(X, torch.ones(8, dtype=torch.int32)), TypeError, "weight must be a floating tensor"),
        (lambda: identity_rule(X.to(torch.int64), "silu"), TypeError, "x must be a floating tensor"),
        (lambda: half_rule(X, X.int()), TypeError, "v must be a floating tensor"),
        (lambda: gated_activation(X, torch.randn(2, 9)), ValueError, r"gate of shape \(2, 8\) and up of shape \(2, 9\) must match"),
        (lambda: gated_activation(X, X.double()), TypeError, "gate .* and up .* must have the same dtype"),
        (lambda: gated_activation(X.bool(), X), TypeError, "gate must be a floating tensor"),
        (lambda: identity_rule(X, "swiglu"), ValueError, "act: unknown activation name 'swiglu'"),
        (lambda: gated_activation(X, X, "tanhh"), ValueError, "act: unknown activation name 'tanhh'"),
        (lambda: identity_rule(X, 3), TypeError, "act must be an activation name or a callable"),
        (lambda: identity_rule(X, "silu", zero_limit=float("nan")), ValueError, "zero_limit must be a finite float"),
        (lambda: layer_norm(X, eps=float("nan")), ValueError, r"eps must be finite and >= 0, got nan"),
        (lambda: layer_norm(X, eps=float("inf")), ValueError, "eps must be finite and >= 0"),
        (lambda: rms_norm(X, eps=-1e-6), ValueError, r"eps must be finite and >= 0, got -1e-06"),
        (lambda: rms_norm(X, eps="1e-6"), TypeError, "eps must be a float"),
        (lambda: rms_norm(X, torch.ones(8), offset=float("inf")), ValueError, "offset must be finite"),
        (lambda: rms_norm(X, None, offset=1.0), ValueError, "offset needs a weight"),
        (lambda: half_rule(torch.randn(3), torch.randn(4)), ValueError, r"u of shape \(3,\) and v of shape \(4,\) do not broadcast"),
        (lambda: layer_norm(torch.tensor(1.0)), ValueError, "x must have at least one dimension"),
        (lambda: layer_norm([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_mixed_devices_named():
    meta = torch.ones(8, device="meta")
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        layer_norm(X, meta)
    with pytest.raises(ValueError, match="up is on meta but gate is on cpu"):
        gated_activation(X, torch.ones(2, 8, device="meta"))
    with pytest.raises(ValueError, match="v is on meta but u is on cpu"):
        half_rule(X, torch.ones(2, 8, device="meta"))


def test_relevance_rules_validation():
    with pytest.raises(ValueError, match="RelevanceRules.attention must be False, True, 'frozen' or 'attnlrp'"):
        pyattr.RelevanceRules(attention="soft")
    with pytest.raises(TypeError, match="RelevanceRules.normalization must be a bool"):
        pyattr.RelevanceRules(normalization=1)
    assert pyattr.RelevanceRules(attention=True).attention == "frozen"


def test_ln_rule_errors_name_arguments():
    from pyattr.rules import ln_rule, ln_rule_grad

    with pytest.raises(ValueError, match=r"num of shape \(2,\) and denom of shape \(3,\) do not broadcast"):
        ln_rule(torch.randn(2), torch.randn(3))
    with pytest.raises(ValueError, match="offset must be a finite float, got '1'"):
        ln_rule_grad(X, X, torch.ones(8), norm="rms_norm", offset="1")
    with pytest.raises(ValueError, match="offset must be a finite float, got nan"):
        ln_rule_grad(X, X, torch.ones(8), norm="rms_norm", offset=float("nan"))


def test_inplace_activation_forms_do_not_corrupt_inputs():
    import functools

    import torch.nn.functional as F
    from torch import nn

    for act in (nn.SiLU(inplace=True), functools.partial(F.silu, inplace=True), nn.ReLU(inplace=True)):
        x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
        y = identity_rule(x, act)
        (dx,) = torch.autograd.grad(y.sum(), x)
        assert torch.equal(x.detach(), torch.tensor([-1.0, 0.5, 2.0]))
        kind = "relu" if "relu" in repr(act).lower() else "silu"
        expected = (x > 0).float() if kind == "relu" else torch.sigmoid(x)
        torch.testing.assert_close(dx, expected.detach())
    g = torch.tensor([-1.0, 0.5, 2.0])
    gated_activation(g, torch.ones(3), nn.SiLU(inplace=True))
    assert torch.equal(g, torch.tensor([-1.0, 0.5, 2.0]))
    # an in-place custom callable cannot overwrite the saved input either
    x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)

    def mish_(t):
        return t.mul_(torch.tanh(F.softplus(t)))

    y = identity_rule(x, mish_)
    assert torch.equal(x.detach(), torch.tensor([-1.0, 0.5, 2.0]))
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(dx, (y / x).detach())


def test_custom_activation_module_with_half_parameters():
    from torch import nn

    act = nn.PReLU().half()
    x = torch.randn(4, 6, dtype=torch.float16, requires_grad=True)
    y = identity_rule(x, act)
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(dx.float(), (act(x) / x).detach().float(), atol=2e-3, rtol=2e-3)


def test_derivative_does_not_overflow_to_nan():
    g = torch.tensor([3e38, -3e38, 1e30, -1e30])
    for kind in ("silu", "quick_gelu", "gelu", "gelu_tanh", "relu"):
        gg = g.clone().requires_grad_(True)
        (dg,) = torch.autograd.grad(gated_activation(gg, torch.ones(4), kind, identity=False, half=False).sum(), gg)
        assert torch.equal(dg, torch.tensor([1.0, 0.0, 1.0, 0.0])), (kind, dg)
