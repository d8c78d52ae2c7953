"""Relevance on weight-quantized models against the full-precision model: how far do the
explanations move when a model is run the way large models often are, quantized?

Models (real weights, offline): the trained toy induction decoder (:mod:`pyattr.toy`,
Llama, hidden 64; 64 prompts of 32 tokens, target the full-precision model's top-1 next
token) and all-MiniLM-L6-v2 (BERT, hidden 384; the 48 sentence pairs of
``benchmarks/data/patching_pairs.jsonl`` joined into one text of 20–30 tokens, target
the cosine of the mean-pooled embedding with the partner sentence's full-precision
embedding). Quantizations as users load them: ``from_pretrained(dir,
quantization_config=TorchAoConfig(...))`` (torchao int8 weight-only; int4 weight-only,
which on CPU is ``IntxWeightOnlyConfig(torch.int4, PerGroup(32))``; int8 dynamic
activation + int8 weight), ``torchao.quantization.quantize_`` on the loaded model (int8
weight-only: the output head too), and bitsandbytes 8-bit / 4-bit where it is installed.
Every quantized model explains the same target ids as the full-precision one.

Per row: top-10 token overlap (|top10(q) ∩ top10(fp)| / 10, per prompt, over the real
tokens), Pearson and Spearman of token relevance (per prompt), the relative conservation
delta (median |delta| / |target|) of both models, the largest relative change of the
target, which linear layers were not quantized, and the time of one relevance call.

    .venv/bin/python benchmarks/quantized_agreement.py            # writes benchmarks/results/cpu_quantized.{json,md}
    .venv/bin/python benchmarks/quantized_agreement.py --quick    # 16 prompts per model, prints only
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "results"
DATA = ROOT / "data" / "patching_pairs.jsonl"
TOP = 10


def _quietly():
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


# --- the quantizations --------------------------------------------------------------------

def torchao_schemes() -> List[Tuple[str, Callable]]:
    import torchao.quantization as tq

    return [
        ("torchao int8 weight-only", tq.Int8WeightOnlyConfig),
        ("torchao int4 weight-only (IntxWeightOnlyConfig int4, group 32)",
         lambda: tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=tq.PerGroup(32))),
        ("torchao int8 dynamic activation + int8 weight", tq.Int8DynamicActivationInt8WeightConfig),
    ]


def refused_on_cpu() -> List[Dict]:
    """torchao configs that cannot be made on this CPU at all (torchao's own error)."""
    import torchao.quantization as tq
    from torchao.quantization.quantize_.workflows.int4.int4_packing_format import Int4PackingFormat

    out = []
    cands = [(f"Int4WeightOnlyConfig(int4_packing_format={f.value!r})",
              lambda f=f: tq.Int4WeightOnlyConfig(group_size=32, int4_packing_format=f)) for f in Int4PackingFormat]
    cands.append(("Float8DynamicActivationFloat8WeightConfig()", tq.Float8DynamicActivationFloat8WeightConfig))
    for name, make in cands:
        for dtype in (torch.float32, torch.bfloat16):
            lin = torch.nn.Linear(64, 64).to(dtype)
            try:
                tq.quantize_(lin, make())
                lin(torch.randn(2, 64, dtype=dtype))
                err = None
            except Exception as e:  # noqa: BLE001 - recorded as it is
                err = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
            out.append({"config": name, "dtype": str(dtype).replace("torch.", ""), "error": err})
    return out


def bnb_version() -> Optional[str]:
    try:
        import bitsandbytes
    except ImportError:
        return None
    return bitsandbytes.__version__


# --- the models and inputs ----------------------------------------------------------------

def toy_task(count: int):
    import pyattr.toy as toy
    import pyattr.toy.task as task

    ids, _ = task.batch(torch.Generator().manual_seed(0), count, length=31)
    return "toy induction decoder", toy.INDUCTION_DIR, {"input_ids": ids}, "causal"


def minilm_task(count: int):
    from pyattr.apps.explain import bundled_model_dir
    from transformers import AutoTokenizer

    path = bundled_model_dir()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    pairs = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()][:count]
    texts = [p["clean"] + " " + p["partner"] for p in pairs]
    inputs = dict(tok(texts, padding=True, return_tensors="pt"))
    partner = dict(tok([p["partner"] for p in pairs], padding=True, return_tensors="pt"))
    return "all-MiniLM-L6-v2", path, (inputs, partner), "encoder"


