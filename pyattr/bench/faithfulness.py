"""``pyattr bench --faithfulness``: ABPC (AUC(LeRF) − AUC(MoRF), zeroed input embeddings,
AttnLRP's protocol) and the time of each explanation method, on two models with real
weights:

- all-MiniLM-L6-v2 (bundled), the clean sentences of ``benchmarks/data/patching_pairs.jsonl``,
  target the cosine similarity of the mean-pooled embedding with the partner sentence's;
- the toy induction decoder (:mod:`pyattr.toy`), prompts ``<s> w1..wn w1..wk`` of the
  task, target the top-1 next-token logit (the word the induction copies).

Methods: relevance with all four rules (pyattr's default, AH-rule attention), the same with
AttnLRP's attention rule, the LN-rule alone, gradient × input (every rule off), integrated
gradients (32 steps, zeros and pad baselines) and a random ranking. Times are one call
each over the whole batch (ms), measured after one warm-up call.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Tuple

import torch

STEPS = 20
IG_STEPS = 32


def methods() -> List[Tuple[str, Callable]]:
    """(name, f(model, inputs, target) → token relevance (batch, seq))."""
    import pyattr
    from pyattr.config import RelevanceRules as R

    def rel(rules):
        return lambda m, x, t: pyattr.relevance(m, x, t, rules=rules).token_relevance

    def ig(baseline):
        return lambda m, x, t: pyattr.integrated_gradients(m, x, t, baseline=baseline, n_steps=IG_STEPS,
                                                           internal_batch_size=IG_STEPS).token_attribution

    def random(m, x, t):
        ids = x["input_ids"] if isinstance(x, dict) else x
        return torch.rand(ids.shape, generator=torch.Generator().manual_seed(0))

    return [
        ("relevance, all rules (default)", rel(R.all())),
        ("relevance, AttnLRP attention", rel(R.all("attnlrp"))),
        ("relevance, LN-rule alone", rel(R(normalization=True))),
        ("gradient x input", rel(R())),
        (f"IG, zeros baseline, {IG_STEPS} steps", ig("zeros")),
        (f"IG, pad baseline, {IG_STEPS} steps", ig("pad")),
        ("random", random),
    ]


def minilm_task(limit: int = 0):
    """(name, model, inputs, target) of the MiniLM task."""
    import pyattr.bench.patching as patching
    import pyattr.targets as T

    model, clean, _, reference = patching._minilm_task(limit)
    return "all-MiniLM-L6-v2", model, clean, T.Cosine(reference)


def induction_task(count: int = 64):
    """(name, model, inputs, target) of the toy induction decoder: ``count`` prompts of
    periods 4 … 8, cut at a random point of the repeat (left-padded)."""
    import pyattr.toy as toy
    import pyattr.toy.task as task

    model, tok, _ = toy.load()
    g = torch.Generator().manual_seed(3)
    prompts = []
    for seg in task.segments(g, count, periods=tuple(range(4, 9))):
        k = int(torch.randint(1, len(seg), (1,), generator=g))
        prompts.append(" ".join(task.WORDS[i - len(task.SPECIALS)] for i in seg + seg[:k]))
    return "toy induction decoder", model, dict(tok(prompts, padding=True, return_tensors="pt")), None


def _timed(fn):
    fn()  # warm-up: first-call costs (dispatch, allocator) are not the method's
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def rows_for(name: str, model, inputs, target) -> List[Dict]:
    import pyattr.evaluate as E

    out = []
    for method, fn in methods():
        rel, ms = _timed(lambda: fn(model, inputs, target))
        lerf = E.perturbation_curve(model, inputs, rel, target, order="lerf", steps=STEPS)
        morf = E.perturbation_curve(model, inputs, rel, target, order="morf", steps=STEPS)
        a = lerf.auc - morf.auc
        out.append({"model": name, "method": method, "abpc": a.mean().item(),
                    "lerf_mean": lerf.values.mean(0).tolist(), "morf_mean": morf.values.mean(0).tolist(),
                    "abpc_sem": (a.std() / a.numel() ** 0.5).item() if a.numel() > 1 else 0.0,
                    "rows": int(a.numel()), "ms": ms})
    ig = next(r["ms"] for r in out if r["method"].startswith("IG, zeros"))
    for r in out:
        r["time_ratio_to_ig"] = r["ms"] / ig
    return out


def run_all(quick: bool = False) -> List[Dict]:
    rows = []
    for task in (minilm_task(8 if quick else 0), induction_task(16 if quick else 64)):
        rows += rows_for(*task)
    return rows


def plot(rows: List[Dict], path) -> None:
    """One panel per model: each method's mean MoRF (solid) and LeRF (dashed) curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    x = [j / STEPS for j in range(STEPS + 1)]
    for ax, name in zip(axes[0], models):
        for i, r in enumerate(r for r in rows if r["model"] == name):
            color = f"C{i}"
            ax.plot(x, r["morf_mean"], color=color, label=f"{r['method']} (ABPC {r['abpc']:+.3g})")
            ax.plot(x, r["lerf_mean"], color=color, ls="--")
        ax.set_title(f"{name}: MoRF (solid), LeRF (dashed)")
        ax.set_xlabel("fraction of tokens with zeroed embeddings")
        ax.set_ylabel("target (mean over rows)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(rows: List[Dict], contention=None) -> str:
    from pyattr.bench.report import with_conditions

    lines = [f"ABPC (AUC(LeRF) − AUC(MoRF), zeroed input embeddings, {STEPS} steps; larger is better) and time "
             "per method, one call over the batch", ""]
    lines += ["| model | method | ABPC (± s.e.) | time (ms) | time / IG zeros |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['rows']} rows) | {r['method']} | {r['abpc']:+.4f} ± {r['abpc_sem']:.4f} | "
                     f"{r['ms']:.1f} | {r['time_ratio_to_ig']:.3f} |")
    return with_conditions(lines, contention)
