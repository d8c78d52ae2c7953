"""Gated activation ``act(gate) · up`` (SwiGLU, GeGLU) under the Identity- and Half-rules."""

from __future__ import annotations

import torch

import pyattr._function as _function
import pyattr.backends as backends
from pyattr._validation import check_float, check_same_device
from pyattr.activations import Activation, resolve_activation


@_function.second_order_checked
class GatedActivationFunction(torch.autograd.Function):
    """Saves ``gate`` and ``up`` only; ``act(gate)`` and φ are recomputed in the backward.
    Vmappable."""

    generate_vmap_rule = True

    @staticmethod
    def forward(gate, up, act: Activation, identity: bool, half: bool):
        a = act.fn(gate.clone()) if act.kind == "custom" else act.fn(gate)
        return a * up

    @staticmethod
    def native_jacobian(ctx) -> bool:
        """Neither rule on: the backward is the product's own gradient (a second derivative
        through it is exact, :func:`pyattr._function.check_second_order`)."""
        return not (ctx.identity or ctx.half)

    @staticmethod
    def setup_context(ctx, inputs, output):
        gate, up, ctx.act, ctx.identity, ctx.half = inputs
        ctx.save_for_backward(gate, up)

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        impl = backends.backward_implementation(gate.device, "gated")
        dg, du = impl.gated_backward(gate, up, dh, ctx.act, ctx.identity, ctx.half)
        return (
            dg if ctx.needs_input_grad[0] else None,
            du if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
        )


def gated_activation(
    gate: torch.Tensor,
    up: torch.Tensor,
    act="silu",
    identity: bool = True,
    half: bool = True,
    zero_limit: float = 0.5,
) -> torch.Tensor:
    """``h = act(gate) · up`` with the rule backwards of RelP / AttnLRP.

    Backward, with ``s = ½`` under the Half-rule (``half=True``) and 1 otherwise:
    ``d gate = s·dh·up·φ(gate)`` under the Identity-rule (``act'(gate)`` without it) and
    ``d up = s·dh·act(gate)``. Both rules off gives the ordinary gradient.

    Args:
        gate (Tensor[..., intermediate], floating): pre-activation.
        up (Tensor[..., intermediate]): same shape, dtype and device as ``gate``.
        act: activation as in :func:`pyattr.rules.identity_rule`. Default: ``"silu"``.
        identity (bool): Identity-rule on the activation. Default: True.
        half (bool): Half-rule on the product. Default: True.
        zero_limit (float): φ(0) for custom callables. Default: 0.5.

    Returns:
        ``act(gate) * up``, bit-identical to the native expression.

    Saved for backward: ``gate`` and ``up`` (the native autograd graph also keeps
    ``act(gate)``).

    Raises:
        TypeError: non-floating inputs or different dtypes.
        ValueError: shapes differ, devices differ, unknown activation name.
    """
    check_float("gate", gate)
    check_float("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gate of shape {tuple(gate.shape)} and up of shape {tuple(up.shape)} must match")
    if gate.dtype != up.dtype:
        raise TypeError(f"gate ({gate.dtype}) and up ({up.dtype}) must have the same dtype")
    check_same_device(gate=gate, up=up)
    return _function.apply(GatedActivationFunction, gate, up, resolve_activation(act, zero_limit), bool(identity), bool(half))
