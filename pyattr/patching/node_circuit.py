"""Circuits as node sets, run exactly, and a search for them.

A node circuit keeps some components (heads, attention blocks, MLPs: one node per layer and
unit, every position) clean: every node outside it is patched to its activation in the
corrupt run, at every non-padding position, in one forward (MIB's node-level evaluation,
Mueller et al. 2025, §3). Nodes inside recompute from what reaches them. The input
embeddings are not a node: they stay clean, so the empty circuit is *not* the corrupt run;
``m(∅)`` is measured (every node patched) and faithfulness is
``f(C) = (m(C) − m(∅)) / (m(full) − m(∅))`` with ``m(full)`` the clean run, so that
``f(∅) = 0`` and ``f(all) = 1`` exactly. CPR and CMD are MIB's areas over the sizes, as for
edge circuits (:mod:`pyattr.patching.circuit`).

:func:`circuit_search` builds circuits greedily by the exact metric: starting from the empty
circuit, each step runs every circuit of one more node and keeps the one whose faithfulness
is the largest (``objective="cpr"``) or the closest to 1 (``"cmd"``). Where top-k
thresholding by single-node effects keeps the nodes that matter alone, this keeps the ones
that matter together (a node whose effect shows only once another is in). A second pass
removes nodes from the full circuit the same way; at each size the better of the two
circuits is kept (circuits of different sizes need not nest). Cost: about ``N²`` circuit runs
per pair for ``N`` nodes, batched.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

import pyattr.methods._core as core
import pyattr.methods._core.text as text
import pyattr.targets as T
from pyattr.config import RelevanceRules
from pyattr.integration.wrappers import unwrap
from pyattr.methods._core.forward import evaluate_targets, run_model
from pyattr.patching.circuit_result import check_sizes, curve_result
from pyattr.patching.nodes import Site, check_nodes, node_sites
from pyattr.patching.pairs import check_row_metric, check_value, metric_targets, prepare_pair, recording_forward
from pyattr.patching.result import PatchingResult

#: the node types a node circuit is made of (one node per layer and unit, every position)
CIRCUIT_NODES = ("heads", "attention", "mlp")
#: circuit rows (circuit × pair) per forward
DEFAULT_BATCH = 1024
_PREFIX = {"heads": "a", "attention": "attn", "mlp": "m"}


def check_circuit_nodes(nodes, what: str = "nodes") -> List[str]:
    node_list = check_nodes(nodes)
    bad = [n for n in node_list if n not in CIRCUIT_NODES]
    if bad:
        raise ValueError(f"{what}: node circuits are made of {list(CIRCUIT_NODES)}, one node per layer and unit at "
                         f"every position; {bad} cannot be: the residual stream is what the circuit's nodes write "
                         "into, and neurons are too many to run a circuit of each size")
    return node_list


class NodeSet:
    """The circuit's nodes: names (``a{l}.h{h}`` a head, ``attn{l}`` an attention block's
    output, ``m{l}`` an MLP's output) in the order of ``sites``, units per site."""

    def __init__(self, sites: List[Site]):
        self.sites = sites
        self.names: List[str] = []
        self.span: List[Tuple[int, int]] = []      # per site: its nodes' range in ``names``
        for s in sites:
            lo = len(self.names)
            if s.node == "heads":
                self.names += [f"a{s.layer}.h{h}" for h in range(s.heads)]
            else:
                self.names.append(f"{_PREFIX[s.node]}{s.layer}")
            self.span.append((lo, len(self.names)))

    def __len__(self) -> int:
        return len(self.names)

    def scores(self, result: PatchingResult) -> torch.Tensor:
        """Tensor[N] float64: each node's effect in ``result`` (mean over the pairs)."""
        out = torch.zeros(len(self.names), dtype=torch.float64)
        for node in result.nodes:
            e = result.effects[node]
            want = (sum(s.node == node for s in self.sites),) + ((self.sites[0].heads or 1,) if node == "heads" else ())
            if tuple(e.shape[1:]) != want:
                raise ValueError(f"edges_or_circuit: the {node!r} effects have shape {tuple(e.shape[1:])} per pair, and "
                                 f"this model has {want} (layers[, heads]): they are of another model")
        for s, (lo, hi) in zip(self.sites, self.span):
            e = result.effects[s.node].double().mean(0)[s.layer]
            out[lo:hi] = e.reshape(-1)
        if not bool(torch.isfinite(out).all()):
            bad = [self.names[i] for i in (~torch.isfinite(out)).nonzero().flatten().tolist()]
            raise ValueError(f"edges_or_circuit: the effects of {bad[:4]} are not finite (NaN: a neuron sample, or a "
                             "metric that was not finite); a ranking needs a number for every node")
        return out

    def mask(self, names: Sequence[str]) -> torch.Tensor:
        index = {n: i for i, n in enumerate(self.names)}
        unknown = [n for n in names if n not in index]
        if unknown:
            raise ValueError(f"edges_or_circuit: {unknown[:3]} are no nodes of this model (names as 'a0.h1' (a head), "
                             f"'attn0' (an attention block), 'm0' (an MLP); this model's: {self.names[:4]}…)")
        keep = torch.zeros(len(self.names), dtype=torch.bool)
        keep[[index[n] for n in names]] = True
        return keep


