"""Attribution patching: every node's effect estimated from two forwards and one backward
(AtP, AtP*, RelP)."""

from __future__ import annotations

import contextlib
from typing import Dict, Optional, Sequence, Union

import torch
from torch import nn

import pyattr.methods._core as core
import pyattr.methods._core.text as text
from pyattr.config import RelevanceRules
from pyattr.integration.wrappers import unwrap
import pyattr.patching.ig as IG
from pyattr.patching.nodes import Site, check_nodes, node_sites
from pyattr.patching.pairs import align, check_row_metric, metric_targets, prepare_pair, recording_forward
from pyattr.patching.result import PatchingResult, dims
import pyattr.patching.seq2seq as S2P
from pyattr.methods._core.stacks import is_encoder_decoder
from pyattr.methods._core.forward import check_finite

METHODS = ("relp", "atp", "atp*", "ig", "blockwise")


#: The rules ``method="relp"`` uses by default: the LN-rule alone. Chosen by the
#: correlation with activation patching on all-MiniLM-L6-v2 (README, "Circuit discovery",
#: ``pyattr bench --patching``): of the variants measured it is the one that beats AtP on
#: the residual stream (Pearson and Spearman) and on MLP outputs (Pearson); the AH- and
#: Identity-rules lowered every correlation there. RelP's full rule set (LN-, Identity-,
#: Half- and AH-rule) is ``rules=RelevanceRules.all()``.
PATCHING_RULES = RelevanceRules(normalization=True)


def method_rules(method: str, rules: Optional[RelevanceRules], default: RelevanceRules) -> RelevanceRules:
    """The rules a patching method runs under: ``default`` (or ``rules``) for ``"relp"``, none
    for the others, which refuse ``rules``."""
    if method != "relp":
        if rules is not None:
            what = "runs the later blocks exactly, with no gradient" if method == "blockwise" else \
                "uses the plain gradient"
            raise ValueError(f"rules: method={method!r} {what}; pass method='relp' to use rules")
        return RelevanceRules()
    rules = default if rules is None else rules
    if not isinstance(rules, RelevanceRules):
        raise TypeError(f"rules must be a RelevanceRules, got {type(rules).__name__}")
    return rules


