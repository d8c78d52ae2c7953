"""A method's inputs as the model's kwargs: token ids or pixels, masks, position ids in the
model's own convention, caches, where the input embeddings enter, and row selection."""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch import nn

import pyattr.architectures as A
import pyattr.methods._core.input_checks as IC
import pyattr.methods._core.positions as P
import pyattr.methods._core.readout as R
from pyattr.methods._core.taps import mark_entry_streams
import pyattr.methods._core.state as S
from pyattr.config import RelevanceRules
from pyattr.methods._core.passes import check_grad_mode, check_parameters_usable
from pyattr.methods._core.stacks import refuse_encoder_decoder


def is_pixels(inputs) -> bool:
    if isinstance(inputs, torch.Tensor):  # token ids are (batch, seq) or (seq,): more dims are an image
        return inputs.dim() >= 3
    return isinstance(inputs, Mapping) and "pixel_values" in inputs and inputs.get("input_ids") is None


def normalise_pixels(inputs, attention_mask) -> dict:
    """An image batch (``pixel_values`` of shape (batch, channels, height, width), or a
    single image (channels, height, width), or an image processor's output) → the model's
    kwargs. Images have no padding, so no ``attention_mask``."""
    kwargs = {"pixel_values": inputs} if isinstance(inputs, torch.Tensor) else dict(inputs)
    px = kwargs["pixel_values"]
    if not isinstance(px, torch.Tensor) or not px.is_floating_point():
        raise TypeError("inputs: pixel_values must be a floating tensor of shape (batch, channels, height, width)")
    if px.dim() == 3:
        px = px.unsqueeze(0)
    if px.dim() != 4 or 0 in px.shape:
        raise ValueError(
            f"inputs: pixel_values must have shape (batch, channels, height, width) with no empty dimension, got {tuple(px.shape)}"
        )
    if not bool(torch.isfinite(px).all()):
        raise ValueError("inputs: pixel_values holds NaN or inf")
    if attention_mask is not None or kwargs.get("attention_mask") is not None:
        raise ValueError("attention_mask: image inputs (pixel_values) have no padding; pass no attention_mask")
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    kwargs["pixel_values"] = px
    return kwargs


def normalise_inputs(inputs, attention_mask) -> dict:
    """Token ids or a tokenizer output (+ ``attention_mask``) → the model's kwargs; image
    inputs (floating ``pixel_values``) go to :func:`normalise_pixels`."""
    if is_pixels(inputs):
        return normalise_pixels(inputs, attention_mask)
    if isinstance(inputs, torch.Tensor):
        kwargs = {"input_ids": inputs}
    elif isinstance(inputs, Mapping):
        if "input_ids" not in inputs:
            raise ValueError("inputs: a mapping must contain 'input_ids' (token inputs) or 'pixel_values' (images)")
        kwargs = dict(inputs)
    else:
        raise TypeError(
            "inputs must be token ids (a LongTensor, or a list of ints or of rows of ints), a floating pixel_values "
            f"tensor or a mapping, got {type(inputs).__name__}"
        )
    ids = kwargs["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            "inputs: input_ids must be an integer tensor of shape (batch, seq)"
            + (f", got {ids.dtype} (images go in as pixel_values of shape (batch, channels, height, width))"
               if isinstance(ids, torch.Tensor) else ""))
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(
            f"inputs: input_ids must have shape (batch, seq) with batch > 0 and seq > 0, got {tuple(ids.shape)}"
        )
    kwargs["input_ids"] = ids
    # a tokenizer or collator may hand over None for absent inputs
    for key in [k for k, v in kwargs.items() if v is None]:
        del kwargs[key]
    _check_state_batch(kwargs, ids.shape[0])
    _check_position_ids(kwargs, ids)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a tensor of shape (batch, seq), got {type(mask).__name__}")
        if mask.dim() == 1:
            mask = mask.unsqueeze(0)
        past = S.cache_length(kwargs)
        if past and mask.shape == ids.shape:
            raise ValueError(
                f"attention_mask of shape {tuple(mask.shape)} covers the new tokens only, but the inputs hold a "
                f"key/value cache of {past} positions: transformers reads a mask over the cached and the new tokens, "
                f"shape ({ids.shape[0]}, {past + ids.shape[1]}); pass that mask (ones where the cache holds real "
                "tokens), or no mask")
        if mask.shape != ids.shape and not (past and mask.shape == (ids.shape[0], past + ids.shape[1])):
            with_cache = (f" or, with the {past} cached positions, ({ids.shape[0]}, {past + ids.shape[1]})"
                          if past else "")
            raise ValueError(
                f"attention_mask of shape {tuple(mask.shape)} must match input_ids {tuple(ids.shape)}{with_cache}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token), or booleans")
        if bool((new_tokens(mask, ids.shape[1]).sum(1) == 0).any()):
            raise ValueError("attention_mask has a row with no real token (all zeros)"
                             + (" among the new tokens (after the cache)" if mask.shape != ids.shape else ""))
        kwargs["attention_mask"] = mask
    return kwargs


