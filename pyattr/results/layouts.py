"""How each result lays itself out as panels (:mod:`pyattr.results.panels`): one function
per result class, chosen by class name. At most :data:`MAX_ROWS` batch rows (and target
sets) are drawn; ``to_pandas()`` and the tensors hold every row."""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from pyattr.apps.render import num
from pyattr.results.panels import Curves, Matrix, Table, Tokens

MAX_ROWS = 8


def _labels(result, row: int, seq: int) -> List[Optional[str]]:
    toks = getattr(result, "tokens", None)
    if toks is not None and row < len(toks) and len(toks[row]) == seq:
        return list(toks[row])
    return [f"#{i}" for i in range(seq)]


def _target_word(result, k: Optional[int], row: int) -> str:
    words = getattr(result, "target_tokens", None)
    ids = getattr(result, "target_ids", None)
    try:
        if words is not None:
            w = words[k][row] if k is not None else words[row]
            return f" {w!r}"
        if ids is not None:
            i = ids[k, row] if k is not None else ids[row] if ids.dim() else ids
            return f" (id {int(i)})"
    except (IndexError, TypeError):
        pass
    return ""


def _value(t: Optional[torch.Tensor], k, row) -> Optional[float]:
    if t is None:
        return None
    t = t[k] if k is not None and t.dim() > 1 else t
    return float(t[row]) if t.dim() else float(t)


def _rows_k(values: torch.Tensor, base_dim: int):
    """``(k or None, row)`` pairs of a per-token tensor with ``base_dim`` dims (k leading)."""
    ks = [None] if values.dim() == base_dim else list(range(values.shape[0]))
    batch = values.shape[-base_dim]
    return [(k, r) for k in ks for r in range(batch)][:MAX_ROWS]


def _token_panels(result, values: torch.Tensor, name: str, delta_name: str, delta) -> List:
    panels = []
    for k, r in _rows_k(values, 2):
        v = values[k] if k is not None else values
        v = v[r].double().tolist()
        target = _value(result.target, k, r)
        d = _value(delta, k, r)
        title = f"row {r}" + (f" · target set {k}" if k is not None else "") + \
            f" · target{_target_word(result, k, r)} = {num(target, '.4g')} · Σ {name} = {num(sum(v), '.4g')}" + \
            (f" · {delta_name} {num(d, '.3g')}" if d is not None else "")
        panels.append(Tokens(title, _labels(result, r, len(v)), v, name))
    return panels


def relevance(result) -> List:
    if result.patch_grid is not None:
        grid = result.patch_relevance()
        out = []
        for k, r in _rows_k(grid, 3):
            g = (grid[k] if k is not None else grid)[r].double()
            out.append(Matrix(f"row {r} · image patches (the [CLS] token left out) · target"
                              f"{_target_word(result, k, r)} = {num(_value(result.target, k, r), '.4g')}",
                              [str(i) for i in range(g.shape[0])], [str(j) for j in range(g.shape[1])], g.tolist(),
                              "patch row", "patch column"))
        return out
    return _token_panels(result, result.token_relevance, "relevance", "conservation delta", result.conservation_delta)


def attribution(result) -> List:
    if result.token_attribution is not None:
        return _token_panels(result, result.token_attribution, "attribution", "convergence delta",
                             result.convergence_delta)
    a = result.attribution
    return [Table("attribution (not per token: see .attribution)", ["shape", "sum"],
                  [[str(tuple(a.shape)), float(a.double().sum())]])]


def layer_relevance(result) -> List:
    panels = []
    first = next(iter(result.layers.values()), None)
    if first is None:
        return panels
    rel0 = first.relevance
    base = rel0.dim() - (1 if result.target.dim() > 1 else 0)
    ks = [None] if result.target.dim() <= 1 else list(range(result.target.shape[0]))
    batch = rel0.shape[1 if ks[0] is not None else 0]
    for k in ks:
        for r in range(batch):
            if len(panels) >= MAX_ROWS:
                return panels
            rows, vals = [], []
            seq = None
            for path in result.paths:
                rel = result.layers[path].relevance
                rel = (rel[k] if k is not None else rel)[r].double()
                per = rel.sum(-1) if rel.dim() == 2 else rel if rel.dim() == 1 else None
                if per is None or (seq is not None and per.shape[0] != seq):
                    continue
                seq = per.shape[0]
                rows.append(path)
                vals.append(per.tolist())
            if not rows:
                continue
            panels.append(Matrix(f"row {r}" + (f" · target set {k}" if k is not None else "") +
                                 f" · target{_target_word(result, k, r)} = {num(_value(result.target, k, r), '.4g')}",
                                 rows, _labels(result, r, seq), vals, "layer", "token"))
    del base
    return panels


