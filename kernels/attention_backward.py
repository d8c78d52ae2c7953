"""AttnLRP attention backward, flash style: the full gradient (dq, dk, dv) of softmax
attention, with nothing of size seq × seq held.

Under AttnLRP (Achtibat et al., ICML 2024) the softmax rule (Prop. 3.1) is the softmax's
own gradient in gradient × input form and the uniform rule's ½ (Eq. 12) sits at the q/k/v
projections, so the attention core needs the plain gradient; the native eager backward
keeps every layer's pattern for it, these kernels recompute it block by block:

1. ``_attention_stats``: per block of query rows, online over key blocks, the row maximum
   m, the sum l = Σ exp(s − m) and Δ = Σ P ⊙ dP (dP = dO·Vᵀ, rescaled as m moves), so no
   forward output needs to be saved;
2. ``_attention_dq``: per block of query rows, ``dq = s · Σ_keys dS·K`` with
   ``dS = P ⊙ (dP − Δ)`` (× (1 − tanh²) under Gemma 2's softcap);
3. ``_attention_dkdv``: per block of keys, over the query rows of every query head of the
   key's group (GQA), ``dk = s · dSᵀ·Q`` and ``dv = Pᵀ·dO``.

Scores, masking and causality as in ``kernels/attention.py`` (the AH-rule's dV-only
kernel): ``scaling · q·kᵀ``, softcap, additive mask of any strides, query i sees keys
j ≤ i; a row whose keys are all masked to −inf has P = 0 and gets dq = 0. Accumulation in
float32 (float64 for float64 inputs), IEEE products, int64 offsets, any head size.
Causal key blocks skip the query rows before them unless dO or V is not finite somewhere.
"""

import torch
import triton
import triton.language as tl

from pyattr.kernels._common import INTERPRET, acc_dtype, launch, tanh_