def _check_state_batch(kwargs: dict, batch: int) -> None:
    """A key/value cache holds one row per input row (the model concatenates them)."""
    for key in ("past_key_values", "cache", "cache_params"):
        rows = S.batch_of(kwargs.get(key))
        if rows is not None and rows != batch:
            raise ValueError(
                f"inputs: {key!r} holds a cache of {rows} rows for input_ids of {batch} rows; a cache needs one "
                "row per input row (select or repeat its rows first)")


def _check_position_ids(kwargs: dict, ids: torch.Tensor) -> None:
    pos = kwargs.get("position_ids")
    if pos is None:
        return
    if not isinstance(pos, torch.Tensor) or pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool:
        raise TypeError(f"inputs: position_ids must be an integer tensor of shape (batch, seq), got "
                        f"{pos.dtype if isinstance(pos, torch.Tensor) else type(pos).__name__}")
    batch, seq = ids.shape
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2 or pos.shape[1] != seq or pos.shape[0] not in (1, batch):
        raise ValueError(f"inputs: position_ids of shape {tuple(kwargs['position_ids'].shape)} must be "
                         f"({batch}, {seq}) or (1, {seq}), like input_ids {tuple(ids.shape)}")
    kwargs["position_ids"] = pos


def new_tokens(mask: Optional[torch.Tensor], seq: int) -> Optional[torch.Tensor]:
    """The part of an attention mask over the input ids: with a key/value cache, Hugging
    Face masks span the cached positions too, (batch, past + seq)."""
    return mask if mask is None or mask.shape[-1] == seq else mask[:, -seq:]


