"""``pyattr patch --edges``: the edges of a causal LM's graph scored for one clean / corrupt
pair (:func:`pyattr.patching.edge_attribution`), and the circuits of the strongest edges run
exactly (:func:`pyattr.patching.circuit_faithfulness`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from pyattr.apps.explain import ExplainError, _load
from pyattr.methods._core.tokens import prompt_ids

#: the toy decoder's built-in key pair: the word before the copied one differs, so the
#: effect runs through a previous-token head into the induction heads' keys
DEFAULT_CLEAN = "sun cat red tree sun cat"
DEFAULT_CORRUPT = "sun ant red tree sun cat"
EDGE_CLI_METHODS = ("relp", "atp", "ig", "blockwise", "exact")


@dataclass
class EdgeReport:
    model: str
    metric: str
    result: object          # EdgeAttributionResult
    faithfulness: object    # CircuitFaithfulness
    seconds: float
    clean: str = ""
    corrupt: str = ""

    def heading(self) -> str:
        r = self.result
        return (f"{self.model} · clean {self.clean!r}, corrupt {self.corrupt!r} · {self.metric}: clean "
                f"{float(r.clean_metric.mean()):+.4f}, corrupt {float(r.corrupt_metric.mean()):+.4f} · scores: the "
                "metric's change when an edge is patched from the corrupt run (corrupt − clean)")

    def html(self) -> str:
        """One page: the edges' graph, grid and table, then the circuits' faithfulness curve."""
        from pyattr.results.html import page

        return page(self.result._panels() + self.faithfulness._panels(), self.heading())

    def to_json(self) -> dict:
        r, f = self.result, self.faithfulness
        return {"model": self.model, "metric": self.metric, "method": r.method, "seconds": self.seconds,
                "clean_metric": float(r.clean_metric.mean()), "corrupt_metric": float(r.corrupt_metric.mean()),
                "edges": [{"edge": e, "score": float(s)} for e, s in zip(r.edges, r.scores)],
                "circuits": {"sizes": f.sizes.tolist(), "edges": f.edge_counts.tolist(), "faithfulness": f.curve.tolist(),
                             "cpr": f.cpr, "cmd": f.cmd}}


def run_edges(clean: Optional[str], corrupt: Optional[str], model_dir: Optional[Path], target: Optional[str],
              method: str) -> EdgeReport:
    import pyattr.patching as P
    import pyattr.toy as toy
    from pyattr.apps.patch_report import logit_metric

    path = model_dir if model_dir is not None else toy.INDUCTION_DIR
    tok, model = _load(path, causal=True)
    clean = clean if clean is not None else DEFAULT_CLEAN
    corrupt = corrupt if corrupt is not None else DEFAULT_CORRUPT
    ids_c, ids_x = prompt_ids(tok, clean), prompt_ids(tok, corrupt)
    if len(ids_c) != len(ids_x):
        raise ExplainError(f"--clean is {len(ids_c)} tokens and --corrupt {len(ids_x)}; edge patching pairs position "
                           "p with position p, so the two texts must have the same number of tokens")
    metric, desc = logit_metric(tok, model, target, clean)
    c, x = torch.tensor([ids_c]), torch.tensor([ids_x])
    t0 = time.perf_counter()
    res = P.edge_effects(model, c, x, metric) if method == "exact" else P.edge_attribution(model, c, x, metric,
                                                                                          method=method)
    seconds = time.perf_counter() - t0
    faith = P.circuit_faithfulness(model, c, x, res, metric=metric)
    from pyattr.apps.patch_report import model_label

    return EdgeReport(model_label(path), desc, res, faith, seconds, clean, corrupt)


def print_edges(rep: EdgeReport, top: int = 10) -> None:
    r, f = rep.result, rep.faithfulness
    print(f"{rep.model} · {rep.metric}: clean {float(r.clean_metric.mean()):+.4f}, corrupt "
          f"{float(r.corrupt_metric.mean()):+.4f}")
    print(f"clean {rep.clean!r}, corrupt {rep.corrupt!r}; an edge's score: the metric's change when it alone is "
          "patched from the corrupt run (estimated)")
    print(f"{len(r.edges)} edges scored by {r.method} in {rep.seconds:.2f} s; the strongest:")
    for name, score in r.top(top):
        print(f"  {score:+10.4f}  {name}")
    print(f"circuits of the top edges run exactly: CPR {f.cpr:.3f}, CMD {f.cmd:.3f} (MIB; faithfulness at "
          + ", ".join(f"{int(n)} edges {float(v):.2f}" for n, v in zip(f.edge_counts, f.curve) if int(n) > 0) + ")")
