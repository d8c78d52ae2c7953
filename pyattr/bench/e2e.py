"""End-to-end relevance run on a Llama-architecture model with random weights.

Variants, each measured for wall time and peak memory:

* ``plain``   forward + backward of the target to the input embeddings, no rules;
* ``plain_kept`` the same with the language-model head run at the target's position
  only (``logits_to_keep=1``), as ``pyattr.relevance`` runs it: what the head alone
  accounts for in the ratio to ``plain``;
* ``pyattr``  :func:`pyattr.relevance` with all four rules and the best backend;
* ``unfused`` the same four rules written as separate PyTorch ops (TransformerLens /
  LXT style, :mod:`pyattr.bench.unfused`), same target, same input;
* ``k_targets`` :func:`pyattr.relevance` of k next-token logits in one call (one
  forward, one batched backward), and ``k_calls`` the same k targets as k calls.

On CPU each variant runs in its own process and its peak memory is that process's
peak resident set size (model weights included, the same for every variant); on CUDA it
is ``torch.cuda.max_memory_allocated`` over the measured pass. The times on CPU come from
one more process that runs every variant in turn, one pass each per round, so that a
slow phase of a shared machine lands on all of them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Dict, List

import torch

SIZES = {
    # CPU: sized to a 2-core, 24 GB machine
    "cpu": dict(num_hidden_layers=8, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                num_key_value_heads=16, seq=512),
    # CUDA: ~1.1B parameters (TinyLlama-shaped)
    "cuda": dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                 num_key_value_heads=4, seq=4096),
}
VARIANTS = ("plain", "plain_kept", "pyattr", "unfused")
K_VARIANTS = ("k_targets", "k_calls")
# ``--compile``: pyattr.relevance on torch.compile(model) (inductor); the first pass,
# which compiles, is timed apart as compile_s
COMPILED = "compiled"


def build_model(device: str, dtype: torch.dtype, layers: int = None, seq: int = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(SIZES[device])
    seq = size.pop("seq") if seq is None else seq
    if layers is not None:
        size["num_hidden_layers"] = layers
    cfg = LlamaConfig(vocab_size=32000, max_position_embeddings=max(seq, 2048), **size)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    # built directly in `dtype`, so that construction does not set the process peak
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model = model.to(dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, seq


@contextlib.contextmanager
def unfused_rules(model):
    """Install the unfused rule composition on a Llama model (instance patches)."""
    import pyattr.bench.unfused as unfused

    patched = []

    def put(mod, fwd):
        mod.forward = fwd
        patched.append(mod)

    for mod in model.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm"):
            put(mod, lambda x, m=mod: unfused.rms_norm_unfused(x, m.weight, m.variance_epsilon))
        elif name.endswith("MLP"):
            put(mod, lambda x, m=mod: m.down_proj(unfused.gated_unfused(m.gate_proj(x), m.up_proj(x), m.act_fn)))
        elif name.endswith("Attention"):
            for proj in (mod.q_proj, mod.k_proj):
                put(proj, lambda x, p=proj: torch.nn.functional.linear(x, p.weight, p.bias).detach())
    try:
        yield
    finally:
        for mod in patched:
            del mod.__dict__["forward"]


def one_pass(model, variant: str, ids: torch.Tensor, target: int, k: int = 8):
    import pyattr

    if variant == "pyattr":
        return pyattr.relevance(model, ids, target=target).token_relevance
    if variant == COMPILED:
        cm = model.__dict__.setdefault("_pyattr_bench_compiled", torch.compile(model))
        return pyattr.relevance(cm, ids, target=target).token_relevance
    if variant == "k_targets":
        tk = torch.arange(target, target + k, device=ids.device).expand(ids.shape[0], k)
        return pyattr.relevance(model, ids, target=tk).token_relevance
    if variant == "k_calls":
        return torch.stack([pyattr.relevance(model, ids, target=target + j).token_relevance for j in range(k)])
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    ctx = unfused_rules(model) if variant == "unfused" else contextlib.nullcontext()
    keep = {"logits_to_keep": 1} if variant == "plain_kept" else {}
    with ctx:
        out = model(inputs_embeds=emb, **keep).logits[:, -1, target].sum()
        (g,) = torch.autograd.grad(out, emb)
    return (emb * g).sum(-1)


def saved_activation_bytes(model, variant: str, ids, target: int, k: int = 8) -> int:
    """Bytes autograd keeps for the backward in one pass: distinct saved storages that are
    not model parameters (those exist anyway)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: Dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        one_pass(model, variant, ids, target, k)
    return sum(seen.values())


