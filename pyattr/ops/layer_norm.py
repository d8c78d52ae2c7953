"""LayerNorm with the LN-rule backward (AttnLRP, ICML 2024, Prop. 3.3)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from pyattr import backends
from pyattr._validation import check_eps, check_float, check_has_hidden, check_norm_param, check_same_device


class LayerNormRuleFunction(torch.autograd.Function):
    """Saves ``x`` and ``weight``; μ and σ are recomputed in the backward. Vmappable (the
    batching rule of the backward op gives ``dweight``/``dbias`` per example)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, eps: float, native: Optional[Callable]):
        if native is not None:
            return native(x)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, ctx.eps, _ = inputs
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        impl = backends.backward_implementation(x.device, "layer_norm")
        dx, dw, db = impl.layer_norm_backward(x, weight, ctx.eps, dy, need_w, need_b and ctx.has_bias)
        return (dx if need_x else None), dw, db, None, None


def layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    _native: Optional[Callable] = None,
) -> torch.Tensor:
    """LayerNorm over the last dimension with the LN-rule backward.

    Forward: ``F.layer_norm(x, (hidden,), weight, bias, eps)`` (bit-identical to
    ``nn.LayerNorm``). Backward: σ is a constant and μ stays differentiable,
    ``g = dy·w/σ``, ``dx = g − mean(g)``; ``dw = Σ dy·x̂`` and ``db = Σ dy`` are ordinary.

    Args:
        x (Tensor[..., hidden], float16/bfloat16/float32/float64): input.
        weight (Tensor[hidden], optional): scale. Default: None.
        bias (Tensor[hidden], optional): shift. Default: None.
        eps (float): finite, >= 0. Default: 1e-5.

    Saved for backward: ``x`` and ``weight`` (no per-row statistics; they are recomputed).

    Raises:
        TypeError: non-floating tensors or non-numeric ``eps``.
        ValueError: ``weight``/``bias`` not of shape ``(hidden,)``, tensors on different
            devices, ``eps`` negative or not finite.
    """
    check_float("x", x)
    check_has_hidden("x", x)
    check_norm_param("weight", weight, x)
    check_norm_param("bias", bias, x)
    check_same_device(x=x, weight=weight, bias=bias)
    eps = check_eps(eps)
    return LayerNormRuleFunction.apply(x, weight, bias, eps, _native)
