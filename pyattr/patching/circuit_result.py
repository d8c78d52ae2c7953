"""What a circuit evaluation returns (:class:`CircuitFaithfulness`) and MIB's integrated
metrics over circuit sizes (Mueller et al. 2025, "MIB: A Mechanistic Interpretability
Benchmark", §3.2), shared by edge circuits (:mod:`pyattr.patching.circuit`) and node circuits
(:mod:`pyattr.patching.node_circuit`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from pyattr._repr import summary_repr
from pyattr.results import ResultViews

#: MIB's circuit sizes, as fractions of the edges
MIB_SIZES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass
class CircuitFaithfulness(ResultViews):
    """Output of :func:`circuit_faithfulness`.

    Attributes:
        sizes (Tensor[n], float64): circuit sizes as fractions of the edges.
        edge_counts (Tensor[n], int64): edges kept at each size, after pruning.
        curve (Tensor[n], float64): faithfulness ``f`` at each size.
        metric (Tensor[n], float64): the circuit's metric, mean over the pairs.
        cpr (float): MIB's circuit performance ratio, the area under ``curve`` over ``sizes``
            (trapezoids).
        cmd (float): MIB's circuit–model difference, the area under ``|1 − curve|``.
        clean_metric (float): ``m(full)``, the clean run's mean metric.
        corrupt_metric (float): ``m(∅)``, the corrupt run's (node circuits: the run with
            every node patched, see :mod:`pyattr.patching.node_circuit`).
        edges (int): the graph's edge count.
        kind (str): ``"edges"``, or ``"nodes"`` for node circuits: then ``edge_counts`` and
            ``edges`` count nodes.
        circuits (list[list[str]] or None): node circuits: the nodes of the circuit run at
            each size; None for edge circuits (their edges are the top of the scores, pruned).
    """

    __repr__ = summary_repr

    sizes: torch.Tensor
    edge_counts: torch.Tensor
    curve: torch.Tensor
    metric: torch.Tensor
    cpr: float
    cmd: float
    clean_metric: float
    corrupt_metric: float
    edges: int
    tokens: Optional[list] = field(default=None)
    kind: str = "edges"
    circuits: Optional[List[List[str]]] = field(default=None)


def _areas(sizes: torch.Tensor, curve: torch.Tensor):
    dx = sizes[1:] - sizes[:-1]
    cpr = float((dx * (curve[1:] + curve[:-1]) / 2).sum())
    gap = (1 - curve).abs()
    cmd = float((dx * (gap[1:] + gap[:-1]) / 2).sum())
    return cpr, cmd


def check_sizes(sizes) -> tuple:
    """``sizes`` as increasing fractions in (0, 1] (default :data:`MIB_SIZES`)."""
    if sizes is None:
        return MIB_SIZES
    given = sizes
    try:
        if isinstance(sizes, (str, bytes)):
            raise TypeError
        sizes = given = tuple(sizes)   # once: a generator is read here only
        if any(isinstance(v, (str, bool)) for v in sizes):
            raise TypeError
        sizes = tuple(float(v) for v in sizes)
    except (TypeError, ValueError):
        raise ValueError(f"sizes: expected increasing fractions of the edges in (0, 1], got {given!r}") from None
    if not sizes or any(not 0 < s <= 1 for s in sizes) or any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"sizes: expected increasing fractions of the edges in (0, 1], got {list(sizes)}")
    return sizes


def curve_result(sizes, keep: torch.Tensor, curve: torch.Tensor, metric: torch.Tensor, full: float, empty: float,
                 n: int, scored: bool, kind: str, circuits) -> CircuitFaithfulness:
    """The CircuitFaithfulness of circuits ``keep`` (BoolTensor[k, …], one per size where
    ``scored``, else one circuit of its own size)."""
    counts = keep.reshape(keep.shape[0], -1).sum(1).long()
    if scored:
        xs = torch.tensor(sizes, dtype=torch.float64)
        # an area needs two sizes at least
        cpr, cmd = _areas(xs, curve) if len(sizes) > 1 else (float("nan"), float("nan"))
    else:
        xs = counts.double() / n
        cpr = cmd = float("nan")
    return CircuitFaithfulness(xs, counts, curve, metric, cpr, cmd, full, empty, n, kind=kind, circuits=circuits)
