import pytest
import torch

from conftest import DTYPES, assert_close
from oracles import act64, phi64
from pyattr.ops import gated_activation

KINDS = ["silu", "gelu", "gelu_tanh", "quick_gelu", "relu"]


def _run(g, u, dh, act, **kw):
    g = g.detach().requires_grad_(True)
    u = u.detach().requires_grad_(True)
    h = gated_activation(g, u, act, **kw)
    dg, du = torch.autograd.grad(h, (g, u), dh)
    return h, dg, du


def _native_derivative(kind, g):
    g = g.double().detach().requires_grad_(True)
    (d,) = torch.autograd.grad(act64(kind, g).sum(), g)
    return d


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [17, 768, 4097])
def test_gated_both_rules_match_oracle(backend_name, kind, dtype, hidden):
    g, u, dh = ((torch.randn(3, hidden) * 2).to(dtype) for _ in range(3))
    h, dg, du = _run(g, u, dh, kind)
    from pyattr.activations import resolve_activation

    assert torch.equal(h, resolve_activation(kind).fn(g) * u)
    assert_close(dg, 0.5 * dh.double() * u.double() * phi64(kind, g), dtype)
    assert_close(du, 0.5 * dh.double() * act64(kind, g.double()), dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("identity,half", [(True, False), (False, True), (False, False)])
def test_gated_rules_switch_off_alone(kind, identity, half):
    g, u, dh = (torch.randn(4, 33, dtype=torch.float64) * 2 for _ in range(3))
    _, dg, du = _run(g, u, dh, kind, identity=identity, half=half)
    s = 0.5 if half else 1.0
    local = phi64(kind, g) if identity else _native_derivative(kind, g)
    torch.testing.assert_close(dg, s * dh * u * local)
    torch.testing.assert_close(du, s * dh * act64(kind, g))
    if not identity and not half:  # ordinary gradient
        gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
        ng, nu = torch.autograd.grad(act64(kind, gg) * uu, (gg, uu), dh)
        torch.testing.assert_close(dg, ng)
        torch.testing.assert_close(du, nu)


@pytest.mark.parametrize("kind", KINDS)
def test_gated_conserves(kind):
    g, u = (torch.randn(8, 40, dtype=torch.float64) * 3 for _ in range(2))
    dh = torch.randn(8, 40, dtype=torch.float64)
    h, dg, du = _run(g, u, dh, kind)
    torch.testing.assert_close(g * dg + u * du, h * dh)


def test_gated_special_values_empty_non_contiguous():
    g = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-42])
    u = torch.ones(6)
    _, dg, du = _run(g, u, torch.ones(6), "silu")
    assert torch.equal(dg[:4], torch.tensor([0.25, 0.25, 0.5, 0.0]))
    assert torch.isnan(dg[4]) and torch.isnan(du[4])
    assert torch.isfinite(dg[5])
    e = torch.empty(0, 4)
    _, de, _ = _run(e, e, e, "gelu")
    assert de.shape == (0, 4)
    g2 = torch.randn(20, 12).t()
    u2 = torch.randn(20, 12).t()
    dh2 = torch.randn(12, 20)
    _, dg2, _ = _run(g2, u2, dh2, "gelu_tanh")
    assert_close(dg2, 0.5 * dh2.double() * u2.double() * phi64("gelu_tanh", g2), torch.float32)


def test_gated_saves_gate_and_up_only():
    g = torch.randn(4, 16, requires_grad=True)
    u = torch.randn(4, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        gated_activation(g, u, "silu")
    assert {t.data_ptr() for t in saved} == {g.data_ptr(), u.data_ptr()} and len(saved) == 2
