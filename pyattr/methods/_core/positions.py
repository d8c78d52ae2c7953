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

A third decides what a perturbed input or a ``"pad"`` baseline is compared at: **the
position the model pools from**, where it chooses it from the ids: transformers' decoder
sequence classifiers read their head's output at the last token that is not the pad token;
CLIP's text tower returns as ``pooler_output`` the row of its ``last_hidden_state`` at the
first end-of-text token (``argmax(input_ids)`` with the legacy ``eos_token_id == 2``). Both
are observed on a forward of the unperturbed input (:func:`observe_pooling`: which row of
the head's per-position output the model's output is, which row of ``last_hidden_state``
the ``pooler_output`` is) and kept on other ids (:meth:`PooledPositions.keep`), so that
replacing a token by the pad or eos id does not move them.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

import pyattr.architectures as A
from pyattr.architectures.position_probe import observed_positions
import pyattr.methods._core.readout as R
import pyattr.methods._core.state as S


def convention(model: nn.Module) -> Tuple[str, int]:
    """``("mask", 0)``: real tokens at ``0, 1, …``; ``("padding_idx", p)``: real tokens at
    ``p + 1, p + 2, …`` and padding at ``p`` (RoBERTa family, MPNet, ESM, Longformer, LUKE,
    …). Observed on the model's own embeddings, run on probe ids holding a pad token
    (:func:`pyattr.architectures.position_probe.observed_positions`: the indices its position table
    gets), mapped or not and whether or not the caller opted into ``generic`` (the
    convention decides only how ids are numbered, and numbering them otherwise would change
    the model's own output). Where the embeddings cannot be run on a probe, the table's
    declaration (``Arch.positions``), else the embeddings' source
    (:func:`pyattr.architectures.position_probe.padding_idx_embeddings`)."""
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


def _model_levels(model: nn.Module) -> List[nn.Module]:
    """The model and every model inside it (a transformers ``PreTrainedModel``: a base model,
    a tower such as CLIP's ``text_model``), in registration order: the modules whose output
    can carry a ``pooler_output``."""
    model = getattr(model, "_orig_mod", model)
    return [model] + [m for m in model.modules()
                      if m is not model and hasattr(type(m), "base_model_prefix") and hasattr(m, "config")]


_READS_IDS: Dict[type, bool] = {}


def _reads_ids(mod: nn.Module) -> bool:
    """``mod``'s own forward pools at a token it finds in the ids (CLIP's text tower: the
    first end-of-text token, or ``argmax(input_ids)``): the fail-closed guard where the pooled
    position cannot be observed, read off the source once per class."""
    cls = type(mod)
    if cls not in _READS_IDS:
        _READS_IDS[cls] = bool(R._READS_EOS.search(R._source(cls.forward)))
    return _READS_IDS[cls]


def _pooler_pair(out):
    """``(last_hidden_state, pooler_output)`` of a module output carrying both as tensors
    of shapes (batch, seq, hidden) and (batch, hidden), else None."""
    lhs = getattr(out, "last_hidden_state", None)
    po = getattr(out, "pooler_output", None)
    if (isinstance(lhs, torch.Tensor) and isinstance(po, torch.Tensor) and lhs.dim() == 3 and po.dim() == 2
            and lhs.shape[0] == po.shape[0] and lhs.shape[2] == po.shape[1]):
        return lhs, po
    return None


def _matches(per_position: torch.Tensor, pooled: torch.Tensor):
    """``same`` (batch, seq): position s of row b of ``per_position`` (batch, seq, …) equals
    row b of ``pooled`` (batch, …) exactly; ``finite`` (batch,): row b of ``pooled`` is
    finite; ``copy``: every finite row (and at least one) is found at some position."""
    same = (per_position == pooled[:, None]).reshape(per_position.shape[0], per_position.shape[1], -1).all(-1)
    finite = torch.isfinite(pooled.reshape(pooled.shape[0], -1)).all(-1)
    copy = bool(finite.any()) and bool(same[finite].any(1).all())
    return same, finite, copy


