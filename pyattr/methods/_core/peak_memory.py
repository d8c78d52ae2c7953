"""Peak memory of a block of work, observed rather than estimated.

On CUDA the caching allocator keeps its own peak (``torch.cuda.max_memory_allocated``),
reset at the start of each block. On a CPU the resident set size is sampled from
``/proc/self/statm`` by a daemon thread every :data:`INTERVAL` seconds while the block
runs, and once more as it ends (the compute releases the GIL, so the sampler runs beside
it). The kernel's own peak (``VmHWM``) is not used: resetting it (``clear_refs``) would
also reset the peak every other tool reads for the process (``getrusage``'s ``ru_maxrss``,
``/usr/bin/time``). A sampled peak can miss an allocation that lives shorter than the
interval; the activation-sized buffers a backward holds live far longer. Where
``/proc`` is absent (macOS) or the device is neither (MPS), :meth:`PeakMemory.stop`
returns ``None`` and the caller keeps its estimate.

Peaks are reported above the usage when the meter was made, so memory a block freed to
the allocator but not to the system (glibc's heap, CUDA's cache) and reused by the next
block is counted where it is used, not hidden by a later baseline.
"""

from __future__ import annotations

import resource
import threading
from typing import Optional

import torch

#: seconds between two samples of the CPU resident set size
INTERVAL = 0.002


def rss_bytes() -> Optional[int]:
    """This process's resident set size now (bytes), or None without ``/proc``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None


class _Sampler(threading.Thread):
    def __init__(self, first: int):
        super().__init__(name="pyattr-peak-memory", daemon=True)
        self.top = first
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(INTERVAL):
            now = rss_bytes()
            if now is not None and now > self.top:
                self.top = now


class PeakMemory:
    """Peak bytes in use on ``device`` during a block, above the usage at construction.

    ``start()`` before the block, ``stop()`` after it (also after an exception: it ends
    the sampler): the highest usage seen minus the usage at construction, or ``None``
    where nothing can be observed."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.base = self._current()
        self._sampler: Optional[_Sampler] = None

    @property
    def observable(self) -> bool:
        return self.base is not None

    def _current(self) -> Optional[int]:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        return rss_bytes() if self.device.type == "cpu" else None

    def start(self) -> None:
        if not self.observable:
            return
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._sampler = _Sampler(self._current() or 0)
        self._sampler.start()

    def stop(self) -> Optional[int]:
        if not self.observable:
            return None
        if self.cuda:
            top = torch.cuda.max_memory_allocated(self.device)
        else:
            sampler, self._sampler = self._sampler, None
            if sampler is None:
                return None
            sampler.done.set()
            sampler.join()
            top = max(sampler.top, self._current() or 0)
        return max(0, top - self.base)
