"""Reference backend: every rule backward in plain PyTorch.

This is the oracle that the compiled backends are tested against. Each function takes
checked inputs, computes in float32 (float64 stays float64) and returns results in the
input dtype. Norm functions take ``x`` as ``(rows, hidden)`` views or any ``(..., hidden)``
tensor and reduce over the last dimension.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from pyattr.activations import Activation, act_value, derivative, phi


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def promoted_dtype(x: torch.Tensor, *others: torch.Tensor) -> torch.dtype:
    """The dtype a one-dtype kernel runs in: ``x``'s, widened to the others'. A float32 dy
    arriving at bfloat16 activations (after a norm with a float32 weight) is not rounded
    down; the kernel runs in float32 and its results are cast back."""
    dt = x.dtype
    for t in others:
        if t.dtype != dt:
            dt = torch.promote_types(dt, t.dtype)
    return dt


def _up(t: torch.Tensor) -> torch.Tensor:
    return t.to(acc_dtype(t.dtype))


# --- identity ---------------------------------------------------------------------------

def identity_backward(x: torch.Tensor, dy: torch.Tensor, act: Activation) -> torch.Tensor:
    """``dx = dy · φ(x)``."""
    return (_up(dy) * phi(_up(x), act)).to(x.dtype)


# --- half -------------------------------------------------------------------------------

def half_backward(u: torch.Tensor, v: torch.Tensor, dy: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``du = ½·dy·v``, ``dv = ½·dy·u`` at the broadcast shape (the caller reduces)."""
    d = _up(dy) * 0.5
    return (d * _up(v)).to(u.dtype), (d * _up(u)).to(v.dtype)


# --- gated ------------------------------------------------------------------------------

def gated_forward(g: torch.Tensor, u: torch.Tensor, act: Activation) -> torch.Tensor:
    """``act(g) · u`` with the activation's own native forward."""
    return act.fn(g) * u


