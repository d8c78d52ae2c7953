"""CUDA backends against the reference on CUDA tensors. These run on a machine with a GPU
(benchmarks/gpu_check.sh); on a CPU-only machine they are skipped, and reported so."""

import pytest
import torch

import pyattr
from pyattr.activations import resolve_activation
from pyattr.backends import compiled, reference

from conftest import TOL

HAS_CUDA = torch.cuda.is_available()
GPU_BACKENDS = [n for n in ("cuda", "triton") if pyattr.available_backends()[n].available] if HAS_CUDA else []

pytestmark = pytest.mark.skipif(not GPU_BACKENDS, reason="no CUDA device with a compiled GPU backend")

KINDS = ["silu", "gelu", "gelu_tanh", "quick_gelu", "relu"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HIDDEN = [17, 768, 1023, 4097, 65536 + 3]


def _close(a, b, dtype):
    atol, rtol = TOL[dtype]
    fin = b[torch.isfinite(b)]
    scale = max(1.0, float(fin.abs().max())) if fin.numel() else 1.0
    torch.testing.assert_close(a.double().cpu(), b.double().cpu(), atol=atol * scale, rtol=rtol, equal_nan=True)


def _rand(*shape, dtype):
    return (torch.randn(*shape, device="cuda") * 3).to(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_identity_cuda(kind, dtype, hidden):
    x, dy = _rand(3, hidden, dtype=dtype), _rand(3, hidden, dtype=dtype)
    act = resolve_activation(kind)
    _close(compiled.identity_backward(x, dy, act), reference.identity_backward(x, dy, act), dtype)
    xs = x.t().contiguous().t()  # same values, strided view handled by an explicit copy
    _close(compiled.identity_backward(x[:, 1:], dy[:, 1:], act), reference.identity_backward(x[:, 1:], dy[:, 1:], act), dtype)
    assert xs.shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_half_and_gated_cuda(dtype, hidden):
    g, u, d = (_rand(2, hidden, dtype=dtype) for _ in range(3))
    for a, b in zip(compiled.half_backward(g, u, d), reference.half_backward(g, u, d)):
        _close(a, b, dtype)
    for kind in KINDS:
        act = resolve_activation(kind)
        for ident, half in ((True, True), (False, True), (True, False), (False, False)):  # both off: the memory mount
            for a, b in zip(compiled.gated_backward(g, u, d, act, ident, half), reference.gated_backward(g, u, d, act, ident, half)):
                _close(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", [1, 300])
def test_norms_cuda(dtype, hidden, rows):
    x, dy = _rand(rows, hidden, dtype=dtype), _rand(rows, hidden, dtype=dtype)
    w = (torch.randn(hidden, device="cuda") * 0.5 + 1).to(dtype)
    got = compiled.layer_norm_backward(x, w, 1e-5, dy, True, True)
    ref = reference.layer_norm_backward(x, w, 1e-5, dy, True, True)
    _close(got[0], ref[0], dtype)
    for a, b in zip(got[1:], ref[1:]):
        torch.testing.assert_close(a.double().cpu(), b.double().cpu(), atol=0.1 if dtype != torch.float32 else 1e-3, rtol=2e-2)
    got = compiled.rms_norm_backward(x, w, 1e-6, 1.0, dy, True)
    ref = reference.rms_norm_backward(x, w, 1e-6, 1.0, dy, True)
    _close(got[0], ref[0], dtype)


def test_empty_and_more_than_2_31_elements():
    e = torch.empty(0, 8, device="cuda")
    act = resolve_activation("silu")
    assert compiled.identity_backward(e, e, act).shape == (0, 8)
    free, _ = torch.cuda.mem_get_info()
    n = 2**31 + 33
    if free < n * 2 * 3 + (1 << 30):
        pytest.skip("not enough GPU memory for a > 2**31-element check")
    x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    dx = compiled.identity_backward(x, x, resolve_activation("relu"))
    assert float(dx[-1]) == 1.0 and float(dx[0]) == 1.0


def test_relevance_on_cuda_matches_torch_backend():
    from models import VOCAB, tiny_causal_lm

    m = tiny_causal_lm("llama").cuda()
    ids = torch.randint(0, VOCAB, (2, 9), device="cuda")
    with pyattr.backend("torch"):
        ref = pyattr.relevance(m, ids)
    with pyattr.backend("cuda"):
        got = pyattr.relevance(m, ids)
    torch.testing.assert_close(got.relevance, ref.relevance, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_k_targets_on_cuda_backends_equal_separate_calls(arch):
    """is_grads_batched through the GPU kernels (their vmap rules): k targets in one call
    equal k single-target calls."""
    from models import VOCAB, tiny_causal_lm

    m = tiny_causal_lm(arch).cuda()
    ids = torch.randint(0, VOCAB, (2, 9), device="cuda")
    tk = torch.randint(0, VOCAB, (2, 3), device="cuda")
    for name in GPU_BACKENDS:
        with pyattr.backend(name):
            one = pyattr.relevance(m, ids, target=tk)
            for j in range(3):
                sep = pyattr.relevance(m, ids, target=tk[:, j])
                torch.testing.assert_close(one.relevance[j], sep.relevance, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(one.target[j], sep.target, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif("triton" not in GPU_BACKENDS, reason="no CUDA device with the Triton backend")
@pytest.mark.parametrize("op", ["identity", "layer_norm"])
def test_triton_ops_compile_into_the_inductor_code(op):
    """torch.compile(fullgraph=True) over a rule on the Triton backend: the backward's
    generated code launches pyattr's kernel itself (triton_op), and the gradient equals
    the eager one."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    x = _rand(64, 4096, dtype=torch.bfloat16).requires_grad_(True)
    w = _rand(4096, dtype=torch.float32)
    if op == "identity":
        f, kernel = (lambda x: pyattr.rules.identity_rule(x, "gelu")), "_identity_backward"
    else:
        f, kernel = (lambda x: pyattr.ops.layer_norm(x.float(), w, None, 1e-5)), "_layer_norm_backward"
    with pyattr.backend("triton"):
        (ref,) = torch.autograd.grad(f(x).float().sum(), x)
        cf = torch.compile(f, fullgraph=True)
        got, codes = run_and_get_code(lambda: torch.autograd.grad(cf(x).float().sum(), x)[0])
    _close(got, ref, torch.bfloat16)
    assert any(kernel in c for c in codes), "the kernel is not in inductor's code"


# --- the paths added for the CPU since the last GPU run: each has its CUDA answer checked ---

def test_sdpa_rows_leaves_cuda_calls_to_sdpas_own_backward():
    """sparse_rows_sdpa reroutes CPU flash calls only: a CUDA call inside the block is the
    native function, its gradient bit for bit the one outside the block."""
    import torch.nn.functional as F

    from pyattr.ops import sdpa_rows as SR

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, device="cuda", generator=g).requires_grad_() for _ in range(3))
    do = torch.zeros(1, 2, 64, 16, device="cuda")
    do[:, :, -1] = 1.0  # one live row: the case the CPU path makes sparse
    with SR.sparse_rows_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.grad_fn is None or type(out.grad_fn).__name__ != "SdpaRowsFunctionBackward"
    got = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_edge_values_on_cuda_follow_the_reference(name, dtype):
    """NaN, ±inf, ±0, subnormals and the largest finite values through the Identity-rule,
    the gated activation and the norm rules on CUDA tensors: the same NaN / inf / zero
    pattern as the torch backend on the CPU (tests/test_edge_values.py for the CPU
    backends), finite values within the type's rounding."""
    from test_edge_values import _run, act_edges, assert_norm_close, factors, grid

    from pyattr.ops import gated_activation, rms_norm
    from pyattr.rules import identity_rule

    x, dy = grid(act_edges(dtype), factors(dtype))
    a, u = grid(act_edges(dtype), factors(dtype))
    rows = torch.cat([act_edges(dtype), factors(dtype)])[: 16].reshape(2, 8)
    w = torch.linspace(0.5, 1.5, 8, dtype=dtype)
    cases = [
        (lambda t: identity_rule(t, "silu"), [x], dy),
        (lambda t, s: gated_activation(t, s, "silu"), [a, u], dy[: a.numel()]),
        (lambda t: rms_norm(t, w.to(t.device), 1e-6), [rows], torch.ones_like(rows)),
    ]
    for fn, inputs, grad_out in cases:
        with pyattr.backend("torch"):
            y_ref, g_ref = _run(fn, inputs, grad_out)
        with pyattr.backend(name):
            y, g = _run(fn, [t.cuda() for t in inputs], grad_out.cuda())
        assert_norm_close(y.cpu(), y_ref, dtype)
        for got, ref in zip(g, g_ref):
            assert_norm_close(got.cpu(), ref, dtype)
