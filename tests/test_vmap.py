"""Every pyattr autograd.Function and backward op under batching, on every CPU backend:
`torch.vmap` (forward, and `torch.func.vjp` inside it), `torch.autograd.grad(...,
is_grads_batched=True)` (one batched backward for k gradients), against the per-example
loop; the ops' batching rules are the ones that run (no per-example fallback)."""

import contextlib
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

import pyattr
from pyattr.ops import activation, gated_activation, layer_norm, rms_norm
from pyattr.rules import half_rule, identity_rule, ln_rule, ln_rule_grad, scale_gradient

from conftest import TOL, cpu_backends, keeps_rng_state

FALLBACK = "There is a performance drop"
OPS = ("identity_backward", "half_backward", "gated_backward", "layer_norm_backward", "rms_norm_backward")
# the backends whose ops carry batching rules, and their op namespaces
NAMESPACES = {"cpp": "pyattr", "triton": "pyattr_triton"}
KERNEL_BACKENDS = [n for n in cpu_backends() if n in NAMESPACES]


@contextlib.contextmanager
def fallback_warnings():
    """Record the per-example fallback warnings of both vmaps (``torch.vmap`` and the older
    one behind ``is_grads_batched``)."""
    legacy = torch._C._debug_only_are_vmap_fallback_warnings_enabled()
    torch._C._debug_only_display_vmap_fallback_warnings(True)
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch._C._debug_only_display_vmap_fallback_warnings(legacy)
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)


def fallbacks(caught, backend_name):
    """Fallback warnings that must not fire: any at all on the kernel backends (the rules'
    own backward code and the ops are batched); on ``torch`` the reference formulas' means
    have no rule in the older vmap, so only pyattr's own ops and reductions count."""
    msgs = [str(w.message) for w in caught if FALLBACK in str(w.message)]
    if backend_name == "torch":
        msgs = [m for m in msgs if "pyattr" in m or "sum_to_size" in m]
    return msgs


def close(a, b, dtype=torch.float32):
    if dtype == torch.float32:
        atol, rtol = 1e-6, 1e-6
    else:
        atol, rtol = TOL[dtype]
    torch.testing.assert_close(a.double(), b.double(), atol=atol * max(1.0, float(b.abs().max()) if b.numel() else 1.0),
                               rtol=rtol, equal_nan=True)


# --- torch.vmap over the public functions ------------------------------------------------

W = torch.randn(17, generator=torch.Generator().manual_seed(1))
BIAS = torch.randn(17, generator=torch.Generator().manual_seed(2))

# name: (pyattr function of one per-example tensor, the native forward it must equal)
PUBLIC = {
    "identity_rule": (lambda x: identity_rule(x, "gelu_tanh"), lambda x: F.gelu(x, approximate="tanh")),
    "activation": (lambda x: activation(x, "silu"), F.silu),
    "half_rule": (lambda x: half_rule(x, x.flip(-1)), lambda x: x * x.flip(-1)),
    "half_rule_broadcast": (lambda x: half_rule(x, W), lambda x: x * W),
    "ln_rule": (lambda x: ln_rule(x - x.mean(-1, keepdim=True), x.std(-1, keepdim=True) + 1),
                lambda x: (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1)),
    "ln_rule_float": (lambda x: ln_rule(x, 3.0), lambda x: x / 3.0),
    "ln_rule_grad": (lambda x: ln_rule_grad(x.flip(-1), x, W, norm="rms_norm", offset=1.0), None),
    "scale_gradient": (lambda x: scale_gradient(x, 0.25), lambda x: x),
    "scale_gradient_tensor": (lambda x: scale_gradient(x, W.abs()), lambda x: x),
    "layer_norm": (lambda x: layer_norm(x, W, BIAS), lambda x: F.layer_norm(x, (17,), W, BIAS, 1e-5)),
    "rms_norm": (lambda x: rms_norm(x, W, 1e-6, 1.0),
                 lambda x: (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + W))),
    "gated_activation": (lambda x: gated_activation(x, x.flip(-1), "gelu"), lambda x: F.gelu(x) * x.flip(-1)),
}


