"""Integrated gradients (Sundararajan et al., ICML 2017, Eq. 1 and its Riemann / Gauss–
Legendre approximations), at the input embeddings or at a layer, with the rules on or off.

Semantics follow Captum's ``IntegratedGradients`` and ``LayerIntegratedGradients``:
the path is the straight line from the baseline to the input (for a layer: from the
layer's activation at the baseline input to its activation at the input), the gradient
is integrated along it with the chosen quadrature, ``multiply_by_inputs`` multiplies by
``input − baseline``, and the convergence delta is ``Σ attribution − (f(x) − f(x₀))``.
"""

from __future__ import annotations

from pyattr._repr import summary_repr
from pyattr.results import ResultViews

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import nn

from pyattr.methods._core.stacks import is_encoder_decoder
from pyattr.methods.seq2seq_ig import seq2seq_integrated_gradients
import pyattr.methods._core as core
from pyattr.methods._core.convergence import (CONVERGENCE_TOLERANCE, ConvergenceWarning,  # noqa: F401
                                              baseline_hint, warn_unconverged)
import pyattr.methods._core.text as text
import pyattr.methods._core.groups as G
import pyattr.targets as T
from pyattr.config import RelevanceRuleCoverage, RelevanceRules
from pyattr.integration.wrappers import unwrap
from pyattr.methods._core.baseline import (
    baseline_forward,
    check_baseline,
    precheck_baseline,
)
from pyattr.methods._core.forward import (
    check_grad_outputs,
    evaluate_targets,
    head_free,
    leaf,
    run_model,
)
from pyattr.methods._core.progress import Progress
from pyattr.methods._core.taps import rule_holds_output

METHODS = ("gausslegendre", "riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid")


@dataclass
class AttributionResult(ResultViews):
    """Output of :func:`integrated_gradients`.

    Attributes:
        attribution (Tensor, float32): (batch, seq, hidden) at the embeddings, or the
            layer's shape for layer IG.
        token_attribution (Tensor[batch, seq] float32, or None): ``attribution`` summed
            over the last dimension when it is (batch, seq, hidden).
        convergence_delta (Tensor[batch], float64): ``Σ attribution − (f(x) − f(x₀))``.
        target (Tensor[batch], float64): f(x).
        baseline_target (Tensor[batch], float64): f(x₀).
        target_ids (Tensor[batch] or None): token ids of logit targets.
        n_steps (int), method (str): the quadrature used.
        coverage (RelevanceRuleCoverage): what the rule scope installed and skipped.
    """

    __repr__ = summary_repr

    attribution: torch.Tensor
    token_attribution: Optional[torch.Tensor]
    convergence_delta: torch.Tensor
    target: torch.Tensor
    baseline_target: torch.Tensor
    target_ids: Optional[torch.Tensor]
    n_steps: int
    method: str
    coverage: RelevanceRuleCoverage
    tokens: Optional[List[List[Optional[str]]]] = None
    target_tokens: Optional[list] = None


