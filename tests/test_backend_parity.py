"""Every non-reference backend that runs on CPU tensors here (`cpp`; `triton` under
TRITON_INTERPRET=1) against the reference `torch` backend, op by op, and
`torch.library.opcheck` on the registered `pyattr::` ops."""

import os

import pytest
import torch

import pyattr
from pyattr.activations import resolve_activation
from pyattr.backends import compiled, reference, triton_backend

from conftest import DTYPES, TOL

_ST = pyattr.available_backends()
CPU_COMPILED = [n for n in ("cpp",) if _ST[n].available]
CPU_BACKENDS = [n for n in ("cpp", "triton") if _ST[n].available and "cpu" in _ST[n].devices]
MODULES = {"cpp": compiled, "triton": triton_backend}


def _comparable(impl, x):
    """Elements to compare. Triton's interpreter converts bfloat16 denormals (±1e-40) to 0
    on load (its numpy conversion, not the kernel), so those are left out there."""
    keep = torch.ones_like(x, dtype=torch.bool)
    if impl is triton_backend and x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        keep = (x.float().abs() >= torch.finfo(torch.bfloat16).tiny) | (x.float() == 0) | ~torch.isfinite(x.float())
    return keep


@pytest.fixture(params=CPU_BACKENDS)
def impl(request):
    return MODULES[request.param]
KINDS = ["silu", "gelu", "gelu_tanh", "quick_gelu", "relu"]
SHAPES = [(3, 17), (2, 768), (2, 1023), (1, 4097), (0, 5), (5, 1)]
SPECIAL = torch.tensor([0.0, -0.0, 1e-40, -1e-40, float("inf"), float("-inf"), float("nan"), 1e4, -1e4, 50.0, -50.0, 1.5])



def _close(a, b, dtype):
    """Within the dtype's budget, with atol relative to the largest finite magnitude
    (elementwise results are products of several O(10) inputs here)."""
    atol, rtol = TOL[dtype]
    fin = b[torch.isfinite(b)]
    scale = max(1.0, float(fin.abs().max())) if fin.numel() else 1.0
    torch.testing.assert_close(a.double(), b.double(), atol=atol * scale, rtol=rtol, equal_nan=True)