@pytest.mark.parametrize("name", list(PUBLIC))
def test_vmap_forward_and_vjp_equal_the_loop(backend_name, name):
    fn, native = PUBLIC[name]
    X = torch.randn(3, 2, 17)
    got = torch.vmap(fn)(X)
    loop = torch.stack([fn(x) for x in X])
    if native is not None:  # bit-identical to the native forward batched the same way
        assert torch.equal(got, torch.vmap(native)(X))
    # a batched native kernel may round one element differently from the per-example call
    # (vectorised body vs scalar tail), so against the loop: within float32 rounding
    close(got, loop)

    G = torch.randn_like(got).transpose(1, 2).contiguous().transpose(1, 2)  # strided per example

    # functorch records the backward (create_graph), so the rules' backwards run the
    # differentiable reference formulas here, whatever the backend
    def vjp(x, g):
        return torch.func.vjp(fn, x)[1](g)[0]

    batched = torch.vmap(vjp)(X, G)
    expected = torch.stack([torch.autograd.grad(fn(x.requires_grad_()), x, g)[0] for x, g in zip(X.clone(), G)])
    close(batched, expected)
    grad = torch.vmap(torch.func.grad(lambda x: fn(x).sum()))(X)
    close(grad, torch.stack([torch.autograd.grad(fn(x.requires_grad_()).sum(), x)[0] for x in X.clone()]))


# --- is_grads_batched through each Function ----------------------------------------------

def _batched_vs_loop(y, inputs, G, dtype):
    """One batched backward against the loop over G's rows (computed first: the batched
    call frees the graph)."""
    loop = [torch.autograd.grad(y, inputs, g, retain_graph=True) for g in G]
    batched = torch.autograd.grad(y, inputs, G, is_grads_batched=True)
    assert len(batched) == len(inputs)
    for i, b in enumerate(batched):
        ref = torch.stack([grads[i] for grads in loop])
        assert b.shape == ref.shape and b.dtype == ref.dtype
        close(b, ref, dtype)


def _leaf(shape, dtype, scale=1.0, shift=0.0):
    return (torch.randn(shape) * scale + shift).to(dtype).requires_grad_()


def _grads(shape, dtype, k=3, strided=False):
    if strided:  # non-contiguous: the last two dims transposed in memory
        return torch.randn(k, *shape[:-2], shape[-1], shape[-2]).to(dtype).transpose(-1, -2)
    return torch.randn(k, *shape).to(dtype)


# name: builds (output, inputs that require grad) for a per-example shape and dtype
def _identity(shape, dt):
    x = _leaf(shape, dt, 3)
    return identity_rule(x, "gelu"), (x,)


def _activation_custom(shape, dt):
    x = _leaf(shape, dt, 3)  # a callable with no closed form: the reference backend runs
    return activation(x, lambda t: t * torch.tanh(t)), (x,)


def _half(shape, dt):
    u, v = _leaf(shape, dt), _leaf(shape, dt)
    return half_rule(u, v), (u, v)


def _half_broadcast(shape, dt):
    u, v = _leaf(shape, dt), _leaf(shape[-1:], dt)
    return half_rule(u, v), (u, v)


def _gated(shape, dt):
    g, u = _leaf(shape, dt, 3), _leaf(shape, dt)
    return gated_activation(g, u, "silu"), (g, u)


def _gated_plain(shape, dt):
    g, u = _leaf(shape, dt, 3), _leaf(shape, dt)
    return gated_activation(g, u, "gelu_tanh", identity=False, half=False), (g, u)


def _layer_norm(shape, dt):
    x, w, b = _leaf(shape, dt, 2, 0.5), _leaf(shape[-1:], dt, 0.1, 1.0), _leaf(shape[-1:], dt, 0.1)
    return layer_norm(x, w, b), (x, w, b)


def _layer_norm_plain(shape, dt):
    x = _leaf(shape, dt, 2, 0.5)
    return layer_norm(x), (x,)


