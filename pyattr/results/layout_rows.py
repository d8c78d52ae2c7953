"""The batch rows (and target sets) a view draws, and the pieces every layout writes in its
panel titles: shared by :mod:`pyattr.results.layouts` and
:mod:`pyattr.results.seq2seq_layouts`."""

from __future__ import annotations

from typing import List, Optional

import torch

from pyattr.results.panels import Note

MAX_ROWS = 8


def _left_out(shown: int, total: int, what: str = "rows") -> List:
    """A note where the view draws fewer than all: ``[]`` otherwise."""
    if shown >= total:
        return []
    return [Note(f"the first {shown} of {total} {what} are drawn; to_pandas() and the tensors hold all {total}")]


def _take(items: list, limit: Optional[int]) -> list:
    return items if limit is None else items[:limit]


def _labels(result, row: int, seq: int) -> List[Optional[str]]:
    toks = getattr(result, "tokens", None)
    if toks is not None and row < len(toks) and len(toks[row]) == seq:
        return list(toks[row])
    return [f"#{i}" for i in range(seq)]


def _target_word(result, k: Optional[int], row: int) -> str:
    words = getattr(result, "target_tokens", None)
    ids = getattr(result, "target_ids", None)
    try:
        if words is not None:
            w = words[k][row] if k is not None else words[row]
            return f" {w!r}"
        if ids is not None:
            i = ids[k, row] if k is not None else ids[row] if ids.dim() else ids
            return f" (id {int(i)})"
    except (IndexError, TypeError):
        pass
    return ""


def _value(t: Optional[torch.Tensor], k, row) -> Optional[float]:
    if t is None:
        return None
    t = t[k] if k is not None and t.dim() > 1 else t
    return float(t[row]) if t.dim() else float(t)


def _rows_k(values: torch.Tensor, base_dim: int):
    """``(k or None, row)`` pairs of a per-token tensor with ``base_dim`` dims (k leading)."""
    ks = [None] if values.dim() == base_dim else list(range(values.shape[0]))
    batch = values.shape[-base_dim]
    return [(k, r) for k in ks for r in range(batch)]


def _what(values: torch.Tensor, base_dim: int) -> str:
    return "rows" if values.dim() == base_dim else "(target set, row) pairs"
