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
    import pyattr.bench.e2e as e2e

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


def _prompts(n: int, vocab: int, lo: int = 16, hi: int = 64, seed: int = 5) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g) for k in lengths]


def _batches(prompts: List[torch.Tensor], size: int):
    """(start, input_ids, attention_mask) per ``size`` prompts, right-padded with 0."""
    for i in range(0, len(prompts), size):
        chunk = prompts[i:i + size]
        width = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, p in enumerate(chunk):
            ids[j, :len(p)] = p
            mask[j, :len(p)] = 1
        yield i, ids, mask


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-300))


def measure_prompts(device: str, dtypes: List[torch.dtype], n: int = 100, layers: int = 8, batch: int = 10) -> List[Dict]:
    """Conservation at the input over ``n`` random prompts of 16-64 tokens (padded batches),
    and agreement with the float32 run, per (dtype, implementation).

    The float32 model and each reduced-precision model hold the same weights (built in
    float32, then cast). Every run explains the float32 run's top-1 next token. Per prompt:
    ``|target − Σ relevance| / |target|``; the Pearson correlation of its token relevance
    with the float32 pyattr run's; and the overlap of the 10 tokens of largest |relevance|
    (shared tokens / 10). One row per (dtype, impl) with the median, 90th percentile and
    max of each."""
    import pyattr
    import pyattr.bench.e2e as e2e

    prompts = _prompts(n, CONFIG["vocab_size"])
    base = build_model(device, torch.float32, layers)
    reference, targets = [], []
    for _, ids, mask in _batches(prompts, batch):
        res = pyattr.relevance(base, ids.to(device), attention_mask=mask.to(device))
        targets.append(res.target_ids)
        reference += [res.token_relevance[j, :int(m.sum())].cpu() for j, m in enumerate(mask)]
    rows = []
    for dt in dtypes:
        model = build_model(device, dt, layers)
        for impl in ("pyattr", "unfused"):
            err, err32, corr, top = [], [], [], []
            for b, (start, ids, mask) in enumerate(_batches(prompts, batch)):
                ids, mask = ids.to(device), mask.to(device)
                seen = []
                # the final norm's output: the head's input at every position (the head itself may
                # run at the target positions only)
                hook = model.model.norm.register_forward_hook(lambda mod, args, out: seen.append(out.detach()))
                if impl == "pyattr":
                    res = pyattr.relevance(model, ids, target=targets[b], attention_mask=mask)
                else:
                    with e2e.unfused_rules(model):
                        res = pyattr.relevance(model, ids, target=targets[b], attention_mask=mask,
                                               rules=pyattr.RelevanceRules())
                hook.remove()
                err += (res.conservation_delta.abs() / res.target.abs()).tolist()
                # the same logit before its rounding to `dt`: the head's input and weight row
                # multiplied in float64 (what a float32-accumulating matmul holds before storing)
                last = mask.sum(1) - 1
                h = seen[0][torch.arange(len(ids)), last].double()
                logit = (h * model.lm_head.weight[res.target_ids.to(device)].double()).sum(-1).cpu()
                err32 += ((logit - res.token_relevance.double().sum(1)).abs() / logit.abs()).tolist()
                for j, m in enumerate(mask):
                    r, ref = res.token_relevance[j, :int(m.sum())].cpu(), reference[start + j]
                    corr.append(_pearson(r, ref))
                    k = min(10, len(r))
                    top.append(len(set(r.abs().topk(k).indices.tolist()) & set(ref.abs().topk(k).indices.tolist())) / k)
            row = {"dtype": str(dt).replace("torch.", ""), "impl": impl, "prompts": n,
                   "hidden": model.config.hidden_size, "layers": model.config.num_hidden_layers}
            for name, vals in (("rel_error", err), ("unrounded_rel_error", err32)):
                q = sorted(vals)
                row.update({f"{name}_median": statistics.median(q), f"{name}_p90": q[int(0.9 * (len(q) - 1))],
                            f"{name}_max": q[-1]})
            for name, vals in (("pearson", corr), ("top10_overlap", top)):
                q = sorted(vals)
                row.update({f"{name}_median": statistics.median(q), f"{name}_p10": q[int(0.1 * (len(q) - 1))],
                            f"{name}_min": q[0]})
            rows.append(row)
        del model
    return rows


def prompts_markdown(rows: List[Dict]) -> str:
    lines = ["| dtype | impl | conservation error median | p90 | max | against the unrounded logit: median | p90 | "
             "1 − Pearson vs float32: median | p90 | top-10 overlap: median | p10 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['impl']} | {r['rel_error_median']:.2e} | {r['rel_error_p90']:.2e} | "
                     f"{r['rel_error_max']:.2e} | {r['unrounded_rel_error_median']:.2e} | "
                     f"{r['unrounded_rel_error_p90']:.2e} | {1 - r['pearson_median']:.1e} | "
                     f"{1 - r['pearson_p10']:.1e} | {r['top10_overlap_median']:.2f} | {r['top10_overlap_p10']:.2f} |")
    by = {(r["dtype"], r["impl"]): r for r in rows}
    lines += ["", "| dtype | pyattr / unfused, median error | the same against the unrounded logit |", "|---|---:|---:|"]
    for dt in dict.fromkeys(r["dtype"] for r in rows):
        p, u = by[(dt, "pyattr")], by[(dt, "unfused")]
        ratios = [p[k] / u[k] if u[k] else float("nan") for k in ("rel_error_median", "unrounded_rel_error_median")]
        lines.append(f"| {dt} | {ratios[0]:.2f} | {ratios[1]:.2f} |")
    return "\n".join(lines) + "\n"


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
