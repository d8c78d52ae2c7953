"""Benchmark output: the JSON document (one row per measurement) and markdown tables.

Schema ``pyattr-bench/2`` (``/1`` documents still validate) adds:

* ``contention`` (top level): the CPU conditions of the run, :mod:`pyattr.apps.contention`:
  ``cores``, ``cpu_count``, ``threads``, ``load_avg_1min``, ``others_busy_cores``,
  ``window_s``, ``oversubscribed``, ``reasons``, ``warning`` (null unless oversubscribed:
  then the timings are unreliable);
* ``ratio_to_torch`` (micro rows): median over the ``pyattr-torch`` (reference backend)
  row of the same op, dtype, shape and mode.
"""

from __future__ import annotations

import os
import platform
import subprocess
from typing import List, Optional

import torch

SCHEMA = "pyattr-bench/2"
LEGACY_SCHEMAS = ("pyattr-bench/1",)

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
    "ratio_to_torch": (float, type(None)),
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


def cpu_model() -> Optional[str]:
    """The CPU's model name (``/proc/cpuinfo``; None elsewhere): ``platform.processor()``
    says only ``x86_64`` on Linux, and two runs on different hosts must be told apart."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


CONTENTION_FIELDS = {
    "cores": int,
    "cpu_count": int,
    "threads": int,
    "load_avg_1min": (float, type(None)),
    "others_busy_cores": (float, type(None)),
    "window_s": float,
    "oversubscribed": bool,
    "reasons": list,
    "warning": (str, type(None)),
}


def document(kind: str, device: torch.device, rows: List[dict], contention=None, **extra) -> dict:
    """The JSON document; every row also carries the machine, torch version and commit,
    so rows stay self-describing when results of several runs are concatenated.
    ``contention``: the :class:`~pyattr.apps.contention.Contention` measured over the
    run (default: a snapshot now, load average and threads only)."""
    from pyattr._version import __version__
    from pyattr.backends import available_backends
    import pyattr.apps.contention as _contention

    if contention is None:
        contention = _contention.snapshot()

    commit = git_commit()
    where = machine(device)
    tag = f"{where.get('cpu_model') or where['processor']} {where['cpu_count']} cores" + (f" {where['gpu']}" if "gpu" in where else "")
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
        "contention": contention.to_json(),
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
    if doc["schema"] != SCHEMA and doc["schema"] not in LEGACY_SCHEMAS:
        raise ValueError(f"benchmark JSON: schema {doc['schema']!r}, expected {SCHEMA!r}")
    legacy = doc["schema"] in LEGACY_SCHEMAS
    if not doc["rows"]:
        raise ValueError("benchmark JSON: no rows")
    if not legacy:
        _validate_contention(doc.get("contention"))
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
            fields = {k: v for k, v in ROW_FIELDS.items() if not (legacy and k == "ratio_to_torch")}
            missing = set(fields) - set(row)
            if missing:
                raise ValueError(f"benchmark JSON: row {i} lacks {sorted(missing)}")
            for k, typ in fields.items():
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
    elif doc["kind"] in _ROW_NUMBERS:
        for i, row in enumerate(doc["rows"]):
            if not isinstance(row, dict):
                raise ValueError(f"benchmark JSON: row {i} is not an object")
            # the circuits benchmark has rows of node circuits beside those of edges
            strings, numbers = _NODE_CIRCUIT_ROWS if doc["kind"] == "circuits" and row.get("level") == "nodes" \
                else _ROW_NUMBERS[doc["kind"]]
            for k in strings:
                if not isinstance(row.get(k), str):
                    raise ValueError(f"benchmark JSON: row {i} field {k!r} missing or not a string")
            for k in numbers:
                _finite_nonneg(row.get(k), f"row {i} field {k!r}")
            for k in _SIGNED.get(doc["kind"], ()):
                v = row.get(k)
                if v is not None and not (isinstance(v, (int, float)) and -1.0 <= v <= 1.0):
                    raise ValueError(f"benchmark JSON: row {i} field {k!r} must be a correlation in [-1, 1] or null, got {v!r}")
    else:
        raise ValueError(f"benchmark JSON: kind {doc['kind']!r}, expected one of {['micro', 'e2e', *_ROW_NUMBERS]}")


# the attribution benchmarks' rows: (string fields, finite non-negative number fields)
_ROW_NUMBERS = {
    "conservation": (("dtype", "impl", "layer"), ("median_rel_error", "max_rel_error")),
    "ig-memory": (("dtype", "device"), ("n_steps", "peak_bytes", "seconds", "abs_convergence_delta")),
    "patching": (("model", "method", "variant", "node"), ("nodes", "pairs", "seconds")),
    "generation": (("variant", "model"), ("steps", "prompt", "seconds", "peak_rss_bytes", "peak_extra_bytes",
                                          "time_over_loop", "time_over_inseq")),
    "generation-long": (("variant", "model"), ("steps", "prompt", "seconds", "peak_rss_bytes", "peak_extra_bytes",
                                               "time_over_loop")),
    "long-context": (("variant", "model"), ("context", "seconds", "seconds_min", "seconds_max", "rounds",
                                            "peak_rss_bytes", "peak_extra_bytes", "bytes_per_1k", "memory_over_plain")),
    "scale": (("variant", "model", "dtype"), ("context", "seconds", "seconds_min", "seconds_max", "rounds",
                                              "peak_rss_bytes", "peak_extra_bytes", "memory_over_plain", "parameters")),
    "estimators": (("model", "variant", "node"), ("pairs", "seconds")),
    "frameworks": (("variant", "model"), ("seq", "seconds", "seconds_min", "seconds_max", "rounds", "peak_rss_bytes",
                                          "peak_extra_bytes")),
    "faithfulness": (("model", "method"), ("rows", "ms", "time_ratio_to_ig", "abpc_sem")),
    "citations": (("model", "method"), ("examples", "sources", "forwards", "ms_per_example", "lds_se", "top1")),
    "circuits": (("model", "variant"), ("pairs", "edges", "seconds", "top2_equal_exact", "cmd",
                                        "time_over_exact")),
    "dataset": (("config", "device", "dtype"), ("processes", "prompts", "tokens", "seconds", "prompts_per_s",
                                               "tokens_per_s", "peak_rss_bytes")),
}
# the circuits benchmark's rows of node circuits
_NODE_CIRCUIT_ROWS = (("model", "variant", "level"), ("pairs", "nodes", "seconds", "cpr", "cmd", "held_out_cpr",
                                                      "held_out_cmd"))
# correlations: finite, in [-1, 1], or null where undefined (a constant estimate)
_SIGNED = {"patching": ("pearson", "spearman"), "estimators": ("pearson", "spearman"), "citations": ("lds",),
           "circuits": ("pearson",)}


def _validate_contention(c) -> None:
    if not isinstance(c, dict):
        raise ValueError("benchmark JSON: field 'contention' missing or not dict")
    for k, typ in CONTENTION_FIELDS.items():
        if k not in c:
            raise ValueError(f"benchmark JSON: contention lacks {k!r}")
        v = c[k]
        if not isinstance(v, typ) or (isinstance(v, bool) and typ is not bool):
            raise ValueError(f"benchmark JSON: contention field {k!r} has type {type(v).__name__}")
    for k in ("cores", "cpu_count", "threads"):
        _finite_nonneg(c[k], f"contention field {k!r}", positive=True)
    if c["oversubscribed"] != bool(c["reasons"]) or (c["warning"] is None) == c["oversubscribed"]:
        raise ValueError("benchmark JSON: contention 'oversubscribed', 'reasons' and 'warning' disagree")


def with_conditions(lines, contention) -> str:
    """A markdown table's lines, then the run's CPU conditions when they were measured, as
    one text."""
    if contention is not None:
        lines = [*lines, "", conditions(contention)]
    return "\n".join(lines) + "\n"


def conditions(contention) -> str:
    """Markdown lines on the CPU conditions: a warning first when they ruin the timings."""
    if contention is None:
        return ""
    text = f"Conditions: {contention.summary()}.\n\n"
    if contention.warning:
        text = f"**Warning: {contention.warning}.**\n\n" + text
    return text


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def summary(rows: List[dict], mode: str = "fwd+bwd") -> str:
    """One line per op × activation × dtype × shape at ``mode``: native, unfused and every
    pyattr backend's median ms side by side, each compiled backend divided by the
    ``torch`` reference, by native and by the unfused rules, and bytes saved for backward
    over input bytes per provider."""
    rows = [r for r in rows if r["mode"] == mode]
    providers = []
    for r in rows:
        if r["provider"] not in providers:
            providers.append(r["provider"])
    # native, unfused, pyattr-torch first (when measured), then the other backends as measured
    order = [p for p in ("native", "unfused", "pyattr-torch") if p in providers]
    order += [p for p in providers if p not in order]
    compiled = [p for p in order if p.startswith("pyattr-") and p != "pyattr-torch"]
    cases, by = [], {}
    for r in rows:
        key = (r["op"], r["activation"], r["dtype"], tuple(r["shape"]))
        if key not in by:
            cases.append(key)
            by[key] = {}
        by[key][r["provider"]] = r
    head = ["op", "dtype", "shape"] + [f"{p} ms" for p in order]
    for p in compiled:
        b = p.split("-", 1)[1]
        head += [f"{b} ÷ torch", f"{b} ÷ native", f"{b} ÷ unfused"]
    head.append("saved/inputs " + " · ".join(p.replace("pyattr-", "") for p in order))
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 4) + "---|"]
    for key in cases:
        op, act, dtype, shape = key
        got = by[key]
        cells = [f"{op} {act}" if act else op, dtype, "×".join(map(str, shape))]
        cells += [_fmt(got[p]["median_ms"], ".3f") if p in got else "" for p in order]
        for p in compiled:
            r = got.get(p)
            cells += [_fmt(r and r.get("ratio_to_torch"), ".2f"), _fmt(r and r["ratio_to_native"], ".2f"),
                      _fmt(r and r["ratio_to_unfused"], ".2f")]
        cells.append(" · ".join(_fmt(got[p]["saved_ratio_to_inputs"], ".1f") if p in got else "–" for p in order))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(rows: List[dict], copy_bw: float, title: str, contention=None, allocator: Optional[str] = None) -> str:
    """The run as markdown: the CPU conditions (a warning when oversubscribed), the
    allocator setting when one was made, the fwd+bwd summary (:func:`summary`), then
    every measurement."""
    head = (
        f"### {title}\n\n{conditions(contention)}" + (f"Allocator: {allocator}.\n\n" if allocator else "")
        + f"Copy bandwidth measured in the same run: {copy_bw:.1f} GB/s.\n\n"
        + ("Forward + backward, median ms (`torch` is pyattr's reference backend):\n\n" + summary(rows)
           if any(r["mode"] == "fwd+bwd" for r in rows) else "")
        + (("\nFrozen attention (AH-rule), backward only, median ms (causal, batch 1, hidden 1024; shape is "
            "seq×head_dim):\n\n" + summary([r for r in rows if r["op"] == "attention"], mode="bwd"))
           if any(r["op"] == "attention" for r in rows) else "")
        + "\nEvery measurement:\n\n"
        "| op | act | dtype | shape | mode | provider | median ms | p20–p80 ms | saved / inputs | GB/s | % copy bw | × native | × unfused | × torch |\n"
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['op']} | {r['activation'] or ''} | {r['dtype']} | {'×'.join(map(str, r['shape']))} | {r['mode']} | "
        f"{r['provider']} | {r['median_ms']:.3f} | {r['p20_ms']:.3f}–{r['p80_ms']:.3f} | "
        f"{r['saved_ratio_to_inputs']:.2f} | {r['gbps']:.1f} | {100 * r['frac_of_copy_bandwidth']:.0f} | "
        f"{_fmt(r['ratio_to_native'], '.2f')} | {_fmt(r['ratio_to_unfused'], '.2f')} | {_fmt(r.get('ratio_to_torch'), '.2f')} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"
