"""Scaled dot-product attention whose backward skips the query rows that get no gradient.

One target at the last position (a next-token logit) gives the last block's attention output
a gradient in one row only: every other query row's ``dO`` is exactly 0. The native
backward still runs over every (query, key) pair, the largest single cost of a relevance
pass at 16k tokens (about 2.7 s of 22 on 2 CPU cores, 4 layers). :class:`SdpaRowsFunction`
runs the native CPU flash-attention forward (the same kernel ``F.scaled_dot_product_attention``
dispatches to: the output is bit-identical) and keeps its log-sum-exp; its backward finds
the rows of ``dO`` that are not all zero and, where they are at most 1/:data:`SPARSE_SHARE`
of the queries, computes the gradient from those rows alone (FlashAttention-2's backward,
Dao 2023, Algorithm 2, with the pattern of the r rows recomputed from the saved
log-sum-exp):

    P_r  = exp(q_r·kᵀ·scale + mask_r − lse_r)            (r, kv_len)
    dV   = P_rᵀ·dO_r
    dS_r = P_r ⊙ (dO_r·vᵀ − rowsum(dO_r ⊙ O_r))
    dQ_r = dS_r·k·scale   (other rows: 0)
    dK   = dS_rᵀ·q_r·scale

in O(r·kv_len·head_dim) instead of O(q_len·kv_len·head_dim). Otherwise (denser gradients, a
fully masked selected row) it calls the native flash backward on the saved tensors: the
native work, nothing recomputed.

:func:`sparse_rows_sdpa` routes ``torch.nn.functional.scaled_dot_product_attention`` through
it inside a block, for the calls it can take exactly: CPU, float32/float64, no mask or an
additive one of the query's dtype (a boolean mask, which sdpa converts before its kernel,
goes native), no dropout, and only where sdpa
itself would pick its flash kernel (``torch._fused_sdp_choice``), outside ``torch.func``
transforms; every other call, and every call of a thread outside the block, goes to the
function the name held before. (A ``TorchFunctionMode`` around the block sees the routed calls
as the Function's aten ops, not as ``scaled_dot_product_attention``.)
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

#: the sparse backward runs when at most 1/SPARSE_SHARE of the query rows carry gradient
SPARSE_SHARE = 8

_native_sdpa = F.scaled_dot_product_attention
_FLASH = 1  # SDPBackend.FLASH_ATTENTION, as torch._fused_sdp_choice reports it
_forward_op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_backward_op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _takes(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> bool:
    if _forward_op is None or _backward_op is None or not torch.is_grad_enabled():
        return False
    if torch._C._are_functorch_transforms_active():
        return False  # torch.func (grad, vjp, vmap): the native function, which they can transform
    ts = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in ts) or not any(t.requires_grad for t in ts):
        return False
    if any(t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64) or t.dim() != 4 for t in ts):
        return False
    if dropout_p != 0 or not isinstance(is_causal, bool) or (scale is not None and not isinstance(scale, (int, float))):
        return False
    if key.shape[1] != value.shape[1] or (query.shape[1] != key.shape[1]
                                          and not (enable_gqa and query.shape[1] % key.shape[1] == 0)):
        return False
    if attn_mask is not None and (not isinstance(attn_mask, torch.Tensor) or attn_mask.requires_grad
                                  or attn_mask.dtype != query.dtype or attn_mask.device.type != "cpu"):
        return False  # a boolean mask sdpa converts itself before its kernel: native
    try:
        return int(torch._fused_sdp_choice(query, key, value, attn_mask, 0.0, is_causal, scale=scale,
                                           enable_gqa=bool(enable_gqa))) == _FLASH
    except (AttributeError, RuntimeError, TypeError):
        return False


# The name is process-wide; the routing is per thread: ``_routed`` stays installed while any
# thread is inside :func:`sparse_rows_sdpa` and takes only the calls of threads that are.
_local = threading.local()
_lock = threading.Lock()
_state = {"open": 0, "outer": None}  # blocks open in all threads; what the name held before


def _routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if getattr(_local, "depth", 0) and _takes(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        if query.shape[1] != key.shape[1] and not _kernel_groups():
            # grouped-query on a torch whose flash kernel takes one key/value head per query
            # head: each key/value head repeated for its group, as sdpa's enable_gqa does (the
            # same output, bit for bit); the repeat's own backward sums a group's gradients
            n = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(n, dim=1), value.repeat_interleave(n, dim=1)
        return SdpaRowsFunction.apply(query, key, value, attn_mask, is_causal, scale)
    kw = {"enable_gqa": enable_gqa} if enable_gqa else {}
    fn = _state["outer"] or _native_sdpa
    return fn(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)


_groups = []


def _kernel_groups() -> bool:
    """Whether this torch's CPU flash kernels take fewer key/value heads than query heads
    (each serving its group of queries, as ``enable_gqa``), forward and backward: then the
    Function saves the key/value heads themselves, not their copies per query head (at
    Llama-3.2-1B's 32/8 heads, 3/4 of what the saved keys and values would hold). Probed once."""
    if not _groups:
        try:
            q, kv = torch.ones(1, 2, 2, 4), torch.ones(1, 1, 2, 4)
            out, lse = _forward_op(q, kv, kv, 0.0, True)
            dq, dk, dv = _backward_op(torch.ones_like(out), q, kv, kv, out, lse, 0.0, True)
            _groups.append(out.shape == q.shape and dk.shape == kv.shape and dv.shape == kv.shape)
        except (RuntimeError, TypeError, ValueError):
            _groups.append(False)
    return _groups[0]


@contextlib.contextmanager
def sparse_rows_sdpa() -> Iterator[None]:
    """Inside the block, this thread's ``F.scaled_dot_product_attention`` calls that
    :class:`SdpaRowsFunction` can take run through it (the forward is the native one, bit
    for bit); the others, and every call of other threads, reach whatever the name held
    before. The name is put back when the last open block closes, unless something else
    replaced it meanwhile (then that stays)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    with _lock:
        if _state["open"] == 0 and F.scaled_dot_product_attention is not _routed:
            _state["outer"] = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _routed
        _state["open"] += 1
    try:
        yield
    finally:
        _local.depth -= 1
        with _lock:
            _state["open"] -= 1
            if _state["open"] == 0 and F.scaled_dot_product_attention is _routed:
                F.scaled_dot_product_attention = _state["outer"] or _native_sdpa
                _state["outer"] = None


def rows_backward(dout, q, k, v, out, lse, mask: Optional[torch.Tensor], causal: bool, scale: float,
                  rows: torch.Tensor):
    """``(dq, dk, dv)`` from the query rows ``rows`` (1-d indices) of ``dout`` alone (the other
    rows' gradient is 0); accumulation in float32 (float64 for float64). Module docstring."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_r = q[:, :, rows].to(acc)
    do_r = dout[:, :, rows].to(acc)
    n = q.shape[1] // k.shape[1]  # grouped-query: each key/value head serves n query heads
    kk, vv = (t.to(acc) if n == 1 else t.to(acc).repeat_interleave(n, dim=1) for t in (k, v))
    s = torch.matmul(q_r, kk.transpose(-1, -2)) * scale          # (B, H, r, kv_len)
    if mask is not None:
        m = mask if mask.dim() >= 2 else mask.view(1, -1)
        m = m if m.shape[-2] == 1 else m[..., rows, :]  # a query dimension of 1 broadcasts
        s = s + m.to(acc)
    if causal:  # sdpa's is_causal: query i sees keys j ≤ i (top-left aligned)
        j = torch.arange(k.shape[2], device=q.device)
        s = s.masked_fill(j.view(1, 1, 1, -1) > rows.view(1, 1, -1, 1), float("-inf"))
    p = torch.exp(s - lse[:, :, rows].to(acc).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do_r)
    dp = torch.matmul(do_r, vv.transpose(-1, -2))
    delta = (do_r * out[:, :, rows].to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dq[:, :, rows] = torch.matmul(ds, kk) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q_r) * scale
    if n > 1:  # a key/value head's gradient: the sum over the query heads of its group
        dk, dv = (t.unflatten(1, (k.shape[1], n)).sum(2) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _backward(dout, q, k, v, out, lse, mask, causal: bool, scale: Optional[float]):
    sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
    live = (dout != 0).any(-1).any(1).any(0)               # (q_len,): rows with any gradient
    rows = live.nonzero().flatten()
    if rows.numel() * SPARSE_SHARE <= q.shape[2] and bool(torch.isfinite(lse[:, :, rows]).all()):
        return rows_backward(dout, q, k, v, out, lse, mask, causal, sc, rows)
    return _backward_op(dout.contiguous(), q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


class SdpaRowsFunction(torch.autograd.Function):
    """``F.scaled_dot_product_attention`` (CPU flash kernel) whose backward skips query rows
    without gradient; module docstring. Saves q, k, v, the output and its log-sum-exp (what
    the native flash backward saves); grouped-query keys and values one head per group,
    where this torch's kernels take them so (:func:`_kernel_groups`)."""

    @staticmethod
    def forward(ctx, query, key, value, mask, causal: bool, scale: Optional[float]):
        out, lse = _forward_op(query, key, value, 0.0, causal, attn_mask=mask, scale=scale)
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(query, key, value, out, lse, mask)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        if torch.is_grad_enabled():  # a backward being recorded (create_graph): sdpa's math backend,
            # whose backward is differentiable (the flash backward has no derivative)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with torch.enable_grad(), sdpa_kernel([SDPBackend.MATH]):
                gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
                o = _native_sdpa(q, k, v, attn_mask=mask, is_causal=ctx.causal, scale=ctx.scale, **gqa)
                grads = torch.autograd.grad(o, (q, k, v), dout, create_graph=True, allow_unused=True)
            return (*grads, None, None, None)
        import pyattr.backends._vmap as _vmap

        found = _vmap.legacy_physical(dout, q, k, v, out, lse)
        if found is not None:  # k targets (is_grads_batched): one backward per target
            phys, level = found
            parts = [_backward(d, q, k, v, out, lse, mask, ctx.causal, ctx.scale) for d in phys.unbind(0)]
            return (*(torch._add_batch_dim(torch.stack(t), 0, level) for t in zip(*parts)), None, None, None)
        return (*_backward(dout, q, k, v, out, lse, mask, ctx.causal, ctx.scale), None, None, None)
