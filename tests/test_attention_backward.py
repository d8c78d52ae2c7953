"""AttnLRP's attention core: the full gradient (dq, dk, dv) of softmax attention recomputed
block by block (pyattr/backends/reference.py, csrc/cpu/attention.cpp,
kernels/attention_backward.py) and its use on eager attention under ``rules="attnlrp"``."""

import pytest
import torch

import pyattr
from models import VOCAB, tiny_causal_lm
from pyattr.backends import compiled, reference, triton_backend
from pyattr.integration import attention as FA
from pyattr.ops import attention as OA
from pyattr.ops.attention import AttnLRPAttentionFunction, attention_backward_reference
from test_attention import CASES, TRITON_DEVICE, _case, needs_triton

pytestmark = pytest.mark.usefixtures("one_thread")


def _with_v(case, dtype=torch.float64):
    case = dict(case)
    causal, softcap = case.pop("causal", False), case.pop("softcap", None)
    q, k, do, m = _case(**case, dtype=dtype)
    g = torch.Generator().manual_seed(11)
    v = torch.randn(*k.shape[:3], do.shape[-1], generator=g).to(dtype)
    return q, k, v, do, m, softcap, causal


def autograd_oracle(q, k, v, dout, mask, scaling, softcap, causal):
    """Float64 autograd through ``softmax(scores) @ V`` all at once. A row with every key
    masked has P = 0: its scores are replaced by zeros and its P multiplied by a constant 0,
    so autograd gives it no gradient (softmax of an all −inf row is NaN)."""
    q, k, v, dout = (t.double().requires_grad_(True) for t in (q, k, v, dout))
    b, h, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    kk, vv = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    s = q @ kk.transpose(-1, -2) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        mm = mask[..., :lk]
        s = s.masked_fill(~mm, float("-inf")) if mm.dtype == torch.bool else s + mm.double()
    if causal:
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
    dead = (s == float("-inf")).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), -1) * (~dead).double()
    out = p @ vv
    return torch.autograd.grad(out, (q, k, v), dout)


