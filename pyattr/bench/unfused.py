"""The unfused rule composition: each rule written as separate PyTorch ops and small
``autograd.Function``s, the way TransformerLens- and LXT-style code writes them
(re-implemented here from their published formulas). It is the baseline that pyattr's
fused backwards are measured against; it saves ``x`` and ``y`` where a rule needs them."""

from __future__ import annotations

import torch

from pyattr.activations import resolve_activation


class _IdentityUnfused(torch.autograd.Function):
    """dx = dy · y / x, with y = act(x) saved next to x (LXT's implicit identity rule)."""

    @staticmethod
    def forward(ctx, x, y, zero_limit):
        ctx.save_for_backward(x, y)
        ctx.zero_limit = zero_limit
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        x, y = ctx.saved_tensors
        ratio = torch.where(x == 0, torch.full_like(x, ctx.zero_limit), y / x)
        return dy * ratio, None, None


def identity_unfused(x: torch.Tensor, act="silu") -> torch.Tensor:
    a = resolve_activation(act)
    with torch.no_grad():
        y = a.fn(x)
    return _IdentityUnfused.apply(x, y, 0.0 if a.kind == "relu" else 0.5)


class _HalfUnfused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, v):
        ctx.save_for_backward(u, v)
        return u * v

    @staticmethod
    def backward(ctx, dy):
        u, v = ctx.saved_tensors
        return (dy * v) * 0.5, (dy * u) * 0.5


def half_unfused(u, v):
    return _HalfUnfused.apply(u, v)


def gated_unfused(g, u, act="silu"):
    return half_unfused(identity_unfused(g, act), u)


def layer_norm_unfused(x, weight, bias, eps):
    """TransformerLens' LN-rule: the scale is detached, the centring stays in the graph."""
    xc = x - x.mean(-1, keepdim=True)
    scale = (xc.pow(2).mean(-1, keepdim=True) + eps).sqrt().detach()
    y = xc / scale
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def rms_norm_unfused(x, weight, eps, offset=0.0):
    """Hugging Face's RMSNorm with ``rsqrt(...)`` detached."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps).detach()
    n = xf * r
    if weight is None:
        return n.to(x.dtype)
    if offset == 0.0:
        return weight * n.to(x.dtype)
    return (n * (offset + weight.float())).to(x.dtype)
