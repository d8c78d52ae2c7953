"""``pyattr bench --circuits``: edge attribution methods (:func:`pyattr.patching.edge_attribution`)
against exact edge patching (:func:`pyattr.patching.edge_effects`) on the three toy induction
decoders (two 2-layer, one 4-layer), key and value pairs (:func:`pyattr.toy.task.pairs`; 64 each, seed 11).

Per method: **Pearson** of the edge scores (mean over pairs) with exact edge patching's;
**top-2** the share of pairs whose two largest edges by magnitude are exact patching's two;
**CPR** and **CMD** (MIB, :mod:`pyattr.patching.circuit`) of the circuits of each method's
top edges at MIB's sizes, run exactly; **time** of the scores (median of 3 calls after a
warm-up, the methods interleaved call by call).

Node circuits (heads and MLPs, :mod:`pyattr.patching.node_circuit`): circuits of the top
nodes by activation patching, by RelP and by AtP (thresholding), against
:func:`pyattr.patching.circuit_search`; CPR and CMD on the pairs the nodes were chosen on and,
**held out**, the same circuits run on as many other pairs (seed 12); time of the scores or the
search (one call after a warm-up).

Where the EAP-IG library (hannamw/EAP-IG, with TransformerLens) is installed in a development
environment (never a dependency), its EAP, EAP-IG-inputs (16 steps) and EAP-IG-activations
(4 steps) run on the same pairs as more rows (:mod:`pyattr.bench.circuits_peers`), their
circuits judged by the same evaluator; their times are measured after pyattr's, not
interleaved with them.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List

import torch

PAIRS = 64


def variants():
    """(name, edge_attribution keyword arguments); None: exact edge patching."""
    from pyattr.config import RelevanceRules as R

    return [
        ("exact edge patching", None),
        ("blockwise: exact, block by block", {"method": "blockwise"}),
        ("atp", {"method": "atp"}),
        ("relp, LN-rule", {"method": "relp", "rules": R(normalization=True)}),
        ("relp, LN-, Identity- and Half-rule (default)", {"method": "relp"}),
        ("ig, 4 steps", {"method": "ig", "steps": 4}),
        ("ig, 16 steps", {"method": "ig", "steps": 16}),
    ]


def _top2(per_pair: torch.Tensor) -> List[set]:
    return [set(r.tolist()) for r in per_pair.abs().topk(2, dim=-1).indices]


def model_rows(name: str, path, kind: str, count: int, repeats: int = 3) -> List[Dict]:
    import pyattr.patching as P
    import pyattr.targets as T
    import pyattr.toy as toy
    import pyattr.toy.circuit as C
    import pyattr.toy.task as task

    model, _, _ = toy.load(path)
    pairs = task.pairs(torch.Generator().manual_seed(11), count, kind=kind)
    clean, corrupt, answer, alternative = C.pair_tensors(pairs)
    metric = T.LogitDiff(answer, alternative)

    def call(kw):
        if kw is None:
            return P.edge_effects(model, clean, corrupt, metric)
        return P.edge_attribution(model, clean, corrupt, metric, **kw)

    vs = variants()
    results, seconds = {}, {v: [] for v, _ in vs}
    for _, kw in vs:  # warm-up
        call(kw)
    for _ in range(repeats):
        for v, kw in vs:
            t0 = time.perf_counter()
            results[v] = call(kw)
            seconds[v].append(time.perf_counter() - t0)
    exact = results[vs[0][0]]
    top_exact = _top2(exact.per_pair)
    rows = []
    for v, _ in vs:
        r = results[v]
        cf = P.circuit_faithfulness(model, clean, corrupt, r, metric=metric)
        pearson = float(torch.corrcoef(torch.stack([r.scores, exact.scores]))[0, 1])
        rows.append({"model": f"{name}, {kind} pairs", "variant": v, "pairs": count, "edges": len(r.edges),
                     "seconds": statistics.median(seconds[v]), "pearson": pearson,
                     "top2_equal_exact": statistics.fmean(a == b for a, b in zip(_top2(r.per_pair), top_exact)),
                     "cpr": cf.cpr, "cmd": cf.cmd})
    t_exact = rows[0]["seconds"]
    for row in rows:
        row["time_over_exact"] = row["seconds"] / t_exact
    from pyattr.bench.circuits_peers import eap_available, eap_rows

    if eap_available():  # the reference implementation, where a development environment has it
        rows += eap_rows(model, clean, corrupt, answer, alternative, rows[0]["model"], exact.scores, t_exact,
                         exact.per_pair, repeats=repeats)
    return rows


def _held_out(model, circuits, sizes, clean, corrupt, metric):
    """CPR and CMD of fixed node circuits (one per size) on other pairs."""
    import pyattr.patching as P
    from pyattr.patching.circuit import _areas

    curve = torch.tensor([float(P.circuit_faithfulness(model, clean, corrupt, c, metric=metric).curve[0])
                          if c else 0.0 for c in circuits], dtype=torch.float64)
    return _areas(torch.tensor(sizes, dtype=torch.float64), curve)


def node_rows(name: str, path, kind: str, count: int) -> List[Dict]:
    import pyattr.patching as P
    import pyattr.targets as T
    import pyattr.toy as toy
    import pyattr.toy.circuit as C
    import pyattr.toy.task as task
    from pyattr.patching.circuit import MIB_SIZES

    model, _, _ = toy.load(path)
    sets = []
    for seed in (11, 12):
        clean, corrupt, answer, alternative = C.pair_tensors(task.pairs(torch.Generator().manual_seed(seed), count,
                                                                        kind=kind))
        sets.append((clean, corrupt, T.LogitDiff(answer, alternative)))
    (clean, corrupt, metric), held = sets
    nodes = ("heads", "mlp")
    calls = [
        ("top nodes by activation patching", lambda: P.activation_patching(model, clean, corrupt, metric, nodes=nodes,
                                                                           sum_positions=True, progress=False)),
        ("top nodes by relp", lambda: P.attribution_patching(model, clean, corrupt, metric, nodes=nodes,
                                                            sum_positions=True)),
        ("top nodes by atp", lambda: P.attribution_patching(model, clean, corrupt, metric, nodes=nodes,
                                                           method="atp", sum_positions=True)),
        ("circuit_search (greedy both ways)", lambda: P.circuit_search(model, clean, corrupt, metric, nodes=nodes)),
    ]
    rows = []
    for variant, call in calls:
        call()  # warm-up
        t0 = time.perf_counter()
        res = call()
        seconds = time.perf_counter() - t0
        cf = res if isinstance(res, P.CircuitFaithfulness) else P.circuit_faithfulness(model, clean, corrupt, res,
                                                                                        metric=metric)
        h_cpr, h_cmd = _held_out(model, cf.circuits, MIB_SIZES, *held)
        rows.append({"model": f"{name}, {kind} pairs", "variant": variant, "level": "nodes", "pairs": count,
                     "nodes": cf.edges, "seconds": seconds, "cpr": cf.cpr, "cmd": cf.cmd, "held_out_cpr": h_cpr,
                     "held_out_cmd": h_cmd})
    return rows


def run_all(quick: bool = False) -> List[Dict]:
    import pyattr.toy as toy

    n = 8 if quick else PAIRS
    rows = []
    for name, path in (("toy induction decoder (shipped)", None),
                       ("toy induction decoder B (seed 1)", toy.INDUCTION_B_DIR),
                       ("toy induction decoder, 4 layers", toy.INDUCTION_4L_DIR)):
        for kind in ("key", "value"):
            rows += model_rows(name, path, kind, n, repeats=1 if quick else 3)
            rows += node_rows(name, path, kind, n)
    return rows


def markdown(rows: List[Dict], contention=None) -> str:
    from pyattr.bench.report import conditions

    lines = [conditions(contention).rstrip("\n"), ""] if contention is not None else []
    nodes = [r for r in rows if r.get("level") == "nodes"]
    rows = [r for r in rows if r.get("level") != "nodes"]
    for model in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == model]
        lines += [f"**{model}**: {rs[0]['pairs']} pairs, {rs[0]['edges']} edges:", "",
                  "| method | Pearson with exact | top-2 = exact | CPR | CMD | time (s) | time / exact |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in rs:
            lines.append(f"| {r['variant']} | {r['pearson']:.3f} | {r['top2_equal_exact']:.2f} | {r['cpr']:.3f} | "
                         f"{r['cmd']:.3f} | {r['seconds']:.3f} | {r['time_over_exact']:.2f} |")
        lines.append("")
    if nodes:
        lines += [f"Node circuits (heads and MLPs; {nodes[0]['pairs']} pairs; held out: the same circuits on as many other "
                  "pairs, seed 12):", "",
                  "| model | circuits | nodes | CPR | CMD | held-out CPR | held-out CMD | time (s) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in nodes:
            lines.append(f"| {r['model']} | {r['variant']} | {r['nodes']} | {r['cpr']:.3f} | {r['cmd']:.3f} | "
                         f"{r['held_out_cpr']:.3f} | {r['held_out_cmd']:.3f} | {r['seconds']:.3f} |")
        lines.append("")
    return "\n".join(lines)