def generation(result) -> List:
    panels = []
    width = result.prompt_width
    for r in range(min(result.sequences.shape[0], MAX_ROWS)):
        labels = _labels(result, r, result.sequences.shape[1])
        real = result.attention_mask[r].bool().tolist()
        cols = [j for j in range(len(labels)) if real[j]]
        rows, vals = [], []
        for t in range(result.token_relevance.shape[1]):
            if not bool(result.step_mask[r, t]):
                continue
            own = width + t
            rel = result.token_relevance[r, t].double().tolist()
            vals.append([rel[j] if j < own else math.nan for j in cols])
            rows.append(f"{t}: {labels[own] if labels[own] is not None else ''}")
        panels.append(Matrix(f"row {r} · each generated token (rows) over its context (columns; cells after "
                             f"the step are not in its context) · target {result.target_kind}",
                             rows, [labels[j] for j in cols], vals, "step", "token"))
    return panels


def patching(result) -> List:
    panels = []
    labels = getattr(result, "tokens", None)
    for node, eff in result.effects.items():
        names = result.dims[node]
        for r in range(min(eff.shape[0], MAX_ROWS if len(result.effects) == 1 else 2)):
            e = eff[r].double()
            if "position" in names and ("head" in names or "neuron" in names):
                e = torch.nansum(e, dim=1)
                cols_name = names[-1]
                cols = [str(j) for j in range(e.shape[1])]
                what = "summed over positions"
            elif "position" in names:
                cols_name = "token"
                cols = labels[r] if labels is not None and r < len(labels) and len(labels[r]) == e.shape[1] else \
                    [f"#{j}" for j in range(e.shape[1])]
                what = "per position"
            elif e.dim() == 2:
                cols_name = names[-1]
                cols = [str(j) for j in range(e.shape[1])]
                what = ""
            else:
                e = e[:, None]
                cols_name, cols, what = "effect", [node], ""
            if e.shape[1] > 512:
                continue  # too wide to draw (neurons): to_pandas and the tensor hold it
            panels.append(Matrix(f"row {r} · {node} ({result.method}) {what} · clean metric "
                                 f"{num(float(result.clean_metric[r]), '.4g')}, corrupt "
                                 f"{num(float(result.corrupt_metric[r]), '.4g')}",
                                 [str(i) for i in range(e.shape[0])], cols, e.tolist(), "layer", cols_name, "effect"))
    return panels


def perturbation(result) -> List:
    ys = [row.tolist() for row in result.values[:MAX_ROWS]]
    names = [f"row {i} (AUC {num(float(a), '.4g')})" for i, a in enumerate(result.auc[:MAX_ROWS])]
    if result.values.shape[0] > 1:
        ys.append(result.values.mean(0).tolist())
        names.append("mean")
    return [Curves(f"{result.order} ({result.perturbation})", result.fractions.tolist(), ys, names,
                   "fraction perturbed" if result.order != "insertion" else "fraction restored", "target")]


def captured(result) -> List:
    rows = []
    for i, out in enumerate(result.outputs):
        t = out if isinstance(out, torch.Tensor) else None
        rows.append([i, "output", str(tuple(t.shape)) if t is not None else type(out).__name__,
                     float(t.double().norm()) if t is not None and t.is_floating_point() else math.nan])
    for i, g in enumerate(result.grads):
        rows.append([i, "grad", str(tuple(g.shape)), float(g.double().norm())])
    out = [Table(f"{result.path}: {len(result.outputs)} calls, {len(result.grads)} backward passes",
                 ["index", "kind", "shape", "norm"], rows)]
    grad = result.grad
    if grad is not None and grad.dim() == 3 and grad.is_floating_point():
        norms = grad.double().norm(dim=-1)
        for r in range(min(norms.shape[0], MAX_ROWS)):
            out.append(Tokens(f"{result.path} · row {r} · norm of the latest gradient per position",
                              [f"#{i}" for i in range(norms.shape[1])], norms[r].tolist(), "gradient norm"))
    return out


def gradient_capture(result) -> List:
    out = []
    for path in result.paths:
        out.extend(captured(result[path]))
    return out


def audit(result) -> List:
    rows = [[m.path, m.cls, m.calls, m.relevance_in, m.relevance_out, m.bias_relevance, m.own_gap,
             "leak" if m.leak else ""] for m in result.modules]
    return [Table(f"per-module conservation audit · target {num(float(result.target), '.4g')} · "
                  f"gap {num(float(result.gap), '.3g')} · {len(result.leaks)} leaks",
                  ["module", "class", "calls", "relevance in", "relevance out", "bias", "own gap", "leak"], rows)]


LAYOUTS = {
    "RelevanceResult": relevance,
    "AttributionResult": attribution,
    "LayerRelevanceResult": layer_relevance,
    "GenerationRelevanceResult": generation,
    "PatchingResult": patching,
    "PerturbationCurve": perturbation,
    "Captured": captured,
    "GradientCapture": gradient_capture,
    "RelevanceAudit": audit,
}


def panels(result) -> List:
    return LAYOUTS[type(result).__name__](result)
