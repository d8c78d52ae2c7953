"""``scale_gradient``: identity forward, gradient multiplied by a constant.

Used for the AttnLRP uniform rule on attention's bilinear products (AttnLRP, ICML 2024,
Eq. 7 and Prop. 3.2): each of ``n`` factors of a product receives ``1/n`` of the relevance.
"""

from __future__ import annotations

import math
from typing import Union

import torch

import pyattr._function as _function
from pyattr._validation import check_float, check_same_device
from pyattr.backends._vmap import sum_to


@_function.second_order_checked
class ScaleGradientFunction(torch.autograd.Function):
    """Saves nothing but the (small) scale. Vmappable."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, scale: Union[float, torch.Tensor]) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def native_jacobian(ctx) -> bool:
        """A scale of 1 is the identity's own gradient (:func:`pyattr._function.check_second_order`)."""
        s = ctx.scale
        return bool((s == 1).all()) if isinstance(s, torch.Tensor) else s == 1

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        c = ctx.scale
        if isinstance(c, torch.Tensor):
            # in float32 for 16-bit gradients (float64 stays), as a float scale is: a scale
            # beyond float16's range is not rounded to inf first (0·c stays 0, not NaN)
            acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
            return sum_to((dy.to(acc) * c.to(acc)).to(dy.dtype), dy.shape), None
        return dy * c, None


def scale_gradient(x: torch.Tensor, scale: Union[float, torch.Tensor]) -> torch.Tensor:
    """Return ``x`` unchanged; its gradient becomes ``scale · dy``.

    Args:
        x (Tensor, floating): any shape.
        scale (float | Tensor): a finite number, or a tensor broadcastable to ``x``
            (e.g. a per-column scale of shape ``(hidden,)``) on ``x``'s device.

    Raises:
        TypeError: ``x`` is not floating, or ``scale`` is neither a number nor a tensor.
        ValueError: ``scale`` is not finite, on another device, or does not broadcast to ``x``.
    """
    check_float("x", x)
    if isinstance(scale, torch.Tensor):
        check_float("scale", scale)
        check_same_device(x=x, scale=scale)
        # a data-dependent check: eager only (a traced graph cannot branch on values)
        if not torch.compiler.is_compiling() and not bool(torch.isfinite(scale).all()):
            raise ValueError("scale must be finite")
        try:
            if torch.broadcast_shapes(scale.shape, x.shape) != x.shape:
                raise RuntimeError
        except RuntimeError:
            raise ValueError(
                f"scale of shape {tuple(scale.shape)} does not broadcast to x of shape {tuple(x.shape)}"
            ) from None
        scale = scale.detach()
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        # a traced graph may carry the scale as a symbolic float: eager checks it
        if not torch.compiler.is_compiling() and not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale!r}")
        scale = float(scale)
    else:
        raise TypeError(f"scale must be a float or a tensor, got {type(scale).__name__}")
    return _function.apply(ScaleGradientFunction, x, scale)
