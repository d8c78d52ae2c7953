"""Baselines: what ``"zeros"``, ``"pad"`` and tensor baselines mean, checked, and the forward
at the baseline input."""

from __future__ import annotations

import contextlib
from typing import List, Optional, Union

import torch
from torch import nn

import pyattr.methods._core.positions as P
import pyattr.methods._core.readout as R
import pyattr.targets as T
from pyattr.methods._core.forward import evaluate_targets, head_free, run_model
from pyattr.methods._core.inputs import Prepared, is_pixels
from pyattr.methods._core.taps import record_modules, tap, taps


def pad_token_id(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    pad = getattr(cfg, "pad_token_id", None)
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    if pad is None:
        raise ValueError(
            f"baseline='pad' needs a pad token id, and {type(model).__name__}.config.pad_token_id is None; "
            "set model.config.pad_token_id, or pass baseline='zeros' or a tensor"
        )
    return int(pad)


def precheck_baseline(model: nn.Module, baseline, inputs=None) -> None:
    """What can be checked about a baseline before any pass: its kind, and a pad token for
    ``"pad"`` (its shape is checked against the embeddings once they are known)."""
    if isinstance(baseline, str):
        if baseline not in ("zeros", "pad"):
            raise ValueError(f"baseline must be 'zeros', 'pad' or a tensor, got {baseline!r}")
        if baseline == "pad" and is_pixels(inputs):
            raise ValueError(
                "baseline='pad' runs the pad token at every position, and image inputs (pixel_values) have "
                "no tokens; pass baseline='zeros' or a tensor shaped like the patch embeddings (batch, tokens, hidden)"
            )
        if baseline == "pad":
            pad_token_id(model)
    elif baseline is not None:
        if not isinstance(baseline, torch.Tensor):
            raise TypeError(f"baseline must be 'zeros', 'pad' or a tensor, got {type(baseline).__name__}")
        if not baseline.is_floating_point():
            raise TypeError(f"baseline must be a floating tensor, got dtype {baseline.dtype}")
        if not torch.isfinite(baseline).all():
            raise ValueError("baseline holds NaN or inf")


def check_baseline(baseline, x: torch.Tensor) -> Union[None, str, torch.Tensor]:
    """A baseline :func:`precheck_baseline` accepted, against the embeddings ``x``: a tensor
    is broadcast to ``x``'s shape (batch, seq, hidden) from ``x``'s, ``(1, seq, hidden)``
    or ``(seq, hidden)``; ``None``, ``"zeros"`` and ``"pad"`` pass through."""
    if not isinstance(baseline, torch.Tensor):
        return baseline
    ok = (tuple(x.shape), (1, *x.shape[1:]), tuple(x.shape[1:]))
    if tuple(baseline.shape) not in ok:
        raise ValueError(
            f"baseline of shape {tuple(baseline.shape)} does not match the input embeddings: expected "
            f"{tuple(x.shape)} (batch, seq, hidden), {(1, *x.shape[1:])} or {tuple(x.shape[1:])}"
        )
    return baseline.detach().to(device=x.device, dtype=x.dtype).expand(x.shape)


def baseline_forward(model, prep: Prepared, baseline, x: torch.Tensor, targets, extra_pairs=(), extra_names=()):
    """One forward at the baseline input (no gradient): ``(x₀, f(x₀), extra activations)``.

    ``"pad"`` runs the pad token at every real position (same mask and positions), so
    every module, those before the entry included, sees the baseline input;
    ``"zeros"`` and tensors replace the embeddings where they enter the first block, so
    a module in ``extra_pairs`` that runs before that point cannot see them: ValueError.

    Where the model chooses from the ids the position it pools from (a decoder sequence
    classifier's last non-pad token, CLIP's first end-of-text token), the all-pad ids of
    ``"pad"`` would move it (to position 0: the all-pad row has no non-pad token, and its
    first token is the end-of-text token where pad = eos); f(x₀) is the model pooled where it
    pooled the input, which is where every point of a path from x₀ to x pools (they run on
    the input's ids). That position is observed on a forward of the input
    (:func:`pyattr.methods._core.positions.observe_pooling`), run only when the baseline's
    own forward shows the model pools, and kept in a second baseline forward.
    """
    pad = isinstance(baseline, str) and baseline == "pad"
    if pad:
        R.check_pad_baseline(model, prep.attention_mask, "baseline")
    x0, value, acts, seen, out = _at_baseline(model, prep, baseline, x, targets, extra_pairs, extra_names,
                                              P.observe_pooling(model, poolers=True) if pad else None)
    if seen is not None and seen.detect(out):
        kept = _observed_input_pooling(model, prep, targets, extra_pairs)
        x0, value, acts, _, _ = _at_baseline(model, prep, baseline, x, targets, extra_pairs, extra_names, None,
                                             kept.keep())
    return x0, value, acts


def _observed_input_pooling(model, prep: Prepared, targets, extra_pairs) -> P.PooledPositions:
    """Where the model pools each row of the input itself (a forward on its own ids, no
    gradient); ValueError where that cannot be observed."""
    with torch.no_grad(), P.observe_pooling(model, poolers=True) as kept:
        fwd = run_model(model, prep, targets, {}, keep_logits=head_free(model, [m for m, _ in extra_pairs]))
    kept.read(fwd.output).refuse_unseen("baseline='pad'")
    if not kept.found:
        raise ValueError(
            f"baseline='pad' replaces every token id by the pad id, and {type(model).__name__} pools the baseline's "
            "output from a position it chooses from the ids, but where it pools the input itself could not be "
            "observed (its output is not one position of its head's output, nor a pooler_output one row of its "
            "last_hidden_state), so f(baseline) cannot be read where the input is; pass baseline='zeros' or a tensor")
    return kept


def _at_baseline(model, prep: Prepared, baseline, x: torch.Tensor, targets, extra_pairs, extra_names, observe=None,
                 keep=None):
    """One forward at the baseline; ``observe``: an :func:`observe_pooling` context to run it
    in (the :class:`PooledPositions` it filled is returned, and the model's output);
    ``keep``: a context keeping the input's pooled positions, entered after the recording
    hooks (a layer or target on the head records what it computed)."""
    kwargs = dict(prep.kwargs)
    seen: dict = {}
    if isinstance(baseline, str) and baseline == "pad":
        kwargs["input_ids"] = torch.full_like(prep.input_ids, pad_token_id(model))
        replace = None
    else:
        replace = torch.zeros_like(x) if isinstance(baseline, str) else baseline

    def entry_fn(t):
        seen["x0"] = t.detach() if replace is None else replace
        return None if replace is None else replace

    acts: List[Optional[torch.Tensor]] = [None] * len(extra_pairs)
    early: List[str] = []

    def fn_for(i):
        def fn(t):
            if "x0" not in seen and replace is not None and extra_pairs[i][0] is not prep.entry:
                early.append(extra_names[i] if extra_names else str(i))
            acts[i] = t.detach().clone()
            return None

        return fn

    store: dict = {}
    pooled = None
    with torch.no_grad(), tap(prep.entry, prep.where, entry_fn, once=True), taps(extra_pairs, fn_for), \
            record_modules(model, T.module_paths(targets), store), \
            (observe or contextlib.nullcontext()) as pooled, (keep or contextlib.nullcontext()):
        fwd = run_model(model, prep, targets, store, kwargs,
                        keep_logits=head_free(model, [m for m, _ in extra_pairs]))
        value, _, _ = evaluate_targets(targets, fwd, len(targets) > 1)
    if "x0" not in seen:
        raise RuntimeError("the embedding entry point was not reached during the baseline forward pass")
    if early:
        raise ValueError(
            f"baseline: layer {early[0]!r} runs before the input embeddings enter the first block, where "
            "a 'zeros' or tensor baseline is placed, so it would never see the baseline; use "
            + ("a later layer (image inputs have no pad token)" if prep.patch_grid is not None else
               "baseline='pad' (the pad token runs through every module) or a later layer")
        )
    return seen["x0"], value.detach().double(), acts, pooled, fwd.output
