"""Frozen attention (AH-rule): the dV-only backward.

Op level: the blocked reference against a float64 closed form (whole P, then Pᵀ·dO), and
the ``cpp`` kernel and the Triton kernels (interpreter) against the reference over masks,
causality, GQA, softcap and the sizes the issue names (seq 1, 17, 1000, 4097; head dims
64, 80, 128). Model level: the frozen core runs in every layer of every mapped
architecture, gives the native backward's relevance, keeps the forward bit-identical,
takes the native SDPA backward out of the graph, saves fewer bytes, and leaves nothing
behind after the scope.
"""

import pytest
import torch

import pyattr
from conftest import graph_names
from models import VOCAB, _cfg, tiny_causal_lm
from pyattr.backends import compiled, triton_backend
from pyattr.integration import attention as FA
from pyattr.backends import reference
from pyattr.ops import attention as OA
from pyattr.ops.attention import FrozenAttentionFunction, attention_dv_reference

pytestmark = pytest.mark.usefixtures("one_thread")

# the Triton kernels: CUDA tensors on a GPU machine, CPU tensors under the interpreter here
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not pyattr.available_backends()["triton"].available,
                                  reason=pyattr.available_backends()["triton"].reason)


def closed_form(q, k, dout, mask, scaling, softcap, causal):
    """Float64, all at once: P = softmax(scores), dV = Σ over the group's heads of Pᵀ·dO."""
    q, k, dout = q.double(), k.double(), dout.double()
    b, h, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    kk = k.repeat_interleave(h // hkv, dim=1)
    s = q @ kk.transpose(-1, -2) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        m = mask[..., :lk]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    if causal:
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    dv = p.transpose(-1, -2) @ dout
    return dv.view(b, hkv, h // hkv, lk, -1).sum(2)


def _case(lq, d=16, heads=4, kv=2, dv=None, mask=None, dtype=torch.float64, seed=0, lk=None):
    g = torch.Generator().manual_seed(seed)
    lk = lq if lk is None else lk
    q = torch.randn(2, heads, lq, d, generator=g).to(dtype)
    k = torch.randn(2, kv, lk, d, generator=g).to(dtype)
    do = torch.randn(2, heads, lq, dv or d, generator=g).to(dtype)
    m = None
    if mask == "bool":
        m = torch.ones(2, 1, lq, lk + 3, dtype=torch.bool)
        m[0, :, :, : lk // 2] = False  # left padding of row 0
        m[1, :, 0] = False             # one query row that sees nothing
    elif mask == "float":
        m = torch.randn(2, heads, lq, lk, generator=g).to(dtype)
        m[1, :, :, -2:] = torch.finfo(dtype).min
    elif mask == "finfo_rows":  # eager attention's masks: whole rows at finfo.min (uniform P)
        m = torch.zeros(2, 1, lq, lk, dtype=dtype)
        m[0, :, 1] = torch.finfo(dtype).min
        m[1, :, :, : lk // 2] = torch.finfo(dtype).min
    elif mask == "broadcast":
        m = torch.zeros(1, 1, 1, lk, dtype=dtype)
        m[..., 0] = float("-inf")
    return q, k, do, m


CASES = [
    dict(lq=1), dict(lq=9, causal=True), dict(lq=37, kv=4, mask="bool"), dict(lq=37, kv=1, mask="float", softcap=3.0),
    dict(lq=70, causal=True, mask="bool"), dict(lq=33, dv=8, mask="broadcast"), dict(lq=21, mask="finfo_rows"), dict(lq=65, heads=6, kv=3, causal=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_reference_equals_the_closed_form(case, monkeypatch):
    case = dict(case)
    causal, softcap = case.pop("causal", False), case.pop("softcap", None)
    q, k, do, m = _case(**case)
    monkeypatch.setattr(reference, "_BLOCK_ELEMENTS", 2048)  # several row blocks even at these sizes
    got = attention_dv_reference(q, k, do, m, 0.3, softcap, causal)
    torch.testing.assert_close(got, closed_form(q, k, do, m, 0.3, softcap, causal), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_cpp_kernel_equals_the_reference(case, dtype):
    """float64 / float32: the reference to rounding. bfloat16 / float16: the kernel runs its
    GEMMs on the 16-bit operands with float32 sums and rounds P to the input type as the
    operand of Pᵀ·dO (as sdpa's CPU flash kernel does), so each dV element may differ from
    the float32 reference by the unit roundoff u of that type times Σ P·|dO| (the same
    bound the input dO's own rounding puts on it): checked against that bound, which the
    float32 path (no rounding of P) meets with u = 0."""
    case = dict(case)
    causal, softcap = case.pop("causal", False), case.pop("softcap", None)
    q, k, do, m = _case(**case, dtype=dtype)
    ref = attention_dv_reference(q, k, do, m, 0.3, softcap, causal)
    got = compiled.attention_dv(q, k, do, m, 0.3, softcap, causal)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if dtype in (torch.float64, torch.float32):
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
        return
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11  # 8 and 11 significant bits
    bound = u * closed_form(q, k, do.abs(), m, 0.3, softcap, causal) + 2e-5
    err = (got.double() - ref.double()).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [dict(lq=9, causal=True), dict(lq=65, heads=6, kv=3, causal=True), dict(lq=37, kv=4)],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) if isinstance(c, dict) else str(c))
def test_cpp_kernel_16bit_is_p_rounded_to_nearest(case, dtype):
    """What the 16-bit path computes, exactly: float64 P rounded to the input type (round to
    nearest even), then Pᵀ·dO summed over the group's heads; the float32 sums of the kernel
    differ from it only in the float32 rounding. The path runs where the CPU multiplies the
    type natively (oneDNN packs it: AMX for bfloat16 here); elsewhere the kernel computes in
    float32 and must give the float32 answer."""
    case = dict(case)
    causal = case.pop("causal", False)
    q, k, do, _ = _case(**case, dtype=dtype)
    got = compiled.attention_dv(q, k, do, None, 0.3, None, causal).double()
    b, h, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    s = q.double() @ k.double().repeat_interleave(h // hkv, dim=1).transpose(-1, -2) * 0.3
    if causal:
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
    p64 = torch.softmax(s, -1)
    p = p64.to(torch.float32).to(dtype).double()
    want = (p.transpose(-1, -2) @ do.double()).view(b, hkv, h // hkv, lk, -1).sum(2)
    exact = closed_form(q, k, do, None, 0.3, None, causal)
    if float((got - exact).abs().max()) <= 2e-5:  # the float32 path
        assert not (dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()), \
            "this CPU has AMX: the bfloat16 GEMM path should have run"
        return
    # a P within float32 rounding of a tie between two 16-bit values may round the other way
    # (one ulp, 2u·P): allowed for every element, and the rest equal to float32 rounding
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    flips = 2 * u * (p64.transpose(-1, -2) @ do.double().abs()).view(b, hkv, h // hkv, lk, -1).sum(2)
    err = (got - want).abs()
    assert bool((err <= flips + 1e-5).all())
    assert float((err <= 1e-5).double().mean()) >= 0.99


def test_cpp_kernel_splits_query_blocks_when_heads_are_few():
    """One batch row, one key/value head, 4 threads: the query blocks are shared out and the
    partial sums added."""
    q, k, do, _ = _case(300, heads=2, kv=1)
    q, k, do = q[:1], k[:1], do[:1]
    old = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        got = compiled.attention_dv(q, k, do, None, 0.2, None, True)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(got, closed_form(q, k, do, None, 0.2, None, True), rtol=1e-12, atol=1e-12)


def _on(device, *ts):
    return [None if t is None else t.to(device) for t in ts]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_triton_kernel_equals_the_reference_small(case):
    case = dict(case)
    causal, softcap = case.pop("causal", False), case.pop("softcap", None)
    q, k, do, m = _case(**case, dtype=torch.float32)
    got = triton_backend.attention_dv(*_on(TRITON_DEVICE, q, k, do, m), 0.3, softcap, causal).cpu()
    torch.testing.assert_close(got, attention_dv_reference(q, k, do, m, 0.3, softcap, causal), rtol=2e-5, atol=2e-5)


@needs_triton
@pytest.mark.parametrize("seq", [1, 17, 1000, 4097])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_triton_kernel_at_the_issue_sizes(seq, head_dim):
    """Under the interpreter: GQA (2 query heads on 1 key/value head) with a padding mask
    below 4097, causal at 4097 (where one head keeps the interpreter's run short)."""
    heads = 1 if seq == 4097 else 2
    q, k, do, m = _case(seq, d=head_dim, heads=heads, kv=1, mask=None if seq == 4097 else "bool", dtype=torch.float32)
    q, k, do = q[:1], k[:1], do[:1]
    m = None if m is None else m[:1]
    causal = seq == 4097 or seq == 17
    got = triton_backend.attention_dv(*_on(TRITON_DEVICE, q, k, do, m), head_dim ** -0.5, None, causal).cpu()
    ref = attention_dv_reference(q, k, do, m, head_dim ** -0.5, None, causal)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_bad_shapes_are_refused():
    q, k, do, _ = _case(5)
    with pytest.raises(ValueError, match="GQA: heads % kv_heads == 0"):
        OA.attention_dv(q, k[:, :, :, :3], do, None, 0.1, None, False)
    with pytest.raises(ValueError, match="dout of shape"):
        OA.attention_dv(q, k, do[:, :1], None, 0.1, None, False)
    with pytest.raises(ValueError, match="does not broadcast"):
        OA.attention_dv(q, k, do, torch.zeros(2, 1, 5, 2), 0.1, None, False)
    with pytest.raises(ValueError, match="must be 4-D"):
        OA.attention_dv(q[0], k, do, None, 0.1, None, False)


def test_function_forward_is_the_native_call_and_backward_is_dv():
    import torch.nn.functional as F

    q, k, _, m = _case(12, kv=4, mask="bool")
    v = torch.randn(2, 4, 12, 16, dtype=torch.float64, requires_grad=True)
    mk = m[..., :12]
    def native():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mk, scale=0.3).transpose(1, 2), None

    out, weights = FrozenAttentionFunction.apply(v, q, k, mk, 0.3, None, False, native)
    assert weights.numel() == 0
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mk, scale=0.3).transpose(1, 2)
    assert torch.equal(out, ref)
    go = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, v, go)
    # rows with no key (all False) give NaN in SDPA's own gradient; the frozen core gives 0
    vv = v.detach().requires_grad_(True)
    (gref,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, vv, attn_mask=mk, scale=0.3).transpose(1, 2),
                                  vv, go.nan_to_num(0.0) * mk.any(-1).unsqueeze(-1).transpose(1, 2))
    torch.testing.assert_close(g, gref.nan_to_num(0.0))


# --------------------------------------------------------------------------- in models

ARCHS = [("llama", "eager"), ("llama", "sdpa"), ("qwen3", "sdpa"), ("gemma2", "eager"), ("gpt2", "eager"),
         ("gpt2", "sdpa"), ("gpt_neox", "sdpa"), ("bert", "eager"), ("bert", "sdpa"), ("phi3", "sdpa"),
         ("modernbert", "sdpa"), ("distilbert", "eager"), ("mixtral", "sdpa"), ("olmo2", "eager")]


def _model(arch, impl, dtype=torch.float32, **overrides):
    from transformers import AutoModelForCausalLM

    cfg = _cfg(arch, impl)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).to(dtype).eval()


@pytest.fixture
def counting(monkeypatch):
    calls = []
    orig = FrozenAttentionFunction.backward

    def backward(ctx, dout, dweights):
        calls.append(tuple(dout.shape))
        return orig(ctx, dout, dweights)

    monkeypatch.setattr(FrozenAttentionFunction, "backward", staticmethod(backward))
    return calls


def _batch(seed=0):
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 8:] = 0  # right padding (eager float64 left padding gives NaN in transformers itself)
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("arch,impl", ARCHS)
def test_frozen_core_gives_the_native_backward(arch, impl, counting):
    # grouped_mm experts have no float64 kernel
    m = tiny_causal_lm(arch, impl, dtype=torch.float32 if arch == "mixtral" else torch.float64)
    r = pyattr.relevance(m, _batch())
    assert len(counting) == m.config.num_hidden_layers  # one frozen core per layer
    with FA.native_attention_backward():
        ref = pyattr.relevance(m, _batch())
    assert len(counting) == m.config.num_hidden_layers  # and none on the native run
    torch.testing.assert_close(r.relevance, ref.relevance, rtol=1e-5, atol=1e-7)
    assert (r.conservation_delta.abs() <= 1e-4 * r.target.abs()).all()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_sdpa_with_more_keys_than_queries(arch, counting):
    """A static cache longer than the input: sdpa's causal call cuts the keys (and values)
    to the queries; the cut-off values get a zero gradient, as in the native backward."""
    import transformers

    m = tiny_causal_lm(arch, "sdpa", dtype=torch.float64)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))

    def run():
        cache = transformers.StaticCache(config=m.config, max_cache_len=32)
        return pyattr.relevance(m, {"input_ids": ids, "past_key_values": cache})

    r = run()
    with FA.native_attention_backward():
        ref = run()
    torch.testing.assert_close(r.relevance, ref.relevance, rtol=1e-5, atol=1e-7)


