"""Positions as the model numbers them, and forwards whose result depends on the batch.

Two facts about a model decide whether a padded row computes what the row computes
alone:

- **its position convention**: Llama-style models and GPT-2 number a sequence's tokens
  ``0, 1, …``; RoBERTa-family embeddings (RoBERTa, XLM-RoBERTa, CamemBERT, Longformer,
  ESM, …) number them ``padding_idx + 1, padding_idx + 2, …`` and give padding
  ``padding_idx``, reading the pad token from the ids;
- **whether its forward depends on the longest position in the batch**: transformers picks
  dynamic-NTK frequencies and LongRoPE's long or short factors from ``max(position_ids)``
  over the whole batch, so a short row beside a long one is another function.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

import pyattr.architectures as A
import pyattr.methods._core.state as S


def convention(model: nn.Module) -> Tuple[str, int]:
    """``("mask", 0)``: real tokens at ``0, 1, …``; ``("padding_idx", p)``: real tokens at
    ``p + 1, p + 2, …`` and padding at ``p`` (RoBERTa family). The architecture table
    declares it (``Arch.positions``); an unmapped model is recognised structurally, as
    discovery declares it (:func:`pyattr.architectures.discover.padding_idx_embeddings`),
    whether or not the caller opted into ``generic`` (the convention decides only how ids
    are numbered, and numbering them otherwise would change the model's own output)."""
    mt = A.model_type(getattr(model, "_orig_mod", model))
    arch = A.ARCHITECTURES.get(mt)
    emb = A.padding_idx_embeddings(model)
    if (arch is not None and arch.positions == "padding_idx") or (arch is None and emb is not None):
        if emb is None:
            raise ValueError(f"{type(model).__name__}: no embeddings module with a padding_idx was found")
        return "padding_idx", int(emb.padding_idx)
    return "mask", 0


def position_ids(model: nn.Module, mask: torch.Tensor, past: int = 0) -> torch.Tensor:
    """Position ids (batch, seq) of the real tokens of ``mask`` as the row alone gets them,
    after ``past`` cached positions: counted along the mask from the model's first
    position; padding gets the model's pad position (0, or ``padding_idx``)."""
    kind, pad = convention(model)
    m = mask.to(torch.long)
    counted = (m.cumsum(-1) - 1).clamp_min(0)
    if kind == "padding_idx":
        return (counted + pad + 1 + past) * m + pad * (1 - m)
    return (counted + past) * m


# --------------------------------------------------------------------------- batch dependence


def _longrope_limit(module: nn.Module, prefix: str) -> Optional[int]:
    cfg = getattr(module, "config", None)
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if prefix:
        params = params.get(prefix[:-1], {}) if isinstance(params, dict) else {}
    limit = params.get("original_max_position_embeddings") if isinstance(params, dict) else None
    if limit is None:
        limit = getattr(cfg, "original_max_position_embeddings", None)
    return None if limit is None else int(limit)


def batch_features(model: nn.Module) -> List[Tuple[str, Optional[int]]]:
    """The features that make ``model``'s forward depend on the longest position in the
    batch: ``(rope_type, threshold)`` per rotary module and layer type, where the
    threshold is the length above which the frequencies change (None: unknown, every
    length is its own regime). Empty for a model whose rows are independent."""
    found = []
    for m in model.modules():
        for prefix, kind in S._rope_types(m):
            if "dynamic" in kind:
                limit = getattr(m, "original_max_seq_len", None)
                found.append((kind, None if limit is None else int(limit)))
            elif kind == "longrope":
                found.append((kind, _longrope_limit(m, prefix)))
    return found


def depends_on_batch(model: nn.Module) -> bool:
    return bool(batch_features(model))


def regime_keys(model: nn.Module, lengths: List[int]) -> List[tuple]:
    """Per row, what its forward computes with, from its own length (real tokens plus
    cached positions): rows with equal keys give, batched, what each gives alone.

    LongRoPE: whether the length exceeds ``original_max_position_embeddings``; dynamic
    NTK: the original frequencies up to ``max_position_embeddings``, beyond it frequencies
    rescaled for that exact length."""
    feats = batch_features(model)
    keys = []
    for n in lengths:
        key = []
        for kind, limit in feats:
            if limit is None:
                key.append(n)
            elif kind == "longrope":
                key.append(n > limit)
            else:
                key.append(n if n > limit else 0)
        keys.append(tuple(key))
    return keys


def describe(model: nn.Module) -> Optional[str]:
    """One line for a manifest or a note: what makes the forward batch-dependent and how
    rows are grouped; None when rows are independent."""
    feats = batch_features(model)
    if not feats:
        return None
    parts = sorted({f"{kind} (threshold {limit} positions)" for kind, limit in feats})
    return ("forward depends on the longest position in the batch: " + ", ".join(parts)
            + "; rows are grouped so that each group computes what each row computes alone")


def row_lengths(input_ids: torch.Tensor, mask: Optional[torch.Tensor], past: int = 0,
                position_ids: Optional[torch.Tensor] = None) -> List[int]:
    """Per row, the length a rotary embedding reads: ``max(position_ids) + 1`` where the
    ids are given (what transformers reads, over the whole batch), else the real tokens
    under ``mask`` plus ``past`` cached positions."""
    batch = input_ids.shape[0]
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() >= 1:
        pos = position_ids.reshape(position_ids.shape[0], -1) if position_ids.dim() >= 2 else position_ids[None]
        top = [int(v) + 1 for v in pos.max(1).values.tolist()]
        return top * batch if len(top) == 1 and batch > 1 else top
    if mask is None:
        return [input_ids.shape[1] + past] * batch
    return [int(n) + past for n in mask.to(torch.long).sum(1).tolist()]


def groups(model: nn.Module, lengths: List[int]) -> Optional[List[torch.Tensor]]:
    """Row indices (LongTensor, ascending) of each group of rows that can share a forward
    on a batch-dependent model, given each row's length (:func:`row_lengths`), in order
    of first row; None when one forward serves the whole batch (rows independent, or all
    of one regime)."""
    if not depends_on_batch(model):
        return None
    keys = regime_keys(model, lengths)
    order: Dict[tuple, List[int]] = {}
    for i, k in enumerate(keys):
        order.setdefault(k, []).append(i)
    if len(order) == 1:
        return None
    return [torch.tensor(rows, dtype=torch.long) for rows in order.values()]
