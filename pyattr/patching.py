"""Circuit discovery by patching: how much does each component's activation matter for a
metric, when it is taken from a corrupted input instead of the clean one?

- :func:`activation_patching` measures it (the ground truth): one clean forward per node
  with that node's activation replaced by the corrupt run's, several patched runs batched
  into one forward.
- :func:`attribution_patching` estimates it for every node at once from two forwards and
  one backward: ``(a_corrupt − a_clean) · ∂metric/∂a`` at the clean run. With
  ``method="atp"`` the gradient is the plain one (attribution patching, Nanda 2022;
  Kramár et al., arXiv 2403.00745); with ``method="relp"`` it is the LRP-modified one
  under the relevance rules (RelP, Jafari et al., arXiv 2508.21258); ``method="atp*"``
  adds AtP*'s exact recomputation of the attention pattern for residual-stream nodes
  (Kramár et al., arXiv 2403.00745, §3.1.1; the formula is in ``pyattr/_qk_fix.py``).

Nodes, per layer and token position (``"heads"`` and ``"neurons"`` add a last dimension):

- ``"residual"``: the residual stream at the block's input;
- ``"attention"``: the attention block's output after its output projection (BERT: the
  ``attention.output.dense`` output, before the residual add and the LayerNorm);
- ``"heads"``: each head's slice of the output projection's input (``o_proj`` / ``c_proj``
  / ``dense`` input, ``(batch, seq, heads·head_dim)`` split per head). Patching the slice
  patches the head's whole contribution; for a bias-free projection this equals patching
  the head's term after it;
- ``"mlp"``: the MLP block's output (BERT: ``output.dense``, before the residual add);
- ``"neurons"``: the MLP hidden activation (``act(g)·u`` for gated MLPs, ``act(x)``
  otherwise), one node per hidden unit.

The effect of a node is ``metric(clean run with the node patched) − metric(clean run)``.
Both functions run the model in eval mode (dropout off), so identical clean and corrupt
inputs give effects of exactly 0.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

import pyattr.methods._core as core
import pyattr.methods._core.groups as G
import pyattr.methods._core.positions as P
from pyattr import targets as T
import pyattr.architectures as A
from pyattr.integration.config import RelevanceRuleCoverage, RelevanceRules
from pyattr.methods.layer_relevance import no_neurons
from pyattr.integration.wrappers import unwrap
from pyattr.methods._core.forward import evaluate_targets, leaf, run_model

__all__ = ["NODES", "PATCHING_RULES", "PatchingResult", "activation_patching", "attribution_patching"]

NODES = ("residual", "attention", "heads", "mlp", "neurons")
METHODS = ("relp", "atp", "atp*")

#: The rules ``method="relp"`` uses by default: the LN-rule alone. Chosen by the
#: correlation with activation patching on all-MiniLM-L6-v2 (README, "Circuit discovery",
#: ``pyattr bench --patching``): of the variants measured it is the one that beats AtP on
#: the residual stream (Pearson and Spearman) and on MLP outputs (Pearson); the AH- and
#: Identity-rules lowered every correlation there. RelP's full rule set (LN-, Identity-,
#: Half- and AH-rule) is ``rules=RelevanceRules.all()``.
PATCHING_RULES = RelevanceRules(normalization=True)

@dataclass(frozen=True)
class _Site:
    node: str
    layer: int
    path: str
    module: nn.Module
    where: str              # "input" | "output" of the module
    heads: int = 0          # "heads": the number of heads the width splits into


@dataclass
class PatchingResult:
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
    """

    effects: Dict[str, torch.Tensor]
    dims: Dict[str, Tuple[str, ...]]
    clean_metric: torch.Tensor
    corrupt_metric: torch.Tensor
    method: str
    rules: Optional[RelevanceRules] = None
    sampled: Dict[str, torch.Tensor] = field(default_factory=dict)
    coverage: Optional[RelevanceRuleCoverage] = None

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


# --------------------------------------------------------------------------- nodes


