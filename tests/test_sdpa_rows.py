"""SdpaRowsFunction: sdpa's CPU flash forward bit for bit, its backward from the query rows
that carry gradient (FlashAttention-2's backward restricted to them) equal to the native
backward; the routing takes only the calls it can run exactly; AttnLRP relevance through it
equals the native backward's, for one target and for k targets in one batched backward."""

import pytest
import torch
import torch.nn.functional as F

import pyattr
import pyattr.ops.sdpa_rows as SR
from models import tiny_causal_lm
from pyattr.integration.attention import native_attention_backward

pytestmark = pytest.mark.usefixtures("one_thread")


def _qkv(dtype, b=2, h=3, s=64, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)], ids=["float64", "float32"])
@pytest.mark.parametrize("mask_kind", ["causal", "additive", "none"])
@pytest.mark.parametrize("rows", [[63], [3, 40], list(range(64))], ids=["last", "two", "all"])
def test_gradient_from_the_live_rows_equals_the_native_backward(dtype, tol, mask_kind, rows, monkeypatch):
    q, k, v = _qkv(dtype)
    g = torch.Generator().manual_seed(1)
    mask = torch.randn(2, 1, 64, 64, generator=g, dtype=dtype) if mask_kind == "additive" else None
    causal = mask_kind == "causal"
    dout = torch.zeros(2, 3, 64, 16, dtype=dtype)
    dout[:, :, rows] = torch.randn(2, 3, len(rows), 16, generator=g, dtype=dtype)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    sparse = []
    monkeypatch.setattr(SR, "rows_backward", lambda *a, f=SR.rows_backward: sparse.append(1) or f(*a))
    with SR.sparse_rows_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    assert type(out.grad_fn).__name__ == "SdpaRowsFunctionBackward"
    assert torch.equal(out, ref)  # the same kernel
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert sparse == ([1] if len(rows) * SR.SPARSE_SHARE <= 64 else [])
    for a, b, name in zip(got, want, "qkv"):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=name)
    if len(rows) < 64:  # rows without gradient get none
        other = torch.ones(64, dtype=torch.bool)
        other[rows] = False
        assert torch.equal(got[0][:, :, other], torch.zeros_like(got[0][:, :, other]))


@pytest.mark.parametrize("kernel_groups", [True, False], ids=["kernel groups", "repeated"])
@pytest.mark.parametrize("rows", ["last", "all"])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)], ids=["float64", "float32"])
def test_grouped_query_attention(dtype, tol, rows, kernel_groups, monkeypatch):
    """Both backwards (live rows, native) against sdpa's enable_gqa; where this torch's
    kernels take one key/value head per group, the Function saves those heads, not copies."""
    if kernel_groups and not SR._kernel_groups():  # this torch's kernel refuses them: the probe was right
        with pytest.raises(RuntimeError):
            SR._forward_op(torch.ones(1, 2, 2, 4), torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), 0.0, True)
        return
    monkeypatch.setattr(SR, "_groups", [kernel_groups])
    q, k, v = _qkv(dtype, h=4)
    k, v = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()
    dout = torch.zeros(2, 4, 64, 16, dtype=dtype)
    live = slice(63, 64) if rows == "last" else slice(None)
    dout[:, :, live] = torch.randn(2, 4, dout[:, :, live].shape[2], 16, generator=torch.Generator().manual_seed(3),
                                   dtype=dtype)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    saved = []
    with SR.sparse_rows_sdpa(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                                        lambda t: t):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert type(out.grad_fn).__name__ == "SdpaRowsFunctionBackward" and torch.equal(out, ref)
    heads = [s[1] for s in saved if len(s) == 4]  # q, k, v, out
    assert heads == ([4, 2, 2, 4] if kernel_groups else [4, 4, 4, 4])
    got = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_grouped_query_double_backward_equals_the_math_backends():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv(torch.float64, h=4, s=16)
    k, v = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()
    dout = torch.zeros(2, 4, 16, 16, dtype=torch.float64)
    dout[:, :, -1] = 1.0
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    (gk,) = torch.autograd.grad(ref, k, dout, create_graph=True)
    want = torch.autograd.grad(gk.square().sum(), q)
    with SR.sparse_rows_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert type(out.grad_fn).__name__ == "SdpaRowsFunctionBackward"
    (gk2,) = torch.autograd.grad(out, k, dout, create_graph=True)
    got = torch.autograd.grad(gk2.square().sum(), q)
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=1e-12)