def gauss_legendre(n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Nodes (ascending) and weights of the n-point Gauss–Legendre rule on [-1, 1], float64.

    Newton's method on the Legendre polynomial ``P_n`` from the Tricomi-type initial guess
    ``cos(π(i − ¼)/(n + ½))``, all roots at once, ``P_n`` and ``P_{n−1}`` by the three-term
    recurrence; weights ``2 / ((1 − x²) P_n'(x)²)`` (Abramowitz & Stegun 25.4.29). O(n²),
    so thousands of steps take a fraction of a second.
    """
    i = torch.arange(1, n + 1, dtype=torch.float64)
    x = torch.cos(torch.pi * (i - 0.25) / (n + 0.5))

    def legendre(x):
        p_prev, p = torch.ones_like(x), x.clone()
        for k in range(2, n + 1):
            p_prev, p = p, ((2 * k - 1) * x * p - (k - 1) * p_prev) / k
        return p, n * (x * p - p_prev) / (x * x - 1)  # P_n, P_n'

    for _ in range(100):
        p, dp = legendre(x)
        step = p / dp
        x = x - step
        if float(step.abs().max()) < 1e-15:
            break
    _, dp = legendre(x)
    w = 2 / ((1 - x * x) * dp * dp)
    return x.flip(0), w.flip(0)


def path_points(method: str, n_steps: int) -> Tuple[List[float], List[float]]:
    """``(alphas, step_sizes)`` of the quadrature on [0, 1] (Captum's method names)."""
    n = n_steps
    if method == "gausslegendre":
        x, w = gauss_legendre(n)
        return (0.5 * (x + 1)).tolist(), (0.5 * w).tolist()
    if method == "riemann_trapezoid":
        if n < 2:
            raise ValueError("n_steps must be ≥ 2 for method='riemann_trapezoid'")
        # Captum's rule, kept for parity: nodes at i/(n−1) but steps of 1/n with halved
        # ends, so the weights sum to (n−1)/n and the integral is scaled by that factor
        steps = [1 / n] * n
        steps[0] /= 2
        steps[-1] /= 2
        return [i / (n - 1) for i in range(n)], steps
    offset = {"riemann_left": 0.0, "riemann_right": 1.0, "riemann_middle": 0.5}.get(method)
    if offset is None:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    return [(i + offset) / n for i in range(n)], [1 / n] * n


@text.text_inputs("integrated_gradients")
def integrated_gradients(
    model: nn.Module,
    inputs,
    target=None,
    *,
    baseline="zeros",
    n_steps: int = 50,
    method: str = "gausslegendre",
    internal_batch_size: Optional[int] = None,
    multiply_by_inputs: bool = True,
    grad_outputs=None,
    rules: Optional[RelevanceRules] = None,
    layer: Optional[str] = None,
    attribute_to_layer_input: bool = False,
    attention_mask: Optional[torch.Tensor] = None,
    generic: bool = False,
    tokenizer=None,
    decoder_input_ids=None,
    decoder_attention_mask: Optional[torch.Tensor] = None,
) -> AttributionResult:
    """Integrated gradients of ``target`` at the input embeddings (or at ``layer``).

    ``attribution = (x − x₀) · Σ_i w_i · ∂f/∂x (x₀ + α_i (x − x₀))`` with the quadrature
    ``(α_i, w_i)`` of ``method``; the gradient is the rule-modified one when ``rules``
    turns rules on. The input is where the embeddings enter the first block (as in
    :func:`pyattr.relevance`).

    Args:
        model (nn.Module): a Hugging Face model.
        inputs (LongTensor[batch, seq] | Mapping): token ids or a tokenizer output.
        target: one value per row, as in :func:`pyattr.relevance` (no k targets); token
            ids chosen by ``None`` (top-1) are fixed at the input.
        baseline: ``"zeros"`` (default; ``None`` is the same, as in Captum), ``"pad"``
            (the pad token's embedding at every position, run through the model: needs
            ``model.config.pad_token_id``; where the model picks the position it pools
            from out of the ids, a sequence classifier's last non-pad token or CLIP's
            first end-of-text token, f(baseline) is read where the input pooled, as every
            point of the path is) or a tensor shaped like the embeddings,
            (batch, seq, hidden) or (seq, hidden). A
            zero embedding is ill-conditioned on RMSNorm models (the gradient near 0
            explodes, so the delta converges slowly): prefer ``"pad"`` there.
        n_steps (int): quadrature points, ≥ 1 (≥ 2 for the trapezoid). Default 50.
        method (str): ``"gausslegendre"`` (default), ``"riemann_left"``,
            ``"riemann_right"``, ``"riemann_middle"``, ``"riemann_trapezoid"``; the
            nodes and weights are Captum's, including its trapezoid, whose weights sum to
            ``(n−1)/n`` (the integral comes out scaled by that factor: prefer Gauss–Legendre).
        internal_batch_size (int, optional): rows per forward/backward among the
            ``n_steps × batch`` path points (Captum's meaning); peak memory follows it,
            not ``n_steps``. Results equal the unchunked run. Default: all at once.
        grad_outputs (Tensor[batch], optional): per-row weights of the target, the
            initial gradient of every path point (tdhook's ``init_attr_grads``); the
            delta is then taken against ``w · (f(x) − f(x₀))``. Default ones.
        multiply_by_inputs (bool): multiply the integrated gradient by ``x − x₀``
            (global attribution); False gives the integrated gradient alone. Default True.
        rules (RelevanceRules, optional): Default: every rule off (plain gradients, as
            Captum); ``RelevanceRules.all()`` integrates the rule-modified gradient.
        layer (str, optional): dotted module path for layer IG (Captum's
            ``LayerIntegratedGradients``): the baseline is given in input space, mapped
            to the layer by a forward at the baseline input, and the path runs between the
            layer's two activations (its output's first tensor, or its first input with
            ``attribute_to_layer_input``, which needs ``layer``). At the output of the
            input embedding module (``model.get_input_embeddings()``, e.g.
            ``"model.embed_tokens"``) the layer space is the input space: a ``"zeros"`` or
            tensor baseline is that layer's baseline activation (Captum issue 1132), so on
            Llama-style models layer IG there equals IG at the embeddings.
        attention_mask (Tensor[batch, seq], optional): 1 for real tokens.
        generic (bool): for an architecture without a rule map, structural rule installation
            and the roles structural discovery reads off the module graph; the input is
            where the discovered entry says the residual stream enters the blocks.
        tokenizer (optional): the model's Hugging Face tokenizer, for text inputs, a word
            ``target`` (as :func:`pyattr.relevance`), and the result's ``tokens`` (each
            token as a string). ``model`` may be a hub id, a directory or a bundled
            name, and ``rules`` a shorthand (``"all"``, ``"attnlrp"``, ``"ln"``,
            ``"none"``), as for :func:`pyattr.relevance`.
        decoder_input_ids (LongTensor[batch, target_len] | str | list[str], optional): on an
            encoder–decoder model, the target prefix, as for :func:`pyattr.relevance`; the
            path then runs at both stacks' entries at once from a zero baseline (or
            ``baseline="pad"``: what both entries receive for all-pad inputs), and the
            result is a :class:`~pyattr.methods.seq2seq_ig.Seq2SeqAttributionResult`
            (``layer``, ``internal_batch_size``, ``grad_outputs`` and
            ``multiply_by_inputs=False`` are not supported there yet). Default: None.
        decoder_attention_mask (Tensor[batch, target_len], optional): 1 for real target
            tokens, as for :func:`pyattr.relevance`. Default: None.

    Returns:
        AttributionResult: ``attribution``, ``token_attribution``, ``convergence_delta``
        (batch,), ``target`` (batch,).

    Warns:
        ConvergenceWarning: with plain gradients and ``multiply_by_inputs``, a row whose
            ``|convergence_delta|`` is more than 5 % of ``|f(x) − f(x₀)|``: the integral has
            not converged (raise ``n_steps``; a zero embedding baseline converges slowly on
            RMSNorm models). With rules on no warning: a rule-modified gradient is no
            gradient field, so completeness is not expected of it.

    Raises:
        ValueError: ``n_steps < 1``, ``internal_batch_size < 1``, unknown ``method``,
            baseline of the wrong shape, unknown ``layer`` (nearest paths named),
            ``attribute_to_layer_input`` without ``layer``, a
            target that does not depend on the inputs or gives no value per row.
        RuntimeError: a call under ``torch.inference_mode()``.
    """
    model = unwrap(model)
    n_steps = core.check_count("n_steps", n_steps, allow_none=False)
    internal_batch_size = core.check_count("internal_batch_size", internal_batch_size)
    if attribute_to_layer_input and layer is None:
        raise ValueError("attribute_to_layer_input=True needs layer: without it the attribution is at the input embeddings")
    alphas, weights = path_points(method, n_steps)
    if is_encoder_decoder(model):
        if layer is not None or internal_batch_size is not None or grad_outputs is not None or not multiply_by_inputs:
            raise ValueError("layer, internal_batch_size, grad_outputs, multiply_by_inputs=False: not supported on "
                             "encoder–decoder models yet")
        return seq2seq_integrated_gradients(
            model, inputs, target, decoder_input_ids=decoder_input_ids, decoder_attention_mask=decoder_attention_mask,
            attention_mask=attention_mask, baseline=baseline, alphas=alphas, weights=weights, method=method,
            rules=RelevanceRules.none() if rules is None else rules, tokenizer=tokenizer)
    if decoder_input_ids is not None or decoder_attention_mask is not None:
        raise ValueError(f"decoder_input_ids / decoder_attention_mask: {type(model).__name__} is not an "
                         "encoder–decoder model (config.is_encoder_decoder is false)")
    precheck_baseline(model, baseline, inputs)
    prep = core.prepare(model, inputs, attention_mask, "integrated_gradients", generic)
    batch = prep.input_ids.shape[0]
    tgts, several = T.normalize(target, batch)
    if several:
        raise ValueError("target: integrated_gradients explains one target per row; call it once per target")
    if layer is not None:
        if layer in ("residual", "attention", "mlp", "neurons"):
            raise ValueError(
                f"layer: layer IG takes one dotted module path, not the shorthand {layer!r} "
                "(layer_relevance expands shorthands)"
            )
        lay_mod = core.resolve_module(model, layer, "layer")
        lay_where = "input" if attribute_to_layer_input else "output"
        pairs = [(lay_mod, lay_where)]
    else:
        pairs = []
    rules = RelevanceRules.none() if rules is None else rules
    args = (pairs, layer, rules, generic, n_steps, internal_batch_size, alphas, weights, multiply_by_inputs, method)
    groups = G.row_groups(model, prep)
    if groups is None:
        return _integrated(model, prep, tgts, baseline, grad_outputs, *args)
    # the forward depends on the batch (dynamic-NTK / LongRoPE): one call per regime
    go_all = None if grad_outputs is None else torch.as_tensor(grad_outputs)
    parts = [_integrated(model, core.select_rows(prep, idx), [t.rows(idx, batch) for t in tgts],
                         G.rows_of(baseline, idx, batch) if isinstance(baseline, torch.Tensor) and baseline.dim() == 3
                         else baseline, G.rows_of(go_all, idx, batch), *args) for idx in groups]
    dims = {k: 0 for k in ("attribution", "token_attribution", "convergence_delta", "target", "baseline_target",
                           "target_ids")}
    return G.merge(parts, groups, batch, dims)


def _integrated(model, prep, tgts, baseline, grad_outputs, pairs, layer, rules, generic, n_steps,
                internal_batch_size, alphas, weights, multiply_by_inputs, method) -> AttributionResult:
    batch = prep.input_ids.shape[0]
    with core.attribution_pass(model, rules, generic, "integrated_gradients") as cov:
        # the input: x, f(x), the layer's activation, and the token ids to keep fixed
        seen: dict = {}
        store: dict = {}

        def entry_fn(t):
            seen["x"] = t.detach()
            return None

        def act_fn(i):
            def fn(t):
                seen.setdefault("acts", []).append(t.detach().clone())
                return None

            return fn

        with torch.no_grad(), core.tap(prep.entry, prep.where, entry_fn, once=True), core.taps(pairs, act_fn), \
                core.record_modules(model, T.module_paths(tgts), store):
            fwd = run_model(model, prep, tgts, store, keep_logits=head_free(model, [m for m, _ in pairs]))
            value, tid, fixed = evaluate_targets(tgts, fwd, False)
        del fwd, store
        if "x" not in seen:
            raise core.entry_not_reached(model, prep)
        if value.dim() != 1:
            raise ValueError("target: integrated_gradients needs one target value per row, got a scalar")
        go = check_grad_outputs(grad_outputs, value)
        x = seen["x"]
        if layer is not None and len(seen.get("acts", [])) != 1:
            raise ValueError(f"layer: {layer!r} ran {len(seen.get('acts', []))} times in one forward pass; layer IG needs one call")
        if layer is not None:  # a layer holding ProphetNet's predicting streams has no position per token
            core.check_not_streams(prep.entry, layer, seen["acts"], x.shape[1], "layer")
        # None is Captum's default, zeros (check_baseline's None means "no baseline": x₀ = x)
        end = seen["acts"][0] if layer is not None else x
        if layer is not None and _embedding_output(model, pairs[0]) and not (isinstance(baseline, str) and baseline == "pad"):
            # at the input embeddings' output the layer space is the input space (Captum
            # issue 1132): a zeros or tensor baseline is that layer's baseline activation
            start = check_baseline("zeros" if baseline is None else baseline, end)
            start = torch.zeros_like(end) if isinstance(start, str) else start
            f0 = _value_at(model, prep, fixed, pairs[0], start)
        else:
            base = check_baseline("zeros" if baseline is None else baseline, x)
            x0, f0, acts0 = baseline_forward(model, prep, base, x, fixed, pairs, [layer] if layer else [])
            start = acts0[0] if layer is not None else x0
        if start.shape != end.shape:
            raise ValueError(f"layer: {layer!r} has shape {tuple(end.shape)} at the input but {tuple(start.shape)} at the baseline")
        total = torch.zeros(end.shape, dtype=torch.float64, device=end.device)
        n_points = n_steps * batch
        chunk = internal_batch_size or n_points
        alpha_t = torch.tensor(alphas, dtype=torch.float64, device=end.device)
        w_t = torch.tensor(weights, dtype=torch.float64, device=end.device)
        progress = Progress(n_points, "integrated gradients")
        try:
            for lo in range(0, n_points, chunk):
                p = torch.arange(lo, min(lo + chunk, n_points))
                rows, steps = p % batch, p // batch
                total.index_add_(0, rows.to(end.device), _chunk_grads(
                    model, prep, pairs, fixed, rows, batch, start, end, alpha_t[steps.to(end.device)], go[rows.to(go.device)],
                ) * w_t[steps.to(end.device)].view(-1, *([1] * (end.dim() - 1))))
                progress.advance(int(p[-1]) + 1)
        finally:
            progress.close()
    diff = (end - start).double()
    attr64 = total * diff if multiply_by_inputs else total
    t64 = value.detach().double()
    delta = attr64.flatten(1).sum(1) - go.detach().double() * (t64 - f0)
    if multiply_by_inputs and not rules.any():
        # completeness holds for the true gradient only: a rule-modified one is no gradient
        # field, and its path integral need not add up to f(x) − f(x₀)
        warn_unconverged(delta, go.detach().double() * (t64 - f0), n_steps, baseline_hint(model, baseline))
    attr = attr64.float()
    tok = attr.sum(-1) if attr.dim() == 3 else None
    return AttributionResult(
        attribution=attr,
        token_attribution=tok,
        convergence_delta=delta,
        target=t64,
        baseline_target=f0,
        target_ids=tid,
        n_steps=n_steps,
        method=method,
        coverage=cov,
    )


def _embedding_output(model: nn.Module, pair) -> bool:
    """``pair`` is the output of the model's input embedding module."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    return pair[1] == "output" and emb is not None and pair[0] is emb


def _value_at(model, prep, fixed, pair, value: torch.Tensor) -> torch.Tensor:
    """f with the output of ``pair``'s module replaced by ``value`` (float64, no gradient)."""
    store: dict = {}
    with torch.no_grad(), core.tap(pair[0], pair[1], lambda t: value, once=True), \
            core.record_modules(model, T.module_paths(fixed), store):
        out, _, _ = evaluate_targets(fixed, run_model(model, prep, fixed, store, keep_logits=head_free(model, [pair[0]])),
                                     False)
    return out.detach().double()


def _chunk_grads(model, prep, pairs, fixed, rows, batch, start, end, alphas, go) -> torch.Tensor:
    """Gradients (float64) at the path points of one chunk: row ``rows[j]`` at ``alphas[j]``."""
    dev = end.device
    r = rows.to(dev)
    shape = (-1, *([1] * (end.dim() - 1)))
    s, e = start[r], end[r]
    points = leaf(s + alphas.to(end.dtype).view(shape) * (e - s))
    sub = core.select_rows(prep, rows)
    tg = [t.rows(rows, batch) for t in fixed]
    store: dict = {}

    held = []

    def replace(t):
        if t.shape != points.shape:
            raise ValueError(f"the value at the path has shape {tuple(t.shape)}, expected {tuple(points.shape)}")
        if torch.is_grad_enabled() and not t.requires_grad and rule_holds_output(where_mod):
            held.append(True)  # the AH-rule's q/k: no gradient reaches it, the path point neither
            return points.detach()
        return points

    where_mod, where = pairs[0] if pairs else (prep.entry, prep.where)
    # the tap stays on through the backward: a checkpointed block recomputed there must see
    # the path point again, not the model's own activation (core.tap replays it)
    with core.tap(where_mod, where, replace, once=True):
        with core.record_modules(model, T.module_paths(tg), store):
            value, _, _ = evaluate_targets(tg, run_model(model, sub, tg, store, keep_logits=head_free(model, [where_mod])),
                                           False)
        if held:
            return torch.zeros_like(points, dtype=torch.float64)
        if not value.requires_grad:
            raise ValueError("target: the explained value does not depend on the inputs, so every attribution would be 0")
        (g,) = torch.autograd.grad(value, points, go.to(value.dtype), allow_unused=True)
    if g is None:
        raise ValueError("target: the explained value does not depend on the inputs, so every attribution would be 0")
    return g.double()
