"""The node's own block without its attention arithmetic, for blockwise patching.

Blockwise patching (:mod:`pyattr.patching.blockwise`) re-runs each patched node's own block on
the clean run's recorded input, the node patched. A node patched *after* the block's
attention has computed (a head at the attention's output projection, the attention's
output, the MLP, its neurons) cannot change what the attention computed before it: its
queries, keys, values and pattern are the clean run's. So there the attention module
returns its recorded output on the re-run rows, and only its output projection runs, on
its recorded input (a head's patch applies there, through the same hooks), its output
taking the place of the attention's. On short sequences the attention's projections,
position rotation and softmax are a fifth to a half of a small block's time; the blocks
after the node's still run whole (their input changed).

Observed, not read off the model type, on the clean run (:meth:`AttentionReplay.usable`):
per block, the attention module and its output projection ran once each, the attention's
own output (before its forward hooks) is the projection's output object (hooks included),
the projection re-run through its hooks on its recorded input (a copy, taken before any
pre-hook) gives that output bit for bit (nothing changed it in place afterwards), no hook
is registered for every module, and every patched site is the projection's input, the
attention's output, or a module whose call began after the attention's call returned.
Anywhere else (a residual node: the block's input; a site inside the attention's
arithmetic; an architecture with no heads role; a block whose attention runs twice or
changes anything after its projection) the block runs whole.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import List, Optional, Sequence

import torch
from torch import nn

from pyattr._module_forward import global_hooks
from pyattr.patching.calls import RecordedCalls, first_output, select_rows, with_first_output


class AttentionReplay:
    """Per block: its attention module ``attn[i]`` (the output projection's parent), the
    projection's recorded calls (:class:`RecordedCalls`: its input before any pre-hook), the
    attention's raw output, and the order in which the watched modules' calls began and
    ended."""

    def __init__(self, attn: Sequence[nn.Module], proj: Sequence[nn.Module], sites: Sequence):
        self.attn = list(attn)
        self.proj = RecordedCalls(proj, prepend=True, copy=True)
        self.proj.caller = "method='blockwise'"
        self.sites = list(sites)
        n = len(self.attn)
        self.raw: list = [None] * n
        self.proj_out: list = [None] * n
        self.attn_count = [0] * n
        self.attn_end: List[Optional[int]] = [None] * n
        self.site_start: dict = {}
        self.replays: dict = {}    # block → whether its projection re-run gives the recorded output

    @contextlib.contextmanager
    def recording(self):
        clock = itertools.count()
        handles = []
        for i, (a, p) in enumerate(zip(self.attn, self.proj.modules)):
            def pre(m, args, i=i):
                self.attn_count[i] += 1

            def post(m, args, out, i=i):  # first of the forward hooks: the forward's own output
                self.raw[i] = out
                self.attn_end[i] = next(clock)

            def proj_post(m, args, out, i=i):  # last of them: what the attention's forward received
                self.proj_out[i] = out

            handles += [a.register_forward_pre_hook(pre), a.register_forward_hook(post, prepend=True),
                        p.register_forward_hook(proj_post)]
        for k, s in enumerate(self.sites):
            def start(m, args, k=k):
                self.site_start.setdefault(k, next(clock))

            handles.append(s.module.register_forward_pre_hook(start, prepend=True))
        try:
            with self.proj.recording():
                yield self
        finally:
            for h in handles:
                h.remove()

    def release(self) -> None:
        n = len(self.attn)
        self.raw, self.proj_out, self.replays = [None] * n, [None] * n, {}
        self.proj.calls, self.proj.inputs = [None] * n, [None] * n

    def _site_after(self, layer: int, site) -> bool:
        """Whether patching ``site`` leaves block ``layer``'s attention output as recorded, but
        for what its projection computes from a patched input."""
        attn, proj = self.attn[layer], self.proj.modules[layer]
        if site.module is proj:
            return site.where == "input"
        if site.module is attn:
            return site.where == "output"
        if any(site.module is m for m in attn.modules()):
            return False       # inside the attention's own arithmetic
        k = next((k for k, s in enumerate(self.sites) if s is site), None)
        start = self.site_start.get(k)
        return start is not None and self.attn_end[layer] is not None and start > self.attn_end[layer]

    def usable(self, layer: int, sites: Sequence) -> bool:
        """The attention of block ``layer`` can be replayed for a run patching ``sites``
        (module docstring)."""
        if global_hooks() or not all(self._site_after(layer, s) for s in sites):
            return False
        if layer not in self.replays:
            self.replays[layer] = self._replays(layer)
        return self.replays[layer]

    def _replays(self, layer: int) -> bool:
        if self.attn_count[layer] != 1 or self.proj.count[layer] != 1 or self.raw[layer] is None:
            return False
        try:
            own = first_output(self.raw[layer])
        except RuntimeError:
            return False
        x = self.proj.inputs[layer]
        if own is not self.proj_out[layer] or x is None:
            return False
        idx = torch.arange(x.shape[0], device=x.device)
        with torch.no_grad():
            again = first_output(self.proj.rerun(layer, idx, x.clone(), x.shape[0]))
        return again.shape == own.shape and torch.equal(again, own)

    @contextlib.contextmanager
    def replaying(self, layer: int, idx: torch.Tensor, batch: int):
        """While open, block ``layer``'s attention returns its recorded output on rows
        ``idx``, its first tensor recomputed by the output projection on the projection's
        recorded input (rows ``idx``), through the projection's hooks."""
        attn = self.attn[layer]
        raw = select_rows(self.raw[layer], idx, batch)
        proj_in = self.proj.inputs[layer][idx.to(self.proj.inputs[layer].device)]  # a copy: hooks may change it

        def forward(*args, **kwargs):
            return with_first_output(raw, first_output(self.proj.rerun(layer, idx, proj_in, batch)))

        saved = attn.__dict__.get("forward")
        attn.forward = forward
        try:
            yield
        finally:
            if saved is None:
                del attn.forward
            else:
                attn.forward = saved


def attention_replay(model: nn.Module, sites: Sequence, generic: bool) -> Optional[AttentionReplay]:
    """An :class:`AttentionReplay` over every block's attention (the parent of the heads
    node's output projection), or None where the architecture names no heads role or the
    projection is a block's direct child."""
    from pyattr.patching.nodes import node_sites

    try:
        heads = node_sites(model, ["heads"], generic)["heads"]
        blocks = node_sites(model, ["residual"], generic)["residual"]
    except ValueError:
        return None
    attn = []
    for h, b in zip(heads, blocks):
        parent = h.path.rsplit(".", 1)[0] if "." in h.path else ""
        if not parent.startswith(b.path + "."):
            return None
        attn.append(model.get_submodule(parent))
    return AttentionReplay(attn, [h.module for h in heads], sites)