def _rms_norm(shape, dt):
    x, w = _leaf(shape, dt, 2), _leaf(shape[-1:], dt, 0.5)
    return rms_norm(x, w, 1e-6, 1.0), (x, w)


def _rms_norm_frozen_weight(shape, dt):
    x = _leaf(shape, dt, 2)  # the weight does not require grad: no dweight
    return rms_norm(x, (torch.rand(shape[-1]) + 0.5).to(dt)), (x,)


def _ln_rule(shape, dt):
    x, d = _leaf(shape, dt), _leaf(shape[:-1] + (1,), dt, 0.1, 2.0)  # no gradient reaches d
    return ln_rule(x, d), (x,)


def _scale(shape, dt):
    x = _leaf(shape, dt)
    return scale_gradient(x, 0.25), (x,)


def _scale_tensor(shape, dt):
    x = _leaf(shape, dt)
    return scale_gradient(x, torch.rand(shape[-1]).to(dt)), (x,)


BUILDERS = {f.__name__[1:]: f for f in (
    _identity, _activation_custom, _half, _half_broadcast, _gated, _gated_plain, _layer_norm, _layer_norm_plain,
    _rms_norm, _rms_norm_frozen_weight, _ln_rule, _scale, _scale_tensor,
)}
NORMS = {"layer_norm", "layer_norm_plain", "rms_norm", "rms_norm_frozen_weight"}


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_is_grads_batched_equals_the_loop(backend_name, name, dtype):
    # norms: two rows per example (Triton's interpreter runs a norm row by row in Python)
    shape = (2, 17) if name in NORMS else (2, 3, 17)
    y, inputs = BUILDERS[name](shape, dtype)
    with fallback_warnings() as caught:
        _batched_vs_loop(y, inputs, _grads(shape, dtype, strided=dtype == torch.float32), dtype)
    assert not fallbacks(caught, backend_name)


@pytest.mark.parametrize("name", ["identity", "gated", "layer_norm", "rms_norm"])
def test_is_grads_batched_empty(backend_name, name):
    y, inputs = BUILDERS[name]((0, 17), torch.float32)
    batched = torch.autograd.grad(y, inputs, torch.randn(3, 0, 17), is_grads_batched=True)
    for b, x in zip(batched, inputs):
        assert b.shape == (3,) + x.shape
        assert torch.equal(b, torch.zeros_like(b))  # no rows: parameter gradients are zero sums


def test_is_grads_batched_hidden_4097(backend_name):
    y, inputs = _identity((1, 4097), torch.float32)
    _batched_vs_loop(y, inputs, _grads((1, 4097), torch.float32, k=2), torch.float32)


def test_norm_parameter_gradients_are_per_example(backend_name):
    """dweight/dbias under is_grads_batched are each row of G's own sum, not the sum over G."""
    x = torch.randn(2, 5)
    w = torch.ones(5, requires_grad=True)
    b = torch.zeros(5, requires_grad=True)
    G = torch.stack([torch.ones(2, 5), torch.zeros(2, 5), -2 * torch.ones(2, 5)])
    dw, db = torch.autograd.grad(layer_norm(x, w, b), (w, b), G, is_grads_batched=True)
    xhat = F.layer_norm(x, (5,))
    torch.testing.assert_close(db, torch.tensor([2.0, 0.0, -4.0])[:, None].expand(3, 5))
    torch.testing.assert_close(dw, torch.tensor([1.0, 0.0, -2.0])[:, None] * xhat.sum(0), atol=1e-6, rtol=1e-6)
    (dw,) = torch.autograd.grad(rms_norm(x, w), (w,), G, is_grads_batched=True)
    xr = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(dw, torch.tensor([1.0, 0.0, -2.0])[:, None] * xr.sum(0), atol=1e-6, rtol=1e-6)


