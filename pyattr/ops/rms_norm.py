"""RMSNorm with the LN-rule backward (RelP, arXiv 2508.21258; AttnLRP, ICML 2024, Prop. 3.3)."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

import pyattr._function as _function
import pyattr.backends as backends
from pyattr._validation import check_eps, check_float, check_has_hidden, check_norm_param, check_same_device


@_function.second_order_checked
class RMSNormRuleFunction(torch.autograd.Function):
    """Saves ``x`` and ``weight``; r is recomputed in the backward. Inside pyattr's own
    passes (:func:`pyattr._function.first_order_saves`) with no weight gradient asked, it
    saves ``1/r`` per row (float32; float64 for float64) instead of ``x``. Vmappable (the
    batching rule of the backward op gives ``dweight`` per example)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, eps: float, offset: float, native: Optional[Callable]):
        if native is not None:
            return native(x)
        impl = backends.implementation(x.device, "rms_norm")
        return impl.rms_norm_forward(x, weight, eps, offset)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, ctx.eps, ctx.offset, _ = inputs
        ctx.first_order = _function.first_order(weight)
        if ctx.first_order:  # the reference backward's 1/r, computed once here
            from pyattr.backends.reference import _up, rms_norm_rinv

            ctx.save_for_backward(rms_norm_rinv(_up(x), ctx.eps), weight)
        else:
            ctx.save_for_backward(x, weight)

    @staticmethod
    def backward(ctx, dy):
        if ctx.first_order:
            rinv, weight = ctx.saved_tensors
            _function.refuse_create_graph("rms_norm", "1/r")
            d = dy.to(rinv.dtype) * rinv
            dx = d if weight is None else d * (ctx.offset + weight.to(rinv.dtype))
            return dx.to(dy.dtype), None, None, None, None
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        impl = backends.backward_implementation(x.device, "rms_norm")
        dx, dw = impl.rms_norm_backward(x, weight, ctx.eps, ctx.offset, dy, need_w)
        return (dx if need_x else None), dw, None, None, None


def rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    *,
    _native: Optional[Callable] = None,
) -> torch.Tensor:
    """RMSNorm over the last dimension with the LN-rule backward.

    Forward, computed in float32 as Hugging Face does (bit-identical to its modules):
    ``offset == 0`` gives ``w · (x/r).to(dtype)`` (``LlamaRMSNorm``, Mistral, Qwen);
    ``offset != 0`` gives ``((x/r)·(offset + w)).to(dtype)`` (``Gemma2RMSNorm`` with
    ``offset=1.0``), where ``r = sqrt(mean(x²) + eps)``.
    Backward: r is a constant, ``dx = dy·(offset + w)/r``; ``dw = Σ dy·x/r`` is ordinary.

    Args:
        x (Tensor[..., hidden], float16/bfloat16/float32/float64): input.
        weight (Tensor[hidden], optional): scale. Default: None.
        eps (float): finite, >= 0. Default: 1e-6.
        offset (float): added to the weight, 1.0 for Gemma's ``(1 + w)``. Default: 0.0.

    Saved for backward: ``x`` and ``weight``; inside pyattr's own attribution passes, when
    no weight gradient is asked, ``1/r`` per row (float32, float64 for float64) instead of
    ``x`` (such a node refuses a backward with ``create_graph=True``).

    Raises:
        TypeError: non-floating tensors or non-numeric ``eps``/``offset``.
        ValueError: ``weight`` not of shape ``(hidden,)``, tensors on different devices,
            ``eps`` negative or not finite, ``offset`` not finite.
    """
    check_float("x", x)
    check_has_hidden("x", x)
    check_norm_param("weight", weight, x)
    check_same_device(x=x, weight=weight)
    eps = check_eps(eps)
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        raise TypeError(f"offset must be a float, got {type(offset).__name__}")
    if not math.isfinite(offset):
        raise ValueError(f"offset must be finite, got {offset!r}")
    if weight is None and offset != 0.0:
        raise ValueError("offset needs a weight: with weight=None the norm has no scale to offset")
    return _function.apply(RMSNormRuleFunction, x, weight, eps, float(offset), _native)
