"""Which tokens each level of a perturbation curve perturbs, from their relevance
(:func:`pyattr.evaluate.perturbation_curve`, on one stack or an encoder–decoder's source)."""

from __future__ import annotations

import torch


def perturbed_masks(relevance: torch.Tensor, real: torch.Tensor, order: str, steps: int) -> torch.Tensor:
    """Which tokens each level perturbs: BoolTensor[batch, steps + 1, seq].

    Ties in relevance are broken by position (earlier first), so a curve is reproducible."""
    descending = order in ("morf", "insertion")
    key = relevance.double().masked_fill(~real, float("-inf") if descending else float("inf"))
    ranked = torch.sort(key, dim=-1, descending=descending, stable=True).indices
    rank = torch.empty_like(ranked)
    rank.scatter_(-1, ranked, torch.arange(key.shape[-1], device=key.device).expand_as(ranked))
    n = real.sum(-1, keepdim=True).double()                                  # (batch, 1)
    j = torch.arange(steps + 1, device=key.device, dtype=torch.float64)
    counts = torch.floor(j[None, :] * n / steps + 0.5).long()                # (batch, steps + 1)
    first = rank[:, None, :] < counts[:, :, None]                            # (batch, steps + 1, seq)
    first &= real[:, None, :]
    return (real[:, None, :] & ~first) if order == "insertion" else first


def checked_relevance(r, shape, inputs: str = "the inputs", layout: str = "(batch, seq), one value per token"):
    """``r`` detached: a floating tensor of ``shape`` with finite values, else the error
    naming ``relevance`` and what was expected."""
    if tuple(r.shape) != tuple(shape):
        raise ValueError(f"relevance of shape {tuple(r.shape)} does not match {inputs}: expected {tuple(shape)} "
                         f"{layout}")
    if not r.is_floating_point():
        raise TypeError(f"relevance must be a floating tensor, got dtype {r.dtype}")
    if not torch.isfinite(r).all():
        raise ValueError("relevance has non-finite values (NaN or inf); a ranking needs finite values")
    return r.detach()