def test_vmap_over_norm_weights(backend_name):
    """vjp inside vmap over the weights themselves, and ln_rule_grad with a batched weight."""
    x = torch.randn(2, 17)
    Ws = torch.randn(3, 17)
    G = torch.randn(3, 2, 17)

    def dx_dw(w, g):
        return torch.func.vjp(rms_norm, x, w)[1](g)

    got = torch.vmap(dx_dw)(Ws, G)
    loop = []
    for w, g in zip(Ws, G):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        loop.append(torch.autograd.grad(rms_norm(xr, wr), (xr, wr), g))
    for i in range(2):
        close(got[i], torch.stack([grads[i] for grads in loop]))
    got = torch.vmap(lambda w, g: ln_rule_grad(g, x, w))(Ws, G)
    close(got, torch.stack([ln_rule_grad(g, x, w) for w, g in zip(Ws, G)]))


# --- end to end: k targets of a model in one batched backward ----------------------------

@functools.lru_cache(maxsize=None)
@keeps_rng_state
def _model(arch, attn):
    from models import tiny_causal_lm

    return tiny_causal_lm(arch, attn=attn)


# each architecture with both attention implementations and both attention rules
E2E = [("llama", "eager", True), ("llama", "sdpa", "attnlrp"), ("gpt2", "eager", "attnlrp"),
       ("gpt2", "sdpa", True), ("bert", "eager", True), ("bert", "sdpa", "attnlrp")]


def _e2e(backend_name, arch, attn, attention, batch, seq):
    from models import VOCAB

    m = _model(arch, attn)
    ids = torch.randint(0, VOCAB, (batch, seq))
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention=attention)) as cov, \
            fallback_warnings() as caught:
        assert cov.installed
        emb = m.get_input_embeddings()(ids).detach().requires_grad_()
        out = m(inputs_embeds=emb).logits[:, -1, :4]
        G = torch.eye(4)[:, None, :].expand(4, batch, 4)
        separate = torch.stack([torch.autograd.grad(out, emb, g, retain_graph=True)[0] for g in G])
        (batched,) = torch.autograd.grad(out, emb, G, is_grads_batched=True)
    assert not [str(w.message) for w in caught if "pyattr" in str(w.message)]
    assert separate.abs().max() > 0
    torch.testing.assert_close(batched, separate, rtol=1e-5, atol=1e-5 * float(separate.abs().max()))


@pytest.mark.parametrize("arch,attn,attention", E2E)
@pytest.mark.parametrize("name", [n for n in cpu_backends() if n != "triton"])
def test_k_targets_in_one_batched_backward(name, arch, attn, attention):
    with pyattr.backend(name):
        _e2e(name, arch, attn, attention, batch=2, seq=5)


@pytest.mark.skipif("triton" not in cpu_backends(), reason="triton is not available")
def test_k_targets_in_one_batched_backward_triton():
    # Triton's interpreter runs the norms row by row in Python (seconds per model): one
    # model, whose rules cover RMSNorm, the gated MLP and the AttnLRP gradient scaling, on a
    # one-row, two-token input; the LayerNorm and activation ops are covered op by op above
    with pyattr.backend("triton"):
        _e2e("triton", "llama", "sdpa", "attnlrp", batch=1, seq=2)


# --- the ops' batching rules -------------------------------------------------------------

def _op_args(name, rows=2, hidden=17):
    t = lambda *s: torch.randn(*s)  # noqa: E731
    return {
        "identity_backward": (t(rows, hidden), t(rows, hidden), "gelu"),
        "half_backward": (t(rows, hidden), t(rows, hidden), t(rows, hidden)),
        "gated_backward": (t(rows, hidden), t(rows, hidden), t(rows, hidden), "quick_gelu", True, False),
        "layer_norm_backward": (t(rows, hidden), t(hidden), 1e-5, t(rows, hidden), True, True),
        "rms_norm_backward": (t(rows, hidden), t(hidden), 1e-6, 1.0, t(rows, hidden), True),
    }[name]


def _op(backend_name, name):
    from pyattr.backends import implementation

    implementation(torch.device("cpu"), name.replace("_backward", ""))  # loads the ops
    return getattr(getattr(torch.ops, NAMESPACES[backend_name]), name).default


