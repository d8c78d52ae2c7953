"""Frozen attention (AH-rule) backward, flash style: ``dV = Pᵀ·dO`` only.

Two kernels, neither of which holds a seq × seq matrix:

1. ``_attention_row_stats``: per block of query rows, the row maximum m and the sum
   l = Σ exp(s − m) over all keys (online; the native forward kept neither);
2. ``_attention_dv``: per block of keys, ``P = exp(S − m) / l`` block by block over the
   query rows of every query head of the key's group (GQA), accumulated as ``Pᵀ·dO`` in
   float32 (float64 for float64 inputs).

Scores are ``scaling · q·kᵀ``, then Gemma 2's softcap ``tanh(s/c)·c`` (through sigmoid),
then an additive mask (any strides; broadcast dimensions have stride 0), then causality
(query i sees keys j ≤ i). m and l are kept apart rather than as ``m + log l``: a row
whose keys are all masked with a large finite value (eager attention's ``finfo.min``)
has ``m`` so large that ``log l`` would vanish in the sum, and its uniform pattern would
come out as ones. A row with every key masked to −inf has ``m = −inf`` and adds nothing;
a row with a NaN score has ``m = NaN`` and a row with +inf ``l = NaN``, so its P is NaN
except at causally hidden keys (0 in every row), as in
``pyattr.backends.reference.attention_dv_reference``. Causal blocks skip the query rows
before a key block, unless dO is not finite somewhere (a flag computed on the device):
then those rows' P = 0 meets it as 0·inf = NaN, as the full product does.
Float32 products run at IEEE precision (no TF32). Offsets are int64; the head dimension
is masked (64, 80, 128, any size).
"""

import torch
import triton
import triton.language as tl

from pyattr.kernels._common import INTERPRET, acc_dtype, launch, tanh_