def accepts(model: nn.Module, name: str, by_name: bool = False) -> bool:
    """``model.forward`` takes ``name``; unless ``by_name``, a ``**kwargs`` counts too."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper forwards (*args, **kwargs)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or (not by_name and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()))


def _has_sliding_window(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return False
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return True
    return bool(getattr(cfg, "sliding_window", None)) and getattr(cfg, "use_sliding_window", True) is not False


def padding_positions(model: nn.Module, kwargs: dict) -> dict:
    """Position ids that make a padded row equal to the same row alone.

    Hugging Face models build positions with ``arange(seq)`` whatever the mask, so a row
    left-padded by ``p`` tokens would see its tokens at positions ``p, p+1, …``: a different
    input for absolute position embeddings (GPT-2, BERT) and for sliding windows. As
    ``generate`` does, the real tokens get the positions the row alone gets, counted along
    the mask in the model's own convention (:func:`pyattr.methods._core.positions.position_ids`: from 0,
    or from ``padding_idx + 1`` for the RoBERTa family); pad positions get the model's pad
    position (they are masked out and never attended to). Explicit ids are passed

    - where a row has padding before a real token (arange would shift it);
    - always for models that number positions from the ids (RoBERTa family), so that a
      forward on other ids (``baseline="pad"``) keeps the input's positions;
    - always, with a mask, for models whose forward depends on the longest position in
      the batch (dynamic-NTK, LongRoPE), which read ``max(position_ids)``.

    Ids the caller passes are kept.
    """
    mask = kwargs.get("attention_mask")
    past = S.cache_length(kwargs)
    kind, _ = P.convention(model)
    if mask is None:
        if kind != "padding_idx" or past or "position_ids" in kwargs or not accepts(model, "position_ids", by_name=True):
            return kwargs
        ids = kwargs["input_ids"]
        return {**kwargs, "position_ids": P.position_ids(model, torch.ones_like(ids))}
    m = mask.to(torch.long)
    # padding between real tokens: a sliding window counts raw positions, so a gap would
    # change which tokens a query sees
    first = m.argmax(1)
    last = m.shape[1] - 1 - m.flip(1).argmax(1)
    gaps = (m.sum(1) != last - first + 1)
    if bool(gaps.any()) and _has_sliding_window(model):
        row = int(gaps.nonzero()[0, 0])
        raise ValueError(
            f"attention_mask row {row} has padding between real tokens; {type(model).__name__} uses "
            "sliding-window attention over raw positions, so that row would not equal the row alone. "
            "Pad on the left or on the right only."
        )
    if "position_ids" in kwargs:
        return kwargs
    seq = kwargs["input_ids"].shape[1]
    if m.shape[1] != seq:  # the mask spans the cache: count along all of it
        pos = P.position_ids(model, m)[:, -seq:]
        if bool((m == 0).any()) and not accepts(model, "position_ids", by_name=True):
            raise ValueError(
                f"attention_mask pads the cached positions, but {type(model).__name__}.forward takes no position_ids, "
                "so the new tokens would see shifted positions")
        return {**kwargs, "position_ids": pos} if bool((m == 0).any()) or P.depends_on_batch(model) else kwargs
    pos = P.position_ids(model, m, past)
    always = kind == "padding_idx" or P.depends_on_batch(model)
    # no row has padding before a real token: arange numbers every real token as alone
    aligned = torch.equal((m.cumsum(-1) - 1).clamp_min(0) * m, torch.arange(m.shape[1], device=m.device).expand_as(m) * m)
    if aligned and not always:
        return kwargs
    if not accepts(model, "position_ids", by_name=True):
        if not aligned:
            raise ValueError(
                f"attention_mask pads some rows on the left, but {type(model).__name__}.forward takes no "
                "position_ids, so those rows would see shifted positions and a different result than "
                "alone; pad on the right, or pass inputs the model can position itself"
            )
        return kwargs
    return {**kwargs, "position_ids": pos}


@dataclass
class Prepared:
    """A checked call: the model's kwargs and where the input embeddings enter.

    ``input_ids`` is the token layout (batch, seq) every target and method reads. For
    image inputs it is a stand-in of -1s, one per token the vision transformer makes
    ([CLS] first, then the patches row by row), and ``patch_grid`` is (rows, cols)."""

    kwargs: dict
    input_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    entry: nn.Module
    where: str  # "input": the module's first tensor argument; "output": its output
    patch_grid: Optional[tuple] = None


def _vision_config(model: nn.Module):
    cfg = getattr(model, "config", None)
    return getattr(cfg, "vision_config", None) or cfg


def patch_grid(model: nn.Module, pixel_values: torch.Tensor, caller: str, generic: bool = False):
    """(rows, cols) of patches a ViT-style model cuts ``pixel_values`` into (a vision entry
    of the table, or with ``generic`` a discovered one)."""
    cfg = _vision_config(model)
    p = getattr(cfg, "patch_size", None)
    arch = A.arch_of(model, generic)
    if arch is not None and p is not None:
        A.require(arch, "vision", model, f"{caller}(): pixel_values inputs")
    if p is None or arch is None or not arch.vision:
        hint = "" if p is None or generic else ", or pass generic=True to read an unmapped one off its module graph"
        raise ValueError(
            f"{caller}(): inputs are pixel_values, but {type(model).__name__} (model type "
            f"{A.model_type(model)!r}) is not a supported vision transformer; image inputs are "
            f"supported for {sorted(A.VISION)}{hint}"
        )
    ph, pw = (p, p) if isinstance(p, int) else tuple(p)
    h, w = pixel_values.shape[-2:]
    channels = getattr(cfg, "num_channels", pixel_values.shape[1])
    if pixel_values.shape[1] != channels:
        raise ValueError(f"inputs: pixel_values has {pixel_values.shape[1]} channels, the model expects {channels}")
    if h < ph or w < pw:
        raise ValueError(f"inputs: pixel_values of {h}×{w} is smaller than one {ph}×{pw} patch")
    return h // ph, w // pw


def prepare(model: nn.Module, inputs, attention_mask, caller: str, generic: bool = False,
            name: str = "inputs") -> Prepared:
    check_grad_mode(caller)
    refuse_encoder_decoder(model, caller)
    kwargs = normalise_inputs(inputs, attention_mask)
    entry, where = entry_module(model, generic)
    check_parameters_usable(model, caller)
    # inputs made under inference_mode elsewhere cannot enter a graph; small copies can
    kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) and v.is_inference() else v) for k, v in kwargs.items()}
    if "pixel_values" in kwargs and "input_ids" not in kwargs:
        px = kwargs["pixel_values"]
        rows, cols = patch_grid(model, px, caller, generic)
        layout = torch.full((px.shape[0], 1 + rows * cols), -1, dtype=torch.long, device=px.device)
        return Prepared(kwargs, layout, None, entry, where, (rows, cols))
    IC.refuse_media_with_tokens(model, kwargs, caller)
    kwargs = padding_positions(model, kwargs)
    R.check_model_forward(model, new_tokens(kwargs.get("attention_mask"), kwargs["input_ids"].shape[1]), caller)
    A.refuse_padded_streams(model, kwargs.get("attention_mask"), "attention_mask", caller)
    if "use_cache" not in kwargs and accepts(model, "use_cache", by_name=True):
        # a key/value cache is never read by an attribution pass: not building one saves a
        # copy of every layer's keys and values
        kwargs["use_cache"] = False
    ids = kwargs["input_ids"]
    check_token_ids(model, ids, name)
    IC.check_token_types(model, kwargs)
    IC.warn_padding_without_mask(model, kwargs, name, caller)
    kwargs = _fit_positions(model, kwargs)
    check_length(model, _read_lengths(model, kwargs), name)
    return Prepared(kwargs, ids, new_tokens(kwargs.get("attention_mask"), ids.shape[1]), entry, where)


def check_token_ids(model: nn.Module, ids: torch.Tensor, name: str = "inputs") -> None:
    """Token ids the input embedding has rows for, else a ValueError naming them (an id
    past the table failed deep inside the model with ``IndexError: index out of range``)."""
    emb = A.input_embeddings(model)
    rows = getattr(emb, "num_embeddings", None)
    if not isinstance(rows, int):
        rows = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(rows, int) or ids.numel() == 0 or ids.is_floating_point():
        return
    bad = (ids < 0) | (ids >= rows)
    if bool(bad.any()):
        raise ValueError(f"{name}: token ids must be in [0, {rows}) (the input embedding's rows, config.vocab_size), "
                         f"got {sorted(set(ids[bad].tolist()))[:5]}")


def _rope_extension(cfg) -> Optional[int]:
    """The length a scaled rotary embedding is configured for (YaRN, linear, Llama 3,
    LongRoPE): ``factor`` × the original context, where the config names a factor."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    sets = [v for v in params.values() if isinstance(v, dict)] or [params]  # per layer type, or one
    best = None
    for ps in sets:
        factor = ps.get("factor")
        if ps.get("rope_type", ps.get("type")) in (None, "default") or not isinstance(factor, (int, float)):
            continue
        base = ps.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None) \
            or getattr(cfg, "max_position_embeddings", None)
        if isinstance(base, int) and factor > 1:
            best = max(best or 0, int(base * factor))
    return best


