"""Edge attribution patching: every edge of the model's graph (:mod:`pyattr.patching.graph`)
scored at once, as EAP defines it (Syed et al. 2023, "Attribution patching outperforms
automated circuit discovery", eq. 3): ``(a_u(corrupt) − a_u(clean)) · ∂metric/∂x_d``, summed
over positions, with ``x_d`` the downstream input's own copy of the residual stream.

The gradient at every downstream input comes from one split forward and one backward
(``"atp"``, ``"relp"``), or ``steps`` of them (``"ig"``), whatever the number of edges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
from torch import nn

import pyattr.methods._core as core
import pyattr.methods._core.text as text
import pyattr.patching.graph as G
from pyattr._repr import summary_repr
from pyattr.config import RelevanceRules
from pyattr.integration.wrappers import unwrap
from pyattr.patching.attribution import method_rules
from pyattr.patching.ig import DEFAULT_STEPS as IG_STEPS, entry_embeddings
from pyattr.patching.pairs import check_row_metric, metric_targets, prepare_pair, recording_forward
from pyattr.results import ResultViews

#: ``"relp"``: the rule-modified gradient (RelP, Jafari et al., arXiv 2508.21258) under
#: ``rules`` (default :data:`EDGE_RULES`); ``"atp"``: the plain gradient (EAP);
#: ``"ig"``: EAP-IG with interpolated inputs (Hanna et al., COLM 2024, §3): the plain
#: gradient averaged over ``steps`` midpoints on the line from the clean to the corrupt
#: embeddings entering the first block; ``"blockwise"``: not an estimate but exact edge
#: patching's effects (:func:`pyattr.patching.edge_effects`), computed from the clean run
#: block by block (:mod:`pyattr.patching.edges_blockwise`)
EDGE_METHODS = ("relp", "atp", "ig", "blockwise")
#: chosen by ``pyattr bench --circuits`` (docs/tutorials/circuits.md), see :data:`EDGE_RULES`
DEFAULT_EDGE_METHOD = "relp"
#: ``"relp"``'s default rules: RelP's LN-, Identity- and Half-rules (its AH-rule on attention
#: rewrites the q/k/v projections the split forward computes per edge, so it is not offered).
#: Chosen by ``pyattr bench --circuits``: on both toy decoders' key and value pairs its
#: circuits' CPR is within 0.006 of exact edge patching's and at or above the EAP-IG
#: library's EAP-IG-inputs (16 steps), at about a sixteenth of that one's time
EDGE_RULES = RelevanceRules(normalization=True, activation=True, multiplicative_gate=True)


@dataclass
class EdgeAttributionResult(ResultViews):
    """Output of :func:`edge_attribution`.

    Attributes:
        scores (Tensor[edges], float64): each edge's estimated effect on the metric, mean over
            the pairs (metric units; patching the edge from the corrupt run changes the
            metric by about this much).
        per_pair (Tensor[batch, edges], float64): the same per pair.
        edges (list[str]): ``"upstream->downstream"`` per edge, in the order of ``scores``.
        upstream (list[str]): the graph's upstream node names (see :mod:`pyattr.patching.graph`).
        downstream (list[str]): its downstream input names.
        clean_metric (Tensor[batch], float64): the metric of the clean run.
        corrupt_metric (Tensor[batch], float64): the metric of the corrupt run.
        method (str): the method (``"exact"`` for :func:`pyattr.patching.edge_effects`).
        steps (int): forwards and backwards the gradient took (patched runs for ``"exact"``).
    """

    __repr__ = summary_repr

    scores: torch.Tensor
    per_pair: torch.Tensor
    edges: List[str]
    upstream: List[str]
    downstream: List[str]
    clean_metric: torch.Tensor
    corrupt_metric: torch.Tensor
    method: str
    steps: int = 1
    tokens: Optional[list] = field(default=None)

    def top(self, n: int = 10, absolute: bool = True) -> List[Tuple[str, float]]:
        """The ``n`` edges with the largest score (by magnitude where ``absolute``), as
        (name, score)."""
        key = self.scores.abs() if absolute else self.scores
        order = key.argsort(descending=True)[:n].tolist()
        return [(self.edges[i], float(self.scores[i])) for i in order]


def _check_method(method, rules, steps, batch_size=None):
    method = DEFAULT_EDGE_METHOD if method is None else method
    if method not in EDGE_METHODS:
        raise ValueError(f"method: expected one of {list(EDGE_METHODS)}, got {method!r}")
    if method != "ig" and steps is not None:
        raise ValueError(f"steps: only method='ig' interpolates; method={method!r} takes none")
    if method != "blockwise" and batch_size is not None:
        raise ValueError(f"batch_size: only method='blockwise' (patched rows per block run) batches; "
                         f"method={method!r} takes none")
    if method == "ig":
        steps = core.check_count("steps", IG_STEPS if steps is None else steps, allow_none=False)
    rules = method_rules(method, rules, EDGE_RULES)
    if rules.attention:
        raise ValueError(f"rules: attention={rules.attention!r} is not supported by edge attribution: it computes "
                         "each head's query, key and value from that input's own copy of the residual stream, "
                         "which the attention rules' mounts on the projections would not see; pass rules with "
                         "attention=False (the default, EDGE_RULES, is the LN-, Identity- and Half-rule)")
    return method, rules, steps


def split_run(model, lay, graph, prep, tgts, mode, metric="required", **kw):
    """One split forward: ``(metric value, the SplitForward with its records)``."""
    split = G.SplitForward(lay, graph, mode, **kw)
    with split.hooks():
        value, _, fixed = recording_forward(model, prep, tgts, [], grad=mode == "grad", metric=metric, cut=False)
    if split.mismatch:
        raise ValueError(f"model: {type(model).__name__}'s residual stream is not what the edge graph reads: "
                         f"{split.mismatch[0]} (a norm after a block's output, a parallel block or a hook that "
                         "edits activations); edge attribution needs a pre-norm sequential decoder")
    return value, split, fixed


def downstream_gradients(model, lay, graph, pair, tgts, method: str, steps: Optional[int]):
    """``(clean metric, clean upstream activations (U, batch, seq, hidden), ∂metric/∂x_d
    (D, batch, seq, hidden) float64, fixed targets)``."""
    value, split, fixed = split_run(model, lay, graph, pair.clean, tgts, "grad", check=True)
    if not value.requires_grad:
        raise ValueError("metric: the value does not depend on the inputs through differentiable operations")
    acts = torch.stack(split.acts)
    if method != "ig":
        (g,) = torch.autograd.grad(value.sum(), [split.leaves])
        return value.detach(), acts, g.double(), fixed
    value = value.detach()
    x_c = entry_embeddings(model, pair.clean)
    x_x = entry_embeddings(model, pair.corrupt)
    total = None
    for k in range(steps):
        alpha = (k + 0.5) / steps
        x = x_c + alpha * (x_x - x_c)
        with core.tap(pair.clean.entry, pair.clean.where, lambda t, x=x: x.to(t.dtype), once=True):
            v, sp, _ = split_run(model, lay, graph, pair.clean, fixed, "grad")
        (g,) = torch.autograd.grad(v.sum(), [sp.leaves])
        total = g.double() if total is None else total + g.double()
    return value, acts, total / steps, fixed


@text.text_inputs("edge_attribution", inputs=("clean", "corrupt"), target=None)
def edge_attribution(model: nn.Module, clean, corrupt, metric, *, method: Optional[str] = None,
                     rules: Optional[RelevanceRules] = None, steps: Optional[int] = None,
                     attention_mask: Optional[torch.Tensor] = None,
                     corrupt_attention_mask: Optional[torch.Tensor] = None,
                     batch_size: Optional[int] = None, tokenizer=None) -> EdgeAttributionResult:
    """Score every edge of the model's graph for patching it from ``corrupt`` into ``clean``.

    Args:
        model (nn.Module): a Hugging Face pre-norm decoder of a mapped architecture with one
            norm before the attention and one before the MLP (llama, mistral, qwen2, qwen3,
            gemma, phi3, gpt2, and the MoE decoders, whose MLP block is one node: experts
            are not separate nodes). Others are refused with the reason.
        clean (LongTensor[batch, seq] | Mapping): token ids or tokenizer outputs.
        corrupt (LongTensor[batch, seq] | Mapping): as ``clean``, of the same length and mask
            (EAP pairs position p with position p); row i is row i of ``clean``'s counterfactual.
        metric: a :mod:`pyattr.targets` target (``LogitDiff(a, b)``, ``Logit(id)``) or a
            callable ``f(output) → Tensor[batch]``.
        method (str, optional): one of :data:`EDGE_METHODS` (default :data:`DEFAULT_EDGE_METHOD`).
        rules (RelevanceRules, optional): ``"relp"`` only (default :data:`EDGE_RULES`; attention
            rules are refused).
        steps (int, optional): ``"ig"`` only (default 16).
        batch_size (int, optional): ``"blockwise"`` only: rows (edge × pair) per block run
            (default 1024).
        attention_mask (Tensor[batch, seq], optional): the mask of ``clean`` given as ids.
        corrupt_attention_mask (Tensor[batch, seq], optional): the mask of ``corrupt`` given as ids.
        tokenizer (optional): for text inputs.

    Returns:
        EdgeAttributionResult.

    Raises:
        ValueError: an unknown method, ``rules``, ``steps`` or ``batch_size`` where the method
            takes none, with ``"blockwise"`` blocks that do not chain or a metric read inside a
            block,
            an architecture the graph does not read (named with the reason), a residual
            stream that is not the sum the graph reads (observed in the clean forward),
            clean and corrupt of different lengths or masks, a metric that is not one
            value per row.
    """
    model = unwrap(model)
    method, rules, steps = _check_method(method, rules, steps, batch_size)
    lay = G.layout(model)
    graph = G.build_graph(lay)
    pair = prepare_pair(model, clean, corrupt, None, attention_mask, corrupt_attention_mask, "edge_attribution",
                        alignable=False)
    tgts = metric_targets(metric, pair.clean.input_ids.shape[0])
    if method == "blockwise":
        return _blockwise(model, lay, graph, pair, tgts, batch_size)
    with core.attribution_pass(model, rules, False, "edge_attribution"):
        value, acts_c, grads, fixed = downstream_gradients(model, lay, graph, pair, tgts, method, steps)
        with torch.no_grad():
            value_x, split_x, _ = split_run(model, lay, graph, pair.corrupt, fixed, "record")
    acts_x = torch.stack(split_x.acts)
    valid_pos = pair.valid.to(acts_c.device, torch.float64)[None, :, :, None]
    diff = (acts_x.double() - acts_c.double()) * valid_pos                          # (U, b, s, h)
    per = torch.einsum("ubsh,dbsh->bud", diff, grads)                              # (b, U, D)
    edges = graph.edges
    u_idx = torch.tensor([u for u, _ in edges], dtype=torch.long)
    d_idx = torch.tensor([d for _, d in edges], dtype=torch.long)
    per_pair = per[:, u_idx, d_idx].cpu()
    return EdgeAttributionResult(per_pair.mean(0), per_pair, graph.edge_names(), list(graph.upstream),
                                 list(graph.downstream), value.double().cpu(), value_x.double().cpu(), method,
                                 steps or 1)


def _blockwise(model, lay, graph, pair, tgts, batch_size) -> EdgeAttributionResult:
    """``method="blockwise"``: :mod:`pyattr.patching.edges_blockwise`."""
    import pyattr.patching.blockwise as BW
    import pyattr.patching.edges_blockwise as EB
    from pyattr.patching.mlp_positions import MLPOutputs

    batch_size = core.check_count("batch_size", batch_size) or EB.DEFAULT_BATCH
    calls = BW.BlockCalls(lay.blocks, mlps=MLPOutputs(lay.mlp))
    BW.check_metric(model, tgts, calls)
    with core.attribution_pass(model, RelevanceRules(), False, "edge_attribution"), torch.no_grad():
        with calls.recording():
            value, split_c, fixed = split_run(model, lay, graph, pair.clean, tgts, "record", check=True)
        try:
            calls.check(model, pair.clean.input_ids.shape[0])
            check_row_metric(model, pair.clean, fixed, value, "edge_attribution(method='blockwise')")
            calls.cut_last_mlp(model, lay.mlp[-1], pair, fixed, pair.clean.input_ids.shape[0])
            value_x, split_x, _ = split_run(model, lay, graph, pair.corrupt, fixed, "record")
            per_pair = EB.effects(model, lay, graph, pair, fixed, torch.stack(split_c.acts), torch.stack(split_x.acts),
                                  calls, batch_size, value)
        finally:
            calls.release()
    return EdgeAttributionResult(per_pair.mean(0), per_pair, graph.edge_names(), list(graph.upstream),
                                 list(graph.downstream), value.double().cpu(), value_x.double().cpu(), "blockwise",
                                 1)
