"""Baselines for relevance on encoder–decoder models: the residual streams x₀ at both
stacks' entries that relevance is taken against, ``(x − x₀) · g``, and f(x₀), the
explained value with x₀ in place of x (one more forward, without gradient)."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

import pyattr.methods._core as core
import pyattr.methods.seq2seq_targets as ST
from pyattr.methods._core.forward import evaluate_targets

BASELINES = ("zeros", "pad")


def check(baseline) -> None:
    if baseline is not None and not (isinstance(baseline, str) and baseline in BASELINES):
        shown = f"a tensor of shape {tuple(baseline.shape)}" if isinstance(baseline, torch.Tensor) else repr(baseline)
        raise ValueError(f"baseline: on encoder–decoder models one of {list(BASELINES)} (at both stacks' entries), "
                         f"got {shown}")


def entries_at(model: nn.Module, kwargs: dict, entries, baseline: str, x_src: torch.Tensor,
               x_tgt: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x₀ at the encoder's and the decoder's entry: zeros, or (``"pad"``) what the entries
    receive when every source and target token is the pad token (positions as the model
    adds them), read off one forward of the model itself."""
    if baseline == "zeros":
        return torch.zeros_like(x_src), torch.zeros_like(x_tgt)
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    if not isinstance(pad, int):
        raise ValueError(f"baseline='pad': {type(model).__name__}'s config has no pad_token_id")
    seen = [[], []]

    def keep(i):
        def fn(t):
            seen[i].append(t.detach())
            return None
        return fn

    padded = {**kwargs, "input_ids": torch.full_like(kwargs["input_ids"], pad),
              "decoder_input_ids": torch.full_like(kwargs["decoder_input_ids"], pad)}
    with torch.no_grad(), core.tap(entries[0], "input", keep(0), once=True), \
            core.tap(entries[1], "input", keep(1), once=True):
        model(**padded)
    return seen[0][0], seen[1][0]


def value_at(model: nn.Module, kwargs: dict, entries, x0: Tuple[torch.Tensor, torch.Tensor], fixed, side: str,
             several: bool) -> torch.Tensor:
    """f(x₀): the targets (token ids fixed at the input; read on ``side``'s stack) with x₀
    at both entries, float64."""
    store: dict = {}
    with torch.no_grad(), core.tap(entries[0], "input", lambda t: x0[0], once=True), \
            core.tap(entries[1], "input", lambda t: x0[1], once=True), ST.recording(model, fixed, store):
        out = model(**kwargs)
    value, _, _ = evaluate_targets(fixed, ST.forward(side, out, kwargs, store), several)
    return value.detach().double()