def _check_nodes(nodes) -> List[str]:
    if isinstance(nodes, str):
        nodes = [nodes]
    if not isinstance(nodes, (list, tuple)) or not nodes:
        raise ValueError(f"nodes must be one of {NODES} or a non-empty list of them, got {nodes!r}")
    out = []
    for n in nodes:
        if n not in NODES:
            raise ValueError(f"nodes: unknown node type {n!r}; expected one of {NODES}")
        if n not in out:
            out.append(n)
    return out


def _n_heads(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "num_attention_heads", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"nodes: 'heads' needs config.num_attention_heads, and {type(model).__name__} has none")
    return n


def node_sites(model: nn.Module, nodes: Sequence[str]) -> Dict[str, List[_Site]]:
    """Node type → its module in each block (in layer order)."""
    mt = A.model_type(model)
    arch = A.ARCHITECTURES.get(mt)
    if arch is None or arch.heads is None:
        supported = sorted(k for k, a in A.ARCHITECTURES.items() if a.heads is not None)
        raise ValueError(
            f"nodes: patching needs a mapped architecture to find the nodes, and {type(model).__name__} "
            f"(model_type {mt!r}) has none; supported: {', '.join(supported)}"
        )
    blocks = A.layer_paths(model, arch)
    if arch.neurons is None and "neurons" in nodes:
        raise no_neurons(model, "nodes")
    neurons, neurons_where = arch.neurons or (None, None)
    rel = {"attention": (arch.attention_out, "output"), "mlp": (arch.mlp_out, "output"),
           "neurons": (neurons, neurons_where), "heads": (arch.heads, "input")}
    out: Dict[str, List[_Site]] = {}
    for node in nodes:
        sites = []
        for i, b in enumerate(blocks):
            path, where = (b, "input") if node == "residual" else (f"{b}.{rel[node][0]}", rel[node][1])
            heads = _n_heads(model) if node == "heads" else 0
            sites.append(_Site(node, i, path, model.get_submodule(path), where, heads))
        out[node] = sites
    return out


def _dims(node: str, sum_positions: bool) -> Tuple[str, ...]:
    d = ("batch", "layer") + (() if sum_positions else ("position",))
    return d + (("head",) if node == "heads" else ("neuron",) if node == "neurons" else ())


# --------------------------------------------------------------------------- inputs


@dataclass
class _Pair:
    clean: core.Prepared
    corrupt: core.Prepared
    index: torch.Tensor    # (batch, seq) corrupt position of each clean position (-1: none)
    valid: torch.Tensor    # (batch, seq) bool: a node exists (real clean token with a counterpart)


