import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import DTYPES, assert_close
from oracles import phi64
from pyattr.activations import resolve_activation
from pyattr.ops import activation
from pyattr.rules import identity_rule

KINDS = ["silu", "gelu", "gelu_tanh", "quick_gelu", "relu"]


def _grad(x, act, dy, **kw):
    x = x.detach().requires_grad_(True)
    y = identity_rule(x, act, **kw)
    (dx,) = torch.autograd.grad(y, x, dy)
    return y, dx


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [17, 768, 1023, 4097])
def test_identity_backward_matches_float64_oracle(backend_name, kind, dtype, hidden):
    x = (torch.randn(3, hidden) * 3).to(dtype)
    dy = torch.randn(3, hidden).to(dtype)
    _, dx = _grad(x, kind, dy)
    expected = dy.double() * phi64(kind, x.double())
    assert dx.dtype == dtype
    assert_close(dx, expected, dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_identity_rule_conserves_relevance_float64(kind):
    x = torch.randn(64, 33, dtype=torch.float64) * 4
    dy = torch.randn_like(x)
    y, dx = _grad(x, kind, dy)
    torch.testing.assert_close(x * dx, y * dy, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_special_values(kind, dtype):
    tiny = torch.finfo(dtype).tiny
    vals = [0.0, -0.0, tiny / 4, -tiny / 4, float("inf"), float("-inf"), float("nan"), 1e4, -1e4, 60.0, -60.0]
    x = torch.tensor(vals, dtype=dtype)
    dy = torch.ones_like(x)
    _, dx = _grad(x, kind, dy)
    dx = dx.double()
    limit0 = 0.0 if kind == "relu" else 0.5
    assert dx[0] == limit0 and dx[1] == limit0  # φ(±0): the limit, no 0/0
    # denormals: φ is at its limit (sign-dependent only for relu)
    assert abs(dx[2] - limit0) <= (0.0 if kind == "relu" else 1e-2) or (kind == "relu" and dx[2] == 1.0)
    assert dx[3] == 0.0 if kind == "relu" else abs(dx[3] - 0.5) < 1e-2
    assert dx[4] == 1.0 and dx[5] == 0.0  # φ(+inf) = 1, φ(-inf) = 0: never NaN
    assert torch.isnan(dx[6])  # NaN propagates
    assert dx[7] == 1.0 and dx[8] == 0.0
    assert torch.isfinite(dx[[0, 1, 2, 3, 4, 5, 7, 8, 9, 10]]).all()


FORMS = [
    ("silu", F.silu, "silu"),
    ("silu", nn.SiLU(), "silu"),
    ("silu", "swish", "silu"),
    ("gelu", F.gelu, "gelu"),
    ("gelu", nn.GELU(), "gelu"),
    ("gelu", functools.partial(F.gelu, approximate="none"), "gelu"),
    ("gelu_tanh", functools.partial(F.gelu, approximate="tanh"), "gelu_tanh"),
    ("gelu_tanh", nn.GELU(approximate="tanh"), "gelu_tanh"),
    ("gelu_tanh", "gelu_new", "gelu_tanh"),
    ("gelu_tanh", "gelu_pytorch_tanh", "gelu_tanh"),
    ("relu", F.relu, "relu"),
    ("relu", nn.ReLU(), "relu"),
    ("relu", torch.relu, "relu"),
    ("quick_gelu", "quick_gelu", "quick_gelu"),
]


@pytest.mark.parametrize("kind,act,expected", FORMS)
def test_activation_forms_are_recognised(kind, act, expected):
    assert resolve_activation(act).kind == expected


@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu", "relu", "gelu_python"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_activation_classes_forward_equal_and_recognised(name, dtype):
    from transformers.activations import ACT2FN

    mod = ACT2FN[name]
    x = torch.randn(4, 65).to(dtype)
    assert resolve_activation(mod).kind != "custom"
    y, dx = _grad(x, mod, torch.ones_like(x))
    assert torch.equal(y, mod(x))  # native forward, bit-identical
    kind = resolve_activation(mod).kind
    assert_close(dx, phi64(kind, x.double()), dtype)


@pytest.mark.parametrize("act", [F.silu, nn.GELU(approximate="tanh"), "quick_gelu", torch.relu])
def test_forward_bit_identical(act):
    x = torch.randn(5, 300, dtype=torch.bfloat16)
    native = resolve_activation(act).fn
    assert torch.equal(identity_rule(x, act), native(x))
    assert torch.equal(activation(x, act), native(x))


def test_custom_callable_uses_quotient_and_zero_limit():
    act = lambda t: t * torch.tanh(F.softplus(t))  # mish: no closed form here
    x = torch.tensor([-2.0, 0.0, 3.0, float("inf")], dtype=torch.float64)
    _, dx = _grad(x, act, torch.ones_like(x), zero_limit=0.25)
    expected = torch.tensor([act(torch.tensor(-2.0, dtype=torch.float64)) / -2.0, 0.25, act(torch.tensor(3.0, dtype=torch.float64)) / 3.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(dx, expected)
    assert resolve_activation(act).kind == "custom"


def test_non_contiguous_and_empty_and_no_grad():
    base = torch.randn(64, 48)
    x = base.t()  # non-contiguous
    assert not x.is_contiguous()
    dy = torch.randn(48, 64)
    _, dx = _grad(x, "silu", dy)
    torch.testing.assert_close(dx.double(), dy.double() * phi64("silu", x.double()), atol=1e-6, rtol=1e-5)
    e = torch.empty(0, 7)
    _, de = _grad(e, "gelu", torch.empty(0, 7))
    assert de.shape == (0, 7)
    y = identity_rule(torch.randn(3, 4), "silu")  # no grad required: plain forward
    assert not y.requires_grad


def test_saves_only_x():
    x = torch.randn(8, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        identity_rule(x, "gelu")
    assert len(saved) == 1 and saved[0].data_ptr() == x.data_ptr()


@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh", "quick_gelu", "relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpp_result_does_not_depend_on_the_position_in_the_tensor(kind, dtype):
    """The vector body and the tail of the cpp kernels use one formula: the same x gives
    the same dx whether it sits in a full vector or in the tail (lengths 1 to 17)."""
    from pyattr.backends import compiled

    import pyattr

    if not pyattr.available_backends()["cpp"].available:
        pytest.skip("the cpp backend is not built")
    act = resolve_activation(kind)
    for v in (-6.0, -5.5, -0.7518, 0.0779, 3.0):
        ref = compiled.identity_backward(torch.full((64,), v, dtype=dtype), torch.ones(64, dtype=dtype), act)[0]
        for n in (1, 3, 9, 17):
            got = compiled.identity_backward(torch.full((n,), v, dtype=dtype), torch.ones(n, dtype=dtype), act)
            assert torch.equal(got, torch.full((n,), ref.item(), dtype=dtype)), (kind, v, n)
    g, u, dh = torch.full((5,), -5.5, dtype=dtype), torch.full((5,), 2.0, dtype=dtype), torch.ones(5, dtype=dtype)
    G, U, DH = (t.repeat(13) for t in (g, u, dh))
    for identity in (True, False):
        a = compiled.gated_backward(g, u, dh, act, identity, True)
        b = compiled.gated_backward(G, U, DH, act, identity, True)
        assert torch.equal(a[0], b[0][:5]) and torch.equal(a[1], b[1][:5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpp_relu_16bit_equals_the_float32_product_for_every_bit_pattern(dtype):
    """The cpp ReLU rule for 16-bit types works on bit patterns (no float32 round trip).
    Against ``dy·φ(x)`` computed in float32 and rounded: every one of the 65536 values of
    x, with dy finite of both signs, ±0, ±inf and NaN (lengths that leave a tail too)."""
    from pyattr.backends import compiled

    import pyattr

    if not pyattr.available_backends()["cpp"].available:
        pytest.skip("the cpp backend is not built")
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    act = resolve_activation("relu")
    for d in (1.5, -2.25, 0.0, -0.0, 3e-39 if dtype == torch.bfloat16 else 6e-8, float("inf"), float("-inf"),
              float("nan")):
        dy = torch.full_like(x, d)
        x32 = x.float()
        phi = torch.where(x32 > 0, 1.0, 0.0).where(~x32.isnan(), float("nan"))
        want = (dy.float() * phi).to(dtype)
        for n in (x.numel(), x.numel() - 5):
            got = compiled.identity_backward(x[:n], dy[:n], act)
            w = want[:n]
            assert torch.equal(got.isnan(), w.isnan()), d
            keep = ~w.isnan()
            # bit for bit, the sign of zero included
            assert torch.equal(got[keep].view(torch.int16), w[keep].view(torch.int16)), d


def test_cpp_relu_16bit_follows_flush_denormal():
    """Under ``torch.set_flush_denormal(True)`` float arithmetic reads and writes
    subnormals as zero; the cpp ReLU rule on bfloat16 then gives what the reference
    backend gives (its bit-pattern path would pass subnormals through)."""
    import pyattr

    if not pyattr.available_backends()["cpp"].available:
        pytest.skip("the cpp backend is not built")
    bf = torch.bfloat16
    x = torch.tensor([0x0001, 0x3F80, 0x0040, 0x7F80, -0x7FFF], dtype=torch.int16).view(bf).requires_grad_(True)
    dy = torch.tensor([0x3F80, 0x0001, 0x0040, 0x0003, -0x4080], dtype=torch.int16).view(bf)  # last: -1.0
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        got = {}
        for name in ("torch", "cpp"):
            with pyattr.backend(name):
                got[name] = torch.autograd.grad(identity_rule(x, "relu"), x, dy)[0].view(torch.int16)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got["cpp"], got["torch"])
    assert got["cpp"].tolist() == [0, 0, 0, 0, -0x8000]
    with pyattr.backend("cpp"):  # and with subnormals kept, they pass through
        kept = torch.autograd.grad(identity_rule(x, "relu"), x, dy)[0].view(torch.int16)
    assert kept.tolist() == [0x3F80, 0x0001, 0x0040, 0x0003, -0x8000]


# --- the C++ autograd Function (csrc/identity_rule.cpp) ----------------------------------

@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cpp_function_equals_the_python_function(kind, dtype):
    """With the cpp backend a CPU Identity-rule on a native activation is a C++ autograd
    node: the forward and the gradient bit for bit those of the Python Function (the same
    op and kernel), the second-order gradient that of the reference formula, and k
    gradients in one batched backward those of the loop."""
    import pyattr
    from pyattr import _function
    from pyattr.rules.identity import IdentityRuleFunction

    if not pyattr.available_backends()["cpp"].available:
        pytest.skip("the cpp backend is not built")
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 37, generator=g) * 3).to(dtype).requires_grad_(True)
    dy = torch.randn(3, 37, generator=g).to(dtype)
    act = resolve_activation(kind)
    with pyattr.backend("cpp"):
        y = identity_rule(x, kind)
        assert "CppNode" in y.grad_fn.name() and "IdentityRule" in y.grad_fn.name()
        ref = _function.apply(IdentityRuleFunction, x, act)
        assert type(ref.grad_fn).__name__ == "IdentityRuleFunctionBackward"
        assert torch.equal(y, ref) and torch.equal(y, act.fn(x))
        assert torch.equal(torch.autograd.grad(y, x, dy, retain_graph=True)[0],
                           torch.autograd.grad(ref, x, dy, retain_graph=True)[0])
        if dtype == torch.float64:
            firsts = [torch.autograd.grad(f, x, dy, create_graph=True)[0] for f in (y, ref)]
            seconds = [torch.autograd.grad((f * f).sum(), x, retain_graph=True)[0] for f in firsts]
            assert torch.equal(firsts[0], firsts[1]) and torch.equal(seconds[0], seconds[1])
        G = torch.randn(4, 3, 37, generator=g).to(dtype)
        loop = torch.stack([torch.autograd.grad(y, x, gi, retain_graph=True)[0] for gi in G])
        assert torch.equal(torch.autograd.grad(y, x, G, is_grads_batched=True)[0], loop)


def test_cpp_function_only_for_native_activations_and_the_cpp_backend():
    import pyattr

    if not pyattr.available_backends()["cpp"].available:
        pytest.skip("the cpp backend is not built")
    x = torch.randn(2, 8, requires_grad=True)
    with pyattr.backend("cpp"):
        assert "CppNode" in identity_rule(x, F.silu).grad_fn.name()
        assert "CppNode" in identity_rule(x, "gelu_pytorch_tanh").grad_fn.name()
        # a module's own forward, QuickGELU (no native op) and custom callables: the Python Function
        assert "CppNode" not in identity_rule(x, nn.SiLU()).grad_fn.name()
        assert "CppNode" not in identity_rule(x, "quick_gelu").grad_fn.name()
        assert "CppNode" not in identity_rule(x, torch.tanh).grad_fn.name()
    with pyattr.backend("torch"):
        assert "CppNode" not in identity_rule(x, "silu").grad_fn.name()


def test_cpp_function_for_torch_nn_module_forwards():
    """A scope passes a module's bound forward: nn.SiLU / nn.GELU / nn.ReLU (not in place)
    call the functional op, so they get the C++ node; another class's forward does not."""
    import pyattr
    from pyattr.activations import Activation
    from pyattr.rules.identity import _native_forward, apply_identity_rule

    if not pyattr.available_backends()["cpp"].available:
        pytest.skip("the cpp backend is not built")
    x = torch.randn(2, 8, requires_grad=True)
    with pyattr.backend("cpp"):
        for kind, mod in [("silu", nn.SiLU()), ("gelu", nn.GELU()), ("gelu_tanh", nn.GELU(approximate="tanh")),
                          ("relu", nn.ReLU())]:
            y = apply_identity_rule(x, Activation(kind, mod.forward))
            assert "CppNode" in y.grad_fn.name() and torch.equal(y, mod(x)), kind
        # the kind must match the module (a GELU module under "gelu_tanh" is not that op)
        assert "CppNode" not in apply_identity_rule(x, Activation("gelu_tanh", nn.GELU().forward)).grad_fn.name()
        assert not _native_forward(Activation("relu", nn.ReLU(inplace=True).forward))  # (would write into x)

        class MySiLU(nn.SiLU):
            def forward(self, t):
                return t * torch.sigmoid(t)

        assert "CppNode" not in apply_identity_rule(x, Activation("silu", MySiLU().forward)).grad_fn.name()
