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
