"""Half-rule for a product of two inputs (RelP, arXiv 2508.21258; AttnLRP, ICML 2024, Eq. 8).

The forward is ``u · v``; the backward gives each factor half of the relevance:
``du = ½·dy·v``, ``dv = ½·dy·u``, so ``u·du + v·dv == u·v·dy``.
"""

from __future__ import annotations

import torch

import pyattr._function as _function
import pyattr.backends as backends
from pyattr._validation import check_broadcast, check_float, check_same_device
from pyattr.backends._vmap import sum_to


@_function.second_order_checked
class HalfRuleFunction(torch.autograd.Function):
    """Saves ``u`` and ``v`` (each is the other's gradient factor). Vmappable."""

    generate_vmap_rule = True

    @staticmethod
    def forward(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return u * v

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        u, v = ctx.saved_tensors
        impl = backends.backward_implementation(dy.device, "half")
        du, dv = impl.half_backward(u, v, dy)
        # Broadcasting in the forward is undone by summing over the expanded dimensions.
        du = sum_to(du, u.shape) if ctx.needs_input_grad[0] else None
        dv = sum_to(dv, v.shape) if ctx.needs_input_grad[1] else None
        return du, dv


def half_rule(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``u * v`` with the Half-rule backward.

    Args:
        u (Tensor, floating): first factor.
        v (Tensor, floating): second factor; broadcasts with ``u`` as in ``u * v``.

    Returns:
        ``u * v`` (bit-identical), at the broadcast shape.

    Backward: ``du = ½·dy·v``, ``dv = ½·dy·u`` (float32 accumulation), each reduced back
    to its input's shape. Saves ``u`` and ``v``.

    Raises:
        TypeError: a non-floating input.
        ValueError: ``u`` and ``v`` are on different devices or do not broadcast.
    """
    check_float("u", u)
    check_float("v", v)
    check_same_device(u=u, v=v)
    check_broadcast("u", u, "v", v)
    return _function.apply(HalfRuleFunction, u, v)
