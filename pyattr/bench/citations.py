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

Where the ContextCite library is installed (a development environment; never a dependency),
its ``ContextCiter`` runs on the toy decoders' examples as two more rows, 32 and 256
ablations, fed the very token sequences pyattr's ablations run
(:mod:`pyattr.bench.citations_peers`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

EVAL_MASKS = 100
#: the many-source tasks' source counts (the toy vocabulary holds 46 words)
MANY_SOURCES = (20, 40)


def variants():
    """(name, context_attribution keyword arguments)."""
    return [
        ("foldover (default)", {"method": "foldover"}),
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


@dataclass
class Task:
    """One benchmark model and its examples.

    call(e): ``(inputs, sources, keyword arguments)`` of :func:`pyattr.context_attribution`
    for example ``e``; outcome(e, masks): the real outcome (Tensor[n], float64) with only
    the kept sources of each keep-mask in the prompt; answer(e) / cue(e): the index of the
    ground-truth source / of the cue source (None where the task has none).
    """

    name: str
    model: object
    examples: list
    call: Callable
    outcome: Callable
    answer: Callable
    cue: Callable
    sources: int
    #: () -> [(name, fn(example) -> (scores Tensor[S], forwards))]: reference libraries
    #: measured beside pyattr where they are installed (None: none for this task)
    peers: Optional[Callable] = None
    #: variant → why it does not run on this task (it refuses the model, by design)
    refused: Optional[Dict[str, str]] = None


def toy_task(name: str, path, count: int, sources: Optional[int] = None, words: Optional[int] = None) -> Task:
    """A toy induction decoder's context task (:mod:`pyattr.toy.context`), on examples the
    model answers; ``sources`` × ``words`` (default :data:`pyattr.toy.context.SOURCES` of
    :data:`~pyattr.toy.context.WORDS_PER_SOURCE` words)."""
    import pyattr.methods._core.ablation as A
    import pyattr.toy as toy
    import pyattr.toy.context as C

    model, tok, _ = toy.load(path)
    sources = C.SOURCES if sources is None else sources
    words = C.WORDS_PER_SOURCE if words is None else words
    examples = C.answered(model, torch.Generator().manual_seed(0), count, sources, words)

    def peers():
        from pyattr.bench.citations_peers import contextcite_available, contextcite_scores

        if not contextcite_available():
            return []
        return [(f"ContextCite {contextcite_version()}, {n} ablations",
                 lambda e, n=n: contextcite_scores(model, tok, e, n)) for n in (32, 256)]

    return Task(name, model, examples,
                lambda e: (torch.tensor(e.prompt), e.ranges, {"response": [e.answer]}),
                lambda e, masks: A.response_logprobs(model, e.prompt, e.ranges, [e.answer], masks, [(0, 1)])[:, 0],
                lambda e: e.answer_source, lambda e: e.cue_source if e.cue_source != e.answer_source else None,
                sources, peers)


def contextcite_version() -> str:
    """The installed ContextCite's version, from its distribution (its ``__version__`` lags)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("context-cite")
    except PackageNotFoundError:  # pragma: no cover - importable without metadata
        return "(version unknown)"


@dataclass(frozen=True)
class RetrievalExample:
    """A passage of sentences (token ids, each sentence's token range) and a query that
    paraphrases one of them (``answer_source``)."""

    prompt: List[int]
    ranges: List[Tuple[int, int]]
    query: List[int]
    answer_source: int


def retrieval_task(count: int, sources: int = 4, suffix: str = "") -> Task:
    """all-MiniLM-L6-v2 (bundled) retrieving a passage of ``sources`` sentences for a query
    that paraphrases one of them (``benchmarks/data/patching_pairs.jsonl``: a sentence and its
    paraphrase per line); the outcome is the cosine similarity of the passage's and the
    query's mean-pooled embeddings. Kept: examples where the paraphrased sentence, embedded
    alone, is the query's nearest of the passage's sentences (the model's own retrieval)."""
    import pyattr.methods._core.ablation as A
    import pyattr.methods._core.embedding as E
    from pyattr.apps.explain import _load, bundled_model_dir
    from pyattr.bench.patching import load_pairs
    from pyattr.methods._core.sources import resolve
    from pyattr.methods._core.tokens import _encode
    from pyattr.patching.atp_star import use_eager

    tok, model = _load(bundled_model_dir(), causal=False)
    use_eager(model)  # the attention method reads the attention weights
    pairs = load_pairs()
    g = torch.Generator().manual_seed(0)
    out: List[RetrievalExample] = []
    for _ in range(50 * count):
        if len(out) == count:
            break
        pick = torch.randperm(len(pairs), generator=g)[:sources].tolist()
        target = int(torch.randint(sources, (1,), generator=g))
        sentences = [pairs[i]["clean"] for i in pick]
        ids, _, offsets = _encode(tok, " ".join(sentences))
        special = [e <= s for s, e in offsets]
        ranges = resolve(sentences, " ".join(sentences), offsets, special, len(ids))
        query = _encode(tok, pairs[pick[target]]["partner"])[0]
        alone = E.embed(model, [_encode(tok, s)[0] for s in sentences], "mean")
        if int(E.cosine(alone, E.embed(model, [query], "mean")[0]).argmax()) == target:
            out.append(RetrievalExample(ids, ranges, query, target))

    def outcome(e, masks):
        q = E.embed(model, [e.query], "mean")[0]
        return E.cosine(E.embed(model, A.ablated_rows(e.prompt, e.ranges, [], masks), "mean"), q)

    return Task(f"all-MiniLM-L6-v2 retrieval (bundled){suffix}", model, out,
                lambda e: (torch.tensor(e.prompt), e.ranges, {"query": e.query, "pooling": "mean"}),
                outcome, lambda e: e.answer_source, lambda e: None, sources,
                refused={"gradient × input": "refused: zero up to rounding on BERT, whose embeddings pass a LayerNorm"})


def task_rows(task: Task) -> List[Dict]:
    import pyattr
    import pyattr.methods._core.ablation as A

    examples, n_src = task.examples, task.sources
    masks = A.random_masks(torch.Generator().manual_seed(123), EVAL_MASKS, n_src)
    truth = [task.outcome(e, masks) for e in examples]
    vs = [(v, kw) for v, kw in variants() if v not in (task.refused or {})]

    def attribute(e, kw):
        inputs, sources, extra = task.call(e)
        return pyattr.context_attribution(task.model, inputs, sources, **extra, **kw)

    peers = task.peers() if task.peers is not None else []
    for _, kw in vs:  # warm-up
        attribute(examples[0], kw)
    for _, fn in peers:
        fn(examples[0])
    scores = {v: [] for v, _ in vs}
    seconds = {v: 0.0 for v, _ in vs}
    forwards = {}
    for e in examples:  # interleaved: every method sees the same load
        for v, kw in vs:
            t0 = time.perf_counter()
            r = attribute(e, kw)
            seconds[v] += time.perf_counter() - t0
            scores[v].append(r.scores[0])
            forwards[v] = r.ablations
        for v, fn in peers:
            t0 = time.perf_counter()
            sc, n = fn(e)
            seconds[v] = seconds.get(v, 0.0) + time.perf_counter() - t0
            scores.setdefault(v, []).append(sc)
            forwards[v] = n
    vs = vs + [(v, None) for v, _ in peers]
    rows = []
    full = torch.ones(1, n_src, dtype=torch.bool)
    for v, _ in vs:
        sc = scores[v]
        lds = [_spearman(masks.double() @ s, t) for s, t in zip(sc, truth)]
        drops = {}
        for k in (1, 3):
            drop = []
            for s, e in zip(sc, examples):
                keep = torch.ones(1, n_src, dtype=torch.bool)
                keep[0, s.argsort(descending=True)[:k]] = False
                before, after = task.outcome(e, torch.cat([full, keep])).tolist()
                drop.append(before - after)
            drops[k] = statistics.fmean(drop)
        ratios = [float(s[task.cue(e)] / s[task.answer(e)]) for s, e in zip(sc, examples)
                  if task.cue(e) is not None and float(s[task.answer(e)]) != 0]
        rows.append({"model": task.name, "method": v, "examples": len(examples), "sources": n_src,
                     "lds": statistics.fmean(lds), "lds_se": statistics.stdev(lds) / len(lds) ** 0.5,
                     "drop1": drops[1], "drop3": drops[3],
                     "top1": statistics.fmean(int(s.argmax()) == task.answer(e) for s, e in zip(sc, examples)),
                     "cue_ratio": statistics.median(ratios) if ratios else None,
                     "forwards": forwards[v], "ms_per_example": seconds[v] / len(examples) * 1e3})
    return rows


def model_rows(name: str, path, count: int) -> List[Dict]:
    """The rows of one toy decoder (``path``; None: the shipped one) on ``count`` examples."""
    return task_rows(toy_task(name, path, count))


def run_all(quick: bool = False) -> List[Dict]:
    import pyattr.toy as toy

    n = 12 if quick else 100
    rows = (model_rows("toy induction decoder (shipped)", None, n)
            + model_rows("toy induction decoder B (seed 1)", toy.INDUCTION_B_DIR, n)
            + task_rows(retrieval_task(n)))
    # many sources: every context word its own source; passages of many sentences
    for many in MANY_SOURCES:
        for name, path in (("toy induction decoder (shipped)", None),
                           ("toy induction decoder B (seed 1)", toy.INDUCTION_B_DIR)):
            rows += task_rows(toy_task(f"{name}, {many} one-word sources", path, n // 2 if quick else 30, many, 1))
    rows += task_rows(retrieval_task(6 if quick else 30, MANY_SOURCES[0], f", {MANY_SOURCES[0]} sentences"))
    return rows


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
        missing = [v for v, _ in variants() if v not in {r["method"] for r in rs}]
        if missing:  # a method that refuses the model by design (gradient × input on BERT)
            lines += ["", f"Not run on this model, which the method refuses: {', '.join(missing)}."]
        lines.append("")
    return "\n".join(lines)