def _prepare_pair(model, clean, corrupt, alignment, clean_mask, corrupt_mask, caller) -> _Pair:
    for name, value in (("clean", clean), ("corrupt", corrupt)):
        if core.is_pixels(value):
            raise TypeError(
                f"{caller}: {name} is an image (pixel_values); patching aligns token sequences, and "
                "image inputs are supported by relevance(), layer_relevance() and integrated_gradients()"
            )
    pc = core.prepare(model, clean, clean_mask, caller)
    px = core.prepare(model, corrupt, corrupt_mask, caller)
    for name, prep in (("clean", pc), ("corrupt", px)):
        if G.row_groups(model, prep) is not None:
            raise ValueError(
                f"{caller}: the rows of {name} have lengths for which {type(model).__name__}'s rotary embedding "
                f"computes different frequencies ({P.describe(model).split(';')[0]}), so a row batched with the "
                "others would not compute what it computes alone; patch rows of one rotary regime per call "
                "(pyattr.relevance, layer_relevance and integrated_gradients group such rows themselves)"
            )
    (bc, sc), (bx, sx) = pc.input_ids.shape, px.input_ids.shape
    if bc != bx:
        raise ValueError(f"clean has {bc} rows and corrupt {bx}; patching pairs row i of clean with row i of corrupt")
    mc = torch.ones(bc, sc, dtype=torch.bool) if pc.attention_mask is None else pc.attention_mask.bool().cpu()
    mx = torch.ones(bx, sx, dtype=torch.bool) if px.attention_mask is None else px.attention_mask.bool().cpu()
    if alignment is None:
        if sc != sx:
            raise ValueError(
                f"clean and corrupt have different lengths ({sc} and {sx} tokens); patching pairs position p "
                "with position p, so pass alignment= (LongTensor[batch, clean_seq]: the corrupt position of "
                "each clean position, -1 for none)"
            )
        if not torch.equal(mc, mx):
            row = int((mc != mx).any(1).nonzero()[0, 0])
            raise ValueError(
                f"clean and corrupt attention masks differ in row {row}; patching pairs position p with "
                "position p, so the real tokens must line up, or pass alignment= (LongTensor[batch, "
                "clean_seq]: the corrupt position of each clean position, -1 for none)"
            )
        index = torch.arange(sc).expand(bc, sc).clone()
        valid = mc.clone()
    else:
        if not isinstance(alignment, torch.Tensor) or alignment.dtype not in (torch.int64, torch.int32):
            raise TypeError("alignment must be an integer tensor of shape (batch, clean_seq)")
        index = alignment.detach().to("cpu", torch.long)
        if index.dim() == 1:
            index = index.expand(bc, -1)
        if tuple(index.shape) != (bc, sc):
            raise ValueError(f"alignment of shape {tuple(alignment.shape)} must be (batch, clean_seq) = {(bc, sc)}")
        if bool(((index < -1) | (index >= sx)).any()):
            raise ValueError(f"alignment: positions must be in [0, {sx}) (the corrupt length) or -1 for none")
        valid = (index >= 0) & mc
        gathered = torch.gather(mx, 1, index.clamp_min(0))
        if bool((valid & ~gathered).any()):
            raise ValueError("alignment: a real clean token is aligned to a padding position of corrupt")
    return _Pair(pc, px, index, valid)


def _metric(metric, batch: int):
    if metric is None:
        raise ValueError("metric is required: a callable(output) -> Tensor[batch] or a pyattr.targets target")
    tgts, several = T.normalize(metric, batch)
    if several:
        raise ValueError("metric must be one target (one value per row), not k targets")
    return tgts


def _check_value(value: torch.Tensor, batch: int) -> torch.Tensor:
    if value.dim() != 1 or value.shape[0] != batch:
        raise ValueError(f"metric must give one value per row, shape ({batch},), got shape {tuple(value.shape)}")
    return value


