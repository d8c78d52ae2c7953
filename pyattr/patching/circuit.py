"""Circuits as edge sets, run exactly: every edge outside the circuit patched to its corrupt
value (each downstream input rewritten as the sum of its upstream contributions, those of
patched edges taken from the corrupt run; EAP-IG's ``evaluate_graph``), the faithfulness of
circuits of growing size, and MIB's integrated metrics (Mueller et al. 2025, "MIB: A
Mechanistic Interpretability Benchmark", §3.2):

- faithfulness of a circuit C: ``f(C) = (m(C) − m(∅)) / (m(full) − m(∅))``, the metric ``m``
  averaged over the pairs; ``m(full)`` is the clean run, ``m(∅)`` every edge patched (the
  corrupt run);
- **CPR** (circuit performance ratio): the area under ``f`` over circuit sizes as a fraction
  of the edges (trapezoids at MIB's sizes 0.1 %, 0.2 %, 0.5 %, 1 %, 2 %, 5 %, 10 %, 20 %,
  50 %, 100 %); higher is better;
- **CMD** (circuit–model difference): the area under ``|1 − f|`` over the same sizes; lower
  is better.

A circuit of the top-n edges is pruned as EAP-IG prunes it: an edge stays only where its
upstream node is reached from the input and its downstream node reaches the logits through
edges of the circuit.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

import pyattr.methods._core as core
import pyattr.methods._core.text as text
import pyattr.patching.graph as G
import pyattr.patching.node_circuit as NC
from pyattr.config import RelevanceRules
from pyattr.integration.wrappers import unwrap
from pyattr.patching.circuit_result import MIB_SIZES, CircuitFaithfulness, _areas, check_sizes, curve_result
from pyattr.patching.edges import EdgeAttributionResult, split_run
from pyattr.patching.pairs import check_row_metric, metric_targets, prepare_pair

__all__ = ["MIB_SIZES", "CircuitFaithfulness", "_areas", "circuit_faithfulness", "edge_effects", "patched_metrics",
           "prune", "top_edges"]


def prune(graph: G.Graph, keep: torch.Tensor) -> torch.Tensor:
    """``keep`` (BoolTensor[U, D], the circuit's edges) without the edges whose upstream node
    the input does not reach or whose downstream node does not reach the logits."""
    keep = keep & graph.valid
    n_layers = len(graph.mlp_node)
    # the upstream node each downstream input belongs to (a key/value input: every head of its group)
    owners: List[List[int]] = [[] for _ in graph.downstream]
    for l in range(n_layers):
        heads = graph.head_nodes[l]
        nq, ins = len(heads), graph.attn_inputs[l]
        n_kv = (len(ins) - nq) // 2
        per = nq // n_kv
        for h in range(nq):
            owners[ins[h]].append(heads[h])
        for g in range(n_kv):
            for h in range(g * per, (g + 1) * per):
                owners[ins[nq + g]].append(heads[h])
                owners[ins[nq + n_kv + g]].append(heads[h])
        owners[graph.mlp_input[l]].append(graph.mlp_node[l])
    reached = torch.zeros(len(graph.upstream), dtype=torch.bool)
    reached[0] = True
    for u in range(len(graph.upstream)):        # upstream nodes are in forward order
        if u == 0:
            continue
        feeds = [d for d, os in enumerate(owners) if u in os]
        reached[u] = bool((keep[:, feeds] & reached[:, None]).any())
    keep = keep & reached[:, None]
    alive = torch.zeros(len(graph.downstream), dtype=torch.bool)   # downstream inputs reaching the logits
    out_alive = torch.zeros(len(graph.upstream), dtype=torch.bool)
    alive[graph.logits] = True
    for u in reversed(range(len(graph.upstream))):
        out_alive[u] = bool((keep[u] & alive).any())
        for d, os in enumerate(owners):
            if u in os and out_alive[u]:
                alive[d] = True
    return keep & alive[None, :] & out_alive[:, None]


def top_edges(graph: G.Graph, scores: torch.Tensor, n: int, absolute: bool = True) -> torch.Tensor:
    """BoolTensor[U, D]: the ``n`` edges with the largest scores (``scores`` in the order of
    ``graph.edges``), pruned."""
    edges = graph.edges
    key = scores.abs() if absolute else scores
    keep = torch.zeros_like(graph.valid)
    for i in key.argsort(descending=True)[:n].tolist():
        u, d = edges[i]
        keep[u, d] = True
    return prune(graph, keep)


def patched_metrics(model, lay, graph, pair, tgts, corrupt_acts: torch.Tensor, circuits: torch.Tensor,
                    batch_size: Optional[int] = None) -> torch.Tensor:
    """Tensor[n, batch] float64: the metric of each circuit (``circuits`` BoolTensor[n, U, D],
    True: the edge is in the circuit) with every other edge patched to the corrupt run."""
    batch = pair.clean.input_ids.shape[0]
    per = max(1, (batch_size or 256) // batch)
    out = []
    for lo in range(0, circuits.shape[0], per):
        part = circuits[lo:lo + per]
        nv = part.shape[0]
        rows = torch.arange(batch).repeat(nv)
        sub = core.select_rows(pair.clean, rows.to(pair.clean.input_ids.device))
        tg = [t.rows(rows, batch) for t in tgts]
        patched = (~part & graph.valid).to(torch.float32).repeat_interleave(batch, 0)
        corrupt = corrupt_acts[:, rows.to(corrupt_acts.device)]
        with torch.no_grad():
            value, _, _ = split_run(model, lay, graph, sub, tg, "patch", corrupt=corrupt,
                                    patched=patched.to(corrupt.device))
        out.append(value.detach().double().cpu().reshape(nv, batch))
    return torch.cat(out)


def _circuit_masks(graph, edges_or_circuit, sizes):
    n_edges = len(graph.edges)
    if isinstance(edges_or_circuit, str) or not isinstance(edges_or_circuit, (EdgeAttributionResult, list, tuple)):
        raise TypeError("edges_or_circuit: expected an EdgeAttributionResult, a PatchingResult, a list of edge names "
                        f"('a0.h1->a1.h2<k>', ...) or a list of node names ('a0.h1', 'm0', ...), got "
                        f"{type(edges_or_circuit).__name__}")
    if isinstance(edges_or_circuit, EdgeAttributionResult):
        if edges_or_circuit.edges != graph.edge_names():
            raise ValueError("edges_or_circuit: the edge scores are of another model's graph")
        if not bool(torch.isfinite(edges_or_circuit.scores).all()):
            bad = (~torch.isfinite(edges_or_circuit.scores)).nonzero().flatten().tolist()
            raise ValueError(f"edges_or_circuit: the scores of {[graph.edge_names()[i] for i in bad[:4]]} are not "
                             "finite; a ranking needs a number for every edge")
        counts = [int(s * n_edges) for s in sizes]
        return torch.stack([top_edges(graph, edges_or_circuit.scores, c) for c in counts])
    names = list(edges_or_circuit)
    index = {n: i for i, n in enumerate(graph.edge_names())}
    unknown = [n for n in names if n not in index]
    if unknown:
        raise ValueError(f"edges_or_circuit: {unknown[:3]} are no edges of this model's graph (names as "
                         "'a0.h1->a1.h2<k>', see EdgeAttributionResult.edges)")
    keep = torch.zeros_like(graph.valid)
    for n in names:
        u, d = graph.edges[index[n]]
        keep[u, d] = True
    kept = prune(graph, keep)
    dropped = [n for n in dict.fromkeys(names) if not kept[graph.edges[index[n]]]]
    if dropped:
        import warnings

        warnings.warn(f"circuit_faithfulness: {len(dropped)} of the circuit's edges are on no path from the input "
                      f"to the logits through the circuit and are patched like the edges outside it (EAP-IG's "
                      f"pruning): {dropped[:5]}; add the edges that connect them", stacklevel=4)
    return kept[None]


@text.text_inputs("circuit_faithfulness", inputs=("clean", "corrupt"), target=None)
def circuit_faithfulness(model: nn.Module, clean, corrupt, edges_or_circuit, *, metric,
                         sizes: Optional[Sequence[float]] = None, attention_mask: Optional[torch.Tensor] = None,
                         corrupt_attention_mask: Optional[torch.Tensor] = None, batch_size: Optional[int] = None,
                         nodes: Optional[Sequence[str]] = None, tokenizer=None) -> CircuitFaithfulness:
    """How much of the metric circuits of growing size recover, run exactly: circuits of
    edges (every edge outside patched) or of nodes (every node outside patched,
    :mod:`pyattr.patching.node_circuit`).

    Args:
        model (nn.Module): as for :func:`pyattr.patching.edge_attribution`.
        clean (LongTensor[batch, seq] | Mapping): token ids or tokenizer outputs.
        corrupt (LongTensor[batch, seq] | Mapping): the counterfactuals, of ``clean``'s length and mask.
        edges_or_circuit: an :class:`EdgeAttributionResult` (circuits of its top-scored
            edges, by magnitude, at each size: ``int(size × edges)`` edges, as MIB counts
            them, then pruned) or a list of edge names (one circuit; pruned too, with a
            warning naming the edges pruning drops); or for node circuits a
            :class:`PatchingResult` computed with ``sum_positions=True`` over node types among
            ``"heads"``, ``"attention"``, ``"mlp"`` (circuits of its top nodes by the magnitude
            of their mean effect: ``int(size × nodes)`` nodes) or a list of node names
            (``"a0.h1"`` a head, ``"attn0"`` an attention block, ``"m0"`` an MLP; one circuit).
        metric: a :mod:`pyattr.targets` target or a callable ``f(output) → Tensor[batch]``.
        sizes (sequence of float, optional): fractions of the edges in (0, 1], increasing
            (default :data:`MIB_SIZES`); with a list of edges, ignored (its own size).
        attention_mask (Tensor[batch, seq], optional): the mask of ``clean`` given as ids.
        corrupt_attention_mask (Tensor[batch, seq], optional): the mask of ``corrupt`` given as ids.
        batch_size (int, optional): rows per forward (pairs × circuits; default 256 for edge
            circuits, 1024 for node circuits).
        nodes (str | sequence of str, optional): for a list of node names only: the node
            types among ``"heads"``, ``"attention"``, ``"mlp"`` the circuit is chosen from
            (every other node of these types is patched). Default heads and MLPs, or
            attention blocks and MLPs where the names are attention blocks.
        tokenizer (optional): for text inputs.

    Returns:
        CircuitFaithfulness (``cpr`` and ``cmd`` NaN for a single circuit).

    Raises:
        ValueError: sizes outside (0, 1] or not increasing, edge or node names not in the
            model, scores of another graph, node effects per position or of node types a
            circuit is not made of, clean and corrupt metrics equal on average (``f`` is
            undefined), and what :func:`edge_attribution` refuses.
        TypeError: ``edges_or_circuit`` of another type.
    """
    model = unwrap(model)
    sizes = check_sizes(sizes)
    batch_size = core.check_count("batch_size", batch_size)
    scored = isinstance(edges_or_circuit, (EdgeAttributionResult, NC.PatchingResult))
    node_circuit = NC.is_node_circuit(edges_or_circuit, nodes)
    if nodes is not None and not node_circuit:
        raise ValueError("nodes: only node circuits (a list of node names) are chosen among node types; edge "
                         "circuits are chosen among the graph's edges")
    if node_circuit:
        if isinstance(edges_or_circuit, NC.PatchingResult):
            NC.result_nodes(edges_or_circuit)
        pair = prepare_pair(model, clean, corrupt, None, attention_mask, corrupt_attention_mask,
                            "circuit_faithfulness", alignable=False)
        tgts = metric_targets(metric, pair.clean.input_ids.shape[0])
        with core.attribution_pass(model, RelevanceRules(), False, "circuit_faithfulness"), torch.no_grad():
            keep, curve, m, full, empty, names = NC.node_circuits(model, pair, tgts, edges_or_circuit, sizes,
                                                                  batch_size or NC.DEFAULT_BATCH, nodes)
        circuits = [[names[i] for i in k.nonzero().flatten().tolist()] for k in keep]
        return curve_result(sizes, keep, curve, m, full, empty, len(names), scored, "nodes", circuits)
    lay = G.layout(model)
    graph = G.build_graph(lay)
    masks = _circuit_masks(graph, edges_or_circuit, sizes)
    pair = prepare_pair(model, clean, corrupt, None, attention_mask, corrupt_attention_mask, "circuit_faithfulness",
                        alignable=False)
    tgts = metric_targets(metric, pair.clean.input_ids.shape[0])
    with core.attribution_pass(model, RelevanceRules(), False, "circuit_faithfulness"), torch.no_grad():
        v_c, split_c, fixed = split_run(model, lay, graph, pair.clean, tgts, "record", check=True)
        check_row_metric(model, pair.clean, fixed, v_c, "circuit_faithfulness")
        v_x, split_x, _ = split_run(model, lay, graph, pair.corrupt, fixed, "record")
        m = patched_metrics(model, lay, graph, pair, fixed, torch.stack(split_x.acts), masks, batch_size)
    # the empty circuit is the corrupt run and the whole graph the clean one: their own metrics, so that
    # f(∅) = 0 and f(all) = 1 exactly rather than to the split forward's rounding
    kept = masks & graph.valid
    m[~kept.flatten(1).any(1)] = v_x.detach().double().cpu()
    m[(kept == graph.valid).flatten(1).all(1)] = v_c.detach().double().cpu()
    clean_m, corrupt_m = float(v_c.double().mean()), float(v_x.double().mean())
    if clean_m == corrupt_m:
        raise ValueError("metric: clean and corrupt give the same mean metric, so faithfulness (m(C) − m(∅)) / "
                         "(m(full) − m(∅)) is undefined")
    curve = (m.mean(1) - corrupt_m) / (clean_m - corrupt_m)
    return curve_result(sizes, masks.reshape(masks.shape[0], -1), curve, m.mean(1), clean_m, corrupt_m,
                        len(graph.edges), scored, "edges", None)


@text.text_inputs("edge_effects", inputs=("clean", "corrupt"), target=None)
def edge_effects(model, clean, corrupt, metric, *, attention_mask=None, corrupt_attention_mask=None,
                 batch_size: Optional[int] = None, tokenizer=None) -> EdgeAttributionResult:
    """Exact edge patching: each edge alone patched to the corrupt run, every other edge
    clean: ``metric(that run) − metric(clean)`` per pair (one run per edge, batched). The
    ground truth the estimators of :func:`edge_attribution` approximate; the result has
    ``method="exact"``. Arguments as for :func:`edge_attribution`; ``batch_size`` as for
    :func:`circuit_faithfulness`."""
    model = unwrap(model)
    batch_size = core.check_count("batch_size", batch_size)
    lay = G.layout(model)
    graph = G.build_graph(lay)
    pair = prepare_pair(model, clean, corrupt, None, attention_mask, corrupt_attention_mask, "edge_effects",
                        alignable=False)
    tgts = metric_targets(metric, pair.clean.input_ids.shape[0])
    edges = graph.edges
    masks = graph.valid.clone()[None].repeat(len(edges), 1, 1)
    for i, (u, d) in enumerate(edges):
        masks[i, u, d] = False
    with core.attribution_pass(model, RelevanceRules(), False, "edge_effects"), torch.no_grad():
        v_c, _, fixed = split_run(model, lay, graph, pair.clean, tgts, "record", check=True)
        check_row_metric(model, pair.clean, fixed, v_c, "edge_effects")
        v_x, split_x, _ = split_run(model, lay, graph, pair.corrupt, fixed, "record")
        m = patched_metrics(model, lay, graph, pair, fixed, torch.stack(split_x.acts), masks, batch_size)
    # the empty circuit is the corrupt run and the whole graph the clean one: their own metrics, so that
    # f(∅) = 0 and f(all) = 1 exactly rather than to the split forward's rounding
    kept = masks & graph.valid
    m[~kept.flatten(1).any(1)] = v_x.detach().double().cpu()
    m[(kept == graph.valid).flatten(1).all(1)] = v_c.detach().double().cpu()
    per_pair = (m - v_c.double().cpu()[None]).T
    return EdgeAttributionResult(per_pair.mean(0), per_pair, graph.edge_names(), list(graph.upstream),
                                 list(graph.downstream), v_c.double().cpu(), v_x.double().cpu(), "exact", len(edges))
