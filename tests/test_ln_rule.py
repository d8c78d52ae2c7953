import pytest
import torch

from conftest import DTYPES, assert_close
from oracles import layer_norm_rule_grads, rms_norm_rule_grads
from pyattr.rules import ln_rule, ln_rule_grad


def test_ln_rule_forward_and_backward():
    num = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    denom = (num.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    y = ln_rule(num, denom)
    assert torch.equal(y, num / denom)
    dy = torch.randn(4, 9, dtype=torch.float64)
    (dnum,) = torch.autograd.grad(y, num, dy)
    torch.testing.assert_close(dnum, dy / denom.detach())


def test_ln_rule_no_gradient_to_denom_and_scalar_denom():
    num = torch.randn(5, requires_grad=True)
    denom = torch.tensor(2.0, requires_grad=True)
    y = ln_rule(num, denom)
    y.sum().backward()
    assert denom.grad is None
    torch.testing.assert_close(num.grad, torch.full((5,), 0.5))
    y2 = ln_rule(num.detach().requires_grad_(), 4.0)
    assert torch.equal(y2, num / 4.0)


def test_ln_rule_makes_rmsnorm_linear():
    x = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    r = (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    y = ln_rule(x, r)
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close((x * g).sum(), y.sum())  # conservation


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_ln_rule_grad_matches_oracle(backend_name, dtype, norm):
    x = torch.randn(6, 1023).to(dtype)
    w = torch.randn(1023).to(dtype)
    dy = torch.randn(6, 1023).to(dtype)
    dx = ln_rule_grad(dy, x, w, eps=1e-5, norm=norm)
    if norm == "layer_norm":
        expected = layer_norm_rule_grads(x, w, None, 1e-5, dy)[0]
    else:
        expected = rms_norm_rule_grads(x, w, 1e-5, 0.0, dy)[0]
    assert_close(dx, expected, dtype)


def test_ln_rule_grad_errors():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"dy of shape \(2, 7\) must match x of shape \(2, 8\)"):
        ln_rule_grad(torch.randn(2, 7), x)
    with pytest.raises(ValueError, match="norm must be 'layer_norm' or 'rms_norm'"):
        ln_rule_grad(torch.randn(2, 8), x, norm="batch_norm")
    with pytest.raises(ValueError, match="offset applies to norm='rms_norm' only"):
        ln_rule_grad(torch.randn(2, 8), x, torch.ones(8), offset=1.0)
    with pytest.raises(TypeError, match="num must be a floating tensor"):
        ln_rule(torch.ones(3, dtype=torch.long), 2.0)
