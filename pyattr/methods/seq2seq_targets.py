"""Which stack an encoder–decoder's targets read: a logit (or a callable of the output) the
decoder side, a module-output target (:class:`pyattr.targets.ModuleOutput`) the stack its
module sits in. Its positions and padding are that stack's: the source's ids and mask for
a module of the encoder, the decoder inputs' for one of the decoder or the head."""

from __future__ import annotations

import contextlib
from typing import Dict, Sequence

import torch
from torch import nn

import pyattr.methods._core as core
import pyattr.targets as T


def encoder_modules(model: nn.Module) -> set:
    """The ids of the modules of the model's encoder (``get_encoder()``), the stack a module
    belongs to read off the model itself."""
    get = getattr(model, "get_encoder", None)
    enc = get() if callable(get) else None
    return {id(m) for m in enc.modules()} if isinstance(enc, nn.Module) else set()


def side_of(model: nn.Module, targets: Sequence, caller: str) -> str:
    """``"encoder"`` or ``"decoder"``: the one stack every target reads; ValueError for
    targets that read both."""
    inside = encoder_modules(model)
    sides = []
    for t in targets:
        paths = T.module_paths([t])
        if not paths:
            sides.append(("decoder", repr(t)))
            continue
        for p in paths:
            mod = core.resolve_module(model, p, "target")
            sides.append(("encoder" if id(mod) in inside else "decoder", p))
    kinds = {s for s, _ in sides}
    if len(kinds) > 1:
        enc_t = next(w for s, w in sides if s == "encoder")
        dec_t = next(w for s, w in sides if s == "decoder")
        raise ValueError(f"target: {caller}() reads targets of one stack at a time, and {enc_t!r} is in the encoder "
                         f"while {dec_t!r} reads the decoder side; explain them in separate calls")
    return kinds.pop() if kinds else "decoder"


def recording(model: nn.Module, targets: Sequence, store: Dict[str, torch.Tensor]):
    """The module outputs the targets read, kept in ``store`` during the forward."""
    paths = T.module_paths(list(targets))
    return core.record_modules(model, paths, store) if paths else contextlib.nullcontext()


def forward(side: str, out, kwargs: dict, store: Dict[str, torch.Tensor]) -> T.Forward:
    """The :class:`pyattr.targets.Forward` the targets are read from: the output, the
    module outputs, and the ids and mask of ``side``'s stack from the call's ``kwargs``."""
    if side == "encoder":
        return T.Forward(out, kwargs["input_ids"], kwargs.get("attention_mask"), store, None)
    return T.Forward(out, kwargs["decoder_input_ids"], kwargs.get("decoder_attention_mask"), store, None)
