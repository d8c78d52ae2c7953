"""Layer and neuron relevance: a layer's activation, the (rule-modified) gradient of the
target with respect to it, and their product, at any module of the model.

Semantics follow Captum's ``compute_layer_gradients_and_eval`` / ``LayerGradientXActivation``
(``attribute_to_layer_input``, neuron selectors through :class:`pyattr.targets.ModuleOutput`)
and tdhook's input / target modules; the rules are those of RelP (arXiv 2508.21258) and
AttnLRP (ICML 2024). With all four rules on a bias-free decoder, the relevance summed at
the input of every block and of the final norm equals the target (layer-wise conservation).
"""

from __future__ import annotations

from pyattr._repr import summary_repr
from pyattr.results import ResultViews

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import nn

import pyattr.architectures as A
from pyattr.methods._core.stacks import is_encoder_decoder
from pyattr.methods.seq2seq_layers import seq2seq_layer_relevance
import pyattr.methods._core as core
import pyattr.methods._core.text as text
import pyattr.methods._core.groups as G
import pyattr.targets as T
from pyattr.architectures.paths import no_neurons
from pyattr.config import RelevanceRuleCoverage, RelevanceRules
from pyattr.integration.wrappers import unwrap
from pyattr.methods._core.baseline import (
    baseline_forward,
    check_baseline,
    precheck_baseline,
)
from pyattr.methods._core.forward import (
    backward,
    check_grad_outputs,
    evaluate_targets,
    head_free,
    leaf,
    run_model,
)

SHORTHANDS = ("residual", "attention", "mlp", "neurons")


@dataclass
class LayerRelevance:
    """One layer's result. Shapes are the layer's (its output's first tensor, or its input
    with ``attribute_to_layer_input``), e.g. (batch, seq, hidden); with k targets,
    ``gradient`` and ``relevance`` gain a leading k dimension.

    Attributes:
        activation (Tensor, float32): the layer's value at the input.
        gradient (Tensor, float32): d target / d activation under the rules.
        relevance (Tensor, float32): ``activation · gradient``, or ``(activation −
            baseline activation) · gradient`` with a baseline.
        conservation_delta (Tensor[batch] float64, or None): for residual-stream layers
            (block inputs, final norm input), ``w·target − Σ relevance`` per row (with a
            baseline, against ``f(x) − f(x₀)``); None elsewhere, and at residual layers
            the target does not depend on (after the module of a ``ModuleOutput`` target).
        where (str): ``"output"`` or ``"input"``.
    """

    __repr__ = summary_repr

    activation: torch.Tensor
    gradient: torch.Tensor
    relevance: torch.Tensor
    conservation_delta: Optional[torch.Tensor] = None
    where: str = "output"


@dataclass
class LayerRelevanceResult(ResultViews):
    """Output of :func:`layer_relevance`: ``result[path]`` is a :class:`LayerRelevance`.

    Attributes:
        paths (list of str): the layers, shorthands expanded, in model order.
        target (Tensor[batch] float64, (k, batch) with k targets): the explained value f(x).
        target_ids (Tensor or None): token ids of logit targets.
        coverage (RelevanceRuleCoverage): what the rule scope installed and skipped.
        sides (list of str, or None): on an encoder–decoder model, each path's stack
            (``"encoder"``: positions are the source's, ``"decoder"``: the decoder inputs').
        decoder_tokens (list of lists of str, or None): on an encoder–decoder model with
            ``tokenizer=``, the decoder inputs' tokens (``tokens`` holds the source's).
    """

    __repr__ = summary_repr

    layers: Dict[str, LayerRelevance]
    paths: List[str]
    target: torch.Tensor
    target_ids: Optional[torch.Tensor]
    coverage: RelevanceRuleCoverage
    baseline_target: Optional[torch.Tensor] = None
    tokens: Optional[List[List[Optional[str]]]] = None
    target_tokens: Optional[list] = None
    sides: Optional[List[str]] = None
    decoder_tokens: Optional[List[List[Optional[str]]]] = None

    def __getitem__(self, path: str) -> LayerRelevance:
        if path not in self.layers:
            raise KeyError(f"{path!r} is not among the layers of this result: {self.paths}")
        return self.layers[path]

    def __contains__(self, path) -> bool:
        return path in self.layers

    def __iter__(self):
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)


