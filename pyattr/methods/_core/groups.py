"""Rows run in groups where the model's forward depends on its batch.

On a model whose forward reads the longest position in the batch (dynamic-NTK RoPE,
LongRoPE: :mod:`pyattr.methods._core.positions`), a method's rows are split into groups of one regime
each, every group runs as its own call, and the results are put back in row order. Each
row then gets what it gets alone.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch
from torch import nn

import pyattr.methods._core.positions as P
import pyattr.methods._core.state as S


def row_groups(model: nn.Module, prep) -> Optional[List[torch.Tensor]]:
    """Groups of row indices of the prepared call ``prep`` (None: one call serves all)."""
    if prep.patch_grid is not None:
        return None
    if not P.depends_on_batch(model):
        return None
    full = prep.kwargs.get("attention_mask")
    if full is not None and full.shape[-1] != prep.input_ids.shape[1]:  # the mask spans the cache too
        lengths = P.row_lengths(prep.input_ids, full, 0, prep.kwargs.get("position_ids"))
    else:
        lengths = P.row_lengths(prep.input_ids, prep.attention_mask, S.cache_length(prep.kwargs),
                                prep.kwargs.get("position_ids"))
    return P.groups(model, lengths)


def rows_of(value, idx: torch.Tensor, batch: int, dim: int = 0):
    """``value`` restricted to rows ``idx`` along ``dim`` when it has ``batch`` rows there
    (a tensor argument such as a baseline or ``grad_outputs``); anything else as is."""
    if isinstance(value, torch.Tensor) and value.dim() > dim and value.shape[dim] == batch:
        return value.index_select(dim, idx.to(value.device))
    return value


def scatter(parts: Sequence[Optional[torch.Tensor]], groups: Sequence[torch.Tensor], batch: int, dim: int):
    """The tensors of each group put back at their rows along ``dim`` (None stays None)."""
    if parts[0] is None:
        return None
    first = parts[0]
    if first.dim() <= dim:
        raise ValueError(
            "target: a scalar target (one value for the whole batch) cannot be computed by row groups, and this "
            "model's forward depends on the batch (dynamic-NTK / LongRoPE); give one value per row"
        )
    shape = list(first.shape)
    shape[dim] = batch
    out = first.new_zeros(shape)
    for t, idx in zip(parts, groups):
        out.index_copy_(dim, idx.to(out.device), t)
    return out


def merge(parts: list, groups: Sequence[torch.Tensor], batch: int, dims: dict):
    """One result of the same dataclass as ``parts``: each field named in ``dims`` is
    scattered along its row dimension; the others are taken from the first part."""
    fields = {}
    for f in dataclasses.fields(parts[0]):
        values = [getattr(p, f.name) for p in parts]
        fields[f.name] = scatter(values, groups, batch, dims[f.name]) if f.name in dims else values[0]
    return type(parts[0])(**fields)