def load(path, kind: str, **kw):
    from transformers import AutoModel, AutoModelForCausalLM

    cls = AutoModelForCausalLM if kind == "causal" else AutoModel
    return cls.from_pretrained(path, attn_implementation="eager", local_files_only=True, **kw).eval()


def variants(path, kind: str, fp) -> List[Tuple[str, str, Callable]]:
    """(quantization, route, () -> model)."""
    import torchao.quantization as tq
    from transformers import TorchAoConfig

    out = []
    for name, make in torchao_schemes():
        out.append((name, "TorchAoConfig", lambda make=make: load(path, kind, quantization_config=TorchAoConfig(make()))))

    def quantize_direct():
        m = copy.deepcopy(fp)
        tq.quantize_(m, tq.Int8WeightOnlyConfig())
        return m

    out.append(("torchao int8 weight-only", "quantize_", quantize_direct))
    if bnb_version() is not None:
        from transformers import BitsAndBytesConfig

        for name, kw in (("bitsandbytes 8-bit (LLM.int8)", dict(load_in_8bit=True)),
                         ("bitsandbytes 4-bit nf4", dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                        bnb_4bit_compute_dtype=torch.float32))):
            out.append((name, "BitsAndBytesConfig",
                        lambda kw=kw: load(path, kind, quantization_config=BitsAndBytesConfig(**kw), device_map="cpu")))
    return out


# --- the measurement ----------------------------------------------------------------------

def _rank(v: torch.Tensor) -> torch.Tensor:
    r = torch.empty_like(v)
    r[v.argsort()] = torch.arange(len(v), dtype=v.dtype)
    return r


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])


def agreement(q: torch.Tensor, fp: torch.Tensor, mask: torch.Tensor) -> Dict[str, List[float]]:
    """Per row over the real tokens: top-10 overlap, Pearson, Spearman."""
    out = {"top10": [], "pearson": [], "spearman": []}
    for a, b, m in zip(q, fp, mask.bool()):
        a, b = a[m].double(), b[m].double()
        k = min(TOP, len(a))
        out["top10"].append(len(set(a.topk(k).indices.tolist()) & set(b.topk(k).indices.tolist())) / k)
        out["pearson"].append(_pearson(a, b))
        out["spearman"].append(_pearson(_rank(a), _rank(b)))
    return out


