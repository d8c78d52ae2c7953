"""The attribution pass every method shares: input checks, padding positions, the model
state for the pass, where the input embeddings enter, and hooks that read or replace a
module's tensors during the forward."""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import operator
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import torch
from torch import nn

from pyattr import _model_state as S
from pyattr import _positions as P
from pyattr import _readout as R
import pyattr.architectures as A
from pyattr.integration.config import RelevanceRules
from pyattr.integration.errors import RelevanceRuleConflictError
from pyattr.integration.install import _in_backward
from pyattr.integration.checkpoint import CHECKPOINT_INNER, bind_checkpoint
from pyattr.integration.scope import use_relevance_rules


def _is_pixels(inputs) -> bool:
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
    if _is_pixels(inputs):
        return normalise_pixels(inputs, attention_mask)
    if isinstance(inputs, torch.Tensor):
        kwargs = {"input_ids": inputs}
    elif isinstance(inputs, Mapping):
        if "input_ids" not in inputs:
            raise ValueError("inputs: a mapping must contain 'input_ids' (token inputs) or 'pixel_values' (images)")
        kwargs = dict(inputs)
    else:
        raise TypeError(
            f"inputs must be a LongTensor of token ids, a floating pixel_values tensor or a mapping, got {type(inputs).__name__}"
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
    the mask in the model's own convention (:func:`pyattr._positions.position_ids`: from 0,
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
        if kind != "padding_idx" or past or "position_ids" in kwargs or not accepts(model, "position_ids"):
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
        if bool((m == 0).any()) and not accepts(model, "position_ids"):
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
    if not accepts(model, "position_ids"):
        if not aligned:
            raise ValueError(
                f"attention_mask pads some rows on the left, but {type(model).__name__}.forward takes no "
                "position_ids, so those rows would see shifted positions and a different result than "
                "alone; pad on the right, or pass inputs the model can position itself"
            )
        return kwargs
    return {**kwargs, "position_ids": pos}


def check_parameters_usable(model: nn.Module, caller: str) -> None:
    for name, p in model.named_parameters():
        if p.is_inference():
            raise RuntimeError(
                f"{caller}(): parameter {name!r} is an inference tensor (the model was created or "
                "loaded under torch.inference_mode()), and autograd cannot differentiate through it. "
                "Load the model outside inference_mode, or replace its parameters with clones made "
                "outside it."
            )


def check_grad_mode(caller: str) -> None:
    """Every method needs autograd. ``torch.no_grad()`` is overridden for the pass (as
    Captum does); ``torch.inference_mode()`` is refused, because tensors made under it
    (the caller's inputs, cached weights) can never enter a graph."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{caller}() cannot run under torch.inference_mode(): attribution needs autograd, and "
            "tensors created in inference mode cannot be recorded for backward. Call it outside "
            "the inference_mode block (torch.no_grad() is fine: the pass enables autograd for itself)."
        )


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


def patch_grid(model: nn.Module, pixel_values: torch.Tensor, caller: str):
    """(rows, cols) of patches a ViT-style model cuts ``pixel_values`` into."""
    cfg = _vision_config(model)
    p = getattr(cfg, "patch_size", None)
    if p is None or A.model_type(model) not in A.VISION:
        raise ValueError(
            f"{caller}(): inputs are pixel_values, but {type(model).__name__} (model type "
            f"{A.model_type(model)!r}) is not a supported vision transformer; image inputs are "
            f"supported for {sorted(A.VISION)}"
        )
    ph, pw = (p, p) if isinstance(p, int) else tuple(p)
    h, w = pixel_values.shape[-2:]
    channels = getattr(cfg, "num_channels", pixel_values.shape[1])
    if pixel_values.shape[1] != channels:
        raise ValueError(f"inputs: pixel_values has {pixel_values.shape[1]} channels, the model expects {channels}")
    if h < ph or w < pw:
        raise ValueError(f"inputs: pixel_values of {h}×{w} is smaller than one {ph}×{pw} patch")
    return h // ph, w // pw


def prepare(model: nn.Module, inputs, attention_mask, caller: str) -> Prepared:
    check_grad_mode(caller)
    kwargs = normalise_inputs(inputs, attention_mask)
    entry, where = entry_module(model)
    check_parameters_usable(model, caller)
    # inputs made under inference_mode elsewhere cannot enter a graph; small copies can
    kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) and v.is_inference() else v) for k, v in kwargs.items()}
    if "pixel_values" in kwargs and "input_ids" not in kwargs:
        px = kwargs["pixel_values"]
        rows, cols = patch_grid(model, px, caller)
        layout = torch.full((px.shape[0], 1 + rows * cols), -1, dtype=torch.long, device=px.device)
        return Prepared(kwargs, layout, None, entry, where, (rows, cols))
    kwargs = padding_positions(model, kwargs)
    R.check_model_forward(model, new_tokens(kwargs.get("attention_mask"), kwargs["input_ids"].shape[1]), caller)
    if "use_cache" not in kwargs and accepts(model, "use_cache", by_name=True):
        # a key/value cache is never read by an attribution pass: not building one saves a
        # copy of every layer's keys and values
        kwargs["use_cache"] = False
    ids = kwargs["input_ids"]
    return Prepared(kwargs, ids, new_tokens(kwargs.get("attention_mask"), ids.shape[1]), entry, where)


def input_device(model: nn.Module) -> torch.device:
    """Where token ids go: the input embedding's device. Under an accelerate hook (a
    ``device_map`` or ``cpu_offload``) that is the hook's execution device, since the
    weight itself may sit on ``meta`` between calls."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
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


