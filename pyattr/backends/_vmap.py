"""Batching rules of the backward ops (``pyattr::*`` of the extension, ``pyattr_triton::*``
of the Triton backend), so that a kernel never sees a batched tensor and runs once per
batched call instead of once per example.

Two batching mechanisms reach the ops:

* ``torch.vmap`` (functorch), including ``torch.func.vjp``/``grad`` inside it: the rule is
  registered with ``torch.library.register_vmap``.
* ``torch.autograd.grad(..., is_grads_batched=True)``, which runs the backward under
  PyTorch's older vmap (``torch._vmap_internals``, dispatch key ``Batched``). That key
  ignores ``register_vmap`` and loops over the examples one kernel call at a time, so the
  same rule is registered on it as a Python kernel that unwraps the batched tensors at
  the current level, runs the rule and wraps the results back.

The rules (one per op family, shared by both mechanisms and both backends):

* Elementwise ops (``identity_backward``, ``half_backward``, ``gated_backward``): every
  operand gets its batch dimension in front (unbatched ones are expanded), then one
  kernel call on the stacked tensors.
* Norm ops (``layer_norm_backward``, ``rms_norm_backward``): rows are independent, so the
  batch folds into the rows and one kernel call gives ``dx``. ``dweight``/``dbias`` are
  sums over one example's rows; the kernel would sum over every example, so they are
  reduced per example here in float32 (float64 stays float64), from the unbatched saved
  ``x`` without expanding it. A batched weight (``vmap`` over the weights themselves) is
  one kernel call per example.

Anything else (tensors batched at more than one level of the older vmap) runs the
reference formulas, which PyTorch batches itself.

:func:`sum_to` serves the rules' own backwards: ``sum_to_size`` has no batching rule in the
older vmap.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import torch
from torch._C._functorch import is_batchedtensor as _is_batchedtensor

from pyattr.activations import resolve_activation
import pyattr.backends.reference as reference

OPS = ("identity_backward", "half_backward", "gated_backward", "layer_norm_backward", "rms_norm_backward")

_libs: Dict[str, torch.library.Library] = {}  # keeps the older-vmap kernels registered
_registered: set = set()


# --- the rules: (batch size, in_dims, *args) -> (outputs, out_dims) ---------------------

def _front(t: torch.Tensor, bdim: Optional[int], batch: int) -> torch.Tensor:
    """``t`` with its batch dimension first; an unbatched ``t`` is expanded (a view)."""
    if bdim is None:
        return t.expand(batch, *t.shape)
    return t.movedim(bdim, 0)


def _elementwise(op, n_tensors: int, n_out: int):
    def rule(batch, in_dims, *args):
        tensors = [_front(t, d, batch) for t, d in zip(args[:n_tensors], in_dims)]
        out = op(*tensors, *args[n_tensors:])
        return out, (0 if n_out == 1 else (0,) * n_out)

    return rule


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_sum(t: torch.Tensor) -> torch.Tensor:
    """``(batch, ..., hidden)`` summed over every row of each example -> ``(batch, hidden)``."""
    return t if t.dim() == 2 else t.sum(tuple(range(1, t.dim() - 1)))


def _per_example(op, batch, in_dims, args, n_out):
    """One kernel call per example (weights batched): results stacked on dim 0."""
    outs = [op(*[a if d is None else a.select(d, i) for a, d in zip(args, in_dims)]) for i in range(batch)]
    return tuple(torch.stack([o[k] for o in outs]) for k in range(n_out)), (0,) * n_out


def _norm_stats(x, bx, eps, centred: bool):
    """The unbatched-or-batch-first ``x`` in the accumulation dtype and its per-row ``x̂``
    (LayerNorm: ``(x − μ)/σ``; RMSNorm: ``x/r``)."""
    x32 = (x if bx is None else x.movedim(bx, 0)).to(_acc(x.dtype))
    if centred:
        x32 = x32 - x32.mean(-1, keepdim=True)
    return x32 * torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + eps)


def _param_dtype(x, weight):
    return weight.dtype if weight is not None else x.dtype


def _layer_norm(op):
    def rule(batch, in_dims, x, weight, eps, dy, need_dweight, need_dbias):
        bx, bw, _, bdy = in_dims[:4]
        if bw is not None:
            return _per_example(op, batch, in_dims, (x, weight, eps, dy, need_dweight, need_dbias), 3)
        dy_b = _front(dy, bdy, batch)
        dx = op(_front(x, bx, batch), weight, eps, dy_b, False, False)[0]
        dy32 = dy_b.to(x.dtype).to(_acc(x.dtype))  # the kernels read dy in x's dtype
        pdt = _param_dtype(x, weight)
        dw = _row_sum(dy32 * _norm_stats(x, bx, eps, True)).to(pdt) if need_dweight else x.new_empty((0,))
        db = _row_sum(dy32).to(pdt) if need_dbias else x.new_empty((0,))
        return (dx, dw, db), (0, 0 if need_dweight else None, 0 if need_dbias else None)

    return rule


def _rms_norm(op):
    def rule(batch, in_dims, x, weight, eps, offset, dy, need_dweight):
        bx, bw, _, _, bdy = in_dims[:5]
        if bw is not None:
            return _per_example(op, batch, in_dims, (x, weight, eps, offset, dy, need_dweight), 2)
        dy_b = _front(dy, bdy, batch)
        dx = op(_front(x, bx, batch), weight, eps, offset, dy_b, False)[0]
        if not need_dweight:
            return (dx, x.new_empty((0,))), (0, None)
        dy32 = dy_b.to(x.dtype).to(_acc(x.dtype))
        dw = _row_sum(dy32 * _norm_stats(x, bx, eps, False)).to(_param_dtype(x, weight))
        return (dx, dw), (0, 0)

    return rule


_RULES = {
    "identity_backward": lambda op: _elementwise(op, 2, 1),
    "half_backward": lambda op: _elementwise(op, 3, 2),
    "gated_backward": lambda op: _elementwise(op, 3, 2),
    "layer_norm_backward": _layer_norm,
    "rms_norm_backward": _rms_norm,
}


# --- reference formulas with the ops' signatures (the older vmap's nested case) ---------

def _empty_if_none(t, like):
    return like.new_empty((0,)) if t is None else t


def _ref_layer_norm(x, weight, eps, dy, need_dweight, need_dbias):
    dx, dw, db = reference.layer_norm_backward(x, weight, eps, dy.to(x.dtype), need_dweight, need_dbias)
    return dx, _empty_if_none(dw, x), _empty_if_none(db, x)


def _ref_rms_norm(x, weight, eps, offset, dy, need_dweight):
    dx, dw = reference.rms_norm_backward(x, weight, eps, offset, dy.to(x.dtype), need_dweight)
    return dx, _empty_if_none(dw, x)


_REFERENCE: Dict[str, Callable] = {
    "identity_backward": lambda x, dy, act: reference.identity_backward(x, dy, resolve_activation(act)),
    "half_backward": reference.half_backward,
    "gated_backward": lambda g, u, dh, act, identity, half: reference.gated_backward(
        g, u, dh, resolve_activation(act), identity, half),
    "layer_norm_backward": _ref_layer_norm,
    "rms_norm_backward": _ref_rms_norm,
}


# --- the older vmap (``Batched`` key, used by ``is_grads_batched``) ---------------------

def _legacy_key():
    """The older vmap's dispatch key, or None where this torch has no such vmap (its
    batched tensors then never reach the ops and nothing is registered for it)."""
    try:
        key = torch._C._parse_dispatch_key("Batched")
    except (AttributeError, RuntimeError):
        return None
    needed = ("_vmapmode_increment_nesting", "_vmapmode_decrement_nesting")
    if key is None or not all(hasattr(torch._C, n) for n in needed) or not hasattr(torch, "_remove_batch_dim"):
        return None
    return key


_LEGACY_KEY = _legacy_key()


def _legacy_batched(t) -> bool:
    return isinstance(t, torch.Tensor) and torch._C._dispatch_keys(t).has(_LEGACY_KEY)


def _legacy_level() -> int:
    """The innermost level of the older vmap (the one whose batched tensors we are given)."""
    level = torch._C._vmapmode_increment_nesting()
    torch._C._vmapmode_decrement_nesting()
    return level - 1


def batched(t) -> bool:
    """``t`` is batched by either vmap (``torch.vmap`` or ``is_grads_batched``)."""
    return isinstance(t, torch.Tensor) and (_is_batchedtensor(t) or (_LEGACY_KEY is not None and _legacy_batched(t)))


def legacy_physical(t, *shared):
    """``(physical tensor with the batch first, level)`` when ``t`` is batched by the older
    vmap at one level and the ``shared`` tensors are not batched (one value for every
    batch entry, such as a saved statistic); None otherwise. The result goes back with
    ``torch._add_batch_dim(out, 0, level)``."""
    if _LEGACY_KEY is None or not _legacy_batched(t) or any(_legacy_batched(x) for x in shared):
        return None
    level = _legacy_level()
    phys = torch._remove_batch_dim(t, level, 1, 0)
    return None if _legacy_batched(phys) else (phys, level)


def physical_copy(t: torch.Tensor) -> torch.Tensor:
    """A plain detached copy of ``t``; a gradient batched by ``is_grads_batched`` (the
    older vmap) comes out with its batch as a leading dimension, so that it can be kept
    after the batched backward (a batched tensor is only valid inside it)."""
    if _LEGACY_KEY is not None and _legacy_batched(t):
        p = torch._remove_batch_dim(t, _legacy_level(), 1, 0)
        if _legacy_batched(p):
            raise RuntimeError("cannot record a gradient batched at several levels (nested is_grads_batched)")
        return p.detach().clone()
    return t.detach().clone()


def _legacy_kernel(rule: Callable, ref: Callable) -> Callable:
    def kernel(*args):
        level = _legacy_level()
        physical, in_dims = [], []
        for a in args:
            if _legacy_batched(a):
                # the batch dimension of ``level`` goes to dim 0 (batch_size only matters
                # for a tensor that lacks the level, which the check below sends away)
                p = torch._remove_batch_dim(a, level, 1, 0)
                if _legacy_batched(p):  # batched at an outer level as well: nested
                    return ref(*args)
                physical.append(p)
                in_dims.append(0)
            else:
                physical.append(a)
                in_dims.append(None)
        batch = next(p.shape[0] for p, d in zip(physical, in_dims) if d is not None)
        out, out_dims = rule(batch, tuple(in_dims), *physical)
        if isinstance(out, torch.Tensor):
            return out if out_dims is None else torch._add_batch_dim(out, out_dims, level)
        return tuple(o if d is None else torch._add_batch_dim(o, d, level) for o, d in zip(out, out_dims))

    return kernel


# --- registration -----------------------------------------------------------------------

def _functorch_rule(rule: Callable) -> Callable:
    def vmap_rule(info, in_dims, *args):
        return rule(info.batch_size, in_dims, *args)

    return vmap_rule


def register(namespace: str, ops: Sequence[str] = OPS) -> None:
    """Register the batching rules of ``namespace::<op>`` for every op in ``ops``, once,
    with both ``torch.vmap`` and the older vmap of ``is_grads_batched``."""
    if namespace in _registered:
        return
    _registered.add(namespace)
    lib = _libs[namespace] = torch.library.Library(namespace, "FRAGMENT")
    packet = getattr(torch.ops, namespace)
    for name in ops:
        op = getattr(packet, name).default
        rule = _RULES[name](op)
        torch.library.register_vmap(f"{namespace}::{name}", _functorch_rule(rule))
        if _LEGACY_KEY is not None:
            lib.impl(name, _legacy_kernel(rule, _REFERENCE[name]), "Batched")



def sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t.sum_to_size(shape)`` (the same reduction, bit for bit), written with ops that the
    older vmap batches itself: ``sum_to_size`` has no batching rule there and would run
    once per example inside ``is_grads_batched``."""
    if t.shape == shape:
        return t
    lead = t.dim() - len(shape)
    dims = list(range(lead)) + [lead + i for i, n in enumerate(shape) if n == 1 and t.shape[lead + i] != 1]
    return (t.sum(dims, keepdim=True) if dims else t).reshape(shape)
