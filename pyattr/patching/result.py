"""What a patching call returns: effects per node type, the metrics, the dimensions."""

from __future__ import annotations

from pyattr._repr import summary_repr
from pyattr.results import ResultViews

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from pyattr.config import RelevanceRuleCoverage, RelevanceRules


@dataclass
class PatchingResult(ResultViews):
    """Effects of patching each node from the corrupt run into the clean run.

    ``result[node]`` is a float32 tensor of shape ``(batch, layer, position)``, with a last
    ``head`` / ``neuron`` dimension for ``"heads"`` / ``"neurons"`` (``position`` is absent
    with ``sum_positions=True``); ``result.dims[node]`` names the dimensions. Positions
    that are padding in the clean input, or that have no counterpart under
    ``alignment``, hold 0. Activation patching of a neuron sample holds NaN at the nodes it
    did not patch (``result.sampled[node]`` is the mask of those it did).

    Attributes:
        effects (dict): node type → effect tensor.
        dims (dict): node type → dimension names, e.g. ``("batch", "layer", "position", "head")``.
        clean_metric, corrupt_metric (Tensor[batch], float64): the metric on each input
            (``corrupt_metric`` is NaN where an ``alignment`` is given and the metric cannot
            be read on the corrupt input, e.g. an absolute position beyond its length).
        method (str): ``"relp"``, ``"atp"``, ``"atp*"`` or ``"exact"`` (activation patching).
        rules (RelevanceRules or None): the rules of the backward (``"relp"``).
        sampled (dict): node type → bool mask of the nodes patched, where a sample was taken.
        coverage (RelevanceRuleCoverage or None): what the rule scope installed (``"relp"``).
        tokens (list of lists of str, or None): with ``tokenizer=``, each clean input token
            as a string (on an encoder–decoder model: the source's).
        decoder_tokens (list of lists of str, or None): on an encoder–decoder model with
            ``tokenizer=``, each token of the decoder's inputs (the positions of the
            ``"decoder.*"`` nodes).
    """

    __repr__ = summary_repr

    effects: Dict[str, torch.Tensor]
    dims: Dict[str, Tuple[str, ...]]
    clean_metric: torch.Tensor
    corrupt_metric: torch.Tensor
    method: str
    rules: Optional[RelevanceRules] = None
    sampled: Dict[str, torch.Tensor] = field(default_factory=dict)
    coverage: Optional[RelevanceRuleCoverage] = None
    tokens: Optional[List[List[Optional[str]]]] = None
    decoder_tokens: Optional[List[List[Optional[str]]]] = None

    @property
    def nodes(self) -> List[str]:
        """The node types, in the order asked for (iterating the result yields them too)."""
        return list(self.effects)

    def items(self):
        """``(node type, effects)`` pairs, as a dict's."""
        return self.effects.items()

    def __getitem__(self, node: str) -> torch.Tensor:
        if node not in self.effects:
            raise KeyError(f"{node!r} is not among the node types of this result: {self.nodes}")
        return self.effects[node]

    def __contains__(self, node) -> bool:
        return node in self.effects

    def __iter__(self):
        return iter(self.effects)

    def top(self, k: int = 10, row: int = 0) -> List[Tuple[str, Tuple[int, ...], float]]:
        """The ``k`` nodes of batch row ``row`` with the largest |effect|, over every node
        type: ``(node type, index without the batch dimension, effect)``."""
        items = []
        for node, eff in self.effects.items():
            e = eff[row]
            flat = e.abs().flatten()
            measured = (~torch.isnan(flat)).nonzero().flatten()  # sampled-out neurons are NaN
            n = min(k, measured.numel())
            for i in measured[flat[measured].topk(n).indices].tolist():
                idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), e.shape))
                items.append((node, idx, float(e[idx])))
        items.sort(key=lambda t: -abs(t[2]))
        return items[:k]


def dims(node: str, sum_positions: bool) -> Tuple[str, ...]:
    d = ("batch", "layer") + (() if sum_positions else ("position",))
    return d + (("head",) if node == "heads" else ("neuron",) if node == "neurons" else ())


def correlations(est: torch.Tensor, exact: torch.Tensor) -> Tuple[Optional[float], Optional[float]]:
    """(Pearson, Spearman) of two tensors of one shape (any number of dimensions: a
    patching effect of (batch, layer, seq) against its exact counterpart), over every
    element, in float64 (scipy.stats). Elements that are not finite on either side (the
    NaN of padded positions) are left out. ``(None, None)`` with fewer than 3 elements left
    or a side that is constant (no correlation is defined).

    Raises:
        ValueError: the two tensors differ in shape.
    """
    from scipy import stats

    a, b = torch.as_tensor(est).detach(), torch.as_tensor(exact).detach()
    if a.shape != b.shape:
        raise ValueError(f"correlations: est has shape {tuple(a.shape)} and exact {tuple(b.shape)}; give the two "
                         "effects of one node at one shape")
    a, b = a.double().cpu().reshape(-1), b.double().cpu().reshape(-1)
    keep = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[keep].numpy(), b[keep].numpy()
    if a.size < 3 or a.std() == 0 or b.std() == 0:
        return None, None
    return float(stats.pearsonr(a, b)[0]), float(stats.spearmanr(a, b)[0])