def test_float64_closed_form():
    """One live row, float64: dV, dK, dQ from the softmax written out by hand."""
    q, k, v = _qkv(torch.float64, b=1, h=1, s=8, d=4)
    dout = torch.zeros(1, 1, 8, 4, dtype=torch.float64)
    dout[0, 0, 5] = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    with SR.sparse_rows_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    s = (q[0, 0, 5] @ k[0, 0, :6].T).detach() / 2.0            # keys 0..5 visible, scale 1/sqrt(4)
    p = torch.softmax(s, -1)
    d = dout[0, 0, 5]
    want_dv = torch.zeros(8, 4, dtype=torch.float64)
    want_dv[:6] = p[:, None] * d
    dp = v[0, 0, :6].detach() @ d
    ds = p * (dp - (p * dp).sum())
    want_dq = (ds @ k[0, 0, :6].detach()) / 2.0
    want_dk = torch.zeros(8, 4, dtype=torch.float64)
    want_dk[:6] = ds[:, None] * q[0, 0, 5].detach() / 2.0
    torch.testing.assert_close(dv[0, 0], want_dv, atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(dk[0, 0], want_dk, atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(dq[0, 0, 5], want_dq, atol=1e-13, rtol=1e-13)
    assert torch.equal(dq[0, 0, :5], torch.zeros(5, 4, dtype=torch.float64))


@pytest.mark.parametrize("case", ["bool mask", "dropout", "no grad", "bfloat16"])
def test_calls_it_cannot_run_exactly_go_native(case):
    q, k, v = _qkv(torch.float32)
    kw = {}
    if case == "bool mask":
        kw["attn_mask"] = torch.ones(64, 64, dtype=torch.bool).tril()
    elif case == "dropout":
        kw["dropout_p"] = 0.5
    elif case == "bfloat16":
        q, k, v = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    with SR.sparse_rows_sdpa(), (torch.no_grad() if case == "no grad" else torch.enable_grad()):
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    assert out.grad_fn is None or type(out.grad_fn).__name__ != "SdpaRowsFunctionBackward"


def test_the_name_is_restored_and_an_earlier_wrapper_still_reached(monkeypatch):
    native = F.scaled_dot_product_attention
    seen = []

    def wrapper(*a, **kw):
        seen.append(1)
        return native(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", wrapper)
    q, k, v = _qkv(torch.float32)
    with SR.sparse_rows_sdpa():
        with SR.sparse_rows_sdpa():  # nested: one routing
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(64, 64, dtype=torch.bool))  # native
        assert F.scaled_dot_product_attention is SR._routed
    assert F.scaled_dot_product_attention is wrapper and seen == [1]


def test_double_backward_through_it_equals_the_math_backends():
    """sdpa's own flash backward has no derivative; this one's create_graph path takes the
    math backend's, and gives its second derivative."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv(torch.float64, s=16)
    dout = torch.zeros(2, 3, 16, 16, dtype=torch.float64)
    dout[:, :, -1] = 1.0
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q, k, v)
    (gq,) = torch.autograd.grad(ref, q, dout, create_graph=True)
    want = torch.autograd.grad(gq.square().sum(), k)
    with SR.sparse_rows_sdpa():
        out = F.scaled_dot_product_attention(q, k, v)
    (gq2,) = torch.autograd.grad(out, q, dout, create_graph=True)
    got = torch.autograd.grad(gq2.square().sum(), k)
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["float64", "float32"])
def test_attnlrp_relevance_equals_the_native_backward(dtype, tol, monkeypatch):
    model = tiny_causal_lm("llama", attn="sdpa", dtype=dtype)
    ids = torch.randint(3, 60, (2, 24), generator=torch.Generator().manual_seed(2))
    calls = []
    monkeypatch.setattr(SR, "rows_backward", lambda *a, f=SR.rows_backward: calls.append(1) or f(*a))
    got = pyattr.relevance(model, ids, target=7, rules="attnlrp")
    assert calls, "the last block's attention took the sparse-rows backward"
    with native_attention_backward():
        want = pyattr.relevance(model, ids, target=7, rules="attnlrp")
    torch.testing.assert_close(got.relevance, want.relevance, atol=tol, rtol=tol)
    targets = [pyattr.targets.Logit(7), pyattr.targets.Logit(9, position=-2)]
    many = pyattr.relevance(model, ids, target=targets, rules="attnlrp")  # one batched backward
    with native_attention_backward():
        many_native = pyattr.relevance(model, ids, target=targets, rules="attnlrp")
    torch.testing.assert_close(many.relevance, many_native.relevance, atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", [(2, 1, 1, 64), (1, 64)], ids=["batch-1-1-kv", "1-kv"])
def test_a_mask_that_broadcasts_over_queries(shape):
    q, k, v = _qkv(torch.float64)
    mask = torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    dout = torch.zeros(2, 3, 64, 16, dtype=torch.float64)
    dout[:, :, -1] = 1.0
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v), dout)
    with SR.sparse_rows_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert type(out.grad_fn).__name__ == "SdpaRowsFunctionBackward"
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_torch_func_transforms_take_the_native_function():
    q, k, v = _qkv(torch.float64, s=16)
    with SR.sparse_rows_sdpa():
        got = torch.func.grad(lambda qq: F.scaled_dot_product_attention(qq, k, v)[:, :, -1].sum())(q.detach())
    want = torch.func.grad(lambda qq: F.scaled_dot_product_attention(qq, k, v)[:, :, -1].sum())(q.detach())
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_routing_is_per_thread():
    import threading

    q, k, v = _qkv(torch.float32)
    inside, seen = threading.Event(), {}
    done = threading.Event()

    def other():
        inside.wait()
        seen["name"] = type(F.scaled_dot_product_attention(q, k, v).grad_fn).__name__
        done.set()

    t = threading.Thread(target=other)
    t.start()
    native = F.scaled_dot_product_attention
    with SR.sparse_rows_sdpa():
        mine = type(F.scaled_dot_product_attention(q, k, v).grad_fn).__name__
        inside.set()
        done.wait(30)
    t.join(30)
    assert mine == "SdpaRowsFunctionBackward" and seen["name"] != "SdpaRowsFunctionBackward", (mine, seen)
    assert F.scaled_dot_product_attention is native


def test_a_replacement_made_meanwhile_stays():
    q, k, v = _qkv(torch.float32)
    native = F.scaled_dot_product_attention
    other = lambda *a, **kw: native(*a, **kw)  # noqa: E731
    try:
        with SR.sparse_rows_sdpa():
            F.scaled_dot_product_attention = other  # another library patches it inside the block
        assert F.scaled_dot_product_attention is other
    finally:
        F.scaled_dot_product_attention = native
