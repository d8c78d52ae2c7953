"""A progress bar for long method runs (rich, on stderr, only on a terminal)."""

from __future__ import annotations

import sys
import time


class Progress:
    """A transient rich progress bar on stderr, shown when stderr is a terminal and the
    run has taken more than ~1 s (shorter runs print nothing)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.start, self.bar, self.task = total, label, time.perf_counter(), None, None
        self.off = False  # rich is not installed

    def advance(self, done: int) -> None:
        if self.bar is None:
            if self.off or time.perf_counter() - self.start < 1.0 or not sys.stderr.isatty() or done >= self.total:
                return
            try:
                from rich.console import Console
                from rich.progress import Progress
            except ImportError:  # rich is optional (the demo / dev extras)
                self.off = True
                return
            self.bar = Progress(console=Console(file=sys.stderr), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=self.total)
        self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
