"""Timings that a second run reproduces: every provider measured in each of several rounds,
in an order that rotates from round to round (no provider always runs first, or always
right after the heaviest one), each measurement in its own process; a ratio between two
providers is taken per round (the two ran minutes apart, under the same conditions) and
reported as its median with its spread, the range over the rounds.

Rounds go on past ``rounds`` while a ratio's spread is wider than ``spread`` (relative to
its median), up to ``max_rounds``; the table says how many ran. Memory (peak RSS) does not
depend on the load: the median over the rounds is kept.
"""

from __future__ import annotations

import statistics
import sys
from typing import Dict, Iterable, List, Sequence, Tuple

from pyattr.bench.e2e import child_row

ROUNDS = 3
MAX_ROUNDS = 6
SPREAD = 0.10


def rotated(items: Sequence, k: int) -> List:
    k %= max(1, len(items))
    return list(items[k:]) + list(items[:k])


def ratio_stats(num: Sequence[float], den: Sequence[float]) -> Dict[str, float]:
    """Per-round ratios ``num[i] / den[i]``: their median, minimum and maximum."""
    rs = [a / b for a, b in zip(num, den)]
    return {"median": statistics.median(rs), "min": min(rs), "max": max(rs), "rounds": len(rs)}


def relative_spread(stats: Dict[str, float]) -> float:
    return (stats["max"] - stats["min"]) / abs(stats["median"]) if stats["median"] else float("inf")


def interleaved_grid(module: str, flag: str, values: Iterable, variants: Sequence[str], extra: List[str], what: str,
                     pairs: Sequence[Tuple[str, str]] = (), rounds: int = ROUNDS, max_rounds: int = MAX_ROUNDS,
                     spread: float = SPREAD, commands: Dict[str, List[str]] = None) -> List[Dict]:
    """One row per value × variant: ``python -m MODULE --variant V FLAG X EXTRA`` run once per
    round, the variants' order rotated each round. A row is the round with the median time;
    it carries ``seconds`` (median), ``seconds_min``/``seconds_max``, ``seconds_rounds`` and,
    for each ``(variant, baseline)`` of ``pairs``, ``over_<baseline>`` = :func:`ratio_stats`
    on the variant's row. ``commands`` maps a variant to the command that replaces
    ``python -m MODULE`` for it (a peer measured by another environment's Python)."""
    values = list(values)
    samples: Dict[Tuple, List[Dict]] = {(x, v): [] for x in values for v in variants}
    done = 0
    while True:
        for x in values:
            for v in rotated(variants, done):
                head = (commands or {}).get(v) or [sys.executable, "-m", module]
                cmd = [*head, "--variant", v, flag, str(x), *extra]
                samples[(x, v)].append(child_row(cmd, f"{what} {v} {x} (round {done + 1})"))
        done += 1
        if done < rounds:
            continue
        widest = max((relative_spread(ratio_stats([r["seconds"] for r in samples[(x, a)]],
                                                  [r["seconds"] for r in samples[(x, b)]]))
                      for x in values for a, b in pairs), default=0.0)
        if widest <= spread or done >= max_rounds:
            break
    rows = []
    for x in values:
        for v in variants:
            runs = samples[(x, v)]
            secs = [r["seconds"] for r in runs]
            row = dict(sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2])
            row.update(seconds=statistics.median(secs), seconds_min=min(secs), seconds_max=max(secs),
                       seconds_rounds=secs, rounds=len(runs))
            if all("peak_extra_bytes" in r for r in runs):
                row["peak_extra_bytes"] = statistics.median(r["peak_extra_bytes"] for r in runs)
            rows.append(row)
    by = {(r[_key(flag)], r["variant"]): r for r in rows}
    for x in values:
        for a, b in pairs:
            if (x, a) in by and (x, b) in by:
                by[(x, a)][f"over_{b}"] = ratio_stats(by[(x, a)]["seconds_rounds"], by[(x, b)]["seconds_rounds"])
    return rows


def _key(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def ratio_text(stats) -> str:
    """``0.54 (0.51–0.57)``: the median ratio and its range over the rounds."""
    if not stats:
        return ""
    return f"{stats['median']:.2f} ({stats['min']:.2f}–{stats['max']:.2f})"


def lxt_lines(rows: List[Dict], head: str, sep: str, cells) -> List[str]:
    """The table of pyattr's AttnLRP over LXT's two forms, per round, and the line naming
    LXT's environment (none without LXT rows): ``head`` / ``sep`` the key columns' header
    and alignment cells, ``cells(row)`` their values."""
    peer = [r for r in rows if r["variant"] == "attnlrp" and "over_lxt" in r]
    if not peer:
        return []
    lines = ["", "pyattr's AttnLRP over LXT's, per round (time):", "",
             f"| {head} | / LXT as its README runs it | / LXT, logits_to_keep=1 |", f"|{sep}---:|---:|"]
    lines += [f"| {cells(r)} | {ratio_text(r['over_lxt'])} | {ratio_text(r['over_lxt_cut'])} |" for r in peer]
    lxt = next(r for r in rows if r["variant"] == "lxt")
    return lines + ["", f"LXT ran in its own environment: {lxt.get('peer_versions', 'versions not reported')}."]


def versions_line(*packages: str) -> str:
    """The versions the numbers were measured with (Python, torch, transformers, pyattr and
    its commit, and ``packages`` where installed), and the machine (CPU model and kernel
    build: runs on two hosts of one VM type differed by 2.7× in the project's history)."""
    import platform
    from importlib import metadata

    import torch

    from pyattr._version import __version__
    from pyattr.bench.report import git_commit

    from pyattr.bench.report import cpu_model

    parts = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    for name in ("transformers", *packages):
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    commit = git_commit()
    parts.append(f"pyattr {__version__}" + (f" @ {commit[:10]}" if commit else ""))
    host = f"{cpu_model() or platform.machine()}, kernel {platform.release()}"
    return "Versions: " + ", ".join(parts) + f". Machine: {host}."
