"""Layer-wise conservation in reduced precision: pyattr's fused rules against the unfused
rule composition (:mod:`pyattr.bench.unfused`), on a Llama with random weights
(8 layers, hidden size 256, 8 rows of 64 tokens).

With all four rules on a bias-free decoder, the relevance summed at the input of every
block and of the final norm equals the target (README, Rules). In bfloat16 / float16 the
model computes in that dtype and each layer's relevance ``a · g`` is summed in float32;
the conservation error of a layer is ``|target − Σ relevance| / |target|`` per row. LXT
issue 27 reported this error growing layer by layer in bfloat16; the question measured
here is whether pyattr's fused backwards (float32 accumulation inside each rule) keep it
at or below the unfused composition's.
"""

from __future__ import annotations

import statistics
from typing import Dict, List

import torch


# Small enough for bfloat16 / float16 on a CPU without native 16-bit matmuls (there they
# run ~50x slower than float32); the rules and the error's growth with depth are the same.
CONFIG = dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=4, vocab_size=1024)


def build_model(device: str, dtype: torch.dtype, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, **CONFIG)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def measure(device: str, dtypes: List[torch.dtype], layers: int = 8, seq: int = 64, batch: int = 8) -> List[Dict]:
    """One row per (dtype, implementation, layer): median and max relative error over rows."""
    import pyattr
    from pyattr.bench import e2e

    rows = []
    for dt in dtypes:
        model = build_model(device, dt, layers)
        ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(2)).to(device)
        fused = pyattr.layer_relevance(model, ids, "residual")
        with e2e.unfused_rules(model):
            # every pyattr rule off: the patched modules carry the unfused rules
            plain = pyattr.layer_relevance(model, ids, "residual", target=fused.target_ids, rules=pyattr.RelevanceRules())
        for impl, res in (("pyattr", fused), ("unfused", plain)):
            for depth, path in enumerate(res.paths):
                err = (res[path].conservation_delta.abs() / res.target.abs()).tolist()
                rows.append({
                    "dtype": str(dt).replace("torch.", ""),
                    "impl": impl,
                    "layer": path,
                    "depth": depth,
                    "median_rel_error": statistics.median(err),
                    "max_rel_error": max(err),
                    "rows": batch,
                    "seq": seq,
                    "hidden": model.config.hidden_size,
                    "layers": model.config.num_hidden_layers,
                })
        del model
    return rows


def summary(rows: List[Dict]) -> List[Dict]:
    """Per dtype: the worst layer's max error for each implementation, and their ratio."""
    out = []
    for dt in dict.fromkeys(r["dtype"] for r in rows):
        worst = {impl: max(r["max_rel_error"] for r in rows if r["dtype"] == dt and r["impl"] == impl)
                 for impl in ("pyattr", "unfused")}
        out.append({
            "dtype": dt,
            "pyattr_max_rel_error": worst["pyattr"],
            "unfused_max_rel_error": worst["unfused"],
            "pyattr_over_unfused": worst["pyattr"] / worst["unfused"] if worst["unfused"] else None,
        })
    return out


def markdown(rows: List[Dict], summ: List[Dict], contention=None) -> str:
    from pyattr.bench.report import conditions

    lines = [conditions(contention).rstrip("\n"), ""] if contention is not None else []
    lines += ["| dtype | layer input | pyattr median | pyattr max | unfused median | unfused max |",
              "|---|---|---:|---:|---:|---:|"]
    by = {(r["dtype"], r["impl"], r["layer"]): r for r in rows}
    for r in rows:
        if r["impl"] != "pyattr":
            continue
        u = by[(r["dtype"], "unfused", r["layer"])]
        lines.append(f"| {r['dtype']} | {r['layer']} | {r['median_rel_error']:.2e} | {r['max_rel_error']:.2e} | "
                     f"{u['median_rel_error']:.2e} | {u['max_rel_error']:.2e} |")
    lines += ["", "| dtype | pyattr worst | unfused worst | pyattr / unfused |", "|---|---:|---:|---:|"]
    for s in summ:
        ratio = "n/a" if s["pyattr_over_unfused"] is None else f"{s['pyattr_over_unfused']:.2f}"
        lines.append(f"| {s['dtype']} | {s['pyattr_max_rel_error']:.2e} | {s['unfused_max_rel_error']:.2e} | {ratio} |")
    return "\n".join(lines) + "\n"
