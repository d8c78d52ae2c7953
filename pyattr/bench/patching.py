"""How well attribution patching predicts activation patching: RelP (several rule
variants) and AtP against the exact effects, per node type, with the time of each method.

Two models:

- all-MiniLM-L6-v2 (bundled, real weights) on ``benchmarks/data/patching_pairs.jsonl``:
  sentences whose corrupt version replaces one content word by an unrelated word of the
  same token length; the metric is the cosine similarity of the clean sentence's
  mean-pooled embedding with a partner sentence's (fixed, computed once);
- a random 4-layer Llama (a sanity check, not a claim): random token sequences with one
  token replaced, metric the logit difference of two fixed tokens at the last position.

Correlations are over every node of every pair (real tokens only); for neurons over the
sampled nodes. Pearson is dominated by the nodes with large effects, Spearman by the
many small ones; the README reports both.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List

import torch

from pyattr.patching.result import correlations

NODES = ("residual", "attention", "heads", "mlp", "neurons")
DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "patching_pairs.jsonl"


def variants():
    """(name, method, rules, metric normalisation a constant): what the bench compares."""
    from pyattr.config import RelevanceRules as R
    from pyattr.patching import PATCHING_RULES

    return [
        ("atp", "atp", None, False),
        ("atp* (QK fix on residual nodes)", "atp*", None, False),
        ("relp (default: LN-rule)", "relp", PATCHING_RULES, False),
        ("relp all rules (AH)", "relp", R.all(), False),
        ("relp all rules, AttnLRP attention", "relp", R.all("attnlrp"), False),
        ("relp LN + Identity", "relp", R(normalization=True, activation=True), False),
        ("relp LN + AH", "relp", R(normalization=True, attention=True), False),
        ("relp LN, metric norm constant", "relp", PATCHING_RULES, True),
        ("relp all rules, metric norm constant", "relp", R.all(), True),
    ]


def _flat(result, node: str, valid: torch.Tensor, sampled=None) -> torch.Tensor:
    e = result[node]
    v = valid.view(valid.shape[0], 1, valid.shape[1], *([1] * (e.dim() - 3))).expand_as(e)
    if sampled is not None and node in sampled:
        v = v & sampled[node]
    return e[v].double()


def load_pairs(path: Path = DATA, limit: int = 0) -> List[dict]:
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"the patching task file {str(path)!r} is not there: `pyattr bench --patching` runs from a source "
            "checkout (benchmarks/data/ is not part of the installed package)"
        )
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def compare(model, clean, corrupt, metric_for, nodes, sample: int, batch_size: int, model_name: str,
            variant_list) -> List[Dict]:
    """One row per (variant, node type) and one per node type for the exact method."""
    import pyattr.patching as P

    valid = clean["attention_mask"].bool() if "attention_mask" in clean else torch.ones_like(clean["input_ids"], dtype=torch.bool)
    exact, t_exact = _timed(lambda: P.activation_patching(
        model, clean, corrupt, metric_for(False), nodes=nodes, batch_size=batch_size,
        sample=sample if "neurons" in nodes else None))
    rows = []
    n_pairs = valid.shape[0]
    for node in nodes:
        rows.append({"model": model_name, "method": "exact", "variant": "activation patching", "node": node,
                     "nodes": int(_flat(exact, node, valid, exact.sampled).numel()), "pairs": n_pairs,
                     "seconds": t_exact, "pearson": 1.0, "spearman": 1.0})
    for name, method, rules, constant_norm in variant_list:
        kw = {"method": method} if method != "relp" else {"method": "relp", "rules": rules}
        est, secs = _timed(lambda: P.attribution_patching(model, clean, corrupt, metric_for(constant_norm), nodes=nodes, **kw))
        for node in nodes:
            e = _flat(est, node, valid, exact.sampled)
            x = _flat(exact, node, valid, exact.sampled)
            pr, sr = correlations(e, x)
            rows.append({"model": model_name, "method": method, "variant": name, "node": node,
                         "nodes": int(e.numel()), "pairs": n_pairs, "seconds": secs,
                         "pearson": pr, "spearman": sr, "speedup_vs_exact": t_exact / secs})
    return rows


def _minilm_task(limit: int = 0):
    """(model, clean, corrupt, partner embeddings) of the MiniLM task."""
    from pyattr.patching.atp_star import use_eager
    from pyattr.apps.explain import _load, bundled_model_dir

    tok, model = _load(bundled_model_dir(), causal=False)
    use_eager(model)  # atp* reads the attention probabilities; every method runs the same model
    pairs = load_pairs(limit=limit)
    clean = dict(tok([p["clean"] for p in pairs], padding=True, return_tensors="pt"))
    corrupt = dict(tok([p["corrupt"] for p in pairs], padding=True, return_tensors="pt"))
    for i, (a, b) in enumerate(zip(clean["attention_mask"], corrupt["attention_mask"])):
        if not torch.equal(a, b):
            raise ValueError(f"{DATA.name} pair {i}: clean and corrupt differ in token length")
    partner = tok([p["partner"] for p in pairs], padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**partner).last_hidden_state
        m = partner["attention_mask"].unsqueeze(-1).to(h.dtype)
        reference = (h * m).sum(1) / m.sum(1)
    return model, clean, corrupt, reference


def minilm_rows(limit: int = 0, sample: int = 100, batch_size: int = 64) -> List[Dict]:
    import pyattr.targets as T

    model, clean, corrupt, reference = _minilm_task(limit)
    return compare(model, clean, corrupt, lambda cn: T.Cosine(reference, constant_norm=cn), NODES, sample,
                   batch_size, "all-MiniLM-L6-v2", variants())


def breakdown(limit: int = 0) -> Dict:
    """Where the estimates fail on MiniLM: residual and MLP nodes split into those at the
    replaced token and the others. Per layer, the residual stream's relative move
    ``|Δr| / |r|`` at the replaced token and elsewhere (mean); per variant and node type,
    Pearson and the median ratio estimate / exact at the replaced token, Pearson and
    Spearman elsewhere, and the share of the exact effects' variance at the replaced token."""
    import pyattr.patching as P
    import pyattr.targets as T
    from pyattr.config import RelevanceRules as R

    model, clean, corrupt, reference = _minilm_task(limit)
    nodes = ("residual", "mlp")
    exact = P.activation_patching(model, clean, corrupt, T.Cosine(reference), nodes=nodes, progress=False)
    valid = clean["attention_mask"].bool()
    replaced = clean["input_ids"] != corrupt["input_ids"]
    moves = []
    for layer, (rc, rx) in enumerate(zip(_block_inputs(model, clean), _block_inputs(model, corrupt))):
        d = (rx - rc).norm(dim=-1) / rc.norm(dim=-1)
        moves.append({"layer": layer, "replaced": float(d[replaced].mean()), "elsewhere": float(d[valid & ~replaced].mean())})
    out = {"relative_move": moves, "variants": []}
    for name, kw, cn in (("atp", {"method": "atp"}, False), ("relp LN-rule", {"rules": R(normalization=True)}, False),
                         ("relp LN-rule, metric norm constant", {"rules": R(normalization=True)}, True),
                         ("relp all rules", {"rules": R.all()}, False)):
        est = P.attribution_patching(model, clean, corrupt, T.Cosine(reference, constant_norm=cn), nodes=nodes, **kw)
        for node in nodes:
            e, x = est[node].double(), exact[node].double()
            at = replaced[:, None, :].expand_as(x)
            other = (valid & ~replaced)[:, None, :].expand_as(x)
            pr_at, _ = correlations(e[at], x[at])
            pr_o, sr_o = correlations(e[other], x[other])
            share = x[at].pow(2).sum() / x[valid[:, None, :].expand_as(x)].pow(2).sum()
            out["variants"].append({
                "variant": name, "node": node, "pearson_replaced": pr_at,
                "median_ratio_replaced": float((e[at] / x[at]).median()),
                "pearson_elsewhere": pr_o, "spearman_elsewhere": sr_o, "exact_variance_share_replaced": float(share),
            })
    return out