def _one_position(mod: nn.Module, same: torch.Tensor, finite: torch.Tensor, what: str) -> torch.Tensor:
    """The position each finite row was found at (-1 for the others); ValueError where a row
    is found at several (identical) positions, so the one the model chose cannot be told."""
    several = ((same.sum(1) > 1) & finite).nonzero()
    if several.numel():
        row = int(several[0, 0])
        at = same[row].nonzero()[:, 0].tolist()
        raise ValueError(
            f"{type(mod).__name__}: {what} of row {row} is its per-position output at each of positions {at} (they "
            "are identical), so the position the model pooled from cannot be told; replacing token ids could move it")
    index = same.to(torch.int8).argmax(1)
    return torch.where(finite, index, torch.full_like(index, -1))


class PooledPositions:
    """Where, per row, a model's output was pooled from: :func:`observe_pooling` fills it
    during one forward and :meth:`read` reads it after.

    ``head`` is the module outside the base model whose per-position output (batch, seq, …)
    the model's output (batch, …) is a row of, ``index`` (LongTensor[batch]) the position
    each row's output was taken at (-1 for a row whose output is not finite, which cannot be
    matched); both None when the output is not pooled from a per-position head output (a
    language model's logits, a head that pools inside itself at a fixed position).

    ``poolers`` (observed with ``poolers=True``): ``(module, index)`` for each model inside
    the model (CLIP's text tower) whose ``pooler_output`` is, in every row, one row of its own
    ``last_hidden_state``: the position it was taken at (-1 for a non-finite row).
    ``unseen``: the models whose pooled position could not be observed (called more than
    once, an output without ``last_hidden_state`` / ``pooler_output`` of a model whose own
    forward pools at a token it finds in the ids), one line each."""

    def __init__(self):
        self.head: Optional[nn.Module] = None
        self.index: Optional[torch.Tensor] = None
        self.poolers: List[Tuple[nn.Module, torch.Tensor]] = []
        self.unseen: List[str] = []
        self._outs: List[Tuple[nn.Module, torch.Tensor]] = []
        self._calls: Dict[nn.Module, list] = {}

    @property
    def found(self) -> bool:
        """A pooled position was observed (a head's or a pooler's)."""
        return self.head is not None or bool(self.poolers)

    def _head_candidates(self, model_output):
        pooled = _first_tensor(model_output)
        outs, self._outs = self._outs, []
        if pooled is None or pooled.dim() < 1:
            return
        for mod, o in reversed(outs):  # the head nearest the output first
            if o.dim() != pooled.dim() + 1 or o.shape[0] != pooled.shape[0] or o.shape[2:] != pooled.shape[1:]:
                continue
            same, finite, copy = _matches(o, pooled)
            # a row whose output is not finite (NaN) cannot be matched: it keeps whatever the
            # model pools (index -1)
            if copy:
                yield mod, same, finite

    def _pooler_candidates(self):
        calls, self._calls = self._calls, {}
        for mod, got in calls.items():
            pairs = [p for p in got if p is not None]
            matched = [_matches(*p) for p in pairs]
            if len(got) == 1 and matched and matched[0][2]:
                same, finite, _ = matched[0]
                yield mod, same, finite, None
                continue
            if any(m[2] for m in matched) or _reads_ids(mod):
                why = (f"it ran {len(got)} times in one forward" if len(got) > 1 else
                       "its output carries no last_hidden_state and pooler_output to observe it on" if not pairs else
                       "its pooler_output is not a row of its last_hidden_state")
                yield mod, None, None, (f"{type(mod).__name__} pools its output at a token it finds in the ids, and "
                                        f"where it pooled cannot be observed ({why})")

    def read(self, model_output) -> "PooledPositions":
        """Match the recorded head outputs against ``model_output`` (its ``logits``) and each
        recorded ``pooler_output`` against its ``last_hidden_state``; ValueError where a row
        is found at several identical positions."""
        for mod, same, finite in self._head_candidates(model_output):
            self.head, self.index = mod, _one_position(mod, same, finite, "the model's output")
            break
        for mod, same, finite, why in self._pooler_candidates():
            if why is not None:
                self.unseen.append(why)
            else:
                self.poolers.append((mod, _one_position(mod, same, finite, "its pooler_output")))
        return self

    def detect(self, model_output) -> bool:
        """Whether ``model_output`` was pooled at all: it is a row of a head's per-position
        output, or a ``pooler_output`` is a row of its ``last_hidden_state``, at one position or
        several (an all-pad input gives identical rows); or where the model pooled cannot be
        observed. Nothing is raised, nothing kept."""
        heads = any(True for _ in self._head_candidates(model_output))
        poolers = any(True for _ in self._pooler_candidates())
        return heads or poolers

    def refuse_unseen(self, what: str) -> None:
        """ValueError naming ``what`` (the perturbation, the baseline) where a model inside the
        model pools at a token of the ids and where it pooled could not be observed."""
        if self.unseen:
            raise ValueError(
                f"{what} replaces token ids, and {self.unseen[0]}: replacing a token could move the position it pools "
                "from, which pyattr cannot keep. Use a perturbation / baseline that leaves the ids as they are "
                "('zero_embedding', 'mean_embedding'; baseline='zeros' or a tensor)")

    @contextlib.contextmanager
    def keep(self, rows: Optional[torch.Tensor] = None):
        """During the block, every pooled position observed (the head's, each pooler's) is
        kept: the forward of rows ``rows`` of the observed batch (all of them when None) pools
        where the observed forward pooled, whatever its ids."""
        def pick(index):
            return index if rows is None else index[rows.to(index.device)]

        with contextlib.ExitStack() as stack:
            stack.enter_context(keep_pooled(self.head, None if self.index is None else pick(self.index)))
            for mod, index in self.poolers:
                stack.enter_context(keep_pooler(mod, pick(index)))
            yield