def entry_module(model: nn.Module):
    """``(module, "input" | "output")``: where the residual stream enters the first block."""
    mt = A.model_type(model)
    if mt in A.ARCHITECTURES:
        path, _ = A.ARCHITECTURES[mt].entry
        mod = A.get_submodule(model, A.join(A.base_prefix(model), path))
        if mod is not None:
            return mod, "input"
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        raise ValueError("cannot find where the input embeddings enter the model")
    return emb, "output"


_CHECKPOINT_TEST = "self.gradient_checkpointing and self.training"


def _checkpointing_modules(model: nn.Module) -> List[nn.Module]:
    """Modules with Hugging Face gradient checkpointing switched on, whose forward reads
    ``self.training`` only to decide whether to checkpoint.

    Hugging Face checkpoints only in training mode, so a pass in eval mode would silently
    drop the memory saving the user asked for. These modules alone stay in training mode
    (dropout lives in their child modules, which go to eval). A module whose own forward
    reads ``self.training`` for anything else (a functional dropout) stays in eval mode:
    its blocks are then not checkpointed, and the result is still exact."""
    found = []
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) is not True or not callable(
                getattr(m, "_gradient_checkpointing_func", None)):
            continue
        fn = type(m).forward
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        if "self.training" not in src.replace(_CHECKPOINT_TEST, ""):
            found.append(m)
    return found


def _reentrant(fn) -> bool:
    """``fn`` is ``partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)``, as
    ``gradient_checkpointing_enable()`` sets by default. PyTorch refuses reentrant
    checkpoints under ``torch.autograd.grad``, which every pass uses; the non-reentrant
    form recomputes the same block with the same memory saving, so the pass swaps it in."""
    import torch.utils.checkpoint as ckpt

    return (isinstance(fn, functools.partial) and fn.func is ckpt.checkpoint
            and fn.keywords.get("use_reentrant", True) is not False)


@contextlib.contextmanager
def _inference_state(model: nn.Module):
    """eval() mode and parameters frozen for the pass, restored afterwards.

    Modules that checkpoint (``gradient_checkpointing_enable()``) stay in training mode,
    which is when Hugging Face checkpoints (:func:`_checkpointing_modules`). Only
    parameters that required grad are touched, and the ``training`` flags are restored
    first."""
    training = [(m, m.training) for m in model.modules()]
    frozen, swapped = [], []
    try:
        model.eval()
        for m in _checkpointing_modules(model):
            m.training = True
            fn = m.__dict__.get("_gradient_checkpointing_func")
            # an open use_relevance_rules scope has wrapped it (scope.bind_checkpoint): look inside
            inner = getattr(fn, CHECKPOINT_INNER, fn)
            if _reentrant(inner):
                swapped.append((m, fn))
                new = functools.partial(inner.func, *inner.args, **{**inner.keywords, "use_reentrant": False})
                m.__dict__["_gradient_checkpointing_func"] = new if inner is fn else bind_checkpoint(new, m)
        for p in model.parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen.append(p)
        yield
    finally:
        for m, t in training:
            m.training = t
        for m, fn in swapped:
            m.__dict__["_gradient_checkpointing_func"] = fn
        for p in frozen:  # never inference tensors: check_parameters_usable refused those
            p.requires_grad_(True)


