"""Benchmark output: the JSON document (one row per measurement) and a markdown table."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import List, Optional

import torch

SCHEMA = "pyattr-bench/1"

ROW_FIELDS = {
    "op": str,
    "activation": (str, type(None)),
    "provider": str,
    "dtype": str,
    "shape": list,
    "mode": str,
    "median_ms": float,
    "p20_ms": float,
    "p80_ms": float,
    "saved_bytes": int,
    "saved_ratio_to_inputs": float,
    "peak_bytes": (int, type(None)),
    "gbps": float,
    "frac_of_copy_bandwidth": float,
    "ratio_to_native": (float, type(None)),
    "ratio_to_unfused": (float, type(None)),
    "machine": str,
    "torch_version": str,
    "git_commit": (str, type(None)),
}


def git_commit() -> Optional[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def document(kind: str, device: torch.device, rows: List[dict], **extra) -> dict:
    """The JSON document; every row also carries the machine, torch version and commit,
    so rows stay self-describing when results of several runs are concatenated."""
    from pyattr import __version__, available_backends

    commit = git_commit()
    where = machine(device)
    tag = f"{where['processor']} {where['cpu_count']} cores" + (f" {where['gpu']}" if "gpu" in where else "")
    for r in rows:
        r.setdefault("machine", tag)
        r.setdefault("torch_version", torch.__version__)
        r.setdefault("git_commit", commit)
    return {
        "schema": SCHEMA,
        "kind": kind,
        "pyattr_version": __version__,
        "torch_version": torch.__version__,
        "git_commit": commit,
        "machine": where,
        "backends": {n: {"available": s.available, "reason": s.reason} for n, s in available_backends().items()},
        **extra,
        "rows": rows,
    }


def _finite_nonneg(v, what: str, positive: bool = False) -> None:
    import math

    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"benchmark JSON: {what} must be a finite {'positive' if positive else 'non-negative'} number, got {v!r}")


def validate(doc: dict) -> None:
    """Check a micro-benchmark JSON document against the schema; raise ValueError if not."""
    for key, typ in (("schema", str), ("kind", str), ("torch_version", str), ("machine", dict), ("rows", list)):
        if not isinstance(doc.get(key), typ):
            raise ValueError(f"benchmark JSON: field {key!r} missing or not {typ.__name__}")
    if doc["schema"] != SCHEMA:
        raise ValueError(f"benchmark JSON: schema {doc['schema']!r}, expected {SCHEMA!r}")
    if not doc["rows"]:
        raise ValueError("benchmark JSON: no rows")
    if doc["kind"] == "e2e":
        for i, row in enumerate(doc["rows"]):
            if not isinstance(row, dict):
                raise ValueError(f"benchmark JSON: row {i} is not an object")
            for k in ("variant", "dtype", "device"):
                if not isinstance(row.get(k), str):
                    raise ValueError(f"benchmark JSON: row {i} field {k!r} missing or not a string")
            for k in ("median_s", "min_s", "max_s", "peak_bytes", "saved_bytes"):
                _finite_nonneg(row.get(k), f"row {i} field {k!r}")
    elif doc["kind"] == "micro":
        _finite_nonneg(doc.get("copy_bandwidth_gbps"), "copy_bandwidth_gbps", positive=True)
        for i, row in enumerate(doc["rows"]):
            if not isinstance(row, dict):
                raise ValueError(f"benchmark JSON: row {i} is not an object")
            missing = set(ROW_FIELDS) - set(row)
            if missing:
                raise ValueError(f"benchmark JSON: row {i} lacks {sorted(missing)}")
            for k, typ in ROW_FIELDS.items():
                if not isinstance(row[k], typ) or isinstance(row[k], bool):
                    raise ValueError(f"benchmark JSON: row {i} field {k!r} has type {type(row[k]).__name__}")
            for k in ("median_ms", "p20_ms", "p80_ms", "saved_bytes", "saved_ratio_to_inputs", "gbps", "frac_of_copy_bandwidth"):
                _finite_nonneg(row[k], f"row {i} field {k!r}")
            if len(row["shape"]) != 2 or not all(isinstance(v, int) and v > 0 for v in row["shape"]):
                raise ValueError(f"benchmark JSON: row {i} shape must be two positive integers")
            if not row["p20_ms"] <= row["median_ms"] <= row["p80_ms"]:
                raise ValueError(f"benchmark JSON: row {i} percentiles out of order")
            if row["mode"] not in ("fwd", "bwd", "fwd+bwd"):
                raise ValueError(f"benchmark JSON: row {i} mode {row['mode']!r}")
    else:
        raise ValueError(f"benchmark JSON: kind {doc['kind']!r}, expected 'micro' or 'e2e'")


def markdown(rows: List[dict], copy_bw: float, title: str) -> str:
    head = (
        f"### {title}\n\nCopy bandwidth measured in the same run: {copy_bw:.1f} GB/s.\n\n"
        "| op | act | dtype | shape | mode | provider | median ms | p20–p80 ms | saved / inputs | GB/s | % copy bw | × native | × unfused |\n"
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )

    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    lines = [
        f"| {r['op']} | {r['activation'] or ''} | {r['dtype']} | {'×'.join(map(str, r['shape']))} | {r['mode']} | "
        f"{r['provider']} | {r['median_ms']:.3f} | {r['p20_ms']:.3f}–{r['p80_ms']:.3f} | "
        f"{r['saved_ratio_to_inputs']:.2f} | {r['gbps']:.1f} | {100 * r['frac_of_copy_bandwidth']:.0f} | "
        f"{f(r['ratio_to_native'], '.2f')} | {f(r['ratio_to_unfused'], '.2f')} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"