def test_gemma2_softcap_and_sliding_window(counting):
    """Gemma 2 (eager): softcapped scores and a sliding window shorter than the input."""
    m = _model("gemma2", "eager", torch.float64, attn_logit_softcapping=2.0, sliding_window=4)
    batch = _batch(1)
    r = pyattr.relevance(m, batch)
    assert counting
    with FA.native_attention_backward():
        ref = pyattr.relevance(m, batch)
    torch.testing.assert_close(r.relevance, ref.relevance, rtol=1e-5, atol=1e-7)




def test_native_attention_backward_and_q_k_paths_leave_the_graph():
    m = tiny_causal_lm("llama", "sdpa")
    ids = torch.randint(3, VOCAB, (1, 9))
    with pyattr.use_relevance_rules(m):
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        names = graph_names(m(inputs_embeds=emb).logits[0, -1, 3])
    # attention's own backward: the fused SDPA node, or (torch 2.6's CPU SDPA, the math
    # path) its softmax
    def attends(n):
        return "ScaledDotProduct" in n or "Softmax" in n

    assert "FrozenAttentionFunctionBackward" in names
    assert not any(attends(n) for n in names), names
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention="attnlrp")):
        names = graph_names(m(inputs_embeds=emb).logits[0, -1, 3])
    assert "FrozenAttentionFunctionBackward" not in names  # AttnLRP keeps its scaled gradients
    # sdpa's full backward: its own node, or (where sdpa runs its CPU flash kernel) the same
    # kernel's backward that skips query rows without gradient (pyattr.ops.sdpa_rows)
    assert any(attends(n) or n == "SdpaRowsFunctionBackward" for n in names), names