class SparseRowsHeadFunction(torch.autograd.Function):
    """The output head's logits (computed natively, passed in) with a backward that
    multiplies only the rows of the logits' gradient that are not zero.

    A logit target's gradient is one-hot over (seq × vocab): the head's native backward
    multiplies the whole (seq × vocab) gradient by the (vocab × hidden) weight, about as
    much work as the head's forward, for rows that are zero. Here ``dh = dlogits[rows] · W``
    over the nonzero rows only (the others are exactly 0 either way); with more than half
    the rows nonzero, or a gradient batched by vmap, or a backward being recorded, the
    dense product runs. Saves the weight (a parameter) only."""

    @staticmethod
    def forward(ctx, h, logits, weight):
        ctx.save_for_backward(weight)
        ctx.h_meta = (h.shape, h.dtype)
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensors
        shape, dtype = ctx.h_meta
        flat = dy.reshape(-1, dy.shape[-1])
        wt = w.to(flat.dtype)
        from pyattr.backends import _vmap

        if torch.is_grad_enabled() or _vmap.batched(dy):
            return (flat @ wt).view(shape).to(dtype), None, None
        rows = flat.ne(0).any(-1).nonzero().squeeze(1)
        if 2 * rows.numel() > flat.shape[0]:
            return (flat @ wt).view(shape).to(dtype), None, None
        dh = flat.new_zeros(flat.shape[0], w.shape[1])
        dh.index_copy_(0, rows, flat.index_select(0, rows) @ wt)
        return dh.view(shape).to(dtype), None, None


@contextlib.contextmanager
def _sparse_rows_head(model: nn.Module):
    """During a pass, the output head (an ``nn.Linear`` with a frozen weight) runs its
    backward through :class:`SparseRowsHeadFunction`; its forward output is the module's own."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    from torch.nn.modules import module as _module

    if (not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward or "forward" in head.__dict__
            or hasattr(head, "_hf_hook") or head._forward_hooks or _module._global_forward_hooks):
        # only a plain Linear's output is h·Wᵀ + b: a subclass's forward (a logit scale),
        # an instance patch or forward hook that changes the output, or an accelerate hook
        # (which swaps the weight in for the call only) keeps the native backward
        yield
        return

    def hook(mod, args, out):
        h = args[0] if args else None
        if (not torch.is_grad_enabled() or not isinstance(h, torch.Tensor) or not h.requires_grad
                or mod.weight.requires_grad or mod.weight.device != h.device or not isinstance(out, torch.Tensor)
                or out.shape[:-1] != h.shape[:-1]):
            return None
        return SparseRowsHeadFunction.apply(h, out.detach(), mod.weight)

    handle = head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def attribution_pass(model: nn.Module, rules: RelevanceRules, generic: bool, caller: str):
    """Autograd on, eval mode, parameters frozen, the rules installed; yields the coverage.
    The output head's backward skips the zero rows of its gradient (:class:`SparseRowsHeadFunction`)."""
    with torch.enable_grad(), _inference_state(model), S.keep_rotary_state(model), \
            use_relevance_rules(model, rules, generic=generic) as cov, _sparse_rows_head(model):
        if cov.inherited:
            raise RelevanceRuleConflictError(
                f"{caller}(rules={rules}) runs inside a use_relevance_rules scope that keeps other "
                f"rules on ({', '.join(sorted(cov.inherited))[:200]}); the result would not reflect "
                f"`rules`. Call {caller}() outside that scope, or with the same rules."
            )
        try:
            yield cov
        except RuntimeError as e:
            if "use_reentrant=True" not in str(e):
                raise
            raise RuntimeError(
                f"{caller}(): the model checkpoints with use_reentrant=True through a function pyattr "
                "cannot switch to the non-reentrant form (transformers' offload=True wrapper, or your "
                "own), and torch.autograd.grad, which every method uses, refuses reentrant checkpoints. "
                "Enable checkpointing with use_reentrant=False: model.gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False})"
            ) from e