def _align(act: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Corrupt activations (batch, seq_x, …) → clean layout (batch, seq_c, …)."""
    idx = index.clamp_min(0).to(act.device)
    idx = idx.view(*idx.shape, *([1] * (act.dim() - 2))).expand(*idx.shape, *act.shape[2:])
    return torch.gather(act, 1, idx)


@contextlib.contextmanager
def _recording(sites: List[_Site], store: List[Optional[torch.Tensor]], check: List[int]):
    def fn_for(i):
        def fn(t):
            check[i] += 1
            store[i] = t
            return None

        return fn

    with core.taps([(s.module, s.where) for s in sites], fn_for):
        yield


def _check_once(sites: List[_Site], calls: List[int]) -> None:
    for s, c in zip(sites, calls):
        if c != 1:
            raise ValueError(f"nodes: {s.path!r} ran {c} times in one forward pass; patching needs modules that run once")


def _forward(model, prep: core.Prepared, tgts, sites: List[_Site], grad: bool, metric: str = "required"):
    """One forward recording every site's activation: ``(metric value, activations, fixed
    targets)``.

    The entry embeddings are a leaf that requires grad in both the clean and the corrupt
    run, so both run the same kernels (a clean and a corrupt copy of one input give
    bit-identical activations). ``metric``: ``"required"``; ``"optional"`` (a metric that
    cannot be read on this input, e.g. an absolute position beyond a shorter corrupt
    input under an alignment, gives NaN); ``"skip"``."""
    store: List[Optional[torch.Tensor]] = [None] * len(sites)
    calls = [0] * len(sites)
    mods: dict = {}
    with core.tap(prep.entry, prep.where, lambda t: leaf(t), once=True), _recording(sites, store, calls), \
            core.record_modules(model, T.module_paths(tgts), mods):
        fwd = run_model(model, prep, tgts, mods)
    _check_once(sites, calls)
    batch = prep.input_ids.shape[0]
    value, fixed = None, tgts
    if metric == "skip":
        pass
    elif metric == "optional":
        try:
            value, _, fixed = evaluate_targets(tgts, fwd, False)
            value = _check_value(value, batch)
        except (ValueError, IndexError):
            value = torch.full((batch,), float("nan"), dtype=torch.float64)
    else:
        value, _, fixed = evaluate_targets(tgts, fwd, False)
        value = _check_value(value, batch)
    if not grad:
        store = [s.detach() for s in store]
        value = None if value is None else value.detach()
    return value, store, fixed


# --------------------------------------------------------------------------- attribution patching


def attribution_patching(
    model: nn.Module,
    clean,
    corrupt,
    metric,
    nodes: Union[str, Sequence[str]] = ("residual", "attention", "mlp"),
    method: str = "relp",
    *,
    rules: Optional[RelevanceRules] = None,
    sum_positions: bool = False,
    alignment: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    corrupt_attention_mask: Optional[torch.Tensor] = None,
) -> PatchingResult:
    """Estimated effect of patching each node from ``corrupt`` into ``clean``, for every
    node at once: ``(a_corrupt − a_clean) · ∂metric/∂a`` at the clean run.

    Two forwards (clean with gradient, corrupt without) and one backward for the whole
    batch of prompt pairs, whatever the number of nodes.

    Args:
        model (nn.Module): a Hugging Face model of a mapped architecture (llama, mistral,
            qwen2, qwen3, gemma, gemma2, gemma3_text, olmo2, phi3, gpt2, gpt_neox, bert,
            roberta, distilbert).
        clean, corrupt (LongTensor[batch, seq] | Mapping): token ids or tokenizer outputs;
            row i of ``corrupt`` is the counterfactual of row i of ``clean``.
        metric: what the effects are measured on: a :mod:`pyattr.targets` target
            (``LogitDiff(a, b)``, ``Logit(id)``, ``Cosine(reference)``, ``ModuleOutput``) or
            a callable ``f(output) → Tensor[batch]`` that computes each row from that row
            alone (activation patching runs copies of one row; per-row ids or references
            belong in a target, which follows the rows: a callable that reads per-row data
            is refused there). A top-1 ``Logit()`` is fixed to the clean run's token for the
            corrupt run.
        nodes (str | list of str): among ``"residual"``, ``"attention"``, ``"heads"``,
            ``"mlp"``, ``"neurons"`` (see :mod:`pyattr.patching`). Default residual,
            attention, mlp.
        method (str): ``"relp"`` (rule-modified gradient, RelP arXiv 2508.21258),
            ``"atp"`` (plain gradient, attribution patching) or ``"atp*"``: AtP with AtP*'s
            fix for saturated attention (Kramár et al., arXiv 2403.00745, §3.1.1) on
            ``"residual"`` nodes: the block's attention pattern is recomputed exactly with
            the patched position's query and key (one call of the block's attention module
            per position, batched) instead of being linearised; the other node types get
            AtP's estimate (no softmax lies between their patch and a query or key that
            the patch alone determines). Needs eager attention; GradDrop is not applied.
        rules (RelevanceRules, optional): the rules of ``"relp"`` (default
            :data:`PATCHING_RULES`); not accepted with ``"atp"`` / ``"atp*"``.
        sum_positions (bool): sum each node's estimate over positions (the estimate of
            patching it at every position at once). Default False.
        alignment (LongTensor[batch, clean_seq], optional): the corrupt position whose
            activation replaces each clean position, -1 for none (effect 0). Required when
            clean and corrupt differ in length or in their attention masks.
        attention_mask, corrupt_attention_mask (Tensor[batch, seq], optional): masks of
            ``clean`` / ``corrupt`` when they are given as ids.

    Returns:
        PatchingResult: ``result[node]`` float32 ``(batch, layer, position[, head | neuron])``,
        ``clean_metric`` and ``corrupt_metric`` (float64, (batch,)).

    Raises:
        ValueError: an unknown node type or method, a model without a node map,
            ``"atp*"`` on a model whose attention does not return its probabilities
            (not eager), clean
            and corrupt that do not line up (different lengths or masks without
            ``alignment``, different batch sizes), a metric that does not give one value
            per row or does not depend on the inputs, ``rules`` with ``"atp"``.
        RuntimeError: a call under ``torch.inference_mode()``.
    """
    model = unwrap(model)
    node_list = _check_nodes(nodes)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method in ("atp", "atp*"):
        if rules is not None:
            raise ValueError(f"rules: method={method!r} uses the plain gradient; pass method='relp' to use rules")
        rules = RelevanceRules()
    else:
        rules = PATCHING_RULES if rules is None else rules
        if not isinstance(rules, RelevanceRules):
            raise TypeError(f"rules must be a RelevanceRules, got {type(rules).__name__}")
    sites = node_sites(model, node_list)
    flat = [s for n in node_list for s in sites[n]]
    caller = "attribution_patching"
    pair = _prepare_pair(model, clean, corrupt, alignment, attention_mask, corrupt_attention_mask, caller)
    batch = pair.clean.input_ids.shape[0]
    tgts = _metric(metric, batch)
    star = method == "atp*" and "residual" in node_list
    if star:
        from pyattr._qk_fix import AttentionCalls

        attn_c = AttentionCalls(model, [s.path for s in sites["residual"]])
        attn_x = AttentionCalls(model, [s.path for s in sites["residual"]])
    with core.attribution_pass(model, rules, False, caller) as cov:
        with attn_c.recording() if star else contextlib.nullcontext():
            value, acts_c, fixed = _forward(model, pair.clean, tgts, flat, grad=True)
        if not value.requires_grad:
            raise ValueError("metric: the value does not depend on the inputs through differentiable operations")
        extra = []
        if star:
            attn_c.check()
            extra = attn_c.weights
        grads = torch.autograd.grad(value, acts_c + extra, torch.ones_like(value), allow_unused=True, retain_graph=star)
        grads, d_weights = grads[:len(acts_c)], grads[len(acts_c):]
        pattern_grads = {}
        if star:
            # the part of each residual node's gradient that flows through its own block's
            # attention pattern: replaced by the exact pattern change below
            for s, w, dA in zip(sites["residual"], attn_c.weights, d_weights):
                if dA is not None:
                    i = flat.index(s)
                    (pattern_grads[i],) = torch.autograd.grad(w, acts_c[i], dA, retain_graph=True, allow_unused=True)
        acts_c = [a.detach() for a in acts_c]
        value = value.detach()
        with attn_x.recording() if star else contextlib.nullcontext():
            value_x, acts_x, _ = _forward(model, pair.corrupt, fixed, flat, grad=False,
                                          metric="optional" if alignment is not None else "required")
        if star:  # inside the pass: eval mode (no attention dropout in the re-run modules)
            inputs_x = [_align(t.detach(), pair.index) for t in attn_x.inputs]
            pattern_terms = attn_c.pattern_terms(inputs_x, list(d_weights), pair.valid)
    effects: Dict[str, torch.Tensor] = {}
    valid = pair.valid
    for node in node_list:
        per_layer = []
        for s in sites[node]:
            i = flat.index(s)
            a_c = acts_c[i]
            g = grads[i]
            diff = (_align(acts_x[i], pair.index).float() - a_c.float())
            if g is None:
                est = torch.zeros_like(diff)
            else:
                if i in pattern_grads and pattern_grads[i] is not None:
                    g = g - pattern_grads[i]
                est = diff * g.float()
            est = _reduce(est, s)
            if star and node == "residual":
                est = est + pattern_terms[:, s.layer].to(est.device)
            keep = valid.to(est.device).view(*valid.shape, *([1] * (est.dim() - 2)))
            est = torch.where(keep, est, torch.zeros((), dtype=est.dtype, device=est.device))
            per_layer.append(est)
        e = torch.stack(per_layer, 1)  # (batch, layer, seq[, extra])
        effects[node] = e.sum(2) if sum_positions else e
    return PatchingResult(
        effects=effects,
        dims={n: _dims(n, sum_positions) for n in node_list},
        clean_metric=value.double(),
        corrupt_metric=value_x.double(),
        method=method,
        rules=rules if method == "relp" else None,
        coverage=cov if method == "relp" else None,
    )


def _reduce(prod: torch.Tensor, site: _Site) -> torch.Tensor:
    """Per-unit products (batch, seq, width) → one value per node."""
    if site.node == "neurons":
        return prod
    if site.node == "heads":
        b, s, w = prod.shape
        if w % site.heads:
            raise ValueError(f"nodes: {site.path!r} input width {w} does not split into {site.heads} heads")
        return prod.view(b, s, site.heads, w // site.heads).sum(-1)
    return prod.sum(-1)


# --------------------------------------------------------------------------- activation patching


@dataclass(frozen=True)
class _Job:
    row: int
    site: int          # index into the flat site list
    position: int      # -1: every valid position (sum_positions)
    unit: int          # head or neuron index; -1 for the whole width


def _width_slice(site: _Site, width: int, unit: int) -> slice:
    if unit < 0:
        return slice(None)
    if site.node == "heads":
        d = width // site.heads
        return slice(unit * d, (unit + 1) * d)
    return slice(unit, unit + 1)


def activation_patching(
    model: nn.Module,
    clean,
    corrupt,
    metric,
    nodes: Union[str, Sequence[str]] = ("residual", "attention", "mlp"),
    *,
    batch_size: Optional[int] = None,
    sample: Optional[int] = None,
    seed: int = 0,
    sum_positions: bool = False,
    alignment: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    corrupt_attention_mask: Optional[torch.Tensor] = None,
    progress: bool = True,
) -> PatchingResult:
    """The exact effect of each single-node patch: ``metric(clean run with the node's
    activation taken from the corrupt run) − metric(clean run)`` (the ground truth that
    :func:`attribution_patching` estimates).

    Each patched run is one row of a batched forward of ``batch_size`` rows, all patches
    of one clean row, compared with an unpatched forward of the same rows (so identical
    clean and corrupt inputs give exactly 0). Runs without gradient and without rules,
    in eval mode.

    Args:
        model, clean, corrupt, metric, nodes, sum_positions, alignment, attention_mask,
            corrupt_attention_mask: as in :func:`attribution_patching`; with
            ``sum_positions`` a node is patched at every position at once.
        batch_size (int, optional): patched runs per forward. Default 32.
        sample (int, optional): patch only this many ``"neurons"`` nodes per row, drawn
            uniformly without replacement (``seed``); the others hold NaN and
            ``result.sampled["neurons"]`` marks those patched. Other node types are
            always patched in full.
        seed (int): seed of the neuron sample. Default 0.
        progress (bool): a transient progress bar on stderr (on a terminal, after ~1 s).

    Returns:
        PatchingResult with ``method="exact"``.

    Raises:
        ValueError: as :func:`attribution_patching`; ``batch_size`` or ``sample`` < 1.
        RuntimeError: a call under ``torch.inference_mode()``.
    """
    model = unwrap(model)
    from pyattr.methods._core.progress import Progress

    node_list = _check_nodes(nodes)
    batch_size = core.check_count("batch_size", batch_size) or 32
    sample = core.check_count("sample", sample)
    if sample is not None and "neurons" not in node_list:
        raise ValueError(f"sample: a sample is taken of 'neurons' nodes only, and nodes={tuple(node_list)} has none")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    sites = node_sites(model, node_list)
    flat = [s for n in node_list for s in sites[n]]
    caller = "activation_patching"
    pair = _prepare_pair(model, clean, corrupt, alignment, attention_mask, corrupt_attention_mask, caller)
    batch, seq = pair.clean.input_ids.shape
    tgts = _metric(metric, batch)
    with torch.no_grad(), core.inference_state(model):
        value, acts_c, fixed = _forward(model, pair.clean, tgts, flat, grad=False)
        value_x, _, _ = _forward(model, pair.corrupt, fixed, flat, grad=False,
                                 metric="optional" if alignment is not None else "required")
        widths = [a.shape[-1] for a in acts_c]
        del acts_c
        shapes, jobs_per_row, sampled = _plan(flat, node_list, widths, pair.valid, batch, seq, sum_positions, sample, seed)
        out = {n: torch.full((batch, *shapes[n]), float("nan") if n in sampled else 0.0, dtype=torch.float64)
               for n in node_list}
        n_forwards = sum(math.ceil(len(j) / batch_size) for j in jobs_per_row)
        bar = Progress(n_forwards, "activation patching") if progress else None
        done = 0
        try:
            for row, jobs in enumerate(jobs_per_row):
                # per chunk size: the unpatched metric and the corrupt activations of forwards
                # of that many copies of this row, so that a patched run differs from its
                # reference only by the patch (identical inputs give exactly 0 in any dtype)
                copies: Dict[int, Tuple[torch.Tensor, List[torch.Tensor]]] = {}
                for start in range(0, len(jobs), batch_size):
                    chunk = jobs[start:start + batch_size]
                    n = len(chunk)
                    if n not in copies:
                        copies[n] = _copies(model, pair, fixed, flat, row, n, float(value[row]))
                    reference, sources = copies[n]
                    vals = _patched_forward(model, pair, fixed, flat, sources, row, chunk)
                    eff = (vals - reference).cpu()
                    for j, job in enumerate(chunk):
                        out[flat[job.site].node][_index(row, flat[job.site], job, sum_positions)] = eff[j]
                    done += 1
                    if bar is not None:
                        bar.advance(done)
        finally:
            if bar is not None:
                bar.close()
    keep = pair.valid if not sum_positions else pair.valid.any(1)
    for n in node_list:  # no node at padding / unaligned positions: 0, sampled or not
        m = keep.view(batch, 1, *keep.shape[1:], *([1] * (out[n].dim() - 1 - keep.dim())))
        out[n] = torch.where(m, out[n], torch.zeros((), dtype=out[n].dtype))
    return PatchingResult(
        effects={n: out[n].float() for n in node_list},
        dims={n: _dims(n, sum_positions) for n in node_list},
        clean_metric=value.double(),
        corrupt_metric=value_x.double(),
        method="exact",
        sampled=sampled,
    )


def _index(row: int, site: _Site, job: _Job, sum_positions: bool):
    idx = (row, site.layer) + (() if sum_positions else (job.position,))
    return idx + ((job.unit,) if job.unit >= 0 else ())


def _plan(flat, node_list, widths, valid, batch, seq, sum_positions, sample, seed):
    """The patched runs, per clean row; the result shapes; the neuron sample masks."""
    n_layers = {n: sum(1 for s in flat if s.node == n) for n in node_list}
    shapes: Dict[str, Tuple[int, ...]] = {}
    units: Dict[str, int] = {}
    for i, s in enumerate(flat):
        units[s.node] = s.heads if s.node == "heads" else widths[i] if s.node == "neurons" else 0
    for n in node_list:
        shapes[n] = (n_layers[n],) + (() if sum_positions else (seq,)) + ((units[n],) if units[n] else ())
    sampled: Dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(int(seed))
    jobs_per_row: List[List[_Job]] = []
    for row in range(batch):
        positions = [-1] if sum_positions else [int(p) for p in valid[row].nonzero().flatten()]
        if sum_positions and not bool(valid[row].any()):
            positions = []
        jobs: List[_Job] = []
        for n in node_list:
            idxs = [i for i, s in enumerate(flat) if s.node == n]
            if n == "neurons" and sample is not None:
                cand = [(i, p, u) for i in idxs for p in positions for u in range(units[n])]
                pick = torch.randperm(len(cand), generator=gen)[:sample].sort().values.tolist()
                mask = sampled.setdefault(n, torch.zeros((batch, *shapes[n]), dtype=torch.bool))
                for c in pick:
                    i, p, u = cand[c]
                    jobs.append(_Job(row, i, p, u))
                    mask[_index(row, flat[i], jobs[-1], sum_positions)] = True
                continue
            for i in idxs:
                for p in positions:
                    if units[n]:
                        jobs += [_Job(row, i, p, u) for u in range(units[n])]
                    else:
                        jobs.append(_Job(row, i, p, -1))
        jobs_per_row.append(jobs)
    return shapes, jobs_per_row, sampled


def _copies(model, pair: _Pair, fixed, flat, row: int, n: int, clean_value: float):
    """``(unpatched metric, corrupt activations in the clean layout)`` of forwards of ``n``
    copies of clean / corrupt row ``row``."""
    reference = _patched_forward(model, pair, fixed, flat, None, row, [None] * n)
    # a metric that reads per-row data of the original batch (a callable closing over a
    # tensor of ids, say) gives other values on copies of one row: refuse, never mix rows
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    tol = max(1e-4, 16 * torch.finfo(dtype).eps) * max(1.0, abs(clean_value))
    if not bool(torch.isfinite(reference).all()) or float((reference - clean_value).abs().max()) > tol:
        raise ValueError(
            f"metric: on {n} copies of clean row {row} it gives {reference[:3].tolist()}…, but {clean_value} on the "
            "batch; activation patching runs each row as copies of itself, so a callable metric must compute each "
            "row from that row alone. For per-row ids or references use a pyattr.targets target (Logit(ids), "
            "LogitDiff(a, b), Cosine(reference)), which follows the rows"
        )
    idx = torch.full((n,), row, dtype=torch.long)
    _, acts, _ = _forward(model, core.select_rows(pair.corrupt, idx), fixed, flat, grad=False, metric="skip")
    index = pair.index[row:row + 1].expand(n, -1)
    return reference, [_align(a, index) for a in acts]


def _patched_forward(model, pair: _Pair, fixed, flat, sources, row: int, chunk) -> torch.Tensor:
    """Metric of ``len(chunk)`` copies of clean row ``row``, copy j patched by ``chunk[j]``
    (``None``: unpatched) with the activations of copy j in ``sources``."""
    k = len(chunk)
    batch = pair.clean.input_ids.shape[0]
    idx = torch.full((k,), row, dtype=torch.long)
    sub = core.select_rows(pair.clean, idx)
    tg = [t.rows(idx, batch) for t in fixed]
    by_site: Dict[int, List[Tuple[int, _Job]]] = {}
    for j, job in enumerate(chunk):
        if job is not None:
            by_site.setdefault(job.site, []).append((j, job))
    used = sorted(by_site)
    valid = pair.valid[row]

    def fn_for(n):
        site_i = used[n]
        site = flat[site_i]

        def fn(t):
            src = sources[site_i].to(t.dtype)
            new = t.clone()
            for j, job in by_site[site_i]:
                w = _width_slice(site, t.shape[-1], job.unit)
                if job.position >= 0:
                    new[j, job.position, w] = src[j, job.position, w]
                else:
                    pos = valid.nonzero().flatten().to(t.device)
                    new[j, pos, w] = src[j, pos, w]
            return new

        return fn

    mods: dict = {}
    with core.taps([(flat[i].module, flat[i].where) for i in used], fn_for), \
            core.record_modules(model, T.module_paths(tg), mods):
        fwd = run_model(model, sub, tg, mods)
    try:
        value, _, _ = evaluate_targets(tg, fwd, False)
        value = _check_value(value, k)
    except (IndexError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"metric: failed on {k} copies of clean row {row} ({type(e).__name__}: {e}); activation patching runs "
            "each row as copies of itself, so a callable metric must compute each row from that row alone; for "
            "per-row ids or references use a pyattr.targets target (Logit(ids), LogitDiff(a, b), Cosine(reference))"
        ) from e
    return value.double()