def _block_inputs(model, inputs) -> List[torch.Tensor]:
    import pyattr.architectures as A

    blocks = [model.get_submodule(p) for p in A.layer_paths(model, A.ARCHITECTURES["bert"])]
    got: List[torch.Tensor] = []
    hooks = [b.register_forward_pre_hook(lambda m, a, k: got.append((a[0] if a else k["hidden_states"]).detach()),
                                         with_kwargs=True) for b in blocks]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return got


def breakdown_markdown(b: Dict) -> str:
    lines = ["**Where the estimates fail (MiniLM)**: the residual stream's relative move |Δr| / |r|, "
             "mean at the replaced token / elsewhere, per layer: "
             + ", ".join(f"{m['layer']}: {m['replaced']:.2f} / {m['elsewhere']:.3f}" for m in b["relative_move"]), "",
             "| variant | node | variance share at replaced token | Pearson there | median est/exact there "
             "| Pearson / Spearman elsewhere |", "|---|---|---:|---:|---:|---:|"]
    for v in b["variants"]:
        lines.append(f"| {v['variant']} | {v['node']} | {v['exact_variance_share_replaced']:.2f} | "
                     f"{v['pearson_replaced']:+.3f} | {v['median_ratio_replaced']:+.2f} | "
                     f"{v['pearson_elsewhere']:+.3f} / {v['spearman_elsewhere']:+.3f} |")
    return "\n".join(lines) + "\n"