def max_positions(model: nn.Module) -> Optional[int]:
    """The longest input (real tokens plus cached positions) the model's position
    embeddings allow, from its config (``max_position_embeddings`` / ``n_positions``):
    ``padding_idx + 1`` fewer for the RoBERTa family, whose positions start there; for a
    scaled rotary embedding the longer of that and ``factor`` × the original context (a
    YaRN-extended Qwen 2.5 keeps ``max_position_embeddings`` at the original 32k); None where
    the config names no limit, and for dynamic-NTK RoPE (its frequencies are rescaled
    beyond ``max_position_embeddings``, which is what it is for)."""
    if any("dynamic" in kind for kind, _ in P.batch_features(model)):
        return None
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            kind, pad = P.convention(model)
            if kind == "padding_idx":
                return v - pad - 1
            return max(v, _rope_extension(cfg) or 0)
    return None


def _read_lengths(model: nn.Module, kwargs: dict) -> list:
    """Per row, the positions the model reads: counted from the position ids it is given
    (from ``padding_idx + 1`` in the RoBERTa family), else every column plus the cache (a
    forward without position ids numbers the columns, padding included), else, for a
    model that numbers positions from the ids itself, its real tokens."""
    ids = kwargs["input_ids"]
    past = S.cache_length(kwargs)
    kind, pad = P.convention(model)
    pos = kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.numel():
        top = pos.reshape(-1, pos.shape[-1]).max(-1).values + 1 - (pad + 1 if kind == "padding_idx" else 0)
        top = top.tolist()
        return top * ids.shape[0] if len(top) == 1 else top
    mask = kwargs.get("attention_mask")
    if kind == "padding_idx" and mask is not None:
        m = torch.as_tensor(mask)
        return [int(n) for n in m.reshape(m.shape[0], -1).to(torch.long).sum(1).tolist()]
    return [ids.shape[1] + past] * ids.shape[0]


def _fit_positions(model: nn.Module, kwargs: dict) -> dict:
    """Right padding past the position table with real tokens inside it: position ids
    counted along the mask (padding at the pad position), so the pad columns read no
    position the table lacks and each row gets what it gets alone."""
    limit = max_positions(model)
    mask = kwargs.get("attention_mask")
    if limit is None or mask is None or "position_ids" in kwargs or not accepts(model, "position_ids", by_name=True):
        return kwargs
    if max(_read_lengths(model, kwargs)) <= limit or mask.shape[-1] != kwargs["input_ids"].shape[1]:
        return kwargs
    return {**kwargs, "position_ids": P.position_ids(model, mask, S.cache_length(kwargs))}


