"""Is the CPU too busy for a timing to mean anything?

torch runs one intra-op thread per core, and its parallel loops split the work evenly
between them, so a loop lasts as long as its slowest thread. When other processes hold
some of those cores, threads wait for a core and a timing grows many times over (on the
2-core development machine, busy with other jobs: `pyattr explain` 786 ms with two
threads, 30 ms with one). Such a number is not a property of the code.

:func:`start` returns a :class:`Monitor`; :meth:`Monitor.stop` after the measurement
returns a :class:`Contention` that says whether the CPU was oversubscribed, and why:

* **load** (only where the window below cannot be measured): the 1-minute load average
  when the measurement started is above the number of CPUs of the machine. The load
  average trails by about a minute (right after a build it is still high on an idle
  machine), so a direct measurement of the window, when there is one, decides instead;
* **threads > cores**: torch's intra-op threads outnumber the cores this process may
  use (its CPU affinity, and the cgroup CPU quota where one is set);
* **threads > free cores** (Linux): other processes kept, on average, some of this
  process's cores busy *during* the measurement (CPU time on those cores from
  ``/proc/stat``, less this process's own CPU time and that of the children it waited
  for), leaving fewer free cores than torch has threads, by more than half a core.
  Measured only over windows of at least :data:`MIN_WINDOW_S` (the counters tick at
  10 ms).

Nothing here imports torch unless the thread count is not given.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import List, Optional

MIN_WINDOW_S = 0.5
SLACK_CORES = 0.5  # free cores may fall this far below the thread count before it counts


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        n = min(n, max(1, int(quota)))
    return max(1, n)


def _cgroup_quota() -> Optional[float]:
    """CPU quota in cores (cgroup v2 ``cpu.max``, v1 ``cfs_quota_us``), None if unlimited."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period = int(f.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def _load_avg() -> Optional[float]:
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):  # not on every platform
        return None


def _busy_seconds(cpus) -> Optional[float]:
    """CPU-seconds spent busy (not idle or waiting for I/O) on ``cpus`` since boot."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            lines = f.readlines()
    except (AttributeError, OSError, ValueError):
        return None
    want = {f"cpu{i}" for i in cpus}
    busy = 0
    seen = 0
    for line in lines:
        parts = line.split()
        if parts and parts[0] in want:
            v = [int(x) for x in parts[1:9]] + [0] * 8
            user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
            busy += user + nice + system + irq + softirq + steal
            seen += 1
    return busy / tick if seen else None


def _own_seconds() -> float:
    """CPU time of this process, all threads, plus the children it has waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _affinity():
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


@dataclass
class Contention:
    """The CPU conditions a timing was taken under.

    Attributes:
        cores: cores this process may use.
        cpu_count: CPUs of the machine (what the load average spreads over).
        threads: torch intra-op threads.
        load_avg_1min: 1-minute load average at the start (None where unavailable).
        others_busy_cores: average number of this process's cores that other processes
            kept busy during the measurement (None: not measured, or window too short).
        window_s: length of the measurement window.
        reasons: why the CPU counts as oversubscribed; empty if it does not.
    """

    cores: int
    cpu_count: int
    threads: int
    load_avg_1min: Optional[float]
    others_busy_cores: Optional[float]
    window_s: float
    reasons: List[str] = field(default_factory=list)

    @property
    def oversubscribed(self) -> bool:
        return bool(self.reasons)

    @property
    def free_cores(self) -> float:
        """Cores left to this process: measured during the window where possible, else
        estimated from the load average at the start (mostly other processes then)."""
        if self.others_busy_cores is not None:
            busy = self.others_busy_cores
        elif self.load_avg_1min is not None:
            busy = self.load_avg_1min * self.cores / max(self.cpu_count, self.cores)
        else:
            busy = 0.0
        return max(0.0, self.cores - busy)

    @property
    def suggested_threads(self) -> int:
        """Threads that fit in the free cores (at least one, at most the current count)."""
        return max(1, min(self.threads, int(math.floor(self.free_cores + 1e-9))))

    @property
    def warning(self) -> Optional[str]:
        if not self.reasons:
            return None
        fix = "run on an idle machine"
        if self.suggested_threads < self.threads:
            fix += f", or with OMP_NUM_THREADS={self.suggested_threads}"
        return "timings unreliable, the CPU is oversubscribed: " + "; ".join(self.reasons) + f". For stable numbers {fix}"

    def summary(self) -> str:
        """One line on the conditions, whether or not they are a problem."""
        parts = [f"{self.threads} torch thread{'s' if self.threads != 1 else ''} on {self.cores} "
                 f"core{'s' if self.cores != 1 else ''}"]
        if self.load_avg_1min is not None:
            parts.append(f"load average {self.load_avg_1min:.2f} on {self.cpu_count} CPUs at the start")
        if self.others_busy_cores is not None:
            parts.append(f"other processes kept {self.others_busy_cores:.1f} of those cores busy during the run")
        return ", ".join(parts)

    def to_json(self) -> dict:
        return {
            "cores": self.cores,
            "cpu_count": self.cpu_count,
            "threads": self.threads,
            "load_avg_1min": self.load_avg_1min,
            "others_busy_cores": self.others_busy_cores,
            "window_s": self.window_s,
            "oversubscribed": self.oversubscribed,
            "reasons": list(self.reasons),
            "warning": self.warning,
        }


def judge(cores: int, cpu_count: int, threads: int, load: Optional[float], others: Optional[float],
          window_s: float = 0.0) -> Contention:
    """Apply the three checks (module docstring) to measured conditions."""
    reasons = []
    if others is None and load is not None and load > cpu_count:
        reasons.append(f"load average {load:.2f} above the {cpu_count} CPUs of the machine")
    if threads > cores:
        reasons.append(f"{threads} torch threads on {cores} usable cores")
    elif others is not None and threads > cores - others + SLACK_CORES:
        reasons.append(
            f"other processes kept {others:.1f} of {cores} cores busy during the run, "
            f"leaving {max(0.0, cores - others):.1f} free for {threads} torch threads"
        )
    return Contention(cores, cpu_count, threads, load, others, window_s, reasons)


class Monitor:
    """Conditions over a measurement window: ``m = start(); ...; c = m.stop()``."""

    def __init__(self):
        self._cpus = _affinity()
        self._load = _load_avg()
        self._t0 = time.perf_counter()
        self._busy0 = _busy_seconds(self._cpus)
        self._own0 = _own_seconds()

    def stop(self, threads: Optional[int] = None) -> Contention:
        wall = time.perf_counter() - self._t0
        busy1 = _busy_seconds(self._cpus)
        own = _own_seconds() - self._own0
        cores = usable_cores()
        others = None
        if self._busy0 is not None and busy1 is not None and wall >= MIN_WINDOW_S:
            others = min(float(cores), max(0.0, (busy1 - self._busy0 - own) / wall))
        return judge(cores, os.cpu_count() or cores, threads if threads is not None else _torch_threads(),
                     self._load, others, wall)


def start() -> Monitor:
    return Monitor()


def snapshot(threads: Optional[int] = None) -> Contention:
    """Conditions now, without a window (load average and thread count only)."""
    return Monitor().stop(threads)
