"""Peak memory of :func:`pyattr.integrated_gradients` against ``n_steps``, at a fixed
``internal_batch_size`` and without one, on the e2e Llama with random weights.

On CPU each configuration runs in its own process and reports that process's peak
resident set size (model weights included, the same in every row); on CUDA,
``torch.cuda.max_memory_allocated`` over the call, above the model.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Dict, List, Optional

import torch

STEPS = (16, 64, 256)


def measure(device: str, dtype: torch.dtype, n_steps: int, chunk: Optional[int], layers: int = 2, seq: int = 128) -> Dict:
    import pyattr
    import pyattr.bench.e2e as e2e

    model, _ = e2e.build_model(device, dtype, layers)
    model.config.pad_token_id = 0
    ids = torch.randint(0, 32000, (1, seq), generator=torch.Generator().manual_seed(3)).to(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    res = pyattr.integrated_gradients(model, ids, target=5, baseline="pad", n_steps=n_steps, internal_batch_size=chunk)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) if device == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "n_steps": n_steps,
        "internal_batch_size": chunk,
        "dtype": str(dtype).replace("torch.", ""),
        "device": device,
        "seq": seq,
        "layers": layers,
        "hidden": model.config.hidden_size,
        "seconds": elapsed,
        "peak_bytes": int(peak),
        "peak_kind": "cuda max_memory_allocated above the model" if device == "cuda" else "process peak RSS",
        "abs_convergence_delta": float(res.convergence_delta.abs().max()),
    }


def run_all(device: str, dtype: torch.dtype, chunk: int = 16, steps=STEPS, unchunked=(16, 64)) -> List[Dict]:
    import pyattr.bench.e2e as e2e

    configs = [(n, chunk) for n in steps] + [(n, None) for n in unchunked]
    rows = []
    for n, c in configs:
        if device == "cpu":  # one process each: peak RSS cannot be reset in-process
            cmd = [sys.executable, "-m", "pyattr.bench.ig_memory", "--child", str(n), "--dtype",
                   str(dtype).replace("torch.", "")] + (["--chunk", str(c)] if c else [])
            rows.append(e2e.child_row(cmd, f"IG memory run n_steps={n} chunk={c}"))
        else:
            rows.append(measure(device, dtype, n, c))
    return rows


def markdown(rows: List[Dict], contention=None) -> str:
    from pyattr.bench.report import conditions

    lines = [conditions(contention).rstrip("\n"), ""] if contention is not None else []
    lines += ["| n_steps | internal_batch_size | peak MiB | seconds | abs convergence delta |", "|---:|---:|---:|---:|---:|"]
    for r in rows:
        chunk = r["internal_batch_size"] if r["internal_batch_size"] else "all"
        lines.append(f"| {r['n_steps']} | {chunk} | {r['peak_bytes'] / 2**20:.0f} | {r['seconds']:.2f} | "
                     f"{r['abs_convergence_delta']:.2e} |")
    return "\n".join(lines) + "\n"


def _child_main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--child", type=int, required=True, help="n_steps")
    p.add_argument("--chunk", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)
    print(json.dumps(measure("cpu", getattr(torch, a.dtype), a.child, a.chunk)))


if __name__ == "__main__":
    _child_main()