def measure(device: str, dtype: torch.dtype, variant: str, repeats: int, layers: int = None, k: int = 8,
            seq: int = None) -> Dict:
    model, seq = build_model(device, dtype, layers, seq)
    ids = torch.randint(0, 32000, (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    saved = saved_activation_bytes(model, variant, ids, 5, k)  # also the warm-up (and the compile)
    sync()
    first_s = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        one_pass(model, variant, ids, 5, k)
        sync()
        ts.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) if device == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "variant": variant,
        "k": k if variant in K_VARIANTS else 1,
        "dtype": str(dtype).replace("torch.", ""),
        "device": device,
        "seq": seq,
        "layers": model.config.num_hidden_layers,
        "hidden": model.config.hidden_size,
        # repeats=0 (a CPU peak-only child): the times come from the interleaved process
        "median_s": statistics.median(ts) if ts else None,
        "min_s": min(ts) if ts else None,
        "max_s": max(ts) if ts else None,
        "peak_bytes": int(peak),
        "saved_bytes": int(saved),
        "peak_kind": "cuda max_memory_allocated above the model" if device == "cuda" else "process peak RSS",
        **({"compile_s": first_s} if variant == COMPILED else {}),
    }


def time_interleaved(device: str, dtype: torch.dtype, variants: List[str], repeats: int, layers: int = None,
                     k: int = 8, seq: int = None) -> Dict[str, List[float]]:
    """Seconds per pass of each variant on one model, the variants taken in turn: a
    warm-up pass of each (a compiled variant compiles then), then ``repeats`` rounds of
    one pass each."""
    model, seq = build_model(device, dtype, layers, seq)
    ids = torch.randint(0, 32000, (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for v in variants:
        one_pass(model, v, ids, 5, k)
    out: Dict[str, List[float]] = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            sync()
            t0 = time.perf_counter()
            one_pass(model, v, ids, 5, k)
            sync()
            out[v].append(time.perf_counter() - t0)
    return out


class E2EError(RuntimeError):
    """A measurement process failed; the message carries the end of its stderr."""


def child_row(cmd: List[str], what: str) -> Dict:
    """Run a measurement in its own process (its peak RSS is its own) and return the JSON
    row it prints last; E2EError with the end of its stderr if it fails."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        tail = " ".join(out.stderr.strip().splitlines()[-1:]) or f"exit status {out.returncode}"
        raise E2EError(f"{what} failed: {tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_bytes() -> int:
    """This process's resident set size now (bytes)."""
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (bytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_all(device: str, dtypes: List[torch.dtype], repeats: int, layers: int = None, progress=None,
            k: int = 8, seq: int = None, compiled: bool = False) -> List[Dict]:
    """Every variant per dtype; ``k`` targets for the k-target pair (0: skip the pair);
    ``seq`` overrides the input length (512 on CPU, 4096 on CUDA)."""
    rows = []
    variants = VARIANTS + (K_VARIANTS if k else ()) + ((COMPILED,) if compiled else ())
    for dt in dtypes:
        name = str(dt).replace("torch.", "")
        extra = (["--layers", str(layers)] if layers else []) + (["--seq", str(seq)] if seq else [])
        group = []
        for v in variants:
            if device == "cpu":  # one process per variant: peak RSS cannot be reset in-process
                cmd = [sys.executable, "-m", "pyattr.bench.e2e", "--child", v, "--dtype", name,
                       "--repeats", "0", "--k", str(k)] + extra
                group.append(child_row(cmd, f"e2e variant {v!r} ({dt})"))
            else:
                group.append(measure(device, dt, v, repeats, layers, k, seq))
            if progress:
                progress()
        if device == "cpu":
            cmd = [sys.executable, "-m", "pyattr.bench.e2e", "--interleave", ",".join(variants), "--dtype", name,
                   "--repeats", str(repeats), "--k", str(k)] + extra
            times = child_row(cmd, f"e2e interleaved timing ({dt})")
            for r in group:
                ts = times[r["variant"]]
                r.update(median_s=statistics.median(ts), min_s=min(ts), max_s=max(ts), timing="interleaved")
        rows += group
    return rows


def ratios(rows: List[Dict]) -> List[Dict]:
    out = []
    for dt in sorted({r["dtype"] for r in rows}):
        by = {r["variant"]: r for r in rows if r["dtype"] == dt}
        a, b, c = by["plain"], by["pyattr"], by["unfused"]
        extra = {}
        if "k_targets" in by and "k_calls" in by:
            kt, kc = by["k_targets"], by["k_calls"]
            extra = {
                "k": kt["k"],
                "time_k_targets_over_k_calls": kt["median_s"] / kc["median_s"],
                "peak_k_targets_over_k_calls": kt["peak_bytes"] / kc["peak_bytes"],
            }
        if "plain_kept" in by:
            extra["time_pyattr_over_plain_kept"] = b["median_s"] / by["plain_kept"]["median_s"]
        if COMPILED in by:
            extra.update({
                "compiled_s": by[COMPILED]["median_s"], "eager_s": b["median_s"],
                "time_compiled_over_eager": by[COMPILED]["median_s"] / b["median_s"],
                "compile_s": by[COMPILED]["compile_s"],
            })
        out.append({
            "dtype": dt,
            "time_pyattr_over_plain": b["median_s"] / a["median_s"],
            "time_pyattr_over_unfused": b["median_s"] / c["median_s"],
            "peak_pyattr_over_plain": b["peak_bytes"] / a["peak_bytes"],
            "peak_pyattr_over_unfused": b["peak_bytes"] / c["peak_bytes"],
            "saved_pyattr_over_plain": b["saved_bytes"] / a["saved_bytes"],
            "saved_pyattr_over_unfused": b["saved_bytes"] / c["saved_bytes"],
            **extra,
        })
    return out


def markdown(rows: List[Dict], rat: List[Dict], contention=None) -> str:
    """Tables of the run; first the CPU conditions (a warning when oversubscribed)."""
    from pyattr.bench.report import conditions

    lines = [conditions(contention).rstrip("\n"), ""] if contention is not None else []
    seqs = sorted({r["seq"] for r in rows if r.get("seq")})
    if rows:
        r0 = rows[0]
        layers = r0.get("layers")
        lines += [f"Random Llama, {layers} layer{'' if layers == 1 else 's'}, hidden {r0.get('hidden')}, vocabulary 32000, input length "
                  f"{', '.join(map(str, seqs))} tokens, batch 1, median of the repeats. (a) plain: forward + "
                  "backward of the target logit to the input embeddings; (b) pyattr: pyattr.relevance with all "
                  "four rules; (c) unfused: the same rules as separate PyTorch ops; plain_kept: (a) with the head at "
                  "the target position only (logits_to_keep=1), as (b) runs it."
                  + (" Times from one process that runs the variants in turn, one pass each per round; peak memory "
                     "from one process per variant." if r0.get("timing") == "interleaved" else ""), ""]
    lines += ["| dtype | variant | median s | min–max s | peak MiB | saved for backward MiB |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        name = f"{r['variant']} (k={r['k']})" if r.get("k", 1) > 1 else r["variant"]
        lines.append(f"| {r['dtype']} | {name} | {r['median_s']:.3f} | {r['min_s']:.3f}–{r['max_s']:.3f} | "
                     f"{r['peak_bytes'] / 2**20:.0f} | {r['saved_bytes'] / 2**20:.1f} |")
    lines += ["", "| dtype | time (b)/(a) | time (b)/(c) | peak (b)/(a) | peak (b)/(c) | saved (b)/(a) | saved (b)/(c) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for q in rat:
        lines.append(f"| {q['dtype']} | {q['time_pyattr_over_plain']:.2f} | {q['time_pyattr_over_unfused']:.2f} | "
                     f"{q['peak_pyattr_over_plain']:.2f} | {q['peak_pyattr_over_unfused']:.2f} | "
                     f"{q['saved_pyattr_over_plain']:.2f} | {q['saved_pyattr_over_unfused']:.2f} |")
    pk = [q for q in rat if "time_pyattr_over_plain_kept" in q]
    if pk:
        lines += ["", "| dtype | time (b)/plain_kept |", "|---|---:|"]
        lines += [f"| {q['dtype']} | {q['time_pyattr_over_plain_kept']:.2f} |" for q in pk]
    cr = [q for q in rat if "time_compiled_over_eager" in q]
    if cr:
        lines += ["", "| dtype | compiled relevance s | eager relevance s | compiled / eager | compile s (first pass) |",
                  "|---|---:|---:|---:|---:|"]
        for q in cr:
            lines.append(f"| {q['dtype']} | {q['compiled_s']:.3f} | {q['eager_s']:.3f} | "
                         f"{q['time_compiled_over_eager']:.2f} | {q['compile_s']:.1f} |")
    kr = [q for q in rat if "k" in q]
    if kr:
        lines += ["", "| dtype | k | time k_targets / k_calls | peak k_targets / k_calls |", "|---|---:|---:|---:|"]
        for q in kr:
            lines.append(f"| {q['dtype']} | {q['k']} | {q['time_k_targets_over_k_calls']:.2f} | {q['peak_k_targets_over_k_calls']:.2f} |")
    return "\n".join(lines) + "\n"


def _child_main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=VARIANTS + K_VARIANTS + (COMPILED,))
    p.add_argument("--interleave", help="comma-separated variants, timed in turn in this process")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    a = p.parse_args(argv)
    if a.interleave:
        print(json.dumps(time_interleaved("cpu", getattr(torch, a.dtype), a.interleave.split(","), a.repeats, a.layers,
                                          a.k, a.seq)))
        return
    if not a.child:
        p.error("one of --child or --interleave is required")
    row = measure("cpu", getattr(torch, a.dtype), a.child, a.repeats, a.layers, a.k, a.seq)
    print(json.dumps(row))


if __name__ == "__main__":
    _child_main()
