"""State a forward changes: the caller's mutable inputs (key/value caches) and the
model's own batch-dependent rotary state (dynamic-NTK RoPE).

Every method runs several forwards on one call's inputs (the input, a baseline, the
integration steps, the corrupt run, chunks of rows). Hugging Face models append to a
cache they are handed, even with ``use_cache=False``, and dynamic-NTK RoPE rewrites its
frequencies from the longest position it has seen. Replayed as given, each later forward
would see the earlier forwards' keys and frequencies. Here each forward gets its own copy
of the caller's state, rows are selected in that copy, and the rotary modules start every
forward from their pretrained state and are left as the caller had them.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, List, Optional

import torch
from torch import nn

#: values that a forward cannot change in place (tensors are never written by the models;
#: their storage is shared, not copied)
_IMMUTABLE = (torch.Tensor, bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def is_state(value: Any) -> bool:
    """``value`` is a model input a forward may change in place: a Hugging Face ``Cache``
    (``past_key_values`` / ``cache``, Mamba's ``cache_params``), or any other object that
    is not a tensor or a plain immutable value (a legacy tuple-of-tuples cache included,
    whose copy costs nothing more than the tuples)."""
    return not isinstance(value, _IMMUTABLE)


def _tensors_in(value: Any, found: dict, depth: int = 0) -> None:
    """Every tensor reachable from ``value`` through attributes, sequences and mappings."""
    if depth > 6:
        return
    if isinstance(value, torch.Tensor):
        found[id(value)] = value
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors_in(v, found, depth + 1)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, found, depth + 1)
    elif hasattr(value, "__dict__") and not isinstance(value, (type, nn.Module)):
        for v in vars(value).values():
            _tensors_in(v, found, depth + 1)


def _copy(key: str, value: Any) -> Any:
    # a cache built with autograd on holds non-leaf tensors, which deepcopy refuses; the
    # copy takes them detached (a forward never differentiates through the caller's cache)
    found: dict = {}
    _tensors_in(value, found)
    memo = {i: t.detach().clone() for i, t in found.items() if t.requires_grad}
    try:
        return copy.deepcopy(value, memo)
    except Exception as e:  # noqa: BLE001 - any failure means the object cannot be replayed safely
        raise ValueError(
            f"inputs: {key!r} is a {type(value).__name__} that a forward may change in place, and pyattr cannot "
            f"copy it ({type(e).__name__}: {e}); every forward of the method would see what the earlier ones "
            "left in it. Pass a state that copy.deepcopy can copy, or leave it out"
        ) from e


def fresh(kwargs: dict) -> dict:
    """The model's kwargs for one forward: each mutable input (:func:`is_state`) replaced
    by a deep copy, so the forward sees the caller's state exactly as given and leaves the
    caller's object as it was. Tensors are passed as they are."""
    if not any(is_state(v) for v in kwargs.values()):
        return kwargs
    return {k: (_copy(k, v) if is_state(v) else v) for k, v in kwargs.items()}


def batch_of(value: Any) -> Optional[int]:
    """Rows of a key/value cache (None: no cache, or an empty one)."""
    if value is None or isinstance(value, _IMMUTABLE):
        return None
    return _first_batch(value)


def _first_batch(value: Any) -> Optional[int]:
    """Leading size of the first tensor inside ``value`` (its batch)."""
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() else None
    layers = getattr(value, "layers", None)
    if isinstance(layers, (list, tuple)):
        for layer in layers:
            for name in ("keys", "values", "conv_states", "recurrent_states"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor) and t.dim():
                    return t.shape[0]
    if isinstance(value, (list, tuple)):
        for v in value:
            b = _first_batch(v)
            if b is not None:
                return b
    if isinstance(value, dict):
        for v in value.values():
            b = _first_batch(v)
            if b is not None:
                return b
    return None


def _index(value: Any, idx: torch.Tensor, batch: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[idx.to(value.device)] if value.dim() and value.shape[0] == batch else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_index(v, idx, batch) for v in value)
    if isinstance(value, list):
        return [_index(v, idx, batch) for v in value]
    if isinstance(value, dict):
        return {k: _index(v, idx, batch) for k, v in value.items()}
    return value


def select(key: str, value: Any, idx: torch.Tensor, batch: int) -> Any:
    """A copy of the mutable input ``value`` restricted (or repeated) to rows ``idx`` of a
    batch of ``batch`` rows. A state whose batch is not ``batch`` (a cache of one row
    broadcast by the model) is copied whole.

    Raises:
        ValueError: a state of ``batch`` rows that pyattr cannot split by rows.
    """
    if _first_batch(value) != batch:
        return _copy(key, value)
    if hasattr(value, "batch_select_indices"):  # transformers.Cache
        out = _copy(key, value)
        try:
            out.batch_select_indices(idx.to(torch.long))
        except (NotImplementedError, AttributeError, TypeError, RuntimeError) as e:
            raise ValueError(
                f"inputs: {key!r} ({type(value).__name__}) holds {batch} rows that this method must split or "
                f"repeat (chunks, integration steps), and it cannot select rows ({type(e).__name__}: {e}); "
                "pass one row at a time"
            ) from e
        return out
    if isinstance(value, (tuple, list, dict)):
        return _index(value, idx, batch)
    raise ValueError(
        f"inputs: {key!r} is a {type(value).__name__} of {batch} rows that this method must split or repeat "
        "(chunks, integration steps), and pyattr does not know how to select its rows; pass one row at a time"
    )


def cache_length(kwargs: dict) -> int:
    """Positions already in the caller's key/value cache (0 without one)."""
    for key in ("past_key_values", "cache"):
        value = kwargs.get(key)
        if value is None:
            continue
        get = getattr(value, "get_seq_length", None)
        if callable(get):
            return int(get())
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], (tuple, list)) and value[0]:
            t = value[0][0]
            if isinstance(t, torch.Tensor) and t.dim() >= 3:
                return int(t.shape[-2])
    return 0


