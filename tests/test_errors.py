"""Bad input raises a clear error naming the argument."""

import pytest
import torch

import pyattr
from pyattr.ops import gated_activation, layer_norm, rms_norm
from pyattr.rules import half_rule, identity_rule

X = torch.randn(2, 8)


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
