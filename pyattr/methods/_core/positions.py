"""Positions as the model numbers them, the position it pools from, and forwards whose
result depends on the batch.

Two facts about a model decide whether a padded row computes what the row computes
alone:

- **its position convention**: Llama-style models and GPT-2 number a sequence's tokens
  ``0, 1, …``; RoBERTa-family embeddings (RoBERTa, XLM-RoBERTa, CamemBERT, MPNet, ESM,
  Longformer, LUKE, …) number them ``padding_idx + 1, padding_idx + 2, …`` and give padding
  ``padding_idx``, reading the pad token from the ids. Which one a model follows is
  observed on its own embeddings (:func:`convention`), not read off its source;
- **whether its forward depends on the longest position in the batch**: transformers picks
  dynamic-NTK frequencies and LongRoPE's long or short factors from ``max(position_ids)``
  over the whole batch, so a short row beside a long one is another function.

A third decides what a perturbed input is compared at: **the position a sequence
classifier pools from** (transformers' decoder classifiers read the last token that is not
the pad token, found in the ids), observed on a forward (:func:`observe_pooling`) and kept
on other ids (:func:`keep_pooled`).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

import pyattr.architectures as A
from pyattr.architectures.blocks import observed_positions
import pyattr.methods._core.state as S


def convention(model: nn.Module) -> Tuple[str, int]:
    """``("mask", 0)``: real tokens at ``0, 1, …``; ``("padding_idx", p)``: real tokens at
    ``p + 1, p + 2, …`` and padding at ``p`` (RoBERTa family, MPNet, ESM, Longformer, LUKE,
    …). Observed on the model's own embeddings, run on probe ids holding a pad token
    (:func:`pyattr.architectures.blocks.observed_positions`: the indices its position table
    gets), mapped or not and whether or not the caller opted into ``generic`` (the
    convention decides only how ids are numbered, and numbering them otherwise would change
    the model's own output). Where the embeddings cannot be run on a probe, the table's
    declaration (``Arch.positions``), else the embeddings' source
    (:func:`pyattr.architectures.blocks.padding_idx_embeddings`)."""
    inner = getattr(model, "_orig_mod", model)
    seen = observed_positions(inner)
    if seen is not None:
        return seen
    arch = A.ARCHITECTURES.get(A.model_type(inner))
    emb = A.padding_idx_embeddings(inner)
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


# --------------------------------------------------------------------------- pooled positions


def _outside_base(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` outside its base model (a sequence classifier's ``score``
    head), in registration order; none for a bare base model."""
    model = getattr(model, "_orig_mod", model)
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        return []
    inside = {id(m) for m in base.modules()}
    return [m for m in model.modules() if m is not model and id(m) not in inside]


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class PooledPositions:
    """Where, per row, a model's output was pooled from: :func:`observe_pooling` fills it
    during one forward. ``head`` is the module outside the base model whose per-position
    output (batch, seq, …) the model's output (batch, …) is a row of, ``index``
    (LongTensor[batch]) the position each row's output was taken at (-1 for a row whose
    output is not finite, which cannot be matched); both None when the
    output is not pooled from a per-position head output (a language model's logits, a
    head that pools inside itself at a fixed position)."""

    def __init__(self):
        self.head: Optional[nn.Module] = None
        self.index: Optional[torch.Tensor] = None
        self._outs: List[Tuple[nn.Module, torch.Tensor]] = []

    def read(self, model_output) -> "PooledPositions":
        """Match the recorded head outputs against ``model_output`` (its ``logits``)."""
        pooled = _first_tensor(model_output)
        outs, self._outs = self._outs, []
        if pooled is None or pooled.dim() < 1:
            return self
        for mod, o in reversed(outs):  # the head nearest the output first
            if o.dim() != pooled.dim() + 1 or o.shape[0] != pooled.shape[0] or o.shape[2:] != pooled.shape[1:]:
                continue
            same = (o == pooled[:, None]).reshape(o.shape[0], o.shape[1], -1).all(-1)   # (batch, seq)
            # a row whose output is not finite (NaN) cannot be matched: it keeps whatever the
            # model pools (index -1)
            finite = torch.isfinite(pooled.reshape(pooled.shape[0], -1)).all(-1)
            if not bool(finite.any()) or not bool(same[finite].any(1).all()):
                continue
            several = ((same.sum(1) > 1) & finite).nonzero()
            if several.numel():
                row = int(several[0, 0])
                at = same[row].nonzero()[:, 0].tolist()
                raise ValueError(
                    f"{type(mod).__name__}: the model's output of row {row} is its per-position output at each of "
                    f"positions {at} (they are identical), so the position the model pooled from cannot be told; "
                    "perturbing the input could move it")
            index = same.to(torch.int8).argmax(1)
            self.head, self.index = mod, torch.where(finite, index, torch.full_like(index, -1))
            return self
        return self


@contextlib.contextmanager
def observe_pooling(model: nn.Module):
    """During the block, the output of every module outside the base model is recorded;
    after the forward, ``.read(output)`` of the :class:`PooledPositions` yielded finds the
    head and the position each row was pooled from (what transformers' sequence
    classifiers decide from the ids: the last token that is not the pad token)."""
    got = PooledPositions()
    mods = _outside_base(model)

    def hook(mod, args, out):
        t = out if isinstance(out, torch.Tensor) else None
        if t is not None and t.dim() >= 3:
            got._outs.append((mod, t.detach()))

    handles = [m.register_forward_hook(hook) for m in mods]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def keep_pooled(head: Optional[nn.Module], index: Optional[torch.Tensor]):
    """During the block, ``head``'s per-position output holds at every position what it
    gives at ``index`` (LongTensor[batch], one position per row of the forward; a row at -1
    is left as it is), so that
    wherever the model pools from, it reads that position: the position it pooled from on
    another input (:func:`observe_pooling`). Nothing is installed when ``head`` is None."""
    if head is None or index is None:
        yield
        return

    def hook(mod, args, out):
        if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[0] != index.shape[0]:
            raise ValueError(f"{type(mod).__name__}: its output no longer has one row per input row; cannot keep the "
                             "position the model pooled from")
        at = index.to(out.device)
        rows = torch.arange(out.shape[0], device=out.device)
        kept = out[rows, at.clamp_min(0)].unsqueeze(1).expand_as(out)
        pinned = (at >= 0).reshape(-1, *([1] * (out.dim() - 1)))
        return torch.where(pinned, kept, out)

    h = head.register_forward_hook(hook)
    try:
        yield
    finally:
        h.remove()