def test_fewer_bytes_are_saved_for_backward():
    m = tiny_causal_lm("llama", "sdpa")
    ids = torch.randint(3, VOCAB, (1, 64))

    def saved(ctx):
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
            m(inputs_embeds=emb).logits[0, -1, 3]
        return sum(total)

    with pyattr.use_relevance_rules(m):
        frozen = saved(__import__("contextlib").nullcontext())
    with pyattr.use_relevance_rules(m):
        native = saved(FA.native_attention_backward())
    assert frozen < native


def test_scope_leaves_the_attention_functions_as_it_found_them(counting):
    import transformers.models.llama.modeling_llama as L
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager, sdpa = L.eager_attention_forward, ALL_ATTENTION_FUNCTIONS["sdpa"]
    local = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    m, other = tiny_causal_lm("llama", "sdpa"), tiny_causal_lm("llama", "sdpa")
    ids = torch.randint(3, VOCAB, (1, 7))
    with pyattr.use_relevance_rules(m):
        with pyattr.use_relevance_rules(m):  # nested: counted, not patched twice
            assert getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "__wrapped__", None) is sdpa
        assert getattr(L.eager_attention_forward, "__wrapped__", None) is eager
        emb = other.get_input_embeddings()(ids).detach().requires_grad_(True)
        other(inputs_embeds=emb).logits[0, -1, 3].backward()  # another instance: native
        assert counting == []
    assert L.eager_attention_forward is eager and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
    assert dict(ALL_ATTENTION_FUNCTIONS._local_mapping) == local


def test_dropout_goes_native(counting):
    """Attention dropout (a module in training mode) is not the rule's math: the native
    call runs, with q and k still detached by the scope."""
    m = _model("llama", "eager", attention_dropout=0.5)
    ids = torch.randint(3, VOCAB, (1, 7))
    m.train()
    with pyattr.use_relevance_rules(m):
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        m(inputs_embeds=emb).logits[0, -1, 3].backward()
    m.eval()
    assert counting == []


def test_k_targets_share_one_pattern(counting):
    """k targets in one batched backward: one frozen core call per layer computes all k."""
    m = tiny_causal_lm("llama", "sdpa", dtype=torch.float64)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    rk = pyattr.relevance(m, ids, target=torch.tensor([[3, 5, 7]] * 2))
    assert len(counting) == m.config.num_hidden_layers
    for j, t in enumerate((3, 5, 7)):
        torch.testing.assert_close(rk.relevance[j], pyattr.relevance(m, ids, target=t).relevance, rtol=1e-6, atol=1e-9)