@dataclass(frozen=True)
class _Layer:
    path: str
    module: nn.Module
    where: str
    residual: bool = False


_ROLES = {"residual": "layers", "attention": "attention_out", "mlp": "mlp_out", "neurons": "neurons"}


def _blocks(model: nn.Module, shorthand: str, generic: bool = False):
    """``(arch, block paths)``: the roles that name the parts, from the table, or with
    ``generic`` from structural discovery for an unmapped model (a role it could not find
    is refused with its reason)."""
    mt = A.model_type(model)
    arch = A.arch_of(model, generic)
    if arch is None or (arch.attention_out is None and not arch.refusals):
        raise ValueError(
            f"layers: the shorthand {shorthand!r} needs a mapped architecture, and {type(model).__name__} "
            f"(model_type {mt!r}) has none; pass dotted module paths instead, or generic=True to read its "
            "roles off the module graph"
        )
    A.require(arch, "layers", model, f"layers: the shorthand {shorthand!r}")
    A.require(arch, _ROLES[shorthand], model, f"layers: the shorthand {shorthand!r}")
    return arch, A.layer_paths(model, arch)


def expand_layers(model: nn.Module, layers, attribute_to_layer_input: bool = False,
                  generic: bool = False) -> List[_Layer]:
    """Dotted paths and shorthands → the layers, in model order, each once.

    ``"residual"``: every block's input and the final norm's input (the residual stream);
    ``"attention"`` / ``"mlp"``: every block's attention / MLP output (BERT: their dense
    output projections, before the residual add and the LayerNorm); ``"neurons"``: the
    MLP's hidden activation (the input of its down projection; BERT: the
    ``intermediate`` output). Dotted paths follow ``attribute_to_layer_input``.
    """
    if isinstance(layers, str):
        layers = [layers]
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError(f"layers must be a module path, a shorthand {SHORTHANDS} or a non-empty list of them, got {layers!r}")
    out: List[_Layer] = []
    for item in layers:
        if item in SHORTHANDS:
            arch, blocks = _blocks(model, item, generic)
            neurons, neurons_where = arch.neurons or (None, None)
            if item == "residual":
                out += [_Layer(b, model.get_submodule(b), "input", True) for b in blocks]
                final = [n for n in arch.outer_norms if not n.startswith("embeddings")]
                for n in final:
                    p = A.join(A.base_prefix(model), n)
                    out.append(_Layer(p, model.get_submodule(p), "input", True))
            else:
                rel = {"attention": arch.attention_out, "mlp": arch.mlp_out, "neurons": neurons}[item]
                if rel is None:
                    raise no_neurons(model, "layers")
                where = neurons_where if item == "neurons" else "output"
                for b in blocks:
                    p = f"{b}.{rel}"
                    out.append(_Layer(p, core.resolve_module(model, p, "layers"), where))
        else:
            mod = core.resolve_module(model, item, "layers", extra=SHORTHANDS)
            out.append(_Layer(item, mod, "input" if attribute_to_layer_input else "output"))
    order = {n: i for i, n in enumerate(n for n, _ in model.named_modules())}
    seen: Dict[str, _Layer] = {}
    for lay in out:
        prev = seen.get(lay.path)
        if prev is not None and prev.where != lay.where:
            raise ValueError(
                f"layers: {lay.path!r} is asked for both at its input and at its output; request it once"
            )
        if prev is None or lay.residual:
            seen[lay.path] = lay
    return sorted(seen.values(), key=lambda lay: (order.get(lay.path, 0), lay.where == "output"))