def llama_rows(pairs: int = 16, seq: int = 12, sample: int = 100, batch_size: int = 64) -> List[Dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    import pyattr.targets as T

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=4, vocab_size=256, initializer_range=0.1)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (pairs, seq), generator=g)
    corrupt = ids.clone()
    pos = torch.randint(0, seq - 1, (pairs,), generator=g)
    corrupt[torch.arange(pairs), pos] = torch.randint(0, 256, (pairs,), generator=g)
    clean = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    corrupt = {"input_ids": corrupt, "attention_mask": torch.ones_like(ids)}
    names = [v for v in variants() if not v[3]]  # the metric has no normalisation here
    return compare(model, clean, corrupt, lambda cn: T.LogitDiff(3, 7), NODES, sample, batch_size,
                   "random Llama (4 layers, hidden 64)", names)


def _pair(r) -> str:
    if r["pearson"] is None:
        return "n/a"
    return f"{r['pearson']:+.3f} / {r['spearman']:+.3f}"


def markdown(rows: List[Dict], contention=None) -> str:
    from pyattr.bench.report import conditions

    lines = [conditions(contention).rstrip("\n"), ""] if contention is not None else []
    for model in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == model]
        ex = [r for r in rs if r["method"] == "exact"]
        counts = ", ".join(f"{r['node']} {r['nodes']}" for r in ex)
        lines.append(f"**{model}**: {ex[0]['pairs']} pairs; activation patching of every node "
                     f"({counts} nodes; neurons a sample) took {ex[0]['seconds']:.1f} s. "
                     "Pearson / Spearman with activation patching:")
        lines.append("")
        lines.append("| method | " + " | ".join(NODES) + " | time (s) | speed-up vs exact |")
        lines.append("|---|" + "---:|" * (len(NODES) + 2))
        for var in dict.fromkeys(r["variant"] for r in rs if r["method"] != "exact"):
            vr = {r["node"]: r for r in rs if r["variant"] == var}
            cells = [_pair(vr[n]) for n in NODES if n in vr]
            any_r = next(iter(vr.values()))
            lines.append(f"| {var} | " + " | ".join(cells) + f" | {any_r['seconds']:.2f} | {any_r['speedup_vs_exact']:.0f}× |")
        lines.append("")
    return "\n".join(lines)


def run_all(quick: bool = False) -> List[Dict]:
    if quick:
        return minilm_rows(limit=6, sample=20, batch_size=64) + llama_rows(pairs=4, seq=8, sample=20)
    return minilm_rows() + llama_rows()