def _inputs(shape, dtype, n=3, strided=False):
    out = []
    for _ in range(n):
        t = torch.randn(shape[::-1] if strided else shape) * 3
        if strided:
            t = t.t()
        out.append(t.to(dtype))
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_identity_parity(impl, kind, dtype, shape, strided):
    x, dy = _inputs(shape, dtype, 2, strided)
    act = resolve_activation(kind)
    _close(impl.identity_backward(x, dy, act), reference.identity_backward(x, dy, act), dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_identity_special_values_parity(impl, kind, dtype):
    x = SPECIAL.to(dtype)
    dy = torch.ones_like(x)
    act = resolve_activation(kind)
    got, ref = impl.identity_backward(x, dy, act), reference.identity_backward(x, dy, act)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    keep = _comparable(impl, x)
    _close(got[keep], ref[keep], dtype)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_half_parity(impl, dtype, shape):
    u, v, dy = _inputs(shape, dtype, 3)
    for got, ref in zip(impl.half_backward(u, v, dy), reference.half_backward(u, v, dy)):
        _close(got, ref, dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("identity,half", [(True, True), (True, False), (False, True), (False, False)])
def test_gated_parity(impl, kind, dtype, identity, half):
    g, u, dh = _inputs((3, 1023), dtype, 3)
    g[0, :12] = SPECIAL.to(dtype)
    act = resolve_activation(kind)
    got = impl.gated_backward(g, u, dh, act, identity, half)
    ref = reference.gated_backward(g, u, dh, act, identity, half)
    # act(±inf): PyTorch's own gelu gives NaN at +inf where the closed form gives +inf;
    # both are non-finite, so compare there by finiteness only.
    inf = torch.isinf(g)
    keep = _comparable(impl, g) & ~inf
    for a, b in zip(got, ref):
        assert torch.equal(torch.isfinite(a[inf]), torch.isfinite(b[inf]))
        _close(a[keep], b[keep], dtype)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", [(3, 17), (4, 768), (2, 1023), (2, 4097), (70, 33), (0, 8), (2, 3, 65)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_parity(impl, dtype, shape, affine):
    x, dy = _inputs(shape, dtype, 2)
    w = (torch.randn(shape[-1]) * 0.5 + 1).to(dtype) if affine else None
    got = impl.layer_norm_backward(x, w, 1e-5, dy, affine, affine)
    ref = reference.layer_norm_backward(x, w, 1e-5, dy, affine, affine)
    _close(got[0], ref[0], dtype)
    if affine:  # sums over rows: budget grows with the row count
        for a, b in zip(got[1:], ref[1:]):
            torch.testing.assert_close(a.double(), b.double(), atol=0.05 if dtype != torch.float32 and dtype != torch.float64 else 1e-4, rtol=2e-2)
    else:
        assert got[1] is None and got[2] is None


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", [(3, 17), (4, 768), (2, 1023), (2, 4097), (70, 33), (0, 8)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_parity(impl, dtype, shape, offset):
    x, dy = _inputs(shape, dtype, 2)
    w = (torch.randn(shape[-1]) * 0.5).to(dtype)
    got = impl.rms_norm_backward(x, w, 1e-6, offset, dy, True)
    ref = reference.rms_norm_backward(x, w, 1e-6, offset, dy, True)
    _close(got[0], ref[0], dtype)
    torch.testing.assert_close(got[1].double(), ref[1].double(), atol=0.05 if dtype in (torch.float16, torch.bfloat16) else 1e-4, rtol=2e-2)


def test_mixed_weight_dtype_parity(impl):
    x, dy = _inputs((4, 96), torch.bfloat16, 2)
    w = torch.randn(96)  # float32 weight with bfloat16 activations, as in mixed-precision models
    for fn in ("layer_norm", "rms_norm"):
        if fn == "layer_norm":
            got = impl.layer_norm_backward(x, w, 1e-5, dy, True, True)
            ref = reference.layer_norm_backward(x, w, 1e-5, dy, True, True)
        else:
            got = impl.rms_norm_backward(x, w, 1e-5, 0.0, dy, True)
            ref = reference.rms_norm_backward(x, w, 1e-5, 0.0, dy, True)
        _close(got[0], ref[0], torch.bfloat16)
        assert got[1].dtype == torch.float32


def test_parameter_gradients_deterministic(impl):
    # Triton's CPU interpreter runs one Python program per row block: fewer rows keep the
    # test short there, still several programs whose partial sums are reduced in order
    rows = 67 if impl.__name__.endswith("triton_backend") else 513
    x, dy = _inputs((rows, 100), torch.float32, 2)
    w = torch.randn(100)
    a = impl.layer_norm_backward(x, w, 1e-5, dy, True, True)
    for threads in (1, 2):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            b = impl.layer_norm_backward(x, w, 1e-5, dy, True, True)
        finally:
            torch.set_num_threads(prev)
        assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


def test_custom_activation_falls_back_to_reference(impl):
    act = resolve_activation(lambda t: t * torch.tanh(t))
    x, dy = _inputs((2, 9), torch.float32, 2)
    assert torch.equal(impl.identity_backward(x, dy, act), reference.identity_backward(x, dy, act))


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_end_to_end_model_parity(name):
    from models import VOCAB, tiny_causal_lm

    m = tiny_causal_lm("gemma2")
    ids = torch.randint(0, VOCAB, (2, 9))
    with pyattr.backend("torch"):
        ref = pyattr.relevance(m, ids)
    with pyattr.backend(name):
        got = pyattr.relevance(m, ids)
    assert got.backend == name
    torch.testing.assert_close(got.relevance, ref.relevance, atol=1e-6, rtol=1e-4)


OPCHECK = [
    ("identity_backward", lambda: (torch.randn(4, 19), torch.randn(4, 19), "gelu_tanh")),
    ("half_backward", lambda: (torch.randn(4, 19), torch.randn(4, 19), torch.randn(4, 19))),
    ("gated_backward", lambda: (torch.randn(4, 19), torch.randn(4, 19), torch.randn(4, 19), "silu", True, True)),
    ("layer_norm_backward", lambda: (torch.randn(4, 19), torch.randn(19), 1e-5, torch.randn(4, 19), True, True)),
    ("layer_norm_backward", lambda: (torch.randn(4, 19), None, 1e-5, torch.randn(4, 19), False, False)),
    ("rms_norm_backward", lambda: (torch.randn(4, 19), torch.randn(19), 1e-6, 1.0, torch.randn(4, 19), True)),
]


@pytest.mark.skipif(not CPU_COMPILED, reason="pyattr._C is not built")
@pytest.mark.parametrize("name,make", OPCHECK, ids=[f"{n}-{i}" for i, (n, _) in enumerate(OPCHECK)])
def test_opcheck(name, make):
    torch.library.opcheck(getattr(torch.ops.pyattr, name), make())


@pytest.mark.skipif(not CPU_COMPILED, reason="pyattr._C is not built")
def test_kernel_errors_name_the_problem():
    with pytest.raises(ValueError, match="act: unknown activation 'tanh'"):
        torch.ops.pyattr.identity_backward(torch.randn(3), torch.randn(3), "tanh")
    with pytest.raises(ValueError, match="dy must have the shape of x"):
        torch.ops.pyattr.rms_norm_backward(torch.randn(3, 4), None, 1e-6, 0.0, torch.randn(3, 5), False)


def test_wider_incoming_gradient_is_not_rounded_down(impl):
    """A float32 dy at float16 activations (a norm with a float32 weight returns float32)."""
    x = ((torch.randn(2, 8) * 1000).half())
    w = torch.rand(8) + 0.5
    dy = torch.full((2, 8), 1e5)
    for got, ref in (
        (impl.rms_norm_backward(x, w, 1e-6, 0.0, dy, True), reference.rms_norm_backward(x, w, 1e-6, 0.0, dy, True)),
        (impl.layer_norm_backward(x, w, 1e-5, dy, True, True), reference.layer_norm_backward(x, w, 1e-5, dy, True, True)),
    ):
        assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
        assert got[0].dtype == torch.float16 and got[1].dtype == torch.float32
        torch.testing.assert_close(got[0].float(), ref[0].float(), atol=1e-2, rtol=2e-3)
        torch.testing.assert_close(got[1], ref[1], atol=1e-1, rtol=1e-4)
    act = resolve_activation("silu")
    xn = torch.full((2, 8), -10.0, dtype=torch.float16)  # φ = σ(-10) ≈ 4.5e-5: dx ≈ 4.5, finite
    g = impl.identity_backward(xn, dy, act)
    assert g.dtype == torch.float16
    torch.testing.assert_close(g.float(), reference.identity_backward(xn, dy, act).float(), atol=1e-2, rtol=2e-3)


@pytest.mark.skipif(not CPU_COMPILED, reason="pyattr._C is not built")
@pytest.mark.parametrize(
    "call,exc,msg",
    [
        (lambda: torch.ops.pyattr.rms_norm_backward(torch.randn(4, 8), torch.empty(0), 1e-5, 0.0, torch.randn(4, 8), False),
         ValueError, r"weight must have shape \(hidden_size,\) = \(8,\)"),
        (lambda: torch.ops.pyattr.layer_norm_backward(torch.randn(4, 8), torch.ones(2, 8), 1e-5, torch.randn(4, 8), True, True),
         ValueError, "weight must have shape"),
        (lambda: torch.ops.pyattr.layer_norm_backward(torch.randn(4, 8), torch.ones(8, device="meta"), 1e-5, torch.randn(4, 8), False, False),
         ValueError, "weight is on meta but x is on cpu"),
        (lambda: torch.ops.pyattr.rms_norm_backward(torch.randn(4, 8), None, float("nan"), 0.0, torch.randn(4, 8), False),
         ValueError, "eps must be finite and >= 0"),
        (lambda: torch.ops.pyattr.rms_norm_backward(torch.randn(4, 8), None, 1e-6, float("inf"), torch.randn(4, 8), False),
         ValueError, "offset must be finite"),
    ],
)
def test_norm_ops_check_their_arguments(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_layer_norm_one_element_rows_are_exactly_zero(impl):
    x, dy = torch.randn(4, 1), torch.randn(4, 1)
    assert torch.equal(impl.layer_norm_backward(x, None, 1e-5, dy, False, False)[0], torch.zeros(4, 1))
