"""Frozen attention: the AH-rule's attention core with a backward that does only the rule's work.

Under the AH-rule (RelP, arXiv 2508.21258, §3; AttnLRP, ICML 2024, Prop. 3.1 with the
attention pattern held constant) the softmax pattern ``P = softmax(s · q kᵀ + mask)`` is a
constant of the backward: relevance reaches the values only, ``dV = Pᵀ · dO``, and
nothing reaches q or k. A native attention backward still computes dQ and dK (and
PyTorch's fused SDPA backward always does). :class:`FrozenAttentionFunction` runs the
native attention call as its forward (bit-identical: it *is* that call) and, in the
backward, recomputes P block by block from the saved q and k (a block of query rows
against all keys at a time, never seq × seq at once) and multiplies by dO.

Backends for ``attention_dv``: ``torch`` (the blocked reference in ``pyattr.backends.reference``), ``cpp`` (a fused
CPU kernel: scale, softcap, mask, softmax and ``Pᵀ·dO`` per block of rows, threads over
batch × key/value head), ``triton`` (``kernels/attention.py``: a flash-style dV-only
backward with an online softmax over key blocks).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

import pyattr._function as _function
import pyattr.backends as backends
from pyattr.backends.reference import (  # noqa: F401 (public here too)
    additive_mask,
    attention_backward_reference,
    attention_dv_reference,
)

def check_attention_dv(q: torch.Tensor, k: torch.Tensor, dout: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
    """Shapes: q (batch, heads, q_len, head_dim), k (batch, kv_heads, kv_len, head_dim),
    dout (batch, heads, q_len, v_dim); heads a multiple of kv_heads; mask broadcastable to
    (batch, heads, q_len, ≥ kv_len)."""
    if q.dim() != 4 or k.dim() != 4 or dout.dim() != 4:
        raise ValueError(
            f"attention_dv: q, k and dout must be 4-D (batch, heads, seq, head_dim), got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(dout.shape)}"
        )
    b, h, lq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or h % k.shape[1]:
        raise ValueError(f"attention_dv: k of shape {tuple(k.shape)} does not fit q {tuple(q.shape)} (GQA: heads % kv_heads == 0)")
    if dout.shape[:3] != (b, h, lq):
        raise ValueError(f"attention_dv: dout of shape {tuple(dout.shape)} does not fit q {tuple(q.shape)}")
    if mask is not None:
        if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, h) or \
                mask.shape[2] not in (1, lq) or mask.shape[3] < k.shape[2]:
            raise ValueError(
                f"attention_dv: mask of shape {tuple(mask.shape)} does not broadcast to (batch {b}, heads {h}, "
                f"q_len {lq}, kv_len {k.shape[2]})"
            )


def attention_dv(q, k, dout, mask, scaling: float, softcap: Optional[float], causal: bool) -> torch.Tensor:
    """dV = Pᵀ·dO on the selected backend (:func:`attention_dv_reference` for the
    arguments); the result is in the accumulation dtype (float32, float64 for float64)."""
    check_attention_dv(q, k, dout, mask)
    folded = _fold_targets(q, k, dout, mask, scaling, softcap, causal)
    if folded is not None:
        return folded
    if torch.is_grad_enabled():  # a backward being recorded: the differentiable reference
        backends.select(q.device, "attention")
        return attention_dv_reference(q, k, dout, mask, scaling, softcap, causal)
    impl = backends.implementation(q.device, "attention")
    fn = getattr(impl, "attention_dv", None)
    if fn is None:
        return attention_dv_reference(q, k, dout, mask, scaling, softcap, causal)
    return fn(q, k, dout, mask, scaling, softcap, causal)


def _fold_targets(q, k, dout, mask, scaling, softcap, causal):
    """k targets in one batched backward (``is_grads_batched``): ``dout`` carries the older
    vmap's batch of k gradients while P is the same for all of them, so the k gradients
    go side by side along the value dimension and P is computed once."""
    import pyattr.backends._vmap as _vmap

    found = _vmap.legacy_physical(dout, q, k, mask)
    if found is None:
        return None
    phys, level = found  # (k, batch, heads, q_len, v_dim)
    kb, b, h, lq, dvd = phys.shape
    side = phys.permute(1, 2, 3, 0, 4).reshape(b, h, lq, kb * dvd)
    dv = attention_dv(q, k, side, mask, scaling, softcap, causal)
    dv = dv.view(b, k.shape[1], k.shape[2], kb, dvd).permute(3, 0, 1, 2, 4).contiguous()
    return torch._add_batch_dim(dv, 0, level)


# held: the AH-rule's gradient Pᵀ·dO depends on the input through the pattern, which the rule
# holds constant (q and k detached), so no recorded backward could carry that dependence
@_function.second_order_checked(held=True)
class FrozenAttentionFunction(torch.autograd.Function):
    """The native attention call as forward; ``dV = Pᵀ·dO`` as backward (q and k get none).

    Saves q, k and the mask (not v, not the output, not the pattern). ``native()`` returns
    ``(attn_output (batch, q_len, heads, v_dim), attn_weights or None)``, Hugging Face's
    attention-function convention; so does this function (the weights are a constant of
    the rule: no gradient; an empty tensor when the native call gave None).
    """

    @staticmethod
    def forward(ctx, value, query, key, mask, scaling, softcap, causal, native: Callable):
        out, weights = native()
        if not isinstance(weights, torch.Tensor):
            weights = out.new_empty((0,))
        ctx.mark_non_differentiable(weights)
        ctx.scaling, ctx.softcap, ctx.causal = scaling, softcap, causal
        ctx.save_for_backward(query, key, mask)
        ctx.value_meta = (value.dtype, value.shape)
        return out, weights

    @staticmethod
    def backward(ctx, dout, _dweights):
        query, key, mask = ctx.saved_tensors
        dtype, shape = ctx.value_meta
        do = dout.transpose(1, 2)  # (batch, heads, q_len, v_dim)
        dv = attention_dv(query, key, do, mask, ctx.scaling, ctx.softcap, ctx.causal)
        if dv.shape[2] < shape[2]:  # keys past the queries (sdpa's causal cut): never attended
            dv = torch.cat([dv, dv.new_zeros(*dv.shape[:2], shape[2] - dv.shape[2], dv.shape[3])], dim=2)
        return dv.to(dtype).reshape(shape), None, None, None, None, None, None, None


def held_pattern_output(out, query, key, value, mask, scaling: float, softcap: Optional[float], causal: bool):
    """``out`` (the native call's output, (batch, q_len, heads, v_dim)) with
    :class:`FrozenAttentionFunction`'s gradient in autograd operations, for ``torch.func``
    transforms: ``out`` held, plus ``P·v − (P·v)`` held, which is 0 and carries ``dV = Pᵀ·dO``
    (``query`` and ``key`` come detached). ``P`` is computed as
    :func:`pyattr.backends.reference.attention_dv_reference` computes it, in full (no blocks);
    where ``P·v`` is not finite the difference would not be 0, and there no gradient flows."""
    from pyattr.backends.reference import _acc, additive_mask

    b, h, lq, _ = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    acc = _acc(query.dtype)
    k = key.to(acc).repeat_interleave(h // hkv, dim=1)
    v = value[:, :, :lk].to(acc).repeat_interleave(h // hkv, dim=1)  # keys past the causal cut: never attended
    scores = torch.matmul(query.to(acc), k.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    m = additive_mask(mask, lk, acc)
    if m is not None:
        scores = scores + m
    hidden = None
    if causal:
        hidden = torch.arange(lk, device=scores.device) > torch.arange(lq, device=scores.device).unsqueeze(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    zero = scores.amax(-1, keepdim=True) == float("-inf")
    p = p.masked_fill(zero if hidden is None else hidden | zero, 0.0)
    pv = torch.matmul(p, v)
    delta = (pv - pv.detach()).transpose(1, 2)
    delta = torch.where(torch.isfinite(delta), delta, torch.zeros((), dtype=delta.dtype, device=delta.device))
    return out.detach() + delta.to(out.dtype)


def check_attention_backward(q, k, v, dout, mask) -> None:
    """Shapes: as :func:`check_attention_dv`, and v (batch, kv_heads, kv_len, v_dim) with
    dout's last dimension v_dim."""
    check_attention_dv(q, k, dout, mask)
    if v.dim() != 4 or v.shape[:3] != k.shape[:3] or v.shape[3] != dout.shape[3]:
        raise ValueError(f"attention_backward: v of shape {tuple(v.shape)} does not fit k {tuple(k.shape)} and dout "
                         f"{tuple(dout.shape)}")


def attention_backward(q, k, v, dout, mask, scaling: float, softcap: Optional[float], causal: bool):
    """``(dq, dk, dv)`` of softmax attention on the selected backend
    (:func:`pyattr.backends.reference.attention_backward_reference` for the arguments and
    the math), in the accumulation dtype (float32, float64 for float64)."""
    check_attention_backward(q, k, v, dout, mask)
    import pyattr.backends._vmap as _vmap

    found = _vmap.legacy_physical(dout, q, k, v, mask)
    if found is not None:  # k targets (is_grads_batched): one kernel call per target
        phys, level = found
        parts = [attention_backward(q, k, v, d, mask, scaling, softcap, causal) for d in phys.unbind(0)]
        return tuple(torch._add_batch_dim(torch.stack(t), 0, level) for t in zip(*parts))
    if torch.is_grad_enabled():  # a backward being recorded: the differentiable reference
        backends.select(q.device, "attention")
        return attention_backward_reference(q, k, v, dout, mask, scaling, softcap, causal)
    impl = backends.implementation(q.device, "attention")
    fn = getattr(impl, "attention_backward", None)
    if fn is None:
        return attention_backward_reference(q, k, v, dout, mask, scaling, softcap, causal)
    return fn(q, k, v, dout, mask, scaling, softcap, causal)


class AttnLRPAttentionFunction(torch.autograd.Function):
    """The native attention call as forward; its full gradient, recomputed block by block,
    as backward: AttnLRP's attention core (ICML 2024; the softmax rule of Prop. 3.1 is the
    softmax's own gradient in gradient × input form; the uniform rule's ½ on q·kᵀ and P·v,
    Eq. 12, stays at the q/k/v projections, so the gradient here is the plain one).

    Saves q, k, v and the mask (not the output, not the pattern): a native eager backward
    keeps the (batch, heads, q_len, kv_len) pattern of every layer until the backward,
    this one keeps nothing quadratic. Same convention as :class:`FrozenAttentionFunction`.
    """

    @staticmethod
    def forward(ctx, query, key, value, mask, scaling, softcap, causal, kv_len: int, native: Callable):
        out, weights = native()
        if not isinstance(weights, torch.Tensor):
            weights = out.new_empty((0,))
        ctx.mark_non_differentiable(weights)
        ctx.scaling, ctx.softcap, ctx.causal, ctx.kv_len = scaling, softcap, causal, kv_len
        ctx.save_for_backward(query, key, value, mask)
        return out, weights

    @staticmethod
    def backward(ctx, dout, _dweights):
        query, key, value, mask = ctx.saved_tensors
        n = ctx.kv_len  # sdpa's causal cut: keys past the queries are never attended
        do = dout.transpose(1, 2)  # (batch, heads, q_len, v_dim)
        dq, dk, dv = attention_backward(query, key[:, :, :n], value[:, :, :n], do, mask, ctx.scaling, ctx.softcap,
                                        ctx.causal)
        if n < key.shape[2]:
            dk = torch.cat([dk, dk.new_zeros(*dk.shape[:2], key.shape[2] - n, dk.shape[3])], dim=2)
            dv = torch.cat([dv, dv.new_zeros(*dv.shape[:2], value.shape[2] - n, dv.shape[3])], dim=2)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None, None, None, None