@text.text_inputs("layer_relevance")
def layer_relevance(
    model: nn.Module,
    inputs,
    layers: Union[str, Sequence[str]],
    target=None,
    rules: Optional[RelevanceRules] = None,
    *,
    attribute_to_layer_input: bool = False,
    baseline=None,
    grad_outputs=None,
    internal_batch_size: Optional[int] = None,
    attention_mask: Optional[torch.Tensor] = None,
    generic: bool = False,
    tokenizer=None,
    decoder_input_ids=None,
    decoder_attention_mask: Optional[torch.Tensor] = None,
) -> LayerRelevanceResult:
    """Activation, gradient and relevance of ``target`` at each of ``layers``.

    One forward and one backward (one batched backward for k targets) give every layer.

    Args:
        model (nn.Module): a Hugging Face model (rules need a mapped architecture or
            ``generic=True``; with every rule off any model works).
        inputs (LongTensor[batch, seq] | Mapping): token ids or a tokenizer output.
        layers (str | list of str): dotted module paths and/or the shorthands
            ``"residual"`` (every block's input plus the final norm's input),
            ``"attention"``, ``"mlp"`` (block outputs) and ``"neurons"`` (the MLP hidden
            activation ``act(g)·u`` / ``act(x)``: the input of the down projection).
        target: as in :func:`pyattr.relevance` (:mod:`pyattr.targets`), including
            ``ModuleOutput(path, select)`` for a neuron and k targets per row.
        rules (RelevanceRules, optional): Default ``RelevanceRules.all()``;
            ``RelevanceRules()`` gives plain gradients (Captum's ``LayerGradientXActivation``).
        attribute_to_layer_input (bool): dotted paths take the module's first tensor
            argument (positional or ``hidden_states``) instead of its output. Default False.
        baseline: ``None``, ``"zeros"``, ``"pad"`` or a tensor shaped like the input
            embeddings (batch, seq, hidden); the baseline activations come from one more
            forward at the baseline input, and ``relevance = (a − a₀) · g``.
        grad_outputs (Tensor, optional): initial gradient shaped like the target.
        internal_batch_size (int, optional): rows per forward/backward; results equal the
            unchunked run (per-row targets only).
        attention_mask (Tensor[batch, seq], optional): 1 for real tokens.
        generic (bool): for an architecture without a rule map, structural rule installation
            and the roles structural discovery reads off the module graph; the layer shorthands
            read the discovered entry's roles (:func:`pyattr.architectures.discover`).
        tokenizer (optional): the model's Hugging Face tokenizer, for text inputs, a word
            ``target`` (as :func:`pyattr.relevance`), and the result's ``tokens`` (each
            token as a string). ``model`` may be a hub id, a directory or a bundled
            name, and ``rules`` a shorthand (``"all"``, ``"attnlrp"``, ``"ln"``,
            ``"none"``), as for :func:`pyattr.relevance`.

        decoder_input_ids (LongTensor[batch, target_len] | str | list[str], optional): on an
            encoder–decoder model, the target prefix, as for :func:`pyattr.relevance`;
            ``layers`` are then dotted paths in either stack or ``"residual"`` (every
            block's input, the encoder's blocks then the decoder's), and
            ``conservation_delta`` is None (a block of one stack is not a cut of the graph:
            the other stack's entry carries the rest). Default: None.
        decoder_attention_mask (Tensor[batch, target_len], optional): 1 for real target
            tokens. Default: None.

    Returns:
        LayerRelevanceResult: ``result[path].activation / .gradient / .relevance``
        (float32, the layer's shape), ``.conservation_delta`` for residual layers,
        ``result.paths``, ``result.target`` (float64).

    Raises:
        ValueError: unknown module path (naming the nearest ones), a shorthand on an
            unmapped architecture, a layer that runs more than once per forward, a target
            that does not depend on the inputs, bad baseline / grad_outputs /
            internal_batch_size (each names the argument).
        RuntimeError: a call under ``torch.inference_mode()``.
    """
    model = unwrap(model)
    if is_encoder_decoder(model):
        # generic=True: a mapped encoder–decoder's map is its plan (an unmapped one is refused by name)
        for name, value in (("baseline", baseline), ("internal_batch_size", internal_batch_size)):
            if value is not None:
                raise ValueError(f"layer_relevance(): {name} is not supported on encoder–decoder models "
                                 f"({type(model).__name__}) yet")
        found, paths, value, tid, cov, sides, (src_toks, dec_toks) = seq2seq_layer_relevance(
            model, inputs, layers, target, core.rule_defaults(rules), decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask, attention_mask=attention_mask,
            attribute_to_layer_input=attribute_to_layer_input, grad_outputs=grad_outputs, tokenizer=tokenizer)
        from pyattr.methods.seq2seq import explained

        return LayerRelevanceResult(
            layers={p: LayerRelevance(activation=a, gradient=g, relevance=a * g, where=w) for p, (a, g, w) in found.items()},
            paths=paths, target=value, target_ids=tid, coverage=cov, tokens=src_toks,
            target_tokens=explained(tokenizer, tid), sides=sides, decoder_tokens=dec_toks)
    if decoder_input_ids is not None or decoder_attention_mask is not None:
        raise ValueError(f"decoder_input_ids / decoder_attention_mask: {type(model).__name__} is not an "
                         "encoder–decoder model (config.is_encoder_decoder is false)")
    internal_batch_size = core.check_count("internal_batch_size", internal_batch_size)
    core.check_grad_mode("layer_relevance")
    # the layers first: a shorthand on an unmapped model names itself, before the search
    # for the embedding entry (which such a model may not have) can fail less clearly
    lays = expand_layers(model, layers, attribute_to_layer_input, generic)
    precheck_baseline(model, baseline, inputs)
    prep = core.prepare(model, inputs, attention_mask, "layer_relevance", generic)
    batch = prep.input_ids.shape[0]
    tgts, several = T.normalize(target, batch)
    rules = core.rule_defaults(rules)
    chunk = internal_batch_size or batch
    # on a model whose forward depends on the batch (dynamic-NTK / LongRoPE), rows of one
    # regime share a pass; chunks never mix regimes
    groups = G.row_groups(model, prep) or [torch.arange(batch)]
    if chunk >= batch and len(groups) == 1:
        return _layer_pass(model, prep, lays, tgts, several, rules, generic, baseline, grad_outputs)
    go_all = None if grad_outputs is None else torch.as_tensor(grad_outputs)
    # each chunk checks its own slice, so a batch dimension that is too long (or too
    # short) must be caught here, before the rows are split
    if go_all is not None and go_all.dim() >= 1 and go_all.shape[-1] != batch:
        want = f"({len(tgts)}, {batch})" if several else f"({batch},)"
        raise ValueError(f"grad_outputs of shape {tuple(go_all.shape)} must match the target's shape {want}")
    if isinstance(baseline, torch.Tensor) and baseline.dim() == 3 and baseline.shape[0] not in (1, batch):
        raise ValueError(
            f"baseline of shape {tuple(baseline.shape)} does not match the input embeddings: its first "
            f"dimension must be the batch ({batch}) or 1"
        )
    parts = []
    pieces = [g[start:start + chunk] for g in groups for start in range(0, len(g), chunk)]
    for idx in pieces:
        sub = core.select_rows(prep, idx)
        sub_t = [t.rows(idx, batch) for t in tgts]
        go = None if go_all is None else go_all[..., idx]
        base = baseline[idx] if isinstance(baseline, torch.Tensor) and baseline.dim() == 3 and baseline.shape[0] == batch else baseline
        parts.append(_layer_pass(model, sub, lays, sub_t, several, rules, generic, base, go))
        if parts[0].target.dim() == 0:  # known after the first chunk: stop before the others
            raise ValueError(
                "internal_batch_size: a scalar target (one value for the whole batch) cannot be split into row chunks"
            )
    result = _concat(parts, several)
    order = torch.cat(pieces)
    if torch.equal(order, torch.arange(batch)):
        return result
    return _reorder(result, torch.argsort(order), several)