def _timed(fn):
    """(result, ms) of the second of two calls: the first pays the one-time costs."""
    fn()
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def linear_paths(model) -> List[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def rows_for(task) -> List[Dict]:
    import pyattr
    import pyattr.targets as T
    from pyattr.integration.quantized import quantized_linears

    name, path, inputs, kind = task
    fp = load(path, kind)
    if kind == "causal":
        mask = torch.ones_like(inputs["input_ids"])
        r_fp = pyattr.relevance(fp, inputs)
        target = r_fp.target_ids
    else:
        inputs, partner = inputs
        mask = inputs["attention_mask"]
        with torch.no_grad():
            h = fp(**partner).last_hidden_state
            pm = partner["attention_mask"].unsqueeze(-1).to(h.dtype)
            target = T.Cosine((h * pm).sum(1) / pm.sum(1), constant_norm=True)
        r_fp = pyattr.relevance(fp, inputs, target)
    fp_rel_delta = (r_fp.conservation_delta.abs() / r_fp.target.abs()).median().item()
    _, fp_ms = _timed(lambda: pyattr.relevance(fp, inputs, target))
    rows = []
    for quant, route, make in variants(path, kind, fp):
        row = {"model": name, "quantization": quant, "route": route, "rows": int(mask.shape[0]),
               "tokens_mean": float(mask.sum(1).double().mean())}
        try:
            m = make()
            layers = quantized_linears(m)
            row["quantized_layers"] = len(layers)
            row["not_quantized"] = [p for p in linear_paths(fp) if p not in layers]
            r, row["ms"] = _timed(lambda: pyattr.relevance(m, inputs, target))
        except Exception as e:  # noqa: BLE001 - a row that failed says so
            row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            rows.append(row)
            print(f"{name} | {quant} | {route}: {row['error']}", file=sys.stderr)
            continue
        ag = agreement(r.token_relevance, r_fp.token_relevance, mask)
        row.update({
            "finite": bool(torch.isfinite(r.relevance).all()),
            "top10_mean": sum(ag["top10"]) / len(ag["top10"]), "top10_min": min(ag["top10"]),
            "pearson_mean": sum(ag["pearson"]) / len(ag["pearson"]), "pearson_min": min(ag["pearson"]),
            "spearman_mean": sum(ag["spearman"]) / len(ag["spearman"]),
            "target_rel_change_max": float(((r.target - r_fp.target).abs() / r_fp.target.abs()).max()),
            "conservation_rel_median": float((r.conservation_delta.abs() / r.target.abs()).median()),
            "conservation_rel_median_fp": fp_rel_delta,
            "ms_fp": fp_ms,
        })
        rows.append(row)
        print(f"{name} | {quant} | {route}: top10 {row['top10_mean']:.3f} pearson {row['pearson_mean']:.4f} "
              f"delta {row['conservation_rel_median']:.2e} (fp {fp_rel_delta:.2e})", file=sys.stderr)
    return rows


def markdown(doc: Dict) -> str:
    lines = ["# Relevance on quantized models against full precision (CPU)", "",
             f"torch {doc['torch_version']}, torchao {doc['torchao_version']}, transformers "
             f"{doc['transformers_version']}, bitsandbytes {doc['bitsandbytes_version'] or 'not installed'}; "
             "relevance with every rule (pyattr's default); the quantized model explains the full-precision "
             "model's target. Top-10: mean over prompts of |top-10 tokens (quantized) ∩ top-10 (full precision)| / 10 "
             "over the real tokens; Pearson / Spearman of token relevance per prompt (mean, and the worst prompt); "
             "delta: median over prompts of |conservation delta| / |target| (full precision in brackets); "
             "target change: largest |f_q − f_fp| / |f_fp|; ms: one relevance call over all prompts (full "
             "precision in brackets), the second of two.", "",
             "| model (prompts × tokens) | quantization | loaded with | top-10 (min) | Pearson (min) | Spearman | "
             "delta (fp) | target change | finite | ms (fp) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        head = f"| {r['model']} ({r['rows']} × {r['tokens_mean']:.0f}) | {r['quantization']} | {r['route']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} | | | | | | |")
            continue
        lines.append(f"{head} {r['top10_mean']:.3f} ({r['top10_min']:.1f}) | {r['pearson_mean']:.4f} "
                     f"({r['pearson_min']:.3f}) | {r['spearman_mean']:.4f} | {r['conservation_rel_median']:.1e} "
                     f"({r['conservation_rel_median_fp']:.1e}) | {r['target_rel_change_max']:.3f} | "
                     f"{'yes' if r['finite'] else 'NO'} | {r['ms']:.0f} ({r['ms_fp']:.0f}) |")
    lines += ["", "Linear layers left in full precision:", ""]
    seen = set()
    for r in doc["rows"]:
        key = (r["model"], r["quantization"], r["route"])
        if "not_quantized" in r and key not in seen:
            seen.add(key)
            left = ", ".join(f"`{p}`" for p in r["not_quantized"]) or "none"
            lines.append(f"- {r['model']}, {r['quantization']}, {r['route']}: {r['quantized_layers']} quantized; "
                         f"left: {left}")
    if doc.get("conditions"):
        lines += ["", doc["conditions"].strip()]
    lines += ["", "torchao configs that cannot be made on this CPU (torchao's own error, before pyattr sees the "
              "model):", "", "| config | dtype | error |", "|---|---|---|"]
    for r in doc["refused_on_cpu"]:
        lines.append(f"| `{r['config']}` | {r['dtype']} | {r['error'] or 'runs'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 prompts per model; print, write nothing")
    ap.add_argument("--out", default=str(OUT), help="folder for cpu_quantized.{json,md}")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default); default 1")
    args = ap.parse_args(argv)
    _quietly()
    torch.manual_seed(0)
    import torchao
    import transformers

    from pyattr.bench.report import document

    import pyattr.apps.contention as contention
    from pyattr.bench.report import conditions

    if args.threads:
        torch.set_num_threads(args.threads)
    count = 16 if args.quick else 64
    monitor = contention.start()
    rows = rows_for(toy_task(count)) + rows_for(minilm_task(min(count, 48)))
    measured = monitor.stop()
    doc = document("quantized_agreement", torch.device("cpu"), rows, contention=measured, conditions=conditions(measured),
                   torchao_version=torchao.__version__,
                   transformers_version=transformers.__version__, bitsandbytes_version=bnb_version(),
                   refused_on_cpu=refused_on_cpu())
    md = markdown(doc)
    print(md)
    if not args.quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cpu_quantized.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / "cpu_quantized.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