@text.text_inputs("attribution_patching", inputs=("clean", "corrupt"), target="metric")
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
    steps: Optional[int] = None,
    batch_size: Optional[int] = None,
    generic: bool = False,
    tokenizer=None,
    decoder_input_ids=None,
    corrupt_decoder_input_ids=None,
    decoder_attention_mask: Optional[torch.Tensor] = None,
) -> PatchingResult:
    """Estimated effect of patching each node from ``corrupt`` into ``clean``, for every
    node at once: ``(a_corrupt − a_clean) · ∂metric/∂a`` at the clean run.

    Two forwards (clean with gradient, corrupt without) and one backward for the whole
    batch of prompt pairs, whatever the number of nodes.

    Args:
        model (nn.Module): a Hugging Face model of a mapped architecture (llama, mistral,
            qwen2, qwen3, gemma, gemma2, gemma3_text, olmo2, phi3, gpt2, gpt_neox, bert,
            roberta, distilbert, …; ``generic=True`` for others), or a mapped encoder–decoder
            with ``decoder_input_ids`` (nodes on both stacks, see below).
        clean (LongTensor[batch, seq] | Mapping): token ids or tokenizer outputs.
        corrupt (LongTensor[batch, seq] | Mapping): as ``clean``; row i of ``corrupt`` is
            the counterfactual of row i of ``clean``.
        metric: what the effects are measured on: a :mod:`pyattr.targets` target
            (``LogitDiff(a, b)``, ``Logit(id)``, ``Cosine(reference)``, ``ModuleOutput``) or
            a callable ``f(output) → Tensor[batch]`` that computes each row from that row
            alone (activation patching runs copies of one row; per-row ids or references
            belong in a target, which follows the rows: a callable that reads per-row data
            is refused there). A top-1 ``Logit()`` is fixed to the clean run's token for the
            corrupt run. With ``tokenizer=``, a word: its logit at the last position.
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
            ``"ig"``: EAP-IG (Hanna et al., COLM 2024): the plain gradient averaged over
            ``steps`` inputs on the line from the clean to the corrupt input embeddings
            (:mod:`pyattr.patching.ig`); ``steps`` forwards and backwards for every node
            at once. Needs clean and corrupt that line up (no ``alignment``).
            ``"blockwise"``: exact patching's effects, not an estimate, computed from the
            clean run block by block (:mod:`pyattr.patching.blockwise`): the node's own block
            and every later block re-run exactly on the change before them, the output head
            on the last one's, the blocks before the node not run again. It sees composition
            through every later softmax; it costs a run of each later block per node
            (batched ``batch_size`` nodes per run), so it grows with nodes × later blocks.
            Needs blocks that each receive the previous block's output and a metric read
            from the model's output.
        rules (RelevanceRules, optional): the rules of ``"relp"`` (default
            :data:`PATCHING_RULES`); not accepted with the other methods.
        sum_positions (bool): sum each node's estimate over positions (the estimate of
            patching it at every position at once). Default False.
        alignment (LongTensor[batch, clean_seq], optional): the corrupt position whose
            activation replaces each clean position, -1 for none (effect 0). Required when
            clean and corrupt differ in length or in their attention masks.
        steps (int, optional): ``"ig"`` only: the interpolation steps (midpoint rule;
            default 16).
        batch_size (int, optional): ``"ig"``: rows per forward of the ``steps × batch``
            interpolated rows (default: all in one); ``"blockwise"``: patched nodes per block
            run (default 256).
        attention_mask (Tensor[batch, seq], optional): the mask of ``clean`` when it is
            given as ids.
        corrupt_attention_mask (Tensor[batch, seq], optional): the mask of ``corrupt``
            when it is given as ids.
        generic (bool): for an architecture without a rule map, read the nodes (and
            AtP*'s attention core) off the module graph with structural discovery
            (:func:`pyattr.architectures.discover`), and install ``"relp"``'s rules
            structurally; a node whose role discovery could not find is refused with the
            reason. Default False.
        tokenizer (optional): the model's Hugging Face tokenizer, for text inputs and
            the result's ``tokens`` (each token as a string). ``clean`` and ``corrupt``
            may be texts. ``model`` may be a hub id, a directory or a bundled name, and
            ``rules`` a shorthand (``"all"``, ``"attnlrp"``, ``"ln"``, ``"none"``), as
            for :func:`pyattr.relevance`.
        decoder_input_ids (optional): on an encoder–decoder model, the clean run's target
            prefix (ids, text with ``tokenizer=``, or ``labels`` in the inputs), as
            :func:`pyattr.relevance`; ``clean`` and ``corrupt`` are then sources of one
            length, the metric is read on the decoder side, and the nodes are on both
            stacks (``"encoder.residual"``, ``"decoder.cross_heads"``, …;
            :mod:`pyattr.patching.seq2seq`).
        corrupt_decoder_input_ids (optional): the corrupt run's target prefix, of the
            clean one's length (default: the clean one).
        decoder_attention_mask (Tensor[batch, target_len], optional): 1 for the target
            prefix's real tokens (both runs).

    Returns:
        PatchingResult: ``result[node]`` float32 ``(batch, layer, position[, head | neuron])``,
        ``clean_metric`` and ``corrupt_metric`` (float64, (batch,)).

    Raises:
        ValueError: an unknown node type or method, a model without a node map,
            ``"atp*"`` on a model whose attention does not return its probabilities
            (not eager), ``"blockwise"`` on blocks that do not chain or with a metric
            read inside a block, clean
            and corrupt that do not line up (different lengths or masks without
            ``alignment``, different batch sizes), a metric that does not give one value
            per row or does not depend on the inputs, ``rules`` with ``"atp"``.
        RuntimeError: a call under ``torch.inference_mode()``.
    """
    model = unwrap(model)
    if is_encoder_decoder(model) or any(v is not None for v in (decoder_input_ids, corrupt_decoder_input_ids,
                                                                decoder_attention_mask)):
        return S2P.patching(model, clean, corrupt, metric, nodes, method, "attribution_patching",
                            rules=method_rules(method, rules, PATCHING_RULES),
                            sum_positions=sum_positions, alignment=alignment, attention_mask=attention_mask,
                            corrupt_attention_mask=corrupt_attention_mask, decoder_input_ids=decoder_input_ids,
                            corrupt_decoder_input_ids=corrupt_decoder_input_ids,
                            decoder_attention_mask=decoder_attention_mask, tokenizer=tokenizer,
                            unsupported=(("steps", steps), ("batch_size", batch_size)))
    node_list = check_nodes(nodes)
    if not isinstance(sum_positions, bool):
        raise TypeError(f"sum_positions must be a bool, got {sum_positions!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "ig" and steps is not None:
        raise ValueError(f"steps: only method='ig' interpolates; method={method!r} takes no steps")
    if method not in ("ig", "blockwise") and batch_size is not None:
        raise ValueError(f"batch_size: only method='ig' (interpolated rows) and 'blockwise' (patched nodes per block "
                         f"run) batch; method={method!r} takes none")
    if method == "blockwise":
        import pyattr.patching.blockwise as BW
        from pyattr.patching.attention_replay import attention_replay
        from pyattr.patching.last_block import last_mlp
        from pyattr.patching.mlp_positions import block_mlps

        batch_size = core.check_count("batch_size", batch_size) or BW.DEFAULT_BATCH
    if method == "ig":
        steps = core.check_count("steps", IG.DEFAULT_STEPS if steps is None else steps, allow_none=False)
        batch_size = core.check_count("batch_size", batch_size)
        if alignment is not None:
            raise ValueError("alignment: method='ig' interpolates the input embeddings position by position, so "
                             "clean and corrupt must line up; drop alignment= or use method='atp' / 'relp'")
    rules = method_rules(method, rules, PATCHING_RULES)
    sites = node_sites(model, node_list, generic)
    flat = [s for n in node_list for s in sites[n]]
    caller = "attribution_patching"
    pair = prepare_pair(model, clean, corrupt, alignment, attention_mask, corrupt_attention_mask, caller,
                        alignable=method != "ig", generic=generic)
    batch = pair.clean.input_ids.shape[0]
    tgts = metric_targets(metric, batch)
    star = method == "atp*" and "residual" in node_list
    blocks = None
    if method == "blockwise":
        block_sites = node_sites(model, ["residual"], generic)["residual"]
        blocks = BW.BlockCalls([s.module for s in block_sites], attention_replay(model, flat, generic),
                               block_mlps(model, generic))
        BW.check_metric(model, tgts, blocks)
    if star:
        from pyattr.patching.atp_star import AttentionCalls

        attn_c = AttentionCalls(model, [s.path for s in sites["residual"]], generic)
        attn_x = AttentionCalls(model, [s.path for s in sites["residual"]], generic)
    with core.attribution_pass(model, rules, generic, caller) as cov:
        with attn_c.recording() if star else blocks.recording() if blocks is not None else contextlib.nullcontext():
            value, acts_c, fixed = recording_forward(model, pair.clean, tgts, flat, grad=True)
        check_finite(value, caller, False)  # an estimate from a NaN metric is NaN, not a number to read
        if not value.requires_grad:
            raise ValueError("metric: the value does not depend on the inputs through differentiable operations")
        extra = []
        if star:
            attn_c.check()
            extra = attn_c.weights
        if blocks is not None:
            blocks.check(model, batch)
            check_row_metric(model, pair.clean, fixed, value, "attribution_patching(method='blockwise')")
            blocks.cut_last_mlp(model, last_mlp(model, generic), pair, fixed, batch)
        if method == "ig":
            value = value.detach()
            grads = IG.path_gradients(model, pair, fixed, flat, steps, batch_size)
            d_weights = []
        elif blocks is not None:  # no gradient: every later block runs exactly
            grads, d_weights = [None] * len(acts_c), []
        else:
            grads = torch.autograd.grad(value, acts_c + extra, torch.ones_like(value), allow_unused=True,
                                        retain_graph=star)
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
            value_x, acts_x, _ = recording_forward(model, pair.corrupt, fixed, flat, grad=False,
                                          metric="optional" if alignment is not None else "required")
        if star:  # inside the pass: eval mode (no attention dropout in the re-run modules)
            inputs_x = [align(t.detach(), pair.index) for t in attn_x.inputs]
            pattern_terms = attn_c.pattern_terms(inputs_x, list(d_weights), pair.valid)
        if blocks is not None:  # inside the pass: eval mode, the rules' forwards are the model's
            sources = [align(a.detach(), pair.index) for a in acts_x]
            try:
                effects = BW.effects(model, pair, fixed, flat, node_list, sources, acts_c,
                                     [a.shape[-1] for a in acts_c], blocks, sum_positions, batch_size,
                                     value.detach())
            finally:
                blocks.release()
            return PatchingResult(effects=effects, dims={n: dims(n, sum_positions) for n in node_list},
                                  clean_metric=value.detach().double(), corrupt_metric=value_x.double(),
                                  method=method)
    effects: Dict[str, torch.Tensor] = {}
    valid = pair.valid
    for node in node_list:
        per_layer = []
        for s in sites[node]:
            i = flat.index(s)
            a_c = acts_c[i]
            g = grads[i]
            diff = (align(acts_x[i], pair.index).float() - a_c.float())
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
        dims={n: dims(n, sum_positions) for n in node_list},
        clean_metric=value.double(),
        corrupt_metric=value_x.double(),
        method=method,
        rules=rules if method == "relp" else None,
        coverage=cov if method == "relp" else None,
    )


def _reduce(prod: torch.Tensor, site: Site) -> torch.Tensor:
    """Per-unit products (batch, seq, width) → one value per node."""
    if site.node == "neurons":
        return prod
    if site.node == "heads":
        b, s, w = prod.shape
        if w % site.heads:
            raise ValueError(f"nodes: {site.path!r} input width {w} does not split into {site.heads} heads")
        return prod.view(b, s, site.heads, w // site.heads).sum(-1)
    return prod.sum(-1)