@pytest.fixture(params=KERNEL_BACKENDS)
def kernel_backend(request):
    with pyattr.backend(request.param):
        yield request.param


def _as_tuple(out):
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _select(args, in_dims, j):
    return [a if d is None else a.select(d, j) for a, d in zip(args, in_dims)]


def _old_vmap(op, args, in_dims):
    """``op`` under the older vmap of ``is_grads_batched`` (``torch._vmap_internals``)."""
    pos = [i for i, d in enumerate(in_dims) if d is not None]

    def f(*batched):
        full = list(args)
        for i, t in zip(pos, batched):
            full[i] = t
        return op(*full)

    return torch._vmap_internals._vmap(f, tuple(in_dims[i] for i in pos), 0)(*[args[i] for i in pos])


def _check_batched(op, args, in_dims, batch):
    expected = [_as_tuple(op(*_select(args, in_dims, j))) for j in range(batch)]
    with fallback_warnings() as caught:
        new = _as_tuple(torch.vmap(op, in_dims=in_dims)(*args))
        old = _as_tuple(_old_vmap(op, args, in_dims))
    assert not [str(w.message) for w in caught if FALLBACK in str(w.message)]
    for k, (a, b) in enumerate(zip(new, old)):
        ref = torch.stack([e[k] for e in expected])
        close(a, ref)
        close(b, ref)


@pytest.mark.parametrize("name", OPS)
def test_ops_have_batching_rules_and_no_fallback(kernel_backend, name):
    op = _op(kernel_backend, name)
    for key in ("FuncTorchBatched", "Batched"):  # torch.vmap; is_grads_batched
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), key
    args = list(_op_args(name))
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() == 2]
    batch = 3
    # the activations (first tensor) unbatched, the other operands batched on dim 1
    in_dims = [None] * len(args)
    for i in tensors[1:]:
        args[i] = torch.randn(args[i].shape[0], batch, args[i].shape[1])
        in_dims[i] = 1
    _check_batched(op, args, tuple(in_dims), batch)
    # everything batched on dim 0
    in_dims = [None] * len(args)
    for i in tensors:
        args[i] = torch.randn(batch, *_op_args(name)[i].shape)
        in_dims[i] = 0
    _check_batched(op, args, tuple(in_dims), batch)


@pytest.mark.parametrize("name", ["layer_norm_backward", "rms_norm_backward"])
def test_norm_ops_with_batched_weights(kernel_backend, name):
    op = _op(kernel_backend, name)
    args = list(_op_args(name, rows=1))
    args[1] = torch.randn(2, 17)  # a weight per example: one kernel call each
    in_dims = tuple(0 if i == 1 else None for i in range(len(args)))
    _check_batched(op, args, in_dims, 2)


@pytest.mark.parametrize("name", ["identity_backward", "layer_norm_backward"])
def test_nested_old_vmap_runs_the_reference(kernel_backend, name):
    """is_grads_batched inside is_grads_batched: tensors batched at two levels of the older
    vmap go to the reference formulas (PyTorch batches those itself)."""
    op = _op(kernel_backend, name)
    args = list(_op_args(name, rows=1))
    dy_pos = 1 if name == "identity_backward" else 3
    dys = torch.randn(2, 3, *args[dy_pos].shape)

    def call(dy):
        full = list(args)
        full[dy_pos] = dy
        return op(*full)

    inner = torch._vmap_internals._vmap(call, 0, 0)
    got = _as_tuple(torch._vmap_internals._vmap(inner, 0, 0)(dys))
    expected = [[_as_tuple(call(d)) for d in row] for row in dys]
    for k, g in enumerate(got):
        close(g, torch.stack([torch.stack([e[k] for e in row]) for row in expected]))


def test_triton_ops_opcheck():
    if "triton" not in cpu_backends():
        pytest.skip("triton is not available")
    for name in OPS:
        torch.library.opcheck(_op("triton", name), _op_args(name, rows=1, hidden=5))
