"""The functional rules of generic scopes (pyattr/integration/functional.py): each form on a
minimal module, its forward bit-identical, its gradient against the rule's float64
closed form; and the switches of RelevanceRules."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyattr
from pyattr.integration.functional import functional_rules

ALL = pyattr.RelevanceRules.all()


def _grads(module, *xs, rules=ALL):
    """(output, its plain twin, gradients under the functional rules) for a seeded dy."""
    xs = [x.detach().requires_grad_(True) for x in xs]
    ref = module(*xs).detach()
    with functional_rules(module, rules):
        y = module(*xs)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    grads = torch.autograd.grad(y, xs, dy, allow_unused=True, materialize_grads=True)
    return y, ref, grads, dy


class Call(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


@pytest.mark.parametrize("name,fn,phi", [
    ("gelu", F.gelu, lambda x: 0.5 * torch.erfc(-x / math.sqrt(2))),
    ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"),
     lambda x: 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))),
    ("silu", F.silu, torch.sigmoid),
    ("relu", F.relu, lambda x: (x > 0).double()),
    ("tanh", torch.tanh, lambda x: torch.tanh(x) / x),
    ("Tensor.tanh", lambda x: x.tanh(), lambda x: torch.tanh(x) / x),
])
def test_activations_called_as_functions_get_the_identity_rule(name, fn, phi):
    x = _x(3, 7)
    y, ref, (gx,), dy = _grads(Call(fn), x)
    assert torch.equal(y, ref)
    torch.testing.assert_close(gx, dy * phi(x), rtol=1e-12, atol=1e-12)
    assert torch.allclose((x * gx).sum(), (y * dy).sum())  # conservation


def test_a_gated_mlp_written_with_functions_gets_the_gated_rules():
    """down(F.silu(g)·u) as LFM2 and others write it: dg = ½·dh·u·σ(g), du = ½·dh·silu(g)."""
    g, u = _x(2, 5, seed=1), _x(2, 5, seed=2)
    y, ref, (dg, du), dy = _grads(Call(lambda g, u: F.silu(g) * u), g, u)
    assert torch.equal(y, ref)
    torch.testing.assert_close(dg, 0.5 * dy * u * torch.sigmoid(g), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(du, 0.5 * dy * F.silu(g), rtol=1e-12, atol=1e-12)


def test_a_gate_computed_in_one_statement_and_multiplied_in_the_next_is_a_constant():
    """s = σ(g) (or through a cast and a view), then x·s: the gate is held constant, as the
    AH-rule holds a pattern: dx = dy·s, dg = 0; x·σ(x) written out is SiLU's Identity-rule."""
    def gated(x, g):
        s = torch.sigmoid(g).to(torch.float32).to(torch.float64).view(x.shape)
        return x * s

    x, g = _x(4, 6, seed=1), _x(4, 6, seed=2)
    y, ref, (dx, dg), dy = _grads(Call(gated), x, g)
    assert torch.equal(y, ref)
    torch.testing.assert_close(dx, dy * torch.sigmoid(g).float().double(), rtol=1e-12, atol=1e-12)
    assert torch.equal(dg, torch.zeros_like(dg))
    y, _, (dx,), dy = _grads(Call(lambda x: x * torch.sigmoid(x)), x)
    torch.testing.assert_close(dx, dy * torch.sigmoid(x), rtol=1e-12, atol=1e-12)


def test_the_tanh_gelu_written_out_gets_its_identity_rule():
    """½·x·(1 + tanh(z(x))): the (1 + tanh) factor is a gate (a tag kept through + 1)."""
    def gelu_new(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    x = _x(3, 8)
    y, ref, (dx,), dy = _grads(Call(gelu_new), x)
    assert torch.equal(y, ref)
    torch.testing.assert_close(dx, dy * gelu_new(x) / x, rtol=1e-10, atol=1e-12)


def test_norms_written_inline_get_the_ln_rule():
    """x·rsqrt(mean(x²) + eps)·w and F.normalize(x): the statistic is a constant."""
    w = torch.randn(6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def rms(x):
        h = x.to(torch.float32).double()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))

    x = _x(3, 6)
    y, ref, (dx,), dy = _grads(Call(rms), x)
    assert torch.equal(y, ref)
    h = x.float().double()
    r = torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    # the gradient passes the float32 cast back as the native one does
    torch.testing.assert_close(dx, (dy * w / r).float().double(), rtol=1e-12, atol=1e-12)
    y, ref, (dx,), dy = _grads(Call(lambda x: F.normalize(x, dim=-1)), x)
    assert torch.equal(y, ref)
    torch.testing.assert_close(dx, dy / x.norm(dim=-1, keepdim=True), rtol=1e-12, atol=1e-12)
    y, ref, (dx,), dy = _grads(Call(lambda x: x / x.norm(dim=-1, keepdim=True)), x)
    torch.testing.assert_close(dx, dy / x.norm(dim=-1, keepdim=True), rtol=1e-12, atol=1e-12)


def test_each_family_follows_its_switch():
    x = _x(3, 5)
    off = pyattr.RelevanceRules(normalization=True)  # no activation, no gate rule
    _, _, (dx,), dy = _grads(Call(F.gelu), x, rules=off)
    native = torch.autograd.grad(F.gelu(x.requires_grad_()), x, dy)[0]
    torch.testing.assert_close(dx, native, rtol=0, atol=0)
    g, u = _x(2, 5, seed=1), _x(2, 5, seed=2)
    _, _, (dg, du), dy = _grads(Call(lambda g, u: g * u), g, u, rules=off)
    assert torch.equal(dg, dy * u) and torch.equal(du, dy * g)  # the native product
    _, _, (dx,), dy = _grads(Call(lambda x: F.normalize(x, dim=-1)), x, rules=pyattr.RelevanceRules(activation=True))
    xx = x.detach().requires_grad_()
    assert torch.equal(dx, torch.autograd.grad(F.normalize(xx, dim=-1), xx, dy)[0])


def test_outside_the_model_forward_and_inside_rule_forwards_nothing_changes():
    """The mode is active only inside the model's own forward: the caller's code around it
    (a target computed with tanh) keeps native gradients."""
    m = Call(lambda x: x * 1.0)
    x = _x(2, 3).requires_grad_()
    with functional_rules(m, ALL):
        y = torch.tanh(m(x))
    x2 = x.detach().requires_grad_()
    assert torch.equal(torch.autograd.grad(y.sum(), x)[0], torch.autograd.grad(torch.tanh(x2).sum(), x2)[0])


def test_products_of_a_path_tensor_and_a_constant_stay_native():
    x = _x(3, 4)
    c = torch.full((3, 4), 0.3, dtype=torch.float64)
    _, _, (dx,), dy = _grads(Call(lambda x: x * c + x / 2.0), x)
    assert torch.equal(dx, dy * c + dy / 2.0)
