"""Each re-run block's MLP from the first position its input changed, for blockwise patching.

Blockwise patching (:mod:`pyattr.patching.blockwise`, nodes; :mod:`pyattr.patching.edges_blockwise`,
edges) re-runs a block on patched copies of rows beside one unpatched copy of each row, in
the same run. Where a patch changes a block's MLP input only from some position on (a
corrupt token in the middle of the prompt: in a causal model nothing before it moves), the
MLP's output before that position is the unpatched copy's, so the MLP computes from there
on only; before it, every copy takes the clean run's recorded MLP output (the same value in
the patched copies and their reference: their difference there is exactly 0, as the full
MLP gives it).

Observed on each call, not read off the model: the first position where any patched copy's
MLP input differs, bit for bit, from its reference copy's (:func:`first_changed`); the
MLP's forward position-wise as it runs now (:func:`pyattr.patching.last_block.positionwise`:
its own chain of position-wise children, its input its only argument, no hooks on it nor
hooks registered for every module).
An MLP whose input changed at the first position, or that is not position-wise, runs whole;
so does the last block's where it runs at the metric's positions only
(:mod:`pyattr.patching.last_block`), and a block with a patched site inside its MLP.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch
from torch import nn

from pyattr._module_forward import global_hooks
from pyattr.patching.calls import (first_input, first_output, hooks_around, replace_input, select_rows,
                                   with_first_output)


def first_changed(x: torch.Tensor, n: int, ref: torch.Tensor) -> int:
    """The first position (dim 1) where any of the first ``n`` rows of ``x`` differs from its
    reference row ``x[ref[k]]`` (NaN counts as a difference); ``x.shape[1]`` where none does."""
    changed = (x[:n] != x[ref.to(x.device)]).flatten(2).any(-1).any(0)
    hit = changed.nonzero()
    return int(hit[0, 0]) if len(hit) else x.shape[1]


class MLPOutputs:
    """Per block: its MLP (None where it is not position-wise) and the MLP's raw output in
    the clean run (before its forward hooks)."""

    def __init__(self, mlps: Sequence[Optional[nn.Module]]):
        from pyattr.patching.last_block import positionwise

        self.mlps = [m if m is not None and positionwise(m) else None for m in mlps]
        self.raw: List = [None] * len(self.mlps)
        self.count = [0] * len(self.mlps)

    @contextlib.contextmanager
    def recording(self):
        handles = []
        for i, m in enumerate(self.mlps):
            if m is None:
                continue

            def post(mod, args, out, i=i):  # first of the forward hooks: the forward's own output
                self.raw[i] = out.detach().clone() if isinstance(out, torch.Tensor) else out
                self.count[i] += 1

            handles.append(m.register_forward_hook(post, prepend=True))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def release(self) -> None:
        self.raw = [None] * len(self.mlps)

    def usable(self, layer: int) -> bool:
        return self.mlps[layer] is not None and self.count[layer] == 1 and isinstance(self.raw[layer], torch.Tensor) \
            and not global_hooks()

    @contextlib.contextmanager
    def from_change(self, layer: int, idx: torch.Tensor, n: int, ref: torch.Tensor, batch: int):
        """While open, block ``layer``'s MLP on rows ``idx`` (the first ``n`` patched copies,
        ``ref`` their reference copies' indices) computes from :func:`first_changed` of its
        input on; before it, the clean run's output on those rows (module docstring)."""
        mlp = self.mlps[layer]
        start: list = []

        def pre(mod, args, kwargs):
            x = first_input(args, kwargs)
            p = first_changed(x, n, ref) if x is not None and x.dim() == 3 and x.shape[0] == len(idx) else 0
            start.append(p)
            return replace_input(args, kwargs, x[:, p:].contiguous(), "method='blockwise'") if p else None

        def post(mod, args, kwargs, out):
            p = start.pop()
            if not p:
                return None
            full = select_rows(self.raw[layer], idx, batch).clone()
            full[:, p:] = first_output(out)
            return with_first_output(out, full)

        with hooks_around(mlp, pre, post):
            yield


def block_mlps(model: nn.Module, generic: bool) -> Optional[MLPOutputs]:
    """An :class:`MLPOutputs` over every block's MLP (the patching nodes' ``mlp`` site), or
    None where the architecture names none."""
    from pyattr.patching.nodes import node_sites

    try:
        return MLPOutputs([s.module for s in node_sites(model, ["mlp"], generic)["mlp"]])
    except ValueError:
        return None