def _reorder(result: LayerRelevanceResult, inverse: torch.Tensor, several: bool) -> LayerRelevanceResult:
    """``result`` with its rows taken in the order ``inverse`` (the rows came grouped)."""
    d = 1 if several else 0

    def pick(t, dim):
        return None if t is None else t.index_select(dim, inverse.to(t.device))

    layers = {p: LayerRelevance(pick(x.activation, 0), pick(x.gradient, d), pick(x.relevance, d),
                                pick(x.conservation_delta, d), x.where) for p, x in result.layers.items()}
    return LayerRelevanceResult(layers=layers, paths=result.paths, target=pick(result.target, d),
                                target_ids=pick(result.target_ids, d), coverage=result.coverage,
                                baseline_target=pick(result.baseline_target, d))


def _cat(xs, dim):
    return None if xs[0] is None else torch.cat(xs, dim)


def _concat(parts: List[LayerRelevanceResult], several: bool) -> LayerRelevanceResult:
    d = 1 if several else 0
    first = parts[0]
    if first.target.dim() == 0:
        raise ValueError("internal_batch_size: a scalar target (one value for the whole batch) cannot be split into row chunks")
    layers = {}
    for p in first.paths:
        ls = [r[p] for r in parts]
        layers[p] = LayerRelevance(
            activation=torch.cat([x.activation for x in ls], 0),
            gradient=torch.cat([x.gradient for x in ls], d),
            relevance=torch.cat([x.relevance for x in ls], d),
            conservation_delta=_cat([x.conservation_delta for x in ls], d),
            where=ls[0].where,
        )
    return LayerRelevanceResult(
        layers=layers,
        paths=first.paths,
        target=torch.cat([r.target for r in parts], d),
        target_ids=_cat([r.target_ids for r in parts], d),
        coverage=first.coverage,
        baseline_target=_cat([r.baseline_target for r in parts], d),
    )