IDS = lambda c: "-".join(f"{k}={v}" for k, v in c.items())  # noqa: E731


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reference_equals_autograd(case, monkeypatch):
    q, k, v, do, m, softcap, causal = _with_v(case)
    monkeypatch.setattr(reference, "_BLOCK_ELEMENTS", 2048)  # several row blocks even at these sizes
    got = attention_backward_reference(q, k, v, do, m, 0.3, softcap, causal)
    for a, b in zip(got, autograd_oracle(q, k, v, do, m, 0.3, softcap, causal)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def rounding_bounds(q, k, v, dout, mask, scaling, softcap, causal, u):
    """What rounding P and dS to a 16-bit type (unit roundoff ``u``) as GEMM operands can move
    each gradient element, from float64: dq by u·|dS|·|K|, dk by u·|dS|ᵀ·|Q|, dv by u·Pᵀ·|dO|
    (summed over a group's heads), with dS = s·P ⊙ (dP − rowsum(P ⊙ dP)) [⊙ (1 − t²)]."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    b, h, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = h // hkv
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ kk.transpose(-1, -2) * scaling
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if mask is not None:
        mm = mask[..., :lk]
        s = s.masked_fill(~mm, float("-inf")) if mm.dtype == torch.bool else s + mm.double()
    if causal:
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    dp = dout @ vv.transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scaling
    if t is not None:
        ds = ds * (1 - t * t)
    bq = u * (ds.abs() @ kk.abs())
    bk = u * (ds.abs().transpose(-1, -2) @ q.abs()).view(b, hkv, g, lk, -1).sum(2)
    bv = u * (p.transpose(-1, -2) @ dout.abs()).view(b, hkv, g, lk, -1).sum(2)
    return bq, bk, bv


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_cpp_kernel_equals_the_reference(case, dtype):
    """float64 / float32: the reference to rounding. bfloat16 / float16: P and dS are rounded
    to the input type as GEMM operands (16-bit products, float32 sums, as sdpa's CPU flash
    backward): each element within :func:`rounding_bounds` of the float32 reference."""
    q, k, v, do, m, softcap, causal = _with_v(case, dtype)
    ref = attention_backward_reference(q, k, v, do, m, 0.3, softcap, causal)
    got = compiled.attention_backward(q, k, v, do, m, 0.3, softcap, causal)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
    if dtype in (torch.float64, torch.float32):
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        return
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11  # 8 and 11 significant bits
    for a, b, bound in zip(got, ref, rounding_bounds(q, k, v, do, m, 0.3, softcap, causal, u)):
        err = (a.double() - b.double()).abs()
        assert bool((err <= bound + 2e-5).all()), float((err - bound).max())


def test_cpp_kernel_splits_query_blocks_when_heads_are_few():
    q, k, v, do, _, _, _ = _with_v(dict(lq=300, heads=2, kv=1))
    q, k, v, do = q[:1], k[:1], v[:1], do[:1]
    old = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        got = compiled.attention_backward(q, k, v, do, None, 0.2, None, True)
    finally:
        torch.set_num_threads(old)
    for a, b in zip(got, autograd_oracle(q, k, v, do, None, 0.2, None, True)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_value_that_is_not_finite_reaches_the_hidden_keys_as_nan():
    """Causal: keys after a block's rows are skipped only while dO and V are finite; an inf
    in dO meets their P = 0 as 0·inf = NaN in dv, as the full product gives."""
    q, k, v, do, _, _, _ = _with_v(dict(lq=70, heads=2, kv=2))
    do[0, 0, 3, 1] = float("inf")
    ref = attention_backward_reference(q, k, v, do, None, 0.3, None, True)
    got = compiled.attention_backward(q, k, v, do, None, 0.3, None, True)
    assert torch.isnan(ref[2][0, 0, 60, 1]) and torch.isnan(got[2][0, 0, 60, 1])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_kernel_equals_the_reference(case):
    q, k, v, do, m, softcap, causal = _with_v(case, torch.float32)
    dev = [None if t is None else t.to(TRITON_DEVICE) for t in (q, k, v, do, m)]
    got = triton_backend.attention_backward(*dev, 0.3, softcap, causal)
    for a, b in zip(got, attention_backward_reference(q, k, v, do, m, 0.3, softcap, causal)):
        torch.testing.assert_close(a.cpu(), b, rtol=2e-5, atol=2e-5)


@needs_triton
def test_triton_kernel_float64_several_blocks_and_a_dead_row():
    q, k, v, do, m, _, _ = _with_v(dict(lq=300, heads=4, kv=2, mask="bool"))
    got = triton_backend.attention_backward(q, k, v, do, m, 0.3, 4.0, True)
    for a, b in zip(got, autograd_oracle(q, k, v, do, m, 0.3, 4.0, True)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_bad_shapes_are_refused():
    q, k, v, do, _, _, _ = _with_v(dict(lq=5))
    with pytest.raises(ValueError, match=r"attention_backward: v of shape \(2, 2, 5, 7\) does not fit k"):
        OA.attention_backward(q, k, torch.zeros(2, 2, 5, 7, dtype=q.dtype), do, None, 0.3, None, False)
    with pytest.raises(ValueError, match="attention_dv: q, k and dout must be 4-D"):
        OA.attention_backward(q[0], k, v, do, None, 0.3, None, False)


@pytest.fixture
def counting(monkeypatch):
    calls = []
    orig = AttnLRPAttentionFunction.backward

    def backward(ctx, dout, dweights):
        calls.append(tuple(dout.shape))
        return orig(ctx, dout, dweights)

    monkeypatch.setattr(AttnLRPAttentionFunction, "backward", staticmethod(backward))
    return calls


def _batch(seed=0):
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 8:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "qwen3", "olmo2"])
def test_eager_attnlrp_core_gives_the_native_backward(arch, counting):
    m = tiny_causal_lm(arch, "eager", dtype=torch.float64)
    r = pyattr.relevance(m, _batch(), rules="attnlrp")
    assert len(counting) == m.config.num_hidden_layers  # one recomputed core per layer
    with FA.native_attention_backward():
        ref = pyattr.relevance(m, _batch(), rules="attnlrp")
    assert len(counting) == m.config.num_hidden_layers
    torch.testing.assert_close(r.relevance, ref.relevance, rtol=1e-5, atol=1e-7)  # relevance is float32


def test_sdpa_keeps_its_native_blockwise_backward(counting):
    m = tiny_causal_lm("llama", "sdpa", dtype=torch.float64)
    pyattr.relevance(m, _batch(), rules="attnlrp")
    assert counting == []


def test_no_pattern_is_saved_for_the_backward():
    """Eager attention under AttnLRP: the saved tensors hold no attention pattern."""
    m = tiny_causal_lm("llama", "eager")
    n = 37  # not a width of the tiny model
    ids = torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(0))

    def largest_square(ctx):
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention="attnlrp")), ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
            m(inputs_embeds=emb).logits[0, -1, 3]
        # (batch, heads, n, n) patterns; the model's own (1, 1, n, n) mask, one tensor for
        # every layer, is not one
        return sum(1 for s in shapes if len(s) == 4 and s[1] > 1 and s[-1] == n and s[-2] == n)

    assert largest_square(__import__("contextlib").nullcontext()) == 0
    assert largest_square(FA.native_attention_backward()) > 0  # the native backward keeps P


def test_k_targets_under_attnlrp_equal_single_targets(counting):
    m = tiny_causal_lm("llama", "eager", dtype=torch.float64)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    rk = pyattr.relevance(m, ids, target=torch.tensor([[3, 5, 7]]), rules="attnlrp")
    assert counting
    for j, t in enumerate((3, 5, 7)):
        one = pyattr.relevance(m, ids, target=t, rules="attnlrp")
        torch.testing.assert_close(rk.relevance[j], one.relevance, rtol=1e-8, atol=1e-12)