def check_length(model: nn.Module, lengths, name: str = "inputs", what: str = "") -> None:
    """A ValueError naming the longest row and the model's limit (:func:`max_positions`)
    when some row reads more positions than the model has (past it, GPT-2 and BERT fail
    deep inside with an IndexError or a tensor-size error, and rotary models return
    numbers for positions they were never trained on). ``what`` describes the count (e.g.
    "prompt + max_new_tokens")."""
    limit = max_positions(model)
    lengths = list(lengths)
    if limit is None or not lengths:
        return
    longest = max(lengths)
    if longest > limit:
        row = lengths.index(longest)
        detail = f" ({what})" if what else ""
        raise ValueError(f"{name}: row {row} is {longest} positions long{detail}; {type(model).__name__} reads at "
                         f"most {limit} (config.max_position_embeddings / n_positions)")


def input_device(model: nn.Module) -> torch.device:
    """Where token ids go: the input embedding's device. Under an accelerate hook (a
    ``device_map`` or ``cpu_offload``) that is the hook's execution device, since the
    weight itself may sit on ``meta`` between calls."""
    emb = A.input_embeddings(model)
    dev = getattr(getattr(emb, "_hf_hook", None), "execution_device", None)
    if dev is not None:
        return torch.device(dev)
    for t in (emb.parameters() if emb is not None else ()):
        if t.device.type != "meta":
            return t.device
    for t in model.parameters():
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def entry_module(model: nn.Module, generic: bool = False):
    """``(module, "input" | "output")``: where the residual stream enters the first block,
    by the entry the model's architecture declares (the table's, or with ``generic`` the
    discovered one of an unmapped model); else the input embeddings' output."""
    arch = A.arch_of(model, generic)
    if arch is not None and arch.entry is not None:
        path, _ = arch.entry
        mod = A.get_submodule(model, A.join(A.base_prefix(model), path))
        if mod is not None:
            mark_entry_streams(model, arch, mod)
            return mod, "input"
    if arch is not None and arch.refusal("entry") is not None and A.model_type(model) not in A.ARCHITECTURES:
        # discovery declared no entry: the raw word embeddings are not where the residual
        # stream starts (position embeddings added later would act as biases)
        A.require(arch, "entry", model, "inputs")
    emb = A.input_embeddings(model)  # None on a vision backbone without token embeddings (ResNet, …)
    if not isinstance(emb, nn.Module):
        raise ValueError(f"inputs: cannot find where the input embeddings enter {type(model).__name__}: it has no "
                         "input embeddings (get_input_embeddings) and no entry the architecture table or structural "
                         "discovery declares")
    return emb, "output"


def entry_not_reached(model: nn.Module, prep) -> ValueError:
    """The refusal when the module where relevance is read never ran in the forward (an
    entry read off the graph that the model's forward does not take)."""
    name = next((n for n, m in model.named_modules() if m is prep.entry), "?")
    return ValueError(f"inputs: the entry {name!r} ({type(prep.entry).__name__}, its {prep.where}) where relevance is "
                      f"read was not reached during {type(model).__name__}'s forward pass, so no relevance can be "
                      "read there")


def rule_defaults(rules: Optional[RelevanceRules]) -> RelevanceRules:
    if rules is not None and not isinstance(rules, RelevanceRules):
        raise TypeError("rules must be a RelevanceRules or one of 'all', 'attnlrp', 'ln', 'none', got "
                        f"{type(rules).__name__}")
    return RelevanceRules.all() if rules is None else rules


def check_count(name: str, value, allow_none: bool = True) -> Optional[int]:
    """A count ≥ 1: Python, NumPy or 0-d tensor integers (``operator.index``), not bools."""
    if value is None and allow_none:
        return None
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < 1:
        raise ValueError(f"{name} must be an int ≥ 1, got {value!r}")
    return n


def select_rows(prep: "Prepared", idx: torch.Tensor) -> "Prepared":
    """The call restricted (or repeated) to rows ``idx``: every per-row kwarg is indexed."""
    batch = prep.input_ids.shape[0]
    kw = {k: (S.select(k, v, idx, batch) if S.is_state(v) else
              v[idx.to(v.device)] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch else v)
          for k, v in prep.kwargs.items()}
    ids = kw["input_ids"] if "input_ids" in kw else prep.input_ids[idx.to(prep.input_ids.device)]
    return Prepared(kw, ids, new_tokens(kw.get("attention_mask"), ids.shape[1]), prep.entry, prep.where, prep.patch_grid)