def result_nodes(result: PatchingResult) -> List[str]:
    """The node types of a patching result that a node circuit is built from; refused
    unless ``sum_positions=True`` and every type is a circuit node type."""
    if any("position" in result.dims[n] for n in result.nodes):
        raise ValueError("edges_or_circuit: a node circuit keeps a component at every position; pass a patching "
                         "result computed with sum_positions=True")
    return check_circuit_nodes(result.nodes, "edges_or_circuit")


class NodeRuns:
    """The clean and corrupt runs of a pair, and circuits run on it."""

    def __init__(self, model: nn.Module, pair, tgts, node_list: List[str], batch_size: int, caller: str):
        self.model, self.pair, self.batch_size = model, pair, batch_size
        sites = node_sites(model, node_list)
        self.sites = [s for n in node_list for s in sites[n]]
        self.nodes = NodeSet(self.sites)
        self.batch = pair.clean.input_ids.shape[0]
        # the full head, as every circuit run here reads it (one identical input, one value)
        self.clean, _, self.fixed = recording_forward(model, pair.clean, tgts, self.sites, grad=False, cut=False)
        check_row_metric(model, pair.clean, self.fixed, self.clean, caller)
        self.ends: Optional[Tuple[float, float]] = None     # (m(full), m(∅)), see _ends
        self.corrupt_value, self.corrupt, _ = recording_forward(model, pair.corrupt, self.fixed, self.sites, grad=False,
                                                                cut=False)

    def metrics(self, keep: torch.Tensor) -> torch.Tensor:
        """Tensor[n, batch] float64: the metric of each circuit (``keep`` BoolTensor[n, N],
        True: the node is in the circuit) with every other node patched to the corrupt run."""
        per = max(1, self.batch_size // self.batch)
        out = []
        for lo in range(0, keep.shape[0], per):
            part = keep[lo:lo + per]
            out.append(self._run(part).reshape(part.shape[0], self.batch))
        return torch.cat(out)

    def _run(self, keep: torch.Tensor) -> torch.Tensor:
        nc, batch, pair = keep.shape[0], self.batch, self.pair
        rows = torch.arange(batch).repeat(nc)
        dev = pair.clean.input_ids.device
        sub = core.select_rows(pair.clean, rows.to(dev))
        tg = [t.rows(rows, batch) for t in self.fixed]
        patched = (~keep).repeat_interleave(batch, 0)                      # (rows, N)
        valid = pair.valid[rows.to(pair.valid.device)]

        def fn_for(i):
            s, (lo, hi) = self.sites[i], self.nodes.span[i]
            src = self.corrupt[i]

            def fn(t):
                m = patched[:, lo:hi].to(t.device)                             # (rows, units)
                cols = m.repeat_interleave(t.shape[-1] // (hi - lo), 1)        # (rows, width)
                where = cols[:, None, :] & valid.to(t.device)[:, :, None]
                return torch.where(where, src[rows.to(src.device)].to(t.dtype), t)
            return fn

        mods: dict = {}
        with core.taps([(s.module, s.where) for s in self.sites], fn_for), \
                core.record_modules(self.model, T.module_paths(tg), mods):
            fwd = run_model(self.model, sub, tg, mods)
        value, _, _ = evaluate_targets(tg, fwd, False)
        return check_value(value, len(rows)).double().cpu()


def faithfulness(runs: NodeRuns, keep: torch.Tensor):
    """``(f per circuit, metric per circuit, m(full), m(∅))`` (means over the pairs)."""
    full, empty = _ends(runs)
    m = runs.metrics(keep).mean(1) if keep.shape[0] else torch.zeros(0, dtype=torch.float64)
    return (m - empty) / (full - empty), m, full, empty


def _ends(runs: NodeRuns) -> Tuple[float, float]:
    """``(m(full), m(∅))``: run once per NodeRuns (both greedy passes and the final curve
    normalise by them)."""
    if runs.ends is not None:
        return runs.ends
    n = len(runs.nodes)
    ends = runs.metrics(torch.stack([torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)])).mean(1)
    full, empty = float(ends[0]), float(ends[1])
    if full == empty:
        raise ValueError("metric: the clean run and the run with every node patched give the same mean metric, so "
                         "faithfulness (m(C) − m(∅)) / (m(full) − m(∅)) is undefined")
    runs.ends = (full, empty)
    return runs.ends


def _score(f: torch.Tensor, objective: str) -> torch.Tensor:
    return f if objective == "cpr" else -(1 - f).abs()


def greedy(runs: NodeRuns, objective: str, add: bool, step=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One greedy pass (module docstring): adding to the empty circuit (``add``) or removing
    from the full one. ``(circuits BoolTensor[N+1, N], faithfulness Tensor[N+1])``, the
    circuit of k nodes at index k."""
    n = len(runs.nodes)
    full, empty = _ends(runs)
    keep = torch.zeros(n, dtype=torch.bool) if add else torch.ones(n, dtype=torch.bool)
    masks = {int(keep.sum()): keep.clone()}
    fs = {0: 0.0, n: 1.0}
    for _ in range(n - 1):
        cand = (~keep if add else keep).nonzero().flatten()
        trial = keep[None].repeat(len(cand), 1)
        trial[torch.arange(len(cand)), cand] = add
        f = (runs.metrics(trial).mean(1) - empty) / (full - empty)
        best = int(_score(f, objective).argmax())           # ties: the first in node order
        keep = trial[best]
        masks[int(keep.sum())] = keep.clone()
        fs[int(keep.sum())] = float(f[best])
        if step is not None:
            step()
    last = n if add else 0          # the end the pass does not start from: every node, or none
    masks[last] = torch.full((n,), add, dtype=torch.bool)
    return torch.stack([masks[k] for k in range(n + 1)]), torch.tensor([fs[k] for k in range(n + 1)],
                                                                       dtype=torch.float64)


def search(runs: NodeRuns, objective: str, progress: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per size k, the better (by ``objective``) of the forward and the backward greedy
    pass's circuit of k nodes: ``(circuits BoolTensor[N+1, N], faithfulness Tensor[N+1])``."""
    from pyattr.methods._core.progress import Progress

    n = len(runs.nodes)
    bar = Progress(2 * max(n - 1, 0), "circuit search") if progress else None
    done = [0]

    def step():
        done[0] += 1
        if bar is not None:
            bar.advance(done[0])

    try:
        fw, f_fw = greedy(runs, objective, True, step)
        bw, f_bw = greedy(runs, objective, False, step)
    finally:
        if bar is not None:
            bar.close()
    take = _score(f_bw, objective) > _score(f_fw, objective)
    return torch.where(take[:, None], bw, fw), torch.where(take, f_bw, f_fw)


def counts_at(sizes: Sequence[float], n: int) -> List[int]:
    """Nodes kept at each size: ``int(size × n)``, as MIB counts edges."""
    return [int(s * n) for s in sizes]


def prefix_masks(order: Sequence[int], counts: Sequence[int], n: int) -> torch.Tensor:
    out = torch.zeros((len(counts), n), dtype=torch.bool)
    for i, c in enumerate(counts):
        out[i, list(order[:c])] = True
    return out


def check_objective(objective) -> str:
    if objective not in ("cpr", "cmd"):
        raise ValueError(f"objective: expected 'cpr' (the largest faithfulness at each size) or 'cmd' (the closest "
                         f"to 1), got {objective!r}")
    return objective


@text.text_inputs("circuit_search", inputs=("clean", "corrupt"), target=None)
def circuit_search(model: nn.Module, clean, corrupt, metric, *, nodes: Sequence[str] = ("heads", "mlp"),
                   objective: str = "cpr", sizes: Optional[Sequence[float]] = None,
                   attention_mask: Optional[torch.Tensor] = None,
                   corrupt_attention_mask: Optional[torch.Tensor] = None, batch_size: Optional[int] = None,
                   progress: bool = True, tokenizer=None):
    """Node circuits of every size found greedily by the exact metric (module docstring),
    and their faithfulness at ``sizes``.

    Args:
        model (nn.Module): a Hugging Face model of a mapped architecture (as for
            :func:`pyattr.patching.activation_patching`).
        clean (LongTensor[batch, seq] | Mapping): token ids or tokenizer outputs.
        corrupt (LongTensor[batch, seq] | Mapping): the counterfactuals, of ``clean``'s length and mask.
        metric: a :mod:`pyattr.targets` target or a callable ``f(output) → Tensor[batch]``.
        nodes (str | sequence of str): node types among :data:`CIRCUIT_NODES` (default heads
            and MLPs).
        objective (str): ``"cpr"`` (each step keeps the circuit of largest faithfulness) or
            ``"cmd"`` (the one closest to 1).
        sizes (sequence of float, optional): fractions of the nodes in (0, 1], increasing
            (default MIB's sizes), at which the result reports the circuit.
        attention_mask (Tensor[batch, seq], optional): the mask of ``clean`` given as ids.
        corrupt_attention_mask (Tensor[batch, seq], optional): the mask of ``corrupt`` given as ids.
        batch_size (int, optional): circuit rows (circuit × pair) per forward (default 1024).
        progress (bool): a transient progress bar on stderr (on a terminal, after ~1 s): the
            search runs about ``N²`` circuits per pair, minutes for a hundred nodes and more.
        tokenizer (optional): for text inputs.

    Returns:
        CircuitFaithfulness with ``kind="nodes"``, ``circuits`` the circuit found at each
        of ``sizes`` (``int(size × nodes)`` nodes), ``curve`` its faithfulness, ``cpr`` and
        ``cmd`` the areas.

    Raises:
        TypeError: ``progress`` not a bool.
        ValueError: node types outside :data:`CIRCUIT_NODES`, an unknown ``objective``,
            sizes outside (0, 1] or not increasing, a metric equal on the clean run and with
            every node patched, and what :func:`activation_patching` refuses.
    """
    model = unwrap(model)
    node_list = check_circuit_nodes(nodes)
    objective = check_objective(objective)
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {progress!r}")
    sizes = check_sizes(sizes)
    batch_size = core.check_count("batch_size", batch_size) or DEFAULT_BATCH
    pair = prepare_pair(model, clean, corrupt, None, attention_mask, corrupt_attention_mask, "circuit_search",
                        alignable=False)
    tgts = metric_targets(metric, pair.clean.input_ids.shape[0])
    with core.attribution_pass(model, RelevanceRules(), False, "circuit_search"), torch.no_grad():
        runs = NodeRuns(model, pair, tgts, node_list, batch_size, "circuit_search")
        found, _ = search(runs, objective, progress)
        n = len(runs.nodes)
        keep = found[counts_at(sizes, n)]
        curve, m, full, empty = faithfulness(runs, keep)
    circuits = [[runs.nodes.names[i] for i in k.nonzero().flatten().tolist()] for k in keep]
    return curve_result(sizes, keep, curve, m, full, empty, n, True, "nodes", circuits)


def list_nodes(names: Sequence[str], nodes) -> List[str]:
    """The node types of a circuit given as names: ``nodes``, or heads and MLPs (attention
    blocks and MLPs where the names are attention blocks)."""
    if nodes is not None:
        return check_circuit_nodes(nodes)
    attn = any(n.startswith("attn") for n in names)
    if attn and any(n.startswith("a") and not n.startswith("attn") for n in names):
        raise ValueError("edges_or_circuit: the names mix heads ('a0.h1') and attention blocks ('attn0'); a head's "
                         "output is part of its attention block's, so a circuit keeps one or the other; pass "
                         "nodes=('heads', 'attention', 'mlp') to mean both")
    return ["attention", "mlp"] if attn else ["heads", "mlp"]


def node_circuits(model, pair, tgts, circuit, sizes, batch_size: int, nodes=None):
    """``circuit_faithfulness`` of a PatchingResult (top nodes by magnitude at each size) or
    a list of node names among the node types ``nodes`` (:func:`list_nodes`):
    ``(keep masks, curve, metric, m(full), m(∅), the model's node names)``."""
    if isinstance(circuit, PatchingResult):
        if nodes is not None:
            raise ValueError("nodes: a PatchingResult's circuits are made of its own node types; drop nodes=")
        node_list = result_nodes(circuit)
    else:
        node_list = list_nodes(list(circuit), nodes)
    runs = NodeRuns(model, pair, tgts, node_list, batch_size, "circuit_faithfulness")
    n = len(runs.nodes)
    if isinstance(circuit, PatchingResult):
        order = runs.nodes.scores(circuit).abs().argsort(descending=True, stable=True).tolist()
        keep = prefix_masks(order, counts_at(sizes, n), n)
    else:
        keep = runs.nodes.mask(list(circuit))[None]
    curve, m, full, empty = faithfulness(runs, keep)
    return keep, curve, m, full, empty, runs.nodes.names


def is_node_circuit(circuit, nodes=None) -> bool:
    """A PatchingResult, or a list of names none of which is an edge (``u->d``): non-empty,
    or empty with node types given.

    Raises:
        TypeError: a name that is not a string. ValueError: edge and node names mixed.
    """
    if isinstance(circuit, PatchingResult):
        return True
    if isinstance(circuit, str) or not isinstance(circuit, (list, tuple)):
        return False
    odd = [c for c in circuit if not isinstance(c, str)]
    if odd:
        raise TypeError(f"edges_or_circuit: names must be strings ('a0.h1', 'a0.h1->m1'), got "
                        f"{type(odd[0]).__name__} {odd[0]!r}")
    edges = [c for c in circuit if "->" in c]
    if edges and len(edges) < len(circuit):
        raise ValueError(f"edges_or_circuit: the list mixes edge names ({edges[0]!r}) and node names "
                         f"({next(c for c in circuit if '->' not in c)!r}); a circuit is a set of edges or a set of "
                         "nodes")
    return not edges and (bool(circuit) or nodes is not None)