@triton.jit
def _scores_t(q, k, qi, kj, Lq, Lk, M, m_off, sm2, sm3, scaling, softcap,
              HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr):
    """The (rows × keys) block of masked scores (−inf outside the sequence and where masked)
    and, under a softcap, tanh(s / c) for the derivative (else 0)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling
    t = s * 0.0
    if HAS_SOFTCAP:
        t = tanh_(s / softcap)
        s = t * softcap
    valid = (qi[:, None] < Lq) & (kj[None, :] < Lk)
    if HAS_MASK:
        mv = tl.load(M + m_off + qi[:, None].to(tl.int64) * sm2 + kj[None, :].to(tl.int64) * sm3, mask=valid,
                     other=0.0)
        s = s + mv.to(s.dtype)
    if CAUSAL:
        valid = valid & (kj[None, :] <= qi[:, None])
    return tl.where(valid, s, float("-inf")), t


@triton.jit
def _block(X, b, h, idx, cols, s0, s1, s2, s3, n_rows, n_cols, ACC: tl.constexpr):
    """Rows ``idx`` × columns ``cols`` of ``X[b, h]`` (4-D, any strides), zero outside, in ACC."""
    return tl.load(X + b * s0 + h * s1 + idx[:, None].to(tl.int64) * s2 + cols[None, :] * s3,
                   mask=(idx[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0).to(ACC)


@triton.jit
def _attention_stats(Q, K, V, DO, M, ROWMAX, ROWSUM, DELTA, Lq, Lk, H, G, D, Dv,
                     sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, so0, so1, so2, so3,
                     sm0, sm1, sm2, sm3, scaling, softcap,
                     HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    pm = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    hk = h // G
    qi = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    de = tl.arange(0, BLOCK_DV)
    q = _block(Q, b, h, qi, dd, sq0, sq1, sq2, sq3, Lq, D, ACC)
    do = _block(DO, b, h, qi, de, so0, so1, so2, so3, Lq, Dv, ACC)
    m_off = b * sm0 + h * sm1
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    l_i = tl.zeros([BLOCK_M], dtype=ACC)
    d_i = tl.zeros([BLOCK_M], dtype=ACC)
    end = Lk
    if CAUSAL:
        end = tl.minimum(Lk, (pm + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        kj = n0 + tl.arange(0, BLOCK_N)
        k = _block(K, b, hk, kj, dd, sk0, sk1, sk2, sk3, Lk, D, ACC)
        v = _block(V, b, hk, kj, de, sv0, sv1, sv2, sv3, Lk, Dv, ACC)
        s, t = _scores_t(q, k, qi, kj, Lq, Lk, M, m_off, sm2, sm3, scaling, softcap, HAS_MASK, HAS_SOFTCAP, CAUSAL)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - safe)
        e = tl.exp(s - safe[:, None])
        l_i = l_i * alpha + tl.sum(e, axis=1)
        d_i = d_i * alpha + tl.sum(tl.where(e > 0, e * dp, 0.0), axis=1)
        m_i = m_new
    delta = tl.where(l_i > 0, d_i / tl.where(l_i > 0, l_i, 1.0), 0.0)
    tl.store(ROWMAX + bh * Lq + qi, m_i, mask=qi < Lq)
    tl.store(ROWSUM + bh * Lq + qi, l_i, mask=qi < Lq)
    tl.store(DELTA + bh * Lq + qi, delta, mask=qi < Lq)


@triton.jit
def _probs(s, mx, sm):
    """P from the masked scores and the row statistics (0 for a row with every key masked)."""
    none = mx == float("-inf")
    p = tl.exp(s - tl.where(none, 0.0, mx)[:, None]) / tl.where(none, 1.0, sm)[:, None]
    return tl.where(none[:, None], 0.0, p)


@triton.jit
def _attention_dq(Q, K, V, DO, M, ROWMAX, ROWSUM, DELTA, DQ, Lq, Lk, H, G, D, Dv,
                  sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, so0, so1, so2, so3,
                  sm0, sm1, sm2, sm3, scaling, softcap,
                  HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    pm = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    hk = h // G
    qi = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    de = tl.arange(0, BLOCK_DV)
    rows = qi[:, None] < Lq
    q = _block(Q, b, h, qi, dd, sq0, sq1, sq2, sq3, Lq, D, ACC)
    do = _block(DO, b, h, qi, de, so0, so1, so2, so3, Lq, Dv, ACC)
    mx = tl.load(ROWMAX + bh * Lq + qi, mask=qi < Lq, other=float("-inf"))
    sm = tl.load(ROWSUM + bh * Lq + qi, mask=qi < Lq, other=1.0)
    delta = tl.load(DELTA + bh * Lq + qi, mask=qi < Lq, other=0.0)
    m_off = b * sm0 + h * sm1
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    end = Lk
    if CAUSAL:
        end = tl.minimum(Lk, (pm + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        kj = n0 + tl.arange(0, BLOCK_N)
        k = _block(K, b, hk, kj, dd, sk0, sk1, sk2, sk3, Lk, D, ACC)
        v = _block(V, b, hk, kj, de, sv0, sv1, sv2, sv3, Lk, Dv, ACC)
        s, t = _scores_t(q, k, qi, kj, Lq, Lk, M, m_off, sm2, sm3, scaling, softcap, HAS_MASK, HAS_SOFTCAP, CAUSAL)
        p = _probs(s, mx, sm)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        acc += tl.dot(ds, k, input_precision="ieee")
    out = DQ + (bh * Lq + qi[:, None].to(tl.int64)) * D + dd[None, :]
    tl.store(out, acc * scaling, mask=rows & (dd[None, :] < D))


@triton.jit
def _attention_dkdv(Q, K, V, DO, M, ROWMAX, ROWSUM, DELTA, DK, DV, FULL, Lq, Lk, H, Hkv, G, D, Dv,
                    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, so0, so1, so2, so3,
                    sm0, sm1, sm2, sm3, scaling, softcap,
                    HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    pn = tl.program_id(0).to(tl.int64)
    bhk = tl.program_id(1).to(tl.int64)
    b = bhk // Hkv
    hk = bhk % Hkv
    kj = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    de = tl.arange(0, BLOCK_DV)
    keys = kj[:, None] < Lk
    k = _block(K, b, hk, kj, dd, sk0, sk1, sk2, sk3, Lk, D, ACC)
    v = _block(V, b, hk, kj, de, sv0, sv1, sv2, sv3, Lk, Dv, ACC)
    acc_k = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    acc_v = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)
    start = 0
    if CAUSAL:  # rows before the block's first key never see it (unless dO or V is not finite)
        start = tl.where(tl.load(FULL) != 0, 0, (pn * BLOCK_N) // BLOCK_M * BLOCK_M)
    for g in range(0, G):
        h = hk * G + g
        bh = b * H + h
        m_off = b * sm0 + h * sm1
        for m0 in range(start, Lq, BLOCK_M):
            qi = m0 + tl.arange(0, BLOCK_M)
            q = _block(Q, b, h, qi, dd, sq0, sq1, sq2, sq3, Lq, D, ACC)
            do = _block(DO, b, h, qi, de, so0, so1, so2, so3, Lq, Dv, ACC)
            s, t = _scores_t(q, k, qi, kj, Lq, Lk, M, m_off, sm2, sm3, scaling, softcap, HAS_MASK, HAS_SOFTCAP,
                             CAUSAL)
            mx = tl.load(ROWMAX + bh * Lq + qi, mask=qi < Lq, other=float("-inf"))
            sm = tl.load(ROWSUM + bh * Lq + qi, mask=qi < Lq, other=1.0)
            delta = tl.load(DELTA + bh * Lq + qi, mask=qi < Lq, other=0.0)
            p = _probs(s, mx, sm)
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            ds = p * (dp - delta[:, None])
            if HAS_SOFTCAP:
                ds = ds * (1.0 - t * t)
            acc_k += tl.dot(tl.trans(ds), q, input_precision="ieee")
            acc_v += tl.dot(tl.trans(p), do, input_precision="ieee")
    kmask = keys & (dd[None, :] < D)
    tl.store(DK + (bhk * Lk + kj[:, None].to(tl.int64)) * D + dd[None, :], acc_k * scaling, mask=kmask)
    tl.store(DV + (bhk * Lk + kj[:, None].to(tl.int64)) * Dv + de[None, :], acc_v, mask=keys & (de[None, :] < Dv))


def _blocks(d: int, dv: int):
    if INTERPRET:  # numpy runs each block: few large blocks
        return 128, 128
    return (64, 64) if max(d, dv) <= 64 else (64, 32)


def attention_backward(q, k, v, dout, mask, scaling: float, softcap, causal: bool):
    """``(dq, dk, dv)`` of softmax attention, float32 (float64 for float64 inputs);
    ``mask`` additive (floating) or None, broadcastable to (batch, heads, q_len, kv_len)."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    dvd = v.shape[-1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(b, h, lq, d, dtype=acc, device=q.device)
    dk = torch.zeros(b, hkv, lk, d, dtype=acc, device=q.device)
    dv = torch.zeros(b, hkv, lk, dvd, dtype=acc, device=q.device)
    if lk == 0 or lq == 0:
        return dq, dk, dv
    rowmax = torch.empty(b, h, lq, dtype=acc, device=q.device)
    rowsum = torch.empty(b, h, lq, dtype=acc, device=q.device)
    delta = torch.empty(b, h, lq, dtype=acc, device=q.device)
    if mask is not None:
        mask = mask[..., :lk].expand(b, h, lq, lk)
        ms = mask.stride()
    else:
        ms = (0, 0, 0, 0)
    bm, bn = _blocks(d, dvd)
    shape = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, triton.next_power_of_2(d)),
                 BLOCK_DV=max(16, triton.next_power_of_2(dvd)), HAS_MASK=mask is not None,
                 HAS_SOFTCAP=softcap is not None, CAUSAL=bool(causal), ACC=acc_dtype(q.dtype))
    cap = 1.0 if softcap is None else float(softcap)
    m_arg = mask if mask is not None else q
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *ms)
    launch(_attention_stats)[(triton.cdiv(lq, bm), b * h)](
        q, k, v, dout, m_arg, rowmax, rowsum, delta, lq, lk, h, h // hkv, d, dvd, *strides, float(scaling), cap,
        **shape)
    launch(_attention_dq)[(triton.cdiv(lq, bm), b * h)](
        q, k, v, dout, m_arg, rowmax, rowsum, delta, dq, lq, lk, h, h // hkv, d, dvd, *strides, float(scaling), cap,
        **shape)
    if causal:  # whether dO or V has a value that is not finite (on the device, no sync)
        full = ((~torch.isfinite(dout)).any() | (~torch.isfinite(v)).any()).to(torch.int32).reshape(1)
    else:
        full = rowmax
    launch(_attention_dkdv)[(triton.cdiv(lk, bn), b * hkv)](
        q, k, v, dout, m_arg, rowmax, rowsum, delta, dk, dv, full, lq, lk, h, hkv, h // hkv, d, dvd, *strides,
        float(scaling), cap, **shape)
    return dq, dk, dv
