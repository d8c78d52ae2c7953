"""The combined-form twin that runs the rule Functions in eager code (pyattr._function):
the same results, graph node names and errors as the Function itself, which still runs
under functorch transforms and torch.compile."""

from __future__ import annotations

import pytest
import torch

import pyattr
from pyattr import _function
from pyattr.ops import gated_activation, layer_norm, rms_norm
from pyattr.ops.gated import GatedActivationFunction
from pyattr.ops.layer_norm import LayerNormRuleFunction
from pyattr.ops.rms_norm import RMSNormRuleFunction
from pyattr.rules import half_rule, identity_rule, ln_rule, scale_gradient
from pyattr.rules.half import HalfRuleFunction
from pyattr.rules.identity import IdentityRuleFunction
from pyattr.rules.ln import LNRuleFunction
from pyattr.rules.scale import ScaleGradientFunction

H = 12


def _t(seed, *shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)


# name: (the public call on its differentiable inputs, the Function, the inputs)
CASES = {
    "identity": (lambda x: identity_rule(x, "gelu"), IdentityRuleFunction, lambda: [_t(0, 3, H)]),
    "half": (half_rule, HalfRuleFunction, lambda: [_t(0, 3, H), _t(1, 3, H)]),
    "ln_rule": (lambda n: ln_rule(n, torch.full((3, 1), 1.5, dtype=n.dtype)), LNRuleFunction, lambda: [_t(0, 3, H)]),
    "scale": (lambda x: scale_gradient(x, 0.25), ScaleGradientFunction, lambda: [_t(0, 3, H)]),
    "gated": (lambda g, u: gated_activation(g, u, "silu"), GatedActivationFunction,
              lambda: [_t(0, 3, H), _t(1, 3, H)]),
    "layer_norm": (lambda x, w, b: layer_norm(x, w, b, 1e-5), LayerNormRuleFunction,
                   lambda: [_t(0, 3, H), _t(1, H), _t(2, H)]),
    "rms_norm": (lambda x, w: rms_norm(x, w, 1e-6), RMSNormRuleFunction, lambda: [_t(0, 3, H), _t(1, H)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_call_runs_the_twin_with_the_same_node_name_and_gradient(name):
    call, cls, make = CASES[name]
    leaves = make()
    with pyattr.backend("torch"):  # LayerNorm with the cpp backend has a C++ node instead
        y = call(*leaves)
    twin = cls.__dict__[_function._TWIN]
    assert type(y.grad_fn)._forward_cls is twin
    assert type(y.grad_fn).__name__ == f"{cls.__name__}Backward"
    dy = torch.randn_like(y)
    # the reference backend on both sides: torch.func.vjp records its backward, and a
    # recorded rule backward runs the reference formulas whatever the backend
    with pyattr.backend("torch"):
        got = torch.autograd.grad(call(*leaves), leaves, dy)
        # the Function itself, entered through torch.func (the functorch path)
        want = torch.func.vjp(call, *leaves)[1](dy)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_transforms_use_the_function_itself():
    seen = []
    x = torch.randn(4, H, dtype=torch.float64)

    def f(t):
        y = identity_rule(t, "silu")
        seen.append(torch._C._are_functorch_transforms_active())
        return y.sum()

    g = torch.func.grad(f)(x[0])
    assert seen == [True]
    assert torch.allclose(g, torch.sigmoid(x[0]))
    v = torch.vmap(torch.func.grad(f))(x)
    assert torch.allclose(v, torch.sigmoid(x))


def test_a_patched_method_reaches_the_twin_and_its_undoing_too(monkeypatch):
    x = torch.tensor([-1.0, 2.0], requires_grad=True)

    def grad():
        # the torch backend: with cpp a native ReLU is a C++ node, not this Function
        with pyattr.backend("torch"):
            return torch.autograd.grad(identity_rule(x, "relu").sum(), x)[0]

    assert torch.equal(grad(), torch.tensor([0.0, 1.0]))  # the twin exists from here on
    monkeypatch.setattr(IdentityRuleFunction, "backward", staticmethod(lambda ctx, dy: (dy * 100, None)))
    assert torch.equal(grad(), torch.tensor([100.0, 100.0]))
    monkeypatch.undo()
    assert torch.equal(grad(), torch.tensor([0.0, 1.0]))


def test_a_forward_with_defaults_is_refused():
    class WithDefault(torch.autograd.Function):
        @staticmethod
        def forward(x, scale=2.0):
            return x * scale

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, dy):
            return dy, None

    with pytest.raises(TypeError, match="WithDefault.forward must take positional arguments without defaults"):
        _function.apply(WithDefault, torch.ones(2))