def _layer_pass(model, prep, lays, tgts, several, rules, generic, baseline, grad_outputs) -> LayerRelevanceResult:
    store: dict = {}
    calls: List[List[torch.Tensor]] = [[] for _ in lays]
    versions: List[int] = [0] * len(lays)  # an activation edited in place after its hook is not the layer's value

    def as_input(t):
        # parameters are frozen: a tensor before the entry needs a leaf to get a gradient;
        # one downstream of such a leaf stays in the graph
        return t if t.requires_grad else leaf(t)

    def fn_for(i):
        def fn(t):
            t = as_input(t)
            calls[i].append(t)
            versions[i] = t._version
            return t

        return fn

    with core.attribution_pass(model, rules, generic, "layer_relevance") as cov:
        xs: List[torch.Tensor] = []

        def entry_fn(t):
            xs.append(as_input(t))
            return xs[-1]

        pairs = [(lay.module, lay.where) for lay in lays]
        with core.tap(prep.entry, prep.where, entry_fn, once=True), core.taps(pairs, fn_for), \
                core.record_modules(model, T.module_paths(tgts), store):
            fwd = run_model(model, prep, tgts, store, keep_logits=head_free(model, [lay.module for lay in lays]))
        if not xs:
            raise core.entry_not_reached(model, prep)
        for lay, c, v in zip(lays, calls, versions):
            core.check_not_streams(prep.entry, lay.path, c, xs[0].shape[1])
            if len(c) != 1:
                raise ValueError(
                    f"layers: {lay.path!r} ran {len(c)} times in one forward pass; layer_relevance needs a "
                    "module that runs once (use pyattr.capture for every call)"
                )
            if c[0]._version != v:
                raise ValueError(
                    f"layers: {lay.path!r}: its {lay.where} was changed in place later in the forward pass (code "
                    "after the hook edits that tensor: `out += other`, an inplace activation), so the recorded "
                    f"activation would not be the module's {lay.where}; pick another layer (pyattr.capture records a "
                    "copy of every call)"
                )
        value, tid, fixed = evaluate_targets(tgts, fwd, several)
        go = check_grad_outputs(grad_outputs, value)
        x = xs[0]
        base = check_baseline(baseline, x)
        acts = [c[0] for c in calls]
        grads = backward(value, [x, *acts], go, several)[1:]
        del fwd, store
        f0 = None
        if base is not None:
            _, f0, acts0 = baseline_forward(
                model, prep, base, x, fixed, pairs, [lay.path for lay in lays]
            )
    t64 = value.detach().double()
    w = go.detach().double()
    explained = t64 if f0 is None else t64 - f0
    out: Dict[str, LayerRelevance] = {}
    for i, (lay, a, g) in enumerate(zip(lays, acts, grads)):
        a = a.detach()
        reached = g is not None
        g = torch.zeros((*value.shape[:1], *a.shape) if several else a.shape, dtype=a.dtype, device=a.device) if g is None else g
        diff = a if f0 is None else a - acts0[i]
        rel = diff.float() * g.float()
        delta = None
        # a layer the target does not depend on (after a module target) conserves nothing
        if lay.residual and reached:  # per row, or one value for a scalar target
            delta = w * explained - rel.double().flatten(start_dim=t64.dim()).sum(-1)
        out[lay.path] = LayerRelevance(a.float(), g.float(), rel, delta, lay.where)
    return LayerRelevanceResult(
        layers=out,
        paths=[lay.path for lay in lays],
        target=t64,
        target_ids=tid,
        coverage=cov,
        baseline_target=f0,
    )