def gated_backward(
    g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, act: Activation, identity: bool, half: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``dg = s·dh·u·φ(g)`` (or ``act'(g)`` without the Identity-rule), ``du = s·dh·act(g)``,
    with ``s = ½`` under the Half-rule and 1 otherwise; ``act(g)`` is
    :func:`pyattr.activations.act_value` (``g·φ(g)``, as in the compiled kernels)."""
    g32, u32, dh32 = _up(g), _up(u), _up(dh)
    s = 0.5 if half else 1.0
    local = phi(g32, act) if identity else derivative(g32, act)
    dg = s * dh32 * u32 * local
    # act(g) = g·φ(g): with the Identity-rule φ is at hand (one evaluation, not two)
    value = g32 * local if identity and act.kind not in ("custom", "relu") else act_value(g32, act)
    du = s * dh32 * value
    return dg.to(g.dtype), du.to(u.dtype)


# --- layer_norm -------------------------------------------------------------------------

# 2^-64: scales the differences of a row whose sum overflows (its largest are above
# finfo.max / hidden) so that the sum fits, exactly (a power of two); the differences it
# flushes are far below those.
_OVERFLOW_SCALE = 2.0 ** -64


def row_mean(x32: torch.Tensor) -> torch.Tensor:
    """Mean over the last dimension as every LayerNorm backward recomputes it:
    ``K + Σ(x − K)/H`` with ``K`` the row's first value, so that a constant row has exactly
    its value as mean and variance 0, as the native forward's (Welford) statistics have.
    Where that sum overflows, ``K + (Σ(x − K)·2⁻⁶⁴/H)·2⁶⁴``: finite while every ``x − K``
    is, as the native statistics are (rows of ±1e38 in float32); NaN where that is not
    finite either: a row with a value that is not finite, or whose values are more than
    ``finfo.max`` apart (the native statistics are NaN there too)."""
    k = x32[..., :1]
    d = x32 - k
    mu = k + d.mean(-1, keepdim=True)
    big = k + (d * _OVERFLOW_SCALE).mean(-1, keepdim=True) / _OVERFLOW_SCALE
    return torch.where(torch.isfinite(mu), mu, torch.where(torch.isfinite(big), big, float("nan")))


def layer_norm_backward(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    dy: torch.Tensor,
    need_dweight: bool,
    need_dbias: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """LN-rule backward for LayerNorm: σ constant, μ differentiable.

    ``g = dy·w/σ``, ``dx = g − mean(g)``; ``dw = Σ dy·x̂``, ``db = Σ dy`` over all rows.
    μ is :func:`row_mean` (exact for constant rows, no overflow for huge finite ones).
    """
    dy32 = _up(dy)
    xc, rstd = layer_norm_centred(x, eps)
    g = dy32 * rstd if weight is None else dy32 * _up(weight) * rstd
    dx = g - g.mean(-1, keepdim=True)
    dw = db = None
    if need_dweight:
        dw = (dy32 * xc * rstd).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    if need_dbias:
        db = dy32.reshape(-1, x.shape[-1]).sum(0).to(dy.dtype if weight is None else weight.dtype)
    return dx.to(x.dtype), dw, db


# --- rms_norm ---------------------------------------------------------------------------

def rms_norm_forward(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float) -> torch.Tensor:
    """RMSNorm forward in the Hugging Face conventions.

    ``offset == 0`` (Llama, Mistral, Qwen): ``w · (x/r).to(dtype)``;
    ``offset != 0`` (Gemma): ``((x/r) · (offset + w.float())).to(dtype)``.
    """
    xf = x.to(torch.float32) if x.dtype != torch.float64 else x
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return n.to(x.dtype)
    if offset == 0.0:
        return weight * n.to(x.dtype)
    return (n * (offset + weight.to(n.dtype))).to(x.dtype)


def rms_norm_rinv(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """``1/r = 1/sqrt(mean(x²) + eps)`` per row of an upcast ``x``, shape ``(..., 1)``."""
    return torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + eps)


def layer_norm_centred(x: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x − μ, 1/σ)`` of an upcast ``x`` per row (μ by :func:`row_mean`; ``1/σ`` of shape
    ``(..., 1)``), as every LN-rule backward here computes them."""
    x32 = _up(x)
    xc = x32 - row_mean(x32)
    return xc, torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)


def rms_norm_backward(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    offset: float,
    dy: torch.Tensor,
    need_dweight: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """LN-rule backward for RMSNorm: ``dx = dy·w_eff/r``, ``w_eff = offset + w``;
    ``dw = Σ dy·x/r`` (ordinary). Both as ``(dy/r)·w_eff`` and ``(dy/r)·x``, the order of
    the compiled kernels (it decides where a huge dy overflows)."""
    x32, dy32 = _up(x), _up(dy)
    rinv = rms_norm_rinv(x32, eps)
    d = dy32 * rinv
    dx = d if weight is None else d * (offset + _up(weight))
    dw = None
    if need_dweight:
        dw = (d * x32).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx.to(x.dtype), dw


# --------------------------------------------------------------------------- attention (AH-rule)

# elements of one block of scores (float32): 8 Mi elements = 32 MiB
_BLOCK_ELEMENTS = 1 << 23


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def additive_mask(mask: Optional[torch.Tensor], kv_len: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A boolean mask (True: attend) as an additive one (0 / −inf); float masks as they are,
    in ``dtype``; both cut to ``kv_len`` keys (eager attention slices the same way)."""
    if mask is None:
        return None
    mask = mask[..., :kv_len]
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def attention_dv_reference(q, k, dout, mask, scaling: float, softcap: Optional[float], causal: bool):
    """dV = Pᵀ·dO in blocks of query rows (PyTorch ops; differentiable in ``dout``).

    Args:
        q (Tensor[batch, heads, q_len, head_dim]), k (Tensor[batch, kv_heads, kv_len, head_dim]):
            the attention's query and key states (any float dtype).
        dout (Tensor[batch, heads, q_len, v_dim]): the gradient of the attention output.
        mask (Tensor or None): additive (float) or boolean (True: attend), broadcastable to
            (batch, heads, q_len, kv_len).
        scaling (float): the score scale. softcap (float or None): Gemma 2's
            ``tanh(s / c) · c`` on the scores. causal (bool): query i sees keys j ≤ i.

    Returns:
        Tensor[batch, kv_heads, kv_len, v_dim] in float32 (float64 for float64 inputs).

    Edge values (the answer of every backend): a query row whose keys are all masked
    (every score −inf) has P = 0; a NaN or +inf score makes its row of P NaN (softmax's
    own answer), except at keys the causal mask hides, where P is 0 in every row. dV is
    the IEEE product Pᵀ·dO over every query row, so a non-finite dO meets P = 0 as
    0·inf = NaN, also at the keys that blocks after the causal diagonal skip.
    """
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = h // hkv
    acc = _acc(q.dtype)
    qf = q.to(acc).view(b, hkv, g, lq, d)
    kt = k.to(acc).transpose(-1, -2)
    do = dout.to(acc).view(b, hkv, g, lq, dout.shape[-1])
    m = additive_mask(mask, lk, acc)
    if m is not None:
        m = m.expand(m.shape[0], m.shape[1], lq, lk)
        m = m.view(m.shape[0], hkv, g, lq, lk) if m.shape[1] == h else m.unsqueeze(2)
    dv = None
    rows = max(1, min(lq, _BLOCK_ELEMENTS // max(1, b * h * lk)))
    for s in range(0, lq, rows):
        e = min(lq, s + rows)
        kend = min(lk, e) if causal else lk  # causal: keys after the block's last row are never seen
        n = e - s
        scores = torch.matmul(qf[:, :, :, s:e].reshape(b, hkv, g * n, d), kt[..., :kend]) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.view(b, hkv, g, n, kend)
        if m is not None:
            scores = scores + m[:, :, :, s:e, :kend]
        if causal:
            later = torch.arange(kend, device=q.device) > torch.arange(s, e, device=q.device).unsqueeze(1)
            scores = scores.masked_fill(later, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        # all keys masked (the row's max is -inf; a NaN row's is NaN): no contribution, where
        # softmax gives NaN; causal hidden keys: 0 in every row, NaN rows included. One fill
        # for both (the reduction reads the scores once, no full-size boolean of their own)
        zero = scores.amax(-1, keepdim=True) == float("-inf")
        p = p.masked_fill(later | zero if causal else zero, 0.0)
        p = p.view(b, hkv, g * n, kend)
        dob = do[:, :, :, s:e]
        part = torch.matmul(p.transpose(-1, -2), dob.reshape(b, hkv, g * n, -1))
        if kend < lk:  # out of place (vmap and double backward record it)
            # keys no row of the block sees: Σ 0·dO over the block's rows (0, or NaN where
            # a dO is not finite), as the full product gives
            tail = (dob * 0.0).sum((2, 3)).unsqueeze(2).expand(b, hkv, lk - kend, part.shape[-1])
            part = torch.cat([part, tail.to(part.dtype)], dim=2)
        dv = part if dv is None else dv + part
    return dv


# --------------------------------------------------------------- attention (AttnLRP, full)

def attention_backward_reference(q, k, v, dout, mask, scaling: float, softcap: Optional[float], causal: bool):
    """The gradient of softmax attention ``O = softmax(s·q kᵀ [softcap] + mask) · V`` with
    respect to q, k and v, recomputed in blocks of query rows (never seq × seq at once).

    This is the attention core's backward under AttnLRP (Achtibat et al., ICML 2024): its
    softmax rule (Prop. 3.1) is the softmax's own gradient in gradient × input form, and
    the uniform rule's ½ on each bilinear product (Eq. 12) is applied at the q/k/v
    projections, not here. Per block, with full key rows at hand:
    ``dV = Pᵀ·dO``, ``dP = dO·Vᵀ``, ``dT = P ⊙ (dP − Σⱼ P ⊙ dP)``, ``dS = dT ⊙ (1 − tanh²(s/c))``
    under a softcap c, ``dq = s · dS·K``, ``dk = s · dSᵀ·Q``; query heads of a key/value
    head (GQA) are summed into its dk and dv.

    Args:
        q (Tensor[batch, heads, q_len, head_dim]), k (Tensor[batch, kv_heads, kv_len, head_dim]),
        v (Tensor[batch, kv_heads, kv_len, v_dim]): the attention's states (any float dtype).
        dout (Tensor[batch, heads, q_len, v_dim]): the gradient of the attention output.
        mask, scaling, softcap, causal: as for :func:`attention_dv_reference`.

    Returns:
        ``(dq, dk, dv)`` shaped like q, k, v, in float32 (float64 for float64 inputs).

    Edge values: a query row whose keys are all masked has P = 0 and gets dq = 0; keys the
    causal mask hides get nothing unless dO or V holds a value that is not finite (then
    every key is computed, and 0·inf gives NaN as the full product does).
    """
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = h // hkv
    dvd = v.shape[-1]
    acc = _acc(q.dtype)
    qf = q.to(acc).view(b, hkv, g, lq, d)
    kf, vf = k.to(acc), v.to(acc)
    do = dout.to(acc).view(b, hkv, g, lq, dvd)
    m = additive_mask(mask, lk, acc)
    if m is not None:
        m = m.expand(m.shape[0], m.shape[1], lq, lk)
        m = m.view(m.shape[0], hkv, g, lq, lk) if m.shape[1] == h else m.unsqueeze(2)
    cut = causal and bool(torch.isfinite(do).all()) and bool(torch.isfinite(vf).all())
    dq_parts, dk, dv = [], None, None
    rows = max(1, min(lq, _BLOCK_ELEMENTS // max(1, b * h * lk)))
    for s in range(0, lq, rows):
        e = min(lq, s + rows)
        n = e - s
        kend = min(lk, e) if cut else lk
        qb = qf[:, :, :, s:e].reshape(b, hkv, g * n, d)
        raw = torch.matmul(qb, kf[:, :, :kend].transpose(-1, -2)) * scaling
        t = None
        if softcap is not None:
            t = torch.tanh(raw / softcap)
            raw = t * softcap
        scores = raw.view(b, hkv, g, n, kend)
        if m is not None:
            scores = scores + m[:, :, :, s:e, :kend]
        hidden = None
        if causal:
            hidden = torch.arange(kend, device=q.device) > torch.arange(s, e, device=q.device).unsqueeze(1)
            scores = scores.masked_fill(hidden, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        zero = scores.amax(-1, keepdim=True) == float("-inf")
        p = p.masked_fill(hidden | zero if causal else zero, 0.0)
        dob = do[:, :, :, s:e]
        dp = torch.matmul(dob, vf[:, :, :kend].transpose(-1, -2).unsqueeze(2))
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        if t is not None:
            ds = ds * (1 - t * t).view(b, hkv, g, n, kend)
        ds = ds * scaling
        dq_parts.append(torch.matmul(ds, kf[:, :, :kend].unsqueeze(2)))
        dk_part = torch.matmul(ds.reshape(b, hkv, g * n, kend).transpose(-1, -2), qb)
        dv_part = torch.matmul(p.reshape(b, hkv, g * n, kend).transpose(-1, -2), dob.reshape(b, hkv, g * n, dvd))
        if kend < lk:  # out of place: vmap records it
            dk_part = torch.cat([dk_part, dk_part.new_zeros(b, hkv, lk - kend, d)], dim=2)
            dv_part = torch.cat([dv_part, dv_part.new_zeros(b, hkv, lk - kend, dvd)], dim=2)
        dk = dk_part if dk is None else dk + dk_part
        dv = dv_part if dv is None else dv + dv_part
    dq = torch.cat(dq_parts, dim=3).view(b, h, lq, d) if dq_parts else qf.new_zeros(b, h, lq, d)
    if dk is None:
        dk, dv = kf.new_zeros(k.shape), vf.new_zeros(v.shape)
    return dq, dk, dv
