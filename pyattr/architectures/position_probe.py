"""Where a model's positions start, observed: its own embeddings module run on probe ids
holding the pad token, with the indices that reach each position table read by a hook
(:func:`observed_positions`); from its source only where it cannot be run
(:func:`padding_idx_embeddings`). Real tokens at ``0, 1, …`` (``"mask"``) or at
``padding_idx + 1, …`` with padding at ``padding_idx`` (the RoBERTa family, MPNet, ESM,
Longformer, LUKE, …)."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from pyattr._module_state import kept_state
from pyattr.architectures.paths import input_embeddings

from pyattr.architectures.forms import flat_body


def padding_idx_embeddings(model: nn.Module) -> Optional[nn.Module]:
    """The embeddings module that numbers positions from ``padding_idx + 1`` by its source:
    a module with an int ``padding_idx`` whose forward calls
    ``create_position_ids_from_input_ids``, as a method (RoBERTa, XLM-R, CamemBERT, X-MOD,
    data2vec-text) or as the module-level helper (MPNet, ESM, Longformer, LUKE, I-BERT).
    Only the fallback of :func:`observed_positions`, for a model whose embeddings cannot be
    run on a probe."""
    for m in model.modules():
        if not isinstance(getattr(m, "padding_idx", None), int) or isinstance(m, nn.Embedding):
            continue
        body = flat_body(type(m).forward) or ""
        if callable(getattr(m, "create_position_ids_from_input_ids", None)) or \
                "create_position_ids_from_input_ids(" in body:
            return m
    return None


# --------------------------------------------------------------------------- positions, observed


class _Seen(Exception):
    """Raised from the probe's hook once every position table has been called: the rest of
    the forward is not needed."""


#: model -> (what the observation depends on, its result); weak, so a model can be freed
_OBSERVED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")


@contextlib.contextmanager
def _own_hooks_only(modules):
    """During the block, the forward hooks registered on ``modules`` are set aside (a
    caller's taps, a ``once`` replacement among them, must not fire on a probe); hooks
    registered inside the block are dropped on exit."""
    saved = [(m, {k: getattr(m, k) for k in _HOOK_DICTS if hasattr(m, k)}) for m in modules]
    try:
        for m, d in saved:
            for k, v in d.items():
                setattr(m, k, type(v)())
        yield
    finally:
        for m, d in saved:
            for k, v in d.items():
                setattr(m, k, v)


def _takes(mod: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(mod.forward).parameters
    except (TypeError, ValueError):
        return False


def _pad_candidates(model: nn.Module, owner: nn.Module, emb: nn.Module, tables) -> List[int]:
    """Token ids that may be the one the embeddings read padding from: the ``padding_idx``
    of the embeddings module, of the word and position tables, and ``config.pad_token_id``."""
    cfg = getattr(model, "config", None)
    pad = getattr(cfg, "pad_token_id", None)
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    rows = getattr(emb, "num_embeddings", None)
    found: List[int] = []
    for v in [getattr(owner, "padding_idx", None), getattr(emb, "padding_idx", None), pad,
              *(getattr(t, "padding_idx", None) for t in tables)]:
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and (not isinstance(rows, int) or v < rows) \
                and v not in found:
            found.append(v)
    return found


def _numbered_from_pad(seen: torch.Tensor, probe: torch.Tensor, pad: int) -> Optional[int]:
    """``q`` when ``seen`` (the indices a position table got) numbers the real tokens of
    ``probe`` ``q + 1, q + 2, …`` along the row and gives its pad tokens ``q``, else None."""
    if not isinstance(seen, torch.Tensor) or seen.is_floating_point() or seen.shape[-1] != probe.shape[-1]:
        return None
    rows = seen.reshape(-1, probe.shape[-1]).to(torch.long).cpu()
    real = probe[0] != pad
    q = rows[0, ~real]
    if not q.numel() or not bool((q == q[0]).all()):
        return None
    q0 = int(q[0])
    want = torch.where(real, real.to(torch.long).cumsum(0) + q0, torch.full(real.shape, q0, dtype=torch.long))
    return q0 if bool((rows == want).all()) else None


def _probe(owner: nn.Module, tables, kwargs: dict) -> List[torch.Tensor]:
    """The first input of each position table during ``owner(**kwargs)`` (no gradient, no
    other hook firing), the forward stopped once every table has been called."""
    seen: Dict[int, torch.Tensor] = {}

    def pre(i):
        def hook(mod, args):
            if i not in seen and args and isinstance(args[0], torch.Tensor):
                seen[i] = args[0].detach().clone()
            if len(seen) == len(tables):
                raise _Seen
        return hook

    with torch.no_grad(), kept_state(owner), _own_hooks_only(list(owner.modules())):
        for i, t in enumerate(tables):
            t.register_forward_pre_hook(pre(i))
        try:
            owner(**kwargs)
        except _Seen:
            pass
    return [seen.get(i) for i in range(len(tables))]


def observed_positions(model: nn.Module) -> Optional[Tuple[str, int]]:
    """How the model numbers positions, read off its own embeddings run on probe ids:
    ``("padding_idx", p)`` where a position table gets ``p + 1, p + 2, …`` for the real
    tokens and ``p`` for the pad tokens (the RoBERTa family, MPNet, ESM, Longformer, LUKE,
    X-MOD, data2vec-text, …, whatever their source calls to number them); ``("mask", 0)``
    otherwise (``0, 1, …`` whatever the ids; rotary and relative models, which have no
    position table, are not run). None where the probe cannot run (the embeddings need
    other inputs, the weights are not loaded): the caller falls back on the declared
    convention.

    The probe: the module holding the input embeddings (``get_input_embeddings()``) is
    called on ids with each candidate pad token (:func:`_pad_candidates`) at two places,
    a hook on every other table under it (an ``nn.Embedding``, a module with a
    ``padding_idx`` or named ``*Embedding``: I-BERT's ``QuantEmbedding``, a rotary module)
    recording the indices it gets, the forward stopped once each has been called (no other
    hook fires meanwhile; the result is kept per model). For a ``padding_idx`` model, ids
    passed as ``position_ids`` must reach the table as given (pyattr passes them so that a
    padded row and a pad baseline keep the row's own positions): ValueError when they do
    not."""
    model = getattr(model, "_orig_mod", model)
    emb = input_embeddings(model)
    if not isinstance(emb, nn.Module):
        return None
    owner = next((m for m in model.modules() if any(c is emb for c in m.children())), None)
    if owner is None:
        return None
    tables = [m for m in owner.modules() if m is not emb and m is not owner and (
        isinstance(m, nn.Embedding) or isinstance(getattr(m, "padding_idx", None), int)
        or type(m).__name__.endswith("Embedding"))]
    cands = _pad_candidates(model, owner, emb, tables)
    key = (id(emb), id(owner), tuple(id(t) for t in tables), tuple(cands))
    hit = _OBSERVED.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    result = _observe(owner, emb, tables, cands)
    _OBSERVED[model] = (key, result)
    return result


def _observe(owner: nn.Module, emb: nn.Module, tables, cands) -> Optional[Tuple[str, int]]:
    if not tables or not cands:
        return "mask", 0  # no position table, or no pad token the ids could number from
    w = getattr(emb, "weight", None)
    device = w.device if isinstance(w, torch.Tensor) and w.device.type != "meta" else torch.device("cpu")
    rows = getattr(emb, "num_embeddings", None) or (max(cands) + 2)
    other = next((i for i in range(rows) if i not in cands), None)
    if other is None:
        return None
    # what the model's own forward passes beside the ids when the caller gives none (LUKE's
    # embeddings fail without token_type_ids)
    defaults = [(k, v) for k, v in (("attention_mask", 1), ("token_type_ids", 0)) if _takes(owner, k)]
    for c in cands:
        # pad tokens inside and at the end; the real tokens all one id, so that token ids
        # themselves (a table fed the ids, BART's) never look numbered
        probe = torch.tensor([[other, other, c, other, other, c]], device=device)
        extra = {k: torch.full_like(probe, v) for k, v in defaults}
        try:
            seen = _probe(owner, tables, {"input_ids": probe, **extra})
        except Exception:  # noqa: BLE001 - embeddings that need other inputs cannot be probed
            return None
        for t, s in zip(tables, seen):
            q = _numbered_from_pad(s, probe.cpu(), c)
            if q is None:
                continue
            if _takes(owner, "position_ids"):
                given = torch.tensor([[q + 4, q + 1, q, q + 2, q + 3, q]], device=device)
                try:
                    back = _probe(owner, [t], {"input_ids": probe, "position_ids": given, **extra})[0]
                except Exception:  # noqa: BLE001
                    return None
                if back is None or back.reshape(-1, 6)[0].tolist() != given[0].tolist():
                    raise ValueError(
                        f"{type(owner).__name__} numbers positions from the pad token {c} (the real tokens from "
                        f"{q + 1}, padding at {q}), but position_ids passed to it reach its position table as "
                        f"{None if back is None else back.reshape(-1, 6)[0].tolist()}, not as given "
                        f"{given[0].tolist()}: pyattr cannot give a padded row, or a pad baseline, the row's own "
                        "positions")
            return "padding_idx", q
    return "mask", 0
