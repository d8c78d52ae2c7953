"""Norms of unknown classes, recognised by what they compute, for ``generic=True``.

A model without a rule map may carry its own norm class (Cohere's bias-free
``CohereLayerNorm``, OLMo's parameter-free ``OlmoLayerNorm``). Its forward cannot be
replaced by pyattr's fused LN-rule op without risking other bits, so the rule is placed
*beside* the native forward instead:

    y = native(x).detach() + (s(x) − s(x).detach())

where ``s`` is the norm with its scale held constant (``(x − mean)/σ·w`` or ``x/r·w``).
The value is ``native(x) + 0``: the native output, bit for bit (a ``-0.0`` may become
``+0.0``, which ``torch.equal`` counts as equal); the gradient is ``s``'s, the LN-rule's
(RelP, arXiv 2508.21258, and AttnLRP, ICML 2024, Prop. 3.2: the normalising scale is a
constant). The kind of norm and its effective weight are read off the module's outputs
on probe inputs, not off its class name.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn


def _eps(module: nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(module, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return 1e-5


def _normalised(x: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    if kind == "layer_norm":
        c = x - x.mean(-1, keepdim=True)
        return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def classify_norm(module: nn.Module, hidden: int) -> Optional[Tuple[str, torch.Tensor]]:
    """``(kind, weight)`` when ``module`` maps every row x to ``n(x)·w + b`` with ``n`` the
    layer or RMS normalisation over its last dimension (``hidden``), else None.

    Four random rows go through the module without gradient (in its parameters' dtype);
    the per-column weight is fitted from the first two and must predict the others (0.1 %
    in float32 / float64, 5 % in 16-bit dtypes). The weight returned is the module's own
    1-D ``weight`` (plus Gemma's offset of 1 when that is what it computes) if it has one
    of that size, else the fitted one (a parameter-free norm: ones)."""
    p = next((t for t in module.parameters(recurse=False)), None)
    dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
    device = p.device if p is not None and p.device.type != "meta" else torch.device("cpu")
    if device.type == "meta":
        return None
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, hidden, generator=g, dtype=torch.float64) * 2 + 0.3).to(device=device, dtype=dtype)
    try:
        with torch.no_grad():
            y = module(x)
    except Exception:  # noqa: BLE001 - a module that does not take one tensor is not a norm
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    tol = 5e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-3
    xd, yd = x.double(), y.double()
    for kind in ("layer_norm", "rms_norm"):
        n = _normalised(xd, kind, _eps(module))
        dn = n[0] - n[1]
        w = (yd[0] - yd[1]) / torch.where(dn.abs() > 1e-6, dn, torch.ones_like(dn))
        b = yd[0] - n[0] * w
        pred = n * w + b
        if kind == "rms_norm" and b.abs().max() > tol * (yd.abs().max() + 1e-12):
            continue  # an RMS norm has no bias
        if (pred - yd).abs().max() <= tol * (yd.abs().max() + 1e-12):
            own = getattr(module, "weight", None)
            if isinstance(own, torch.Tensor) and own.dim() == 1 and own.shape[0] == hidden:
                for offset in (0.0, 1.0):
                    cand = own.detach().double() + offset
                    if (cand - w).abs().max() <= tol * (w.abs().max() + 1e-12):
                        return kind, (own, offset)
                return None  # a weight of the right size that is not what it multiplies by
            return kind, (None, 0.0)
    return None


def structural_norm_forward(kind: str, weight_spec, eps: float):
    """The make_forward of a norm recognised by :func:`classify_norm`: its own forward's
    value, the LN-rule's gradient (see the module docstring)."""
    own, offset = weight_spec

    def make(module, state):
        native = state.native

        def forward(x, *args, **kwargs):
            y = native(x, *args, **kwargs)
            acc = torch.promote_types(x.dtype, torch.float32)  # float32 at least, float64 kept
            x32 = x.to(acc)
            if kind == "layer_norm":
                c = x32 - x32.mean(-1, keepdim=True)
                s = c * torch.rsqrt(c.detach().pow(2).mean(-1, keepdim=True) + eps)
            else:
                s = x32 * torch.rsqrt(x32.detach().pow(2).mean(-1, keepdim=True) + eps)
            if own is not None:  # not detached: the weight keeps its native gradient n(x)·dy
                s = s * (own.to(acc) + offset)
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor) and bias.shape == s.shape[-1:]:
                s = s + bias.to(acc)
            s = s.to(y.dtype)
            return y.detach() + (s - s.detach())

        return forward

    return make