# --------------------------------------------------------------------------- rotary state


def _rope_types(module: nn.Module) -> List[tuple]:
    """``(prefix, rope_type)`` of a Hugging Face rotary-embedding module: one entry, or one
    per layer type (Gemma 3, ModernBERT keep a rope type per attention kind)."""
    kind = getattr(module, "rope_type", None)
    if isinstance(kind, str):
        return [("", kind)]
    if isinstance(kind, dict):
        return [(f"{lt}_", str(rt)) for lt, rt in kind.items()]
    return []


def dynamic_rotary(model: nn.Module) -> List[tuple]:
    """``(module, prefix)`` of the rotary embeddings whose frequencies a forward rewrites
    from the longest position it sees and keeps for the next forward (dynamic-NTK)."""
    return [(m, p) for m in model.modules() for p, kind in _rope_types(m)
            if "dynamic" in kind and hasattr(m, f"{p}original_inv_freq")]


def _rewritten_rotary(model: nn.Module) -> List[tuple]:
    """``(module, prefix)`` of every rotary embedding a forward rewrites: dynamic-NTK, and
    LongRoPE (which copies the long or short frequencies into its buffer in place)."""
    return [(m, p) for m in model.modules() for p, kind in _rope_types(m)
            if ("dynamic" in kind or kind == "longrope") and isinstance(getattr(m, f"{p}inv_freq", None), torch.Tensor)]


_ROTARY_ATTRS = ("max_seq_len_cached", "attention_scaling")


def _reset(module: nn.Module, prefix: str) -> None:
    """The pretrained state: original frequencies, nothing cached beyond the original length."""
    original = getattr(module, f"{prefix}original_inv_freq")
    module.register_buffer(f"{prefix}inv_freq", original, persistent=False)
    limit = getattr(module, "original_max_seq_len", None)
    if limit is not None:
        setattr(module, f"{prefix}max_seq_len_cached", limit)


def reset_rotary(model: nn.Module) -> None:
    """Start a forward from the rotary modules' pretrained state (see :func:`keep_rotary_state`)."""
    for module, prefix in dynamic_rotary(model):
        _reset(module, prefix)


@contextlib.contextmanager
def keep_rotary_state(model: nn.Module):
    """The rotary modules a forward rewrites (dynamic-NTK, LongRoPE) are put back as the
    caller had them when the block ends: the same frequency buffer objects holding the
    same values, and the same cached lengths (the forwards inside reset them,
    :func:`reset_rotary`)."""
    saved = []
    for module, prefix in _rewritten_rotary(model):
        key = f"{prefix}inv_freq"
        buf = getattr(module, key)
        attrs = {a: module.__dict__[a] for a in (f"{prefix}{n}" for n in _ROTARY_ATTRS) if a in module.__dict__}
        saved.append((module, key, buf, buf.detach().clone(), attrs))
    try:
        yield
    finally:
        for module, key, buf, values, attrs in saved:
            with torch.no_grad():
                buf.copy_(values)
            module._buffers[key] = buf
            module.__dict__.update(attrs)
