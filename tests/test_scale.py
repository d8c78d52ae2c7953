import pytest
import torch

from pyattr.rules import scale_gradient


def test_scale_gradient_scalar():
    x = torch.randn(3, 4, requires_grad=True)
    y = scale_gradient(x, 0.25)
    assert torch.equal(y, x)
    dy = torch.randn(3, 4)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dx, dy * 0.25)


def test_scale_gradient_per_column():
    x = torch.randn(2, 6, requires_grad=True)
    c = torch.tensor([0.0, 0.0, 0.5, 0.5, 1.0, 1.0])
    (dx,) = torch.autograd.grad(scale_gradient(x, c), x, torch.ones(2, 6))
    assert torch.equal(dx, c.expand(2, 6))


@pytest.mark.parametrize(
    "scale,exc,msg",
    [
        (float("nan"), ValueError, "scale must be finite"),
        (float("inf"), ValueError, "scale must be finite"),
        ("half", TypeError, "scale must be a float or a tensor"),
        (torch.ones(5), ValueError, "does not broadcast to x"),
    ],
)
def test_scale_gradient_errors(scale, exc, msg):
    with pytest.raises(exc, match=msg):
        scale_gradient(torch.randn(3, 4), scale)