def first_tensor(value):
    """The first tensor of a module's output or argument (tuples, lists, ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    return None


def _replace_first(value, new):
    if isinstance(value, torch.Tensor):
        return new
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        done, out = False, []
        for v in value:
            if not done and isinstance(v, torch.Tensor):
                out.append(new)
                done = True
            else:
                out.append(v)
        return tuple(out)
    if isinstance(value, Mapping) and hasattr(value, "__setitem__"):
        key = next(k for k, v in value.items() if isinstance(v, torch.Tensor))
        value[key] = new
        return value
    raise TypeError(f"cannot replace the first tensor of a {type(value).__name__}")


_ARG_KEYS = ("hidden_states", "input", "x", "inputs_embeds")


@contextlib.contextmanager
def tap(module: nn.Module, where: str, fn: Callable[[torch.Tensor], Optional[torch.Tensor]], once: bool = False):
    """Call ``fn(t)`` on the first tensor of ``module``'s input (``where="input"``) or
    output (``"output"``) at each call; a tensor it returns replaces ``t`` downstream.
    ``once``: only the first call.

    With ``once``, an activation-checkpoint recomputation during the backward, which calls
    the module again, gets back what the forward's calls got (the first call's tensor,
    ``fn`` not called again), so the recomputed block sees the replaced value too."""
    state = {"calls": 0, "first": None, "replays": 0}

    def apply(t):
        if t is None:
            return None
        if once and state["calls"] and _in_backward():
            out = state["first"] if state["replays"] % state["calls"] == 0 else None
            state["replays"] += 1
            return out
        if once and state["calls"]:
            state["calls"] += 1
            return None
        out = fn(t)
        state["calls"] += 1
        if once:
            state["first"] = out
        return out

    if where == "input":

        def pre(mod, args, kwargs):
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    new = apply(a)
                    return None if new is None else ((*args[:i], new, *args[i + 1:]), kwargs)
            for key in _ARG_KEYS:
                if isinstance(kwargs.get(key), torch.Tensor):
                    new = apply(kwargs[key])
                    return None if new is None else (args, {**kwargs, key: new})
            return None

        h = module.register_forward_pre_hook(pre, with_kwargs=True)
    else:

        def post(mod, args, out):
            new = apply(first_tensor(out))
            return None if new is None else _replace_first(out, new)

        h = module.register_forward_hook(post)
    try:
        yield state
    finally:
        h.remove()


@contextlib.contextmanager
def taps(pairs: Sequence, fn_for) -> Iterator[None]:
    """Several :func:`tap` hooks at once: ``pairs`` of (module, where), ``fn_for(i)`` the hook body."""
    with contextlib.ExitStack() as stack:
        for i, (mod, where) in enumerate(pairs):
            stack.enter_context(tap(mod, where, fn_for(i)))
        yield


def resolve_module(model: nn.Module, path: str, arg: str, extra: Sequence[str] = ()) -> nn.Module:
    """``model.get_submodule(path)``, or a ValueError naming ``arg`` and the nearest paths
    (``extra``: other accepted names, such as shorthands, among the candidates)."""
    if not isinstance(path, str):
        raise TypeError(f"{arg}: module paths must be strings, got {type(path).__name__}")
    names = [n for n, _ in model.named_modules() if n] + list(extra)
    mod = A.get_submodule(model, path) if path else None
    if mod is None:
        near = difflib.get_close_matches(path, names, n=3, cutoff=0.5)
        hint = f"; nearest: {', '.join(near)}" if near else ""
        raise ValueError(f"{arg}: {type(model).__name__} has no module {path!r}{hint}")
    return mod


def record_modules(model: nn.Module, paths: Sequence[str], store: Dict[str, torch.Tensor]):
    """Forward hooks keeping each path's latest output (first tensor, in the graph)."""
    pairs = [(resolve_module(model, p, "target"), "output") for p in paths]

    def fn_for(i):
        def fn(t):
            store[paths[i]] = t
            return None

        return fn

    return taps(pairs, fn_for)


def rule_defaults(rules: Optional[RelevanceRules]) -> RelevanceRules:
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
