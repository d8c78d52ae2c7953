"""LN-rule primitives (AttnLRP, ICML 2024, Prop. 3.3; RelP, arXiv 2508.21258).

The LN-rule treats a normalisation's scale (σ of LayerNorm, r of RMSNorm) as a constant
in the backward, which makes the norm linear in its input along the modified backward.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

import pyattr._function as _function
import pyattr.backends as backends
from pyattr._validation import check_broadcast, check_eps, check_float, check_has_hidden, check_norm_param, check_same_device
from pyattr.backends._vmap import sum_to


@_function.second_order_checked
class LNRuleFunction(torch.autograd.Function):
    """``num / denom`` with no gradient to ``denom``. Saves ``denom`` only. Vmappable."""

    generate_vmap_rule = True

    @staticmethod
    def forward(num: torch.Tensor, denom: Union[torch.Tensor, float]) -> torch.Tensor:
        return num / denom

    @staticmethod
    def setup_context(ctx, inputs, output):
        num, denom = inputs
        if isinstance(denom, torch.Tensor):
            ctx.save_for_backward(denom)
            ctx.denom = None
        else:
            ctx.denom = denom
        ctx.num_shape = num.shape

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        denom = ctx.saved_tensors[0] if ctx.denom is None else ctx.denom
        dnum = sum_to(dy / denom, ctx.num_shape) if ctx.needs_input_grad[0] else None
        return dnum, None


def ln_rule(num: torch.Tensor, denom: Union[torch.Tensor, float]) -> torch.Tensor:
    """``num / denom`` whose backward treats ``denom`` as a constant.

    Write a norm with it as ``ln_rule(x - x.mean(-1, keepdim=True), sigma)``: the forward is
    the native division (bit-identical), the backward is ``d num = dy / denom`` and
    nothing flows into ``denom`` (it may still require grad; it is detached in effect).

    Args:
        num (Tensor, floating): numerator.
        denom (Tensor | float): denominator, broadcastable to ``num``'s shape.

    Raises:
        TypeError: non-floating ``num`` or ``denom``.
        ValueError: tensors on different devices.
    """
    check_float("num", num)
    if isinstance(denom, torch.Tensor):
        check_float("denom", denom)
        check_same_device(num=num, denom=denom)
        check_broadcast("num", num, "denom", denom)
    elif not isinstance(denom, (int, float)) or isinstance(denom, bool):
        raise TypeError(f"denom must be a tensor or a number, got {type(denom).__name__}")
    return _function.apply(LNRuleFunction, num, denom)


def ln_rule_grad(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    norm: str = "layer_norm",
    offset: float = 0.0,
) -> torch.Tensor:
    """The LN-rule input gradient of a norm, as a plain function.

    For library authors who write their own backward: returns ``dx`` given the norm's
    input ``x`` and the incoming gradient ``dy``, through the active backend. Where
    autograd records (grad mode on and an input that requires grad, e.g. inside a
    backward run with ``create_graph=True``) it runs the reference formula, so that the
    result can itself be differentiated.

    * ``norm="layer_norm"``: ``g = dy·w/σ``, ``dx = g − mean(g)``, ``σ = sqrt(var(x) + eps)``.
    * ``norm="rms_norm"``: ``dx = dy·(offset + w)/r``, ``r = sqrt(mean(x²) + eps)``.

    Args:
        dy (Tensor[..., hidden]): incoming gradient, same shape as ``x``.
        x (Tensor[..., hidden]): the norm's input.
        weight (Tensor[hidden], optional): the norm's weight. Default: None (w = 1).
        eps (float): finite, >= 0. Default: 1e-5.
        norm (str): ``"layer_norm"`` or ``"rms_norm"``. Default: ``"layer_norm"``.
        offset (float): RMSNorm weight offset (1.0 for Gemma). Default: 0.0.

    Returns:
        ``dx`` shaped and typed like ``x``.

    Raises:
        TypeError / ValueError: bad dtype, shape, device, ``eps`` or ``norm``.
    """
    check_float("dy", dy)
    check_float("x", x)
    check_has_hidden("x", x)
    if dy.shape != x.shape:
        raise ValueError(f"dy of shape {tuple(dy.shape)} must match x of shape {tuple(x.shape)}")
    check_norm_param("weight", weight, x)
    check_same_device(x=x, dy=dy, weight=weight)
    eps = check_eps(eps)
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise ValueError(f"offset must be a finite float, got {offset!r}")
    if norm not in ("layer_norm", "rms_norm"):
        raise ValueError(f"norm must be 'layer_norm' or 'rms_norm', got {norm!r}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (dy, x, weight)):
        # called where autograd records (a custom backward run with create_graph=True, or
        # plain code on tensors that require grad): the differentiable reference, since
        # the compiled kernels would return a result with no graph behind it
        backends.select(x.device, norm)
        import pyattr.backends.reference as impl
    else:
        impl = backends.implementation(x.device, norm)
    if norm == "layer_norm":
        if offset != 0.0:
            raise ValueError("offset applies to norm='rms_norm' only")
        return impl.layer_norm_backward(x, weight, eps, dy, False, False)[0]
    return impl.rms_norm_backward(x, weight, eps, float(offset), dy, False)[0]
