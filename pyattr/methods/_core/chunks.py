"""How many generated steps one forward serves (:func:`segment_end`) and how many targets
one batched backward takes (:class:`ChunkSizes`), for :func:`pyattr.generation_relevance`:
chosen from measured time and measured memory, bounded before the first measurement by a
deliberately high estimate (:func:`default_batch_targets`)."""

from __future__ import annotations

from typing import Dict, Optional

from torch import nn

from pyattr.methods._core.peak_memory import PeakMemory

#: memory a chunk of targets may take for its backward when the caller sets no
#: ``batch_targets`` (bytes)
DEFAULT_BUDGET = 2 << 30
#: a forward serves the steps whose cut is at most this many times the first one's length
SEGMENT_GROWTH = 1.25


class ChunkSizes:
    """Steps per chunk (one batched backward), chosen by measured time and measured memory
    when the caller set none.

    A bigger chunk runs bigger products, but its batched backward holds k copies of every
    activation-sized gradient: past the CPU's caches (or the device's bandwidth) each
    step's backward gets slower (on 2 CPU cores, 16k tokens of context: 4.2 s per step
    added at k = 2, 5.6 s at k = 8). So the chunk starts at :data:`START` steps and
    doubles while the seconds per step it measures fall, then stays at the fastest size
    measured.

    Memory bounds the doubling: each chunk's peak (:class:`PeakMemory`) is a point of the
    model ``peak(k) = a + b·k``; ``b``, the bytes each further step adds, is the slope
    fitted to the points (with one size measured, ``peak / k``: an upper bound, as
    ``a ≥ 0``), and ``k`` stays where the batching adds at most ``budget`` over one step,
    ``(k − 1)·b ≤ budget``. Before the first measurement ``first`` bounds it (the
    conservative per-position estimate, :func:`default_batch_targets`); where no peak
    can be observed, that bound stays. ``fixed``: always ``first`` (``batch_targets=``)."""

    START = 8

    def __init__(self, first: int, fixed: bool, budget: int = DEFAULT_BUDGET, meter: Optional[PeakMemory] = None):
        self.cap, self.fixed, self.budget = first, fixed, budget
        self.meter = meter if meter is not None else PeakMemory("meta")  # meta: nothing observable
        self.k = first if fixed else min(first, self.START)
        self.per_step: Dict[int, float] = {}
        self.peaks: Dict[int, int] = {}
        self.largest = 0

    def next(self) -> int:
        return self.k

    def step_bytes(self) -> Optional[float]:
        """``b`` of the memory model: bytes one more step in a chunk adds (None: no peak yet)."""
        if not self.peaks:
            return None
        ks = sorted(self.peaks)
        top = self.peaks[ks[-1]] / ks[-1]
        if len(ks) == 1:
            return top
        mk = sum(ks) / len(ks)
        mp = sum(self.peaks.values()) / len(ks)
        slope = sum((k - mk) * (self.peaks[k] - mp) for k in ks) / sum((k - mk) ** 2 for k in ks)
        return slope if slope > 0 else top  # no growth measured (noise): the upper bound

    def measured(self, steps: int, seconds: float, peak_bytes: Optional[int] = None) -> None:
        self.largest = max(self.largest, steps)
        if self.fixed:
            return
        if peak_bytes is not None:
            self.peaks[steps] = max(self.peaks.get(steps, 0), int(peak_bytes))
            b = self.step_bytes()
            self.cap = max(1, 1 + int(self.budget // max(b, 1.0)))
        if steps == self.k:  # the last, shorter chunk says nothing about k's time
            self.per_step[self.k] = seconds / steps
        bigger = min(self.cap, 2 * self.k)
        smaller = self.per_step.get(self.k // 2)
        if (self.k in self.per_step and bigger > self.k and bigger not in self.per_step
                and (smaller is None or self.per_step[self.k] < smaller)):
            self.k = bigger
            return
        fits = {k: t for k, t in self.per_step.items() if k <= self.cap}
        self.k = min(fits, key=fits.get) if fits else min(self.k, self.cap)


def segment_end(width: int, t0: int, generated: int) -> int:
    """The end (exclusive) of the steps one forward serves from step ``t0``: the
    sequence is cut after the last of them, and every backward over that forward runs at
    the cut's length whatever its targets' positions; so a segment ends where the cut
    would pass :data:`SEGMENT_GROWTH` times the length step ``t0`` needs. After a long
    prompt that is every step (16 steps after 16k tokens: one forward); after a short one,
    a few forwards instead of one per chunk."""
    need = width + t0              # positions step t0 reads
    return max(t0 + 1, min(generated, int(SEGMENT_GROWTH * need) - width + 1))


def default_batch_targets(model: nn.Module, batch: int, seq: int, generated: int, budget: int = DEFAULT_BUDGET) -> int:
    """Steps in the first batched backward, before any memory is measured: as many as fit
    ``budget`` bytes, each step taken to hold 16 hidden-size vectors per position and
    layer in float32, at most ``generated``. An upper estimate on purpose (the Llamas of
    the benchmarks measure about a quarter of it per step, :class:`ChunkSizes`), since
    the first chunk runs before anything is known."""
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", None) or 1024
    layers = getattr(cfg, "num_hidden_layers", None) or 12
    per = max(1, batch * seq * hidden * layers * 16 * 4)
    return max(1, min(generated, budget // per))