@contextlib.contextmanager
def observe_pooling(model: nn.Module, poolers: bool = False):
    """During the block, the output of every module outside the base model is recorded
    (and with ``poolers``, the ``last_hidden_state`` and ``pooler_output`` of every model
    inside the model); after the forward, ``.read(output)`` of the :class:`PooledPositions`
    yielded finds the head and the position each row was pooled from (what transformers'
    sequence classifiers decide from the ids: the last token that is not the pad token),
    and the row of ``last_hidden_state`` each pooler output is (CLIP's text tower: its first
    end-of-text token)."""
    got = PooledPositions()
    mods = _outside_base(model)

    def hook(mod, args, out):
        t = out if isinstance(out, torch.Tensor) else None
        if t is not None and t.dim() >= 3:
            got._outs.append((mod, t.detach()))

    def pooler_hook(mod, args, out):
        pair = _pooler_pair(out)
        got._calls.setdefault(mod, []).append(None if pair is None else tuple(t.detach() for t in pair))

    handles = [m.register_forward_hook(hook) for m in mods]
    if poolers:
        handles += [m.register_forward_hook(pooler_hook) for m in _model_levels(model)]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def keep_pooler(module: nn.Module, index: torch.Tensor):
    """During the block, ``module``'s ``pooler_output`` is the row of its own
    ``last_hidden_state`` at ``index`` (LongTensor[batch]; a row at -1 is left as it is):
    the position it pooled from on another input (:func:`observe_pooling` with
    ``poolers=True``). The output is a new object; what the module computed is not changed
    in place, and what runs after it (a projection: CLIP's ``text_embeds``) reads the kept
    row."""

    def hook(mod, args, out):
        pair = _pooler_pair(out)
        if pair is None or pair[0].shape[0] != index.shape[0]:
            raise ValueError(f"{type(mod).__name__}: its output no longer carries last_hidden_state and pooler_output "
                             "with one row per input row; cannot keep the position it pooled from")
        lhs, po = pair
        at = index.to(lhs.device)
        rows = torch.arange(lhs.shape[0], device=lhs.device)
        kept = torch.where((at >= 0)[:, None], lhs[rows, at.clamp_min(0)], po)
        try:
            new = type(out)(**{**dict(out.items()), "pooler_output": kept})
        except Exception:  # an output class that cannot be rebuilt from its fields
            new = out
            new["pooler_output"] = kept
        return new

    h = module.register_forward_hook(hook)
    try:
        yield
    finally:
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
