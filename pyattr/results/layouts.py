"""How each result lays itself out as panels (:mod:`pyattr.results.panels`): one function
per result class, chosen by class name. At most :data:`MAX_ROWS` batch rows (and target
sets) are drawn, and the view says so (a :class:`~pyattr.results.panels.Note`); ``to_pandas()``
lays out every row (``panels(result, None)``), as the tensors hold them."""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from pyattr.results.colours import num
from pyattr.results.panels import Curves, Graph, Matrix, Note, Picture, Table, Tokens, share_scale
import pyattr.results.seq2seq_layouts as S2S

from pyattr.results.layout_rows import (  # noqa: F401 - MAX_ROWS is read from here too
    MAX_ROWS, _labels, _left_out, _rows_k, _take, _target_word, _value, _what)


def _token_panels(result, values: torch.Tensor, name: str, delta_name: str, delta, limit, streams=None) -> List:
    panels, shown = [], 0
    pairs = _rows_k(values, 2)
    for k, r in _take(pairs, limit):
        shown += 1
        v = values[k] if k is not None else values
        v = v[r].double().tolist()
        target = _value(result.target, k, r)
        d = _value(delta, k, r)
        title = f"row {r}" + (f" · target set {k}" if k is not None else "") + \
            f" · target{_target_word(result, k, r)} = {num(target, '.4g')} · Σ {name} = {num(sum(v), '.4g')}" + \
            (f" · {delta_name} {num(d, '.3g')}" if d is not None else "")
        panels.append(Tokens(title, _labels(result, r, len(v)), v, name, row=r, target_set=k))
        panels += S2S.stream_panels(streams, k, r)
    return _left_out(shown, len(pairs), _what(values, 2)) + panels


def relevance(result, limit=MAX_ROWS) -> List:
    if result.patch_grid is not None:
        grid = result.patch_relevance()
        out = []
        pairs = _rows_k(grid, 3)
        for k, r in _take(pairs, limit):
            g = (grid[k] if k is not None else grid)[r].double()
            picture = _over_image(result, g, r)
            if picture is not None:
                out.append(Picture(f"row {r} · relevance over the image (red +, blue −) · "
                                   f"target{_target_word(result, k, r)} = {num(_value(result.target, k, r), '.4g')}",
                                   picture))
            out.append(Matrix(f"row {r} · image patches (the [CLS] token left out) · target"
                              f"{_target_word(result, k, r)} = {num(_value(result.target, k, r), '.4g')}",
                              [str(i) for i in range(g.shape[0])], [str(j) for j in range(g.shape[1])], g.tolist(),
                              "patch row", "patch column", row=r, target_set=k))
        return _left_out(len(out), len(pairs), _what(grid, 3)) + out
    return _token_panels(result, result.token_relevance, "relevance", "conservation delta", result.conservation_delta,
                         limit, getattr(result, "stream_relevance", None))