@triton.jit
def _scores(q, k, qi, kj, Lq, Lk, M, m_off, sm2, sm3, scaling, softcap,
            HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr):
    """The (rows × keys) block of masked scores; −inf outside the sequence and where masked."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling
    if HAS_SOFTCAP:
        s = tanh_(s / softcap) * softcap
    valid = (qi[:, None] < Lq) & (kj[None, :] < Lk)
    if HAS_MASK:
        mv = tl.load(M + m_off + qi[:, None].to(tl.int64) * sm2 + kj[None, :].to(tl.int64) * sm3, mask=valid,
                     other=0.0)
        s = s + mv.to(s.dtype)
    if CAUSAL:
        valid = valid & (kj[None, :] <= qi[:, None])
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _attention_row_stats(Q, K, M, ROWMAX, ROWSUM, Lq, Lk, H, G, D,
                   sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sm0, sm1, sm2, sm3,
                   scaling, softcap, HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr,
                   ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pm = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    hk = h // G
    qi = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b * sq0 + h * sq1 + qi[:, None].to(tl.int64) * sq2 + dd[None, :] * sq3,
                mask=(qi[:, None] < Lq) & (dd[None, :] < D), other=0.0).to(ACC)
    m_off = b * sm0 + h * sm1
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    l_i = tl.zeros([BLOCK_M], dtype=ACC)
    end = Lk
    if CAUSAL:
        end = tl.minimum(Lk, (pm + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        kj = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(K + b * sk0 + hk * sk1 + kj[:, None].to(tl.int64) * sk2 + dd[None, :] * sk3,
                    mask=(kj[:, None] < Lk) & (dd[None, :] < D), other=0.0).to(ACC)
        s = _scores(q, k, qi, kj, Lq, Lk, M, m_off, sm2, sm3, scaling, softcap, HAS_MASK, HAS_SOFTCAP, CAUSAL)
        # a NaN score makes the row's maximum NaN, and it stays NaN (whatever NaN rule the
        # max and maximum of this target follow)
        nan_row = (tl.max((s != s).to(tl.int32), axis=1) > 0) | (m_i != m_i)
        m_new = tl.where(nan_row, float("nan"), tl.maximum(m_i, tl.max(s, axis=1)))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - safe) + tl.sum(tl.exp(s - safe[:, None]), axis=1)
        m_i = m_new
    tl.store(ROWMAX + bh * Lq + qi, m_i, mask=qi < Lq)
    tl.store(ROWSUM + bh * Lq + qi, l_i, mask=qi < Lq)


@triton.jit
def _attention_dv(Q, K, DO, M, ROWMAX, ROWSUM, DV, FULL, Lq, Lk, H, Hkv, G, D, Dv,
                  sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, so0, so1, so2, so3, sm0, sm1, sm2, sm3,
                  scaling, softcap, HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr,
                  ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr):
    pn = tl.program_id(0).to(tl.int64)
    bhk = tl.program_id(1).to(tl.int64)
    b = bhk // Hkv
    hk = bhk % Hkv
    kj = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    de = tl.arange(0, BLOCK_DV)
    k = tl.load(K + b * sk0 + hk * sk1 + kj[:, None].to(tl.int64) * sk2 + dd[None, :] * sk3,
                mask=(kj[:, None] < Lk) & (dd[None, :] < D), other=0.0).to(ACC)
    acc = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)
    start = 0
    if CAUSAL:  # rows before the block's first key never see it (unless dO is not finite)
        start = tl.where(tl.load(FULL) != 0, 0, (pn * BLOCK_N) // BLOCK_M * BLOCK_M)
    for g in range(0, G):
        h = hk * G + g
        m_off = b * sm0 + h * sm1
        for m0 in range(start, Lq, BLOCK_M):
            qi = m0 + tl.arange(0, BLOCK_M)
            rows = qi[:, None] < Lq
            q = tl.load(Q + b * sq0 + h * sq1 + qi[:, None].to(tl.int64) * sq2 + dd[None, :] * sq3,
                        mask=rows & (dd[None, :] < D), other=0.0).to(ACC)
            s = _scores(q, k, qi, kj, Lq, Lk, M, m_off, sm2, sm3, scaling, softcap, HAS_MASK, HAS_SOFTCAP, CAUSAL)
            mx = tl.load(ROWMAX + (b * H + h) * Lq + qi, mask=qi < Lq, other=float("-inf"))
            sm = tl.load(ROWSUM + (b * H + h) * Lq + qi, mask=qi < Lq, other=1.0)
            none = mx == float("-inf")
            p = tl.exp(s - tl.where(none, 0.0, mx)[:, None]) / tl.where(none, 1.0, sm)[:, None]
            p = tl.where(none[:, None], 0.0, p)
            if CAUSAL:  # hidden keys: 0 in every row, a NaN row's too
                p = tl.where(kj[None, :] <= qi[:, None], p, 0.0)
            do = tl.load(DO + b * so0 + h * so1 + qi[:, None].to(tl.int64) * so2 + de[None, :] * so3,
                         mask=rows & (de[None, :] < Dv), other=0.0).to(ACC)
            acc += tl.dot(tl.trans(p), do, input_precision="ieee")
    out = DV + (bhk * Lk + kj[:, None].to(tl.int64)) * Dv + de[None, :]
    tl.store(out, acc, mask=(kj[:, None] < Lk) & (de[None, :] < Dv))


def _blocks(d: int, dv: int):
    if INTERPRET:  # numpy runs each block: few large blocks
        return 256, 256
    return (64, 64) if max(d, dv) <= 64 else (64, 32)


def attention_dv(q, k, dout, mask, scaling: float, softcap, causal: bool) -> torch.Tensor:
    """dV (batch, kv_heads, kv_len, v_dim), float32 (float64 for float64 inputs), of frozen
    attention; ``mask`` additive (floating) or None, broadcastable to (batch, heads, q_len, kv_len)."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    dv_dim = dout.shape[-1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dv = torch.empty(b, hkv, lk, dv_dim, dtype=acc, device=q.device)
    if lk == 0 or dv_dim == 0:
        return dv.zero_()
    rowmax = torch.empty(b, h, lq, dtype=acc, device=q.device)
    rowsum = torch.empty(b, h, lq, dtype=acc, device=q.device)
    if mask is not None:
        mask = mask[..., :lk].expand(b, h, lq, lk)
        ms = mask.stride()
    else:
        ms = (0, 0, 0, 0)
    bm, bn = _blocks(d, dv_dim)
    block_d = max(16, triton.next_power_of_2(d))
    block_dv = max(16, triton.next_power_of_2(dv_dim))
    flags = dict(HAS_MASK=mask is not None, HAS_SOFTCAP=softcap is not None, CAUSAL=bool(causal), ACC=acc_dtype(q.dtype))
    cap = 1.0 if softcap is None else float(softcap)
    m_arg = mask if mask is not None else q
    if lq:
        launch(_attention_row_stats)[(triton.cdiv(lq, bm), b * h)](
            q, k, m_arg, rowmax, rowsum, lq, lk, h, h // hkv, d, *q.stride(), *k.stride(), *ms, float(scaling), cap,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, **flags)
    # causal: whether dO has a value that is not finite (on the device, no sync)
    full = (~torch.isfinite(dout)).any().to(torch.int32).reshape(1) if causal else rowmax
    launch(_attention_dv)[(triton.cdiv(lk, bn), b * hkv)](
        q, k, dout, m_arg, rowmax, rowsum, dv, full, lq, lk, h, hkv, h // hkv, d, dv_dim, *q.stride(), *k.stride(), *dout.stride(), *ms,
        float(scaling), cap, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, BLOCK_DV=block_dv, **flags)
    return dv
