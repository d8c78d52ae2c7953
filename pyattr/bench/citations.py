"""``pyattr bench --citations``: context-attribution methods scored by ContextCite's own
faithfulness metrics on the toy decoders' context task (:mod:`pyattr.toy.context`), on
both trained toy decoders (the shipped one and ``INDUCTION_B_DIR``), on examples each
model answers itself (:func:`pyattr.toy.context.answered`).

Per method (:data:`pyattr.methods.context.METHODS`, the ablation ones at several budgets):

- **LDS** (linear datamodeling score, ContextCite §3): per example, the Spearman
  correlation, over ``EVAL_MASKS`` random keep-masks (each source kept with probability
  1/2, one fixed set for every method), between the sum of the kept sources' scores and the
  answer's actual log-probability with only those sources in the prompt; mean over examples.
- **drop@k**: the answer's log-probability with every source, minus with the ``k``
  top-scored sources removed (nats; larger: the top sources carry more of the answer).
- **top-1 hit**: the share of examples whose top-scored source holds the copied word.
- **cue / answer**: the median ratio of the cue source's score (where the query word's
  earlier occurrence is, when that is another source) to the answer source's: how much a
  method credits where the model looks.
- **forwards** per example the method ran, and **time** per example (ms, one call per
  example after a warm-up, the methods interleaved example by example).
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List

import torch

EVAL_MASKS = 100


def variants():
    """(name, context_attribution keyword arguments)."""
    return [
        ("foldover, 16 ablations (default)", {"method": "foldover"}),
        ("contextcite-style, 32 ablations", {"method": "contextcite", "ablations": 32}),
        ("contextcite-style, 256 ablations", {"method": "contextcite", "ablations": 256}),
        ("leave-one-out", {"method": "loo"}),
        ("attnlrp relevance", {"method": "attnlrp"}),
        ("default-rules relevance", {"method": "relevance"}),
        ("gradient × input", {"method": "gradient"}),
        ("attention weights", {"method": "attention"}),
    ]


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den > 0 else 0.0


def model_rows(name: str, path, count: int) -> List[Dict]:
    import pyattr
    import pyattr.methods._core.ablation as A
    import pyattr.toy as toy
    import pyattr.toy.context as C

    model, _, _ = toy.load(path)
    examples = C.answered(model, torch.Generator().manual_seed(0), count)
    n_src = C.SOURCES
    masks = A.random_masks(torch.Generator().manual_seed(123), EVAL_MASKS, n_src)
    truth = [A.response_logprobs(model, e.prompt, e.ranges, [e.answer], masks, [(0, 1)])[:, 0] for e in examples]
    vs = variants()
    for _, kw in vs:  # warm-up
        pyattr.context_attribution(model, torch.tensor(examples[0].prompt), examples[0].ranges,
                                   response=[examples[0].answer], **kw)
    scores = {v: [] for v, _ in vs}
    seconds = {v: 0.0 for v, _ in vs}
    forwards = {}
    for e in examples:  # interleaved: every method sees the same load
        for v, kw in vs:
            t0 = time.perf_counter()
            r = pyattr.context_attribution(model, torch.tensor(e.prompt), e.ranges, response=[e.answer], **kw)
            seconds[v] += time.perf_counter() - t0
            scores[v].append(r.scores[0])
            forwards[v] = r.ablations
    rows = []
    for v, _ in vs:
        sc = scores[v]
        lds = [_spearman(masks.double() @ s, t) for s, t in zip(sc, truth)]
        drops = {}
        for k in (1, 3):
            keep = torch.ones(len(examples), n_src, dtype=torch.bool)
            for i, s in enumerate(sc):
                keep[i, s.argsort(descending=True)[:k]] = False
            drops[k] = statistics.fmean(
                float(A.response_logprobs(model, e.prompt, e.ranges, [e.answer],
                                          torch.stack([torch.ones(n_src, dtype=torch.bool), keep[i]]),
                                          [(0, 1)])[:, 0].diff().neg()) for i, e in enumerate(examples))
        ratios = [float(s[e.cue_source] / s[e.answer_source]) for s, e in zip(sc, examples)
                  if e.cue_source != e.answer_source and float(s[e.answer_source]) != 0]
        rows.append({"model": name, "method": v, "examples": count, "sources": n_src,
                     "lds": statistics.fmean(lds), "lds_se": statistics.stdev(lds) / len(lds) ** 0.5,
                     "drop1": drops[1], "drop3": drops[3],
                     "top1": statistics.fmean(int(s.argmax()) == e.answer_source for s, e in zip(sc, examples)),
                     "cue_ratio": statistics.median(ratios) if ratios else None,
                     "forwards": forwards[v], "ms_per_example": seconds[v] / count * 1e3})
    return rows


def run_all(quick: bool = False) -> List[Dict]:
    import pyattr.toy as toy

    n = 12 if quick else 100
    return (model_rows("toy induction decoder (shipped)", None, n)
            + model_rows("toy induction decoder B (seed 1)", toy.INDUCTION_B_DIR, n))


def markdown(rows: List[Dict], contention=None) -> str:
    from pyattr.bench.report import conditions

    lines = [conditions(contention).rstrip("\n"), ""] if contention is not None else []
    for model in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == model]
        lines += [f"**{model}**: {rs[0]['examples']} examples of {rs[0]['sources']} sources, LDS over "
                  f"{EVAL_MASKS} keep-masks (± its standard error over examples):", "",
                  "| method | LDS | drop@1 | drop@3 | top-1 hit | cue / answer | forwards | time (ms) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rs:
            cue = "n/a" if r["cue_ratio"] is None else f"{r['cue_ratio']:.3f}"
            lines.append(f"| {r['method']} | {r['lds']:.3f} ± {r['lds_se']:.3f} | {r['drop1']:.2f} | "
                         f"{r['drop3']:.2f} | {r['top1']:.2f} | {cue} | {r['forwards']} | "
                         f"{r['ms_per_example']:.1f} |")
        lines.append("")
    return "\n".join(lines)
