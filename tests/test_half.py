import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DTYPES, assert_close
from pyattr.rules import half_rule


def _grads(u, v, dy):
    u = u.detach().requires_grad_(True)
    v = v.detach().requires_grad_(True)
    y = half_rule(u, v)
    du, dv = torch.autograd.grad(y, (u, v), dy)
    return y, du, dv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [17, 768, 1023, 4097])
def test_half_rule_matches_oracle(backend_name, dtype, hidden):
    u, v, dy = (torch.randn(4, hidden).to(dtype) for _ in range(3))
    y, du, dv = _grads(u, v, dy)
    assert torch.equal(y, u * v)
    assert_close(du, 0.5 * dy.double() * v.double(), dtype)
    assert_close(dv, 0.5 * dy.double() * u.double(), dtype)


def test_half_rule_broadcasts_like_mul():
    u = torch.randn(3, 1, 5, dtype=torch.float64)
    v = torch.randn(4, 1, dtype=torch.float64)
    dy = torch.randn(3, 4, 5, dtype=torch.float64)
    y, du, dv = _grads(u, v, dy)
    assert y.shape == (3, 4, 5) and torch.equal(y, u * v)
    torch.testing.assert_close(du, (0.5 * dy * v).sum(1, keepdim=True))
    torch.testing.assert_close(dv, (0.5 * dy * u).sum((0, 2)).reshape(4, 1))


@settings(max_examples=40, deadline=None, derandomize=True)  # the same 40 examples every run
@given(
    st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=16),
    st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=16),
)
def test_half_rule_conserves(us, vs):
    n = min(len(us), len(vs))
    u = torch.tensor(us[:n], dtype=torch.float64)
    v = torch.tensor(vs[:n], dtype=torch.float64)
    dy = torch.ones(n, dtype=torch.float64)
    y, du, dv = _grads(u, v, dy)
    torch.testing.assert_close(u * du + v * dv, y * dy, atol=1e-9, rtol=1e-12)


def test_half_rule_special_values_and_empty():
    u = torch.tensor([float("nan"), float("inf"), 0.0, -0.0])
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    y, du, dv = _grads(u, v, torch.ones(4))
    assert torch.equal(du, 0.5 * v)
    assert torch.isnan(dv[0]) and dv[1] == float("inf") and dv[2] == 0 and dv[3] == 0
    e = torch.empty(0, 3)
    _, de, _ = _grads(e, e.clone(), e.clone())
    assert de.shape == (0, 3)


def test_half_rule_non_contiguous_and_saved():
    u = torch.randn(32, 16).t()
    v = torch.randn(16, 32)
    dy = torch.randn(16, 32)
    _, du, dv = _grads(u, v, dy)
    torch.testing.assert_close(du, 0.5 * dy * v)
    saved = []
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        half_rule(a, b)
    assert len(saved) == 2
