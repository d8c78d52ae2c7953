"""Input checks, done once in Python before dispatch; kernels assume checked inputs."""

from __future__ import annotations

import math
from typing import Optional

import torch

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOATING:
        raise TypeError(
            f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {t.dtype}"
        )


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    present = [(n, t) for n, t in tensors.items() if t is not None]
    if len(present) < 2:
        return
    n0, t0 = present[0]
    d0 = t0.device
    for n, t in present[1:]:
        if t.device != d0:
            raise ValueError(
                f"{n} is on {t.device} but {n0} is on {t0.device}; all tensors must be on one device"
            )


def check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if torch.compiler.is_compiling():  # a symbolic float while tracing; eager checks it
        return eps
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    return eps


def check_norm_param(name: str, p: Optional[torch.Tensor], x: torch.Tensor) -> None:
    if p is None:
        return
    check_float(name, p)
    hidden = x.shape[-1] if x.dim() > 0 else None
    if p.dim() != 1 or p.shape[0] != hidden:
        raise ValueError(
            f"{name} must have shape (hidden_size,) = ({hidden},) to match x of shape "
            f"{tuple(x.shape)}, got {tuple(p.shape)}"
        )


def check_has_hidden(name: str, x: torch.Tensor) -> None:
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension (..., hidden_size), got a scalar")


def check_broadcast(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    try:
        torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        raise ValueError(
            f"{name_a} of shape {tuple(a.shape)} and {name_b} of shape {tuple(b.shape)} do not broadcast"
        ) from None


def refuse_meta_model(model, caller: str) -> None:
    """A model whose parameters are on the meta device (shapes without values) and not
    offloaded (accelerate's ``_hf_hook`` loads them per module): ValueError naming it, before
    a kernel's ``.item()`` fails."""
    params, modules = getattr(model, "parameters", None), getattr(model, "modules", None)
    if not callable(params) or not any(p.is_meta for p in params()):
        return
    if callable(modules) and any(hasattr(m, "_hf_hook") for m in modules()):
        return
    raise ValueError(f"model: {caller} runs the model, and {type(model).__name__}'s parameters are on the meta "
                     "device (shapes without values); load its weights first (from_pretrained, "
                     "load_state_dict(..., assign=True), or for an nnsight LanguageModel, which loads lazily, "
                     "dispatch=True or .dispatch())")


def refuse_meta(model, arguments: dict, caller: str) -> None:
    """:func:`refuse_meta_model`, and a tensor argument on the meta device: ValueError naming
    the argument."""
    refuse_meta_model(model, caller)
    for name, value in arguments.items():
        tensors = value.values() if isinstance(value, dict) else [value]
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors):
            raise ValueError(f"{name}: a tensor on the meta device (shapes without values); pass it on the "
                             "model's device")