def _over_image(result, grid: torch.Tensor, r: int):
    """Row ``r``'s patch relevance drawn over its image (H×W×3 uint8), or None without one."""
    image = getattr(result, "image", None)
    if image is None or r >= image.shape[0]:
        return None
    from pyattr.results.overlay import overlay_rgb

    rows, cols = grid.shape
    h, w = image.shape[1], image.shape[2]
    if h < rows or w < cols:
        return None
    return overlay_rgb(image[r].numpy(), grid, (h // rows, w // cols), min_side=256)


def attribution(result, limit=MAX_ROWS) -> List:
    if result.token_attribution is not None:
        return _token_panels(result, result.token_attribution, "attribution", "convergence delta",
                             result.convergence_delta, limit)
    a = result.attribution
    return [Table("attribution (not per token: see .attribution)", ["shape", "sum"],
                  [[str(tuple(a.shape)), float(a.double().sum())]])]


def layer_relevance(result, limit=MAX_ROWS) -> List:
    panels = []
    first = next(iter(result.layers.values()), None)
    if first is None:
        return panels
    rel0 = first.relevance
    base = rel0.dim() - (1 if result.target.dim() > 1 else 0)
    ks = [None] if result.target.dim() <= 1 else list(range(result.target.shape[0]))
    batch = rel0.shape[1 if ks[0] is not None else 0]
    total = len(ks) * batch
    for k in ks:
        for r in range(batch):
            if limit is not None and len(panels) >= limit:
                return _left_out(len(panels), total, "rows" if ks[0] is None else "(target set, row) pairs") + panels
            sides = getattr(result, "sides", None) or [None] * len(result.paths)
            # an encoder–decoder: one panel per stack, its positions the source's or the decoder inputs'
            for side in dict.fromkeys(sides):
                rows, vals = [], []
                seq = None
                for path, s in zip(result.paths, sides):
                    rel = result.layers[path].relevance
                    rel = (rel[k] if k is not None else rel)[r].double()
                    per = rel.sum(-1) if rel.dim() == 2 else rel if rel.dim() == 1 else None
                    if s != side or per is None or (seq is not None and per.shape[0] != seq):
                        continue
                    seq = per.shape[0]
                    rows.append(path)
                    vals.append(per.tolist())
                if not rows:
                    continue
                toks = _labels(result, r, seq) if side != "decoder" else _side_labels(result, r, seq)
                panels.append(Matrix(f"row {r}" + (f" · {side}" if side else "") +
                                     (f" · target set {k}" if k is not None else "") +
                                     f" · target{_target_word(result, k, r)} = "
                                     f"{num(_value(result.target, k, r), '.4g')}",
                                     rows, toks, vals, "layer", "token", row=r, target_set=k))
    del base
    return panels


def _side_labels(result, row: int, seq: int) -> List:
    """The decoder inputs' tokens of an encoder–decoder result (``#i`` without them)."""
    toks = getattr(result, "decoder_tokens", None)
    if toks is not None and row < len(toks) and len(toks[row]) == seq:
        return list(toks[row])
    return [f"#{i}" for i in range(seq)]


def generation(result, limit=MAX_ROWS) -> List:
    panels = []
    width = result.prompt_width
    batch = result.sequences.shape[0]
    for r in _take(list(range(batch)), limit):
        labels = _labels(result, r, result.sequences.shape[1])
        real = result.attention_mask[r].bool().tolist()
        steps = [t for t in range(result.token_relevance.shape[1]) if bool(result.step_mask[r, t])]
        # a column is a source of some step only before the last step's own token: the last
        # generated token (and what follows the row's end) is in no step's context
        end = width + steps[-1] if steps else 0
        cols = [j for j in range(min(end, len(labels))) if real[j]]
        rows, vals = [], []
        for t in range(result.token_relevance.shape[1]):
            if not bool(result.step_mask[r, t]):
                continue
            own = width + t
            rel = result.token_relevance[r, t].double().tolist()
            vals.append([rel[j] if j < own else None for j in cols])  # None: not in the step's context
            rows.append(f"{t}: {labels[own] if labels[own] is not None else ''}")
        panels.append(Matrix(f"row {r} · each generated token (rows) over its context (columns; cells after "
                             f"the step are not in its context) · target {result.target_kind}",
                             rows, [labels[j] for j in cols], vals, "step", "token", row=r))
    return _left_out(len(panels), batch) + panels


def patching(result, limit=MAX_ROWS) -> List:
    panels, notes = [], []
    per_node = None if limit is None else (limit if len(result.effects) == 1 else min(limit, 2))
    for node, eff in result.effects.items():
        # an encoder–decoder's "decoder.*" nodes sit at the decoder's inputs
        labels = getattr(result, "decoder_tokens" if node.startswith("decoder.") else "tokens", None)
        names = result.dims[node]
        rows = _take(list(range(eff.shape[0])), per_node)
        first = len(panels)
        notes += [Note(f"{node}: {n.text}") for n in _left_out(len(rows), eff.shape[0])]
        for r in rows:
            e = eff[r].double()
            if "position" in names and ("head" in names or "neuron" in names) and limit is None:
                # the long table (to_pandas()): every position's cells, the position a column
                for pos in range(e.shape[1]):
                    tok = labels[r][pos] if labels is not None and r < len(labels) and len(labels[r]) == e.shape[1] \
                        else None
                    panels.append(Matrix(f"row {r} · {node} ({result.method}) at position {pos}",
                                         [str(i) for i in range(e.shape[0])], [str(j) for j in range(e.shape[2])],
                                         _cells(e[:, pos], node in result.sampled), "layer", names[-1], "effect",
                                         row=r, coords={"position": pos, "token": tok}))
                continue
            if "position" in names and ("head" in names or "neuron" in names):
                # drawn as the sum of the per-position effects (NaN where no position was patched,
                # a sample's unpatched neurons): not the effect of patching every position at once
                e = torch.nansum(e, dim=1).masked_fill(torch.isnan(e).all(dim=1), math.nan)
                cols_name = names[-1]
                cols = [str(j) for j in range(e.shape[1])]
                what = "as the sum of its per-position effects (patching every position at once: sum_positions=True)"
            elif "position" in names:
                cols_name = "token"
                cols = labels[r] if labels is not None and r < len(labels) and len(labels[r]) == e.shape[1] else \
                    [f"#{j}" for j in range(e.shape[1])]
                what = "per position"
            elif e.dim() == 2:
                cols_name = names[-1]
                cols = [str(j) for j in range(e.shape[1])]
                what = "summed over positions"  # by the call (sum_positions=True): its dims hold no position
            else:
                e = e[:, None]
                cols_name, cols, what = "node", [node], "summed over positions"
            if e.shape[1] > 512 and limit is not None:
                if r == rows[0]:
                    notes.append(Note(f"{node}: {e.shape[1]} {cols_name} columns, too many to draw; to_pandas() and "
                                      f".effects[{node!r}] hold them"))
                continue
            panels.append(Matrix(f"row {r} · {node} ({result.method}){' ' + what if what else ''} · clean metric "
                                 f"{num(float(result.clean_metric[r]), '.4g')}, corrupt "
                                 f"{num(float(result.corrupt_metric[r]), '.4g')}",
                                 [str(i) for i in range(e.shape[0])], cols, _cells(e, node in result.sampled),
                                 "layer", cols_name, "effect", row=r))
        share_scale(panels[first:])  # rows of one node type on one scale; node types differ in size
    return notes + panels


def _cells(e: torch.Tensor, sampled: bool) -> list:
    """A matrix's values; in a sampled node's effects NaN marks the nodes not patched
    (not applicable: None), elsewhere a NaN is the result's own and stays NaN."""
    rows = e.tolist()
    if not sampled:
        return rows
    return [[None if isinstance(v, float) and math.isnan(v) else v for v in row] for row in rows]


def perturbation(result, limit=MAX_ROWS) -> List:
    n = result.values.shape[0]
    shown = n if limit is None else min(n, limit)
    ys = [row.tolist() for row in result.values[:shown]]
    names = [f"row {i} (AUC {num(float(a), '.4g')})" for i, a in enumerate(result.auc[:shown])]
    if n > 1:
        ys.append(result.values.mean(0).tolist())
        names.append("mean")  # over every row, drawn or not
    return _left_out(shown, n) + [Curves(f"{result.order} ({result.perturbation})", result.fractions.tolist(), ys, names,
                   "fraction perturbed" if result.order != "insertion" else "fraction restored", "target")]


def captured(result, limit=MAX_ROWS) -> List:
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
        out += _left_out(len(_take(list(range(norms.shape[0])), limit)), norms.shape[0])
        for r in _take(list(range(norms.shape[0])), limit):
            out.append(Tokens(f"{result.path} · row {r} · norm of the latest gradient per position",
                              [f"#{i}" for i in range(norms.shape[1])], norms[r].tolist(), "gradient norm", row=r))
    return out


def gradient_capture(result, limit=MAX_ROWS) -> List:
    out = []
    for path in result.paths:
        out.extend(captured(result[path], limit))
    return out


def audit(result, limit=MAX_ROWS) -> List:
    rows = [[m.path, m.cls, m.calls, m.relevance_in, m.relevance_out, m.bias_relevance, m.own_gap,
             "leak" if m.leak else ""] for m in result.modules]
    return [Table(f"per-module conservation audit · target {num(float(result.target), '.4g')} · "
                  f"gap {num(float(result.gap), '.3g')} · {len(result.leaks)} leaks",
                  ["module", "class", "calls", "relevance in", "relevance out", "bias", "own gap", "leak"], rows)]


def context(result, limit=MAX_ROWS) -> List:
    """Per row (and response span), the sources as a heatmap of their scores."""
    n = len(result.sources)
    shown = n if limit is None else min(n, limit)
    out = _left_out(shown, n)
    for r in range(shown):
        k = len(result.sources[r])
        resp = result.response[r] if result.response[r] is not None else f"{len(result.response_ids[r])} tokens"
        rows = [result.scores[r]] if result.scores.dim() == 2 else list(result.scores[r])
        toks = getattr(result, "response_tokens", None)
        for j, vals in enumerate(rows):
            span = ""
            if result.spans is not None:
                a, b = result.spans[j]
                words = "".join(t or "" for t in toks[r][a:b]) if toks is not None and r < len(toks) else None
                span = f" · response tokens {a}:{b}" + (f" {words!r}" if words is not None else "")
            said = "query" if getattr(result, "outcome", "logprob") == "cosine" else "response"
            value = result.value_text(r, j if result.spans is not None else None)
            out.append(Tokens(f"row {r} · {said} {resp!r}{span} · {result.method} · {value} · score: "
                              f"{result.score_unit}", list(result.sources[r]),
                              vals[:k].tolist(), "score", label_name="source", index_name="source_index", row=r))
    return out


#: edges the graph view draws (the strongest by magnitude)
GRAPH_EDGES = 30


def edge_graph(result, n: int = GRAPH_EDGES, title: Optional[str] = None) -> Graph:
    """The ``n`` strongest edges of an edge result as a graph: the input at the bottom, each
    layer's heads in a row above, its MLP above them on the right, the logits on top. A key or value input
    of a key-value head group is drawn into the group's first head."""
    import re

    layers = sorted({int(m.group(1)) for m in (re.match(r"[am](\d+)", u) for u in result.upstream) if m})
    n_layers = len(layers)
    q = {}
    kv = {}
    for d in result.downstream:
        m = re.match(r"a(\d+)\.h(\d+)<([qkv])>", d)
        if m:
            (q if m.group(3) == "q" else kv).setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    levels = 2 * n_layers + 1
    nodes = [("input", 0.5, 0.0)]
    for l in layers:
        heads = sorted(q.get(l, ()))
        for j, h in enumerate(heads):
            nodes.append((f"a{l}.h{h}", (j + 0.5) / max(len(heads), 1), (2 * l + 1) / levels))
        # the MLP to the right of the heads' row, so that no head-to-head edge runs through it
        nodes.append((f"m{l}", 1.0, (2 * l + 2) / levels))
    nodes.append(("logits", 0.5, 1.0))

    def owner(d: str) -> str:
        m = re.match(r"a(\d+)\.h(\d+)<([qkv])>", d)
        if not m:
            return d
        l, h, kind = int(m.group(1)), int(m.group(2)), m.group(3)
        if kind == "q" or len(kv.get(l, ())) == len(q.get(l, ())):
            return f"a{l}.h{h}"
        per = len(q.get(l, ())) // max(len(kv.get(l, ())), 1)
        return f"a{l}.h{h * per}"

    drawn = []
    for name, v in result.top(n):
        u, d = name.split("->")
        drawn.append((u, owner(d), name, v))
    return Graph(title or f"the {len(drawn)} strongest edges ({result.method})", nodes, drawn, "score")


def edges(result, limit=MAX_ROWS) -> List:
    """The strongest edges as a graph, every edge's mean score as an upstream × downstream
    grid (cells of no edge blank), and the top edges as a table."""
    index = {(u, d): i for i, (u, d) in enumerate(e.split("->") for e in result.edges)}
    score = {k: float(result.scores[i]) for k, i in index.items()}

    def strongest(node, upstream: bool) -> float:
        vals = [abs(v) for (u, d), v in score.items() if (u if upstream else d) == node and v == v]
        return max(vals, default=0.0)

    # strongest rows and columns first: a grid wider than the page (27 downstream inputs on
    # the toy decoder) scrolls, and what is out of sight is then the weakest
    ups = sorted(result.upstream, key=lambda n: -strongest(n, True))
    downs = sorted(result.downstream, key=lambda n: -strongest(n, False))
    grid = [[score.get((u, d)) for d in downs] for u in ups]
    top = result.top(20 if limit is not None else len(result.edges))
    return [edge_graph(result),
            Table("top edges by |score|", ["edge", "score"], [[e, v] for e, v in top]),
            Matrix(f"edge scores ({result.method}), mean over {result.per_pair.shape[0]} pairs; rows and columns "
                   "strongest first", ups, downs, grid, "upstream", "downstream input", "score")]


def circuit(result, limit=MAX_ROWS) -> List:
    """The faithfulness curve over circuit sizes, and its points as a table."""
    head = f"faithfulness (CPR {num(result.cpr, '.3f')}, CMD {num(result.cmd, '.3f')})"
    unit = getattr(result, "kind", "edges")
    cols = ["fraction", unit, "faithfulness", "metric"]
    rows = [[float(x), int(n), float(f), float(m)] for x, n, f, m in
            zip(result.sizes, result.edge_counts, result.curve, result.metric)]
    if getattr(result, "circuits", None) is not None:      # node circuits: which nodes at each size
        cols.append("circuit")
        rows = [r + [" ".join(c)] for r, c in zip(rows, result.circuits)]
    return [Curves(head, result.sizes.tolist(), [result.curve.tolist()], ["circuit"], f"fraction of {unit}",
                   "faithfulness"),
            Table("circuits", cols, rows)]


LAYOUTS = {
    "EdgeAttributionResult": edges,
    "CircuitFaithfulness": circuit,
    "ContextAttributionResult": context,
    "RelevanceResult": relevance,
    "AttributionResult": attribution,
    "LayerRelevanceResult": layer_relevance,
    "GenerationRelevanceResult": generation,
    "PatchingResult": patching,
    "PerturbationCurve": perturbation,
    "Captured": captured,
    "GradientCapture": gradient_capture,
    "RelevanceAudit": audit,
    "Seq2SeqRelevanceResult": S2S.seq2seq_relevance,
    "Seq2SeqAttributionResult": S2S.seq2seq_attribution,
    "Seq2SeqGenerationResult": S2S.seq2seq_generation,
}


def panels(result, limit: Optional[int] = MAX_ROWS) -> List:
    """The result's panels: at most ``limit`` batch rows (with a note saying how many are
    left out); ``limit=None``: every row, every panel (``to_pandas()``)."""
    out = LAYOUTS[type(result).__name__](result, limit)
    if type(result).__name__ not in ("PatchingResult", "GradientCapture", "EdgeAttributionResult", "CircuitFaithfulness"):
        share_scale(out)  # every row of one result on one colour scale, so rows compare by colour
    return out
