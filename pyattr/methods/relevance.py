"""Relevance (gradient × input under the rules), as in RelP (arXiv 2508.21258) and AttnLRP
(ICML 2024): with the rules installed, the backward of the target is a relevance
propagation, and ``input · grad`` at the embeddings is each input's relevance."""

from __future__ import annotations

from pyattr._repr import summary_repr
from pyattr.results import ResultViews

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

import pyattr.methods._core as core
import pyattr.methods._core.groups as G
import pyattr.methods._core.text as text
import pyattr.backends as backends
import pyattr.targets as T
from pyattr.config import RelevanceRuleCoverage, RelevanceRules
from pyattr.integration.wrappers import unwrap
from pyattr.methods.seq2seq import is_encoder_decoder, seq2seq_relevance
from pyattr.methods._core.baseline import (
    baseline_forward,
    check_baseline,
    precheck_baseline,
)
from pyattr.methods._core.forward import (
    backward,
    check_finite,
    check_grad_outputs,
    evaluate_targets,
    leaf,
    run_model,
)

Target = Union[None, int, Sequence[int], torch.Tensor, Callable, T.Target, Sequence[T.Target]]


@dataclass
class RelevanceResult(ResultViews):
    """Output of :func:`relevance`.

    With k targets per row (``target`` a ``LongTensor[batch, k]`` or a list of k target
    objects) every tensor field gains a leading ``k`` dimension.

    Attributes:
        token_relevance (Tensor[batch, seq], float32): relevance per token (sum over hidden).
        relevance (Tensor[batch, seq, hidden], float32): relevance per embedding dimension,
            ``x · g``, or ``(x − x₀) · g`` with a baseline.
        target (Tensor[batch] or Tensor[], float64): the explained value(s) f(x).
        conservation_delta (Tensor, like ``target``, float64): ``w·target − Σ relevance``
            per row, ``w`` the ``grad_outputs`` (1 by default); with a baseline,
            ``w·(f(x) − f(x₀)) − Σ relevance``. Near 0 for bias-free models with all rules
            on; otherwise the relevance absorbed by biases and rules left off.
        target_ids (Tensor[batch] or None): the token ids explained, for logit targets.
        coverage (RelevanceRuleCoverage): what the rule scope installed and skipped.
        backend (str): the backend that ran the rule backwards.
        baseline_target (Tensor like ``target``, float64, or None): f(x₀) with a baseline.
        patch_grid ((rows, cols) or None): for image inputs (``pixel_values``), the patch
            grid; ``token_relevance`` then holds the [CLS] token first and the patches row
            by row (see :meth:`patch_relevance`).
        image (Tensor[batch, height, width, 3], uint8, or None): for image inputs, each image
            for display (its ``pixel_values`` scaled from their min..max to 0..255): the
            notebook view and ``plot()`` draw the patch relevance over it.
        stream_relevance (Tensor[batch, streams, seq], float32, or None): for a model that
            appends streams after the tokens at its entry (ProphetNet's ``ngram``
            predicting streams, whose inputs are an n-gram embedding and a position
            embedding, no token), the relevance reaching each stream position's input;
            part of the conservation sum. None for every other model.
    """

    __repr__ = summary_repr

    token_relevance: torch.Tensor
    relevance: torch.Tensor
    target: torch.Tensor
    conservation_delta: torch.Tensor
    target_ids: Optional[torch.Tensor]
    coverage: RelevanceRuleCoverage
    backend: str
    baseline_target: Optional[torch.Tensor] = None
    patch_grid: Optional[Tuple[int, int]] = None
    tokens: Optional[List[List[Optional[str]]]] = None
    target_tokens: Optional[list] = None
    image: Optional[torch.Tensor] = None
    stream_relevance: Optional[torch.Tensor] = None

    def patch_relevance(self) -> torch.Tensor:
        """Relevance per image patch, ``Tensor[..., batch, rows, cols]`` (float32): the
        patch tokens of ``token_relevance`` laid out as the image's grid, the [CLS] token
        (``token_relevance[..., 0]``) left out.

        Raises:
            ValueError: the input was not an image (no ``patch_grid``).
        """
        if self.patch_grid is None:
            raise ValueError("patch_relevance(): the input was token ids, not an image (pixel_values)")
        rows, cols = self.patch_grid
        return self.token_relevance[..., 1:].reshape(*self.token_relevance.shape[:-1], rows, cols)


@text.text_inputs("relevance")
def relevance(
    model: nn.Module,
    inputs,
    target: Target = None,
    rules: Optional[RelevanceRules] = None,
    *,
    baseline=None,
    grad_outputs=None,
    attention_mask: Optional[torch.Tensor] = None,
    generic: bool = False,
    tokenizer=None,
    decoder_input_ids: Optional[torch.Tensor] = None,
    decoder_attention_mask: Optional[torch.Tensor] = None,
) -> RelevanceResult:
    """Relevance of each input token for ``target``: gradient × input under the rules.

    The input is the residual stream as the first block sees it: ``inputs_embeds`` for
    Llama-style models, word + position embeddings for GPT-2 / GPT-NeoX, and the sum of
    word, position and token-type embeddings before the first LayerNorm for BERT.

    Args:
        model (nn.Module | str): a supported Hugging Face model (see :func:`use_relevance_rules`),
            or its name: a hub id (``"gpt2"``, loaded with ``from_pretrained`` and its
            tokenizer), a local directory, or a bundled model (``"induction"``, ``"minilm"``).
        inputs (str | list[str] | LongTensor[batch, seq] | FloatTensor[batch, channels, height, width] | Mapping):
            a text or a list of texts (with ``tokenizer``: a causal LM reads each as a prompt,
            without the end-of-text markers its tokenizer appends; rows of different lengths
            padded on the tokenizer's ``padding_side``), token ids, or a tokenizer output
            (``input_ids``, optional ``attention_mask`` and other model kwargs); for vision transformers (ViT, CLIP's vision tower) the
            ``pixel_values`` or an image processor's output. An image's relevance is
            measured at the patch embeddings as the first block sees them ([CLS] token and
            position embeddings added): one value per token, [CLS] first.
        target: what to explain (:mod:`pyattr.targets`): ``None`` (the top-1 next-token
            logit at each row's last real position; for a classifier, the top-1 class
            logit), a token or class id (``int``, NumPy integer,
            0-d tensor), one token id per row (list, 1-d or ``(batch, 1)`` integer tensor
            or array), ``Logit`` / ``LogitDiff`` / ``ModuleOutput``, or a callable
            ``f(output) -> Tensor[]`` or ``Tensor[batch]``. k targets per row: a
            ``LongTensor[batch, k]`` or a list of k target objects, explained with one
            forward and one batched backward (``is_grads_batched``); every result field
            gains a leading ``k`` dimension. A word (``"Paris"``, with ``tokenizer``): the
            logit of the word's first token as the tokenizer reads it after each row's
            text; a ValueError if the word is several tokens there (explain a continuation
            token by token with :func:`pyattr.generation_relevance`); one word per row as a
            list; for a classifier, a label of ``config.label2id``. Default: None.
        rules (RelevanceRules | str, optional): Default: ``RelevanceRules.all()``, the four
            rules with AH-rule attention (``RelevanceRules()`` is every rule off: plain
            gradients). Shorthands: ``"all"``, ``"attnlrp"`` (AttnLRP attention), ``"ln"``
            (the LN-rule alone), ``"none"``.
        baseline: ``None``, ``"zeros"``, ``"pad"`` (the pad token's embedding at every
            position; needs ``model.config.pad_token_id``) or a tensor shaped like the
            embeddings (batch, seq, hidden) or (seq, hidden). Relevance becomes
            ``(x − x₀) · g`` and the delta is taken against ``f(x) − f(x₀)`` (one more
            forward, without gradient).
        grad_outputs (Tensor, optional): the initial gradient, shaped like the target's value
            ((batch,), or (k, batch) as ``result.target``: the transpose of (batch, k) target
            ids), finite; default ones (tdhook's ``init_attr_grads``).
        attention_mask (Tensor[batch, seq], optional): 1 for real tokens.
        generic (bool): for an architecture without a rule map, structural rule installation
            and the roles structural discovery reads off the module graph; relevance is measured
            where the discovered entry says the residual stream enters the blocks.
        tokenizer (optional): the model's Hugging Face tokenizer: reads text inputs and word
            targets, and fills the result's ``tokens`` (each token as a string) and
            ``target_tokens``.
        decoder_input_ids (LongTensor[batch, target_len] | str | list[str], optional): on an encoder–decoder
            model (T5, mT5, BART, mBART, Marian, M2M100 / NLLB, Pegasus), the target prefix
            the decoder reads (teacher forcing), starting with the decoder start token; or
            ``decoder_input_ids`` / ``labels`` in the inputs mapping (labels shifted by the
            model's own ``prepare_decoder_input_ids_from_labels``). As text (with
            ``tokenizer=``): the target text's labels as the tokenizer makes them
            (``text_target=``, language codes included), shifted by that same method, so
            the last decoder position predicts the text's last label (a word target
            ``"RED"`` there: give the text before it). The target is read on
            the decoder side (default: the top-1 logit after the last real target token)
            and the result is a :class:`~pyattr.methods.seq2seq.Seq2SeqRelevanceResult`
            with ``source_relevance`` and ``target_relevance`` (``baseline`` there:
            ``"zeros"`` or ``"pad"``, at both stacks' entries). Default: None.
        decoder_attention_mask (Tensor[batch, target_len], optional): 1 for real target
            tokens (right padding; BART-family models refuse left padding, whose absolute
            positions would shift). Default: None.

    Returns:
        RelevanceResult with ``token_relevance`` (batch, seq), ``relevance``
        (batch, seq, hidden), ``target`` and ``conservation_delta``; on an encoder–decoder
        model a :class:`~pyattr.methods.seq2seq.Seq2SeqRelevanceResult` (``source_relevance``
        and ``target_relevance`` in place of ``token_relevance``, ``source_tokens`` and
        ``decoder_tokens`` in place of ``tokens``).

    Logit targets run the language-model head at their positions only
    (``logits_to_keep``, where the model's forward takes it): ``target`` is the model's
    logit from that call, equal to the full head's up to the last bits (a few ulp). Passing
    ``logits_to_keep=0`` with the inputs keeps the full head. No key/value cache is built
    (``use_cache=False`` unless the inputs set it).

    The model runs in eval mode with its parameters' ``requires_grad`` off during the
    pass; both are restored afterwards, also when the call fails. The pass enables
    autograd for itself, so a call under ``torch.no_grad()`` returns the same result.
    Padded rows (``attention_mask``) equal the same row alone: position ids are counted
    along the mask in the model's own convention, read-outs at position 0 ([CLS]) take each
    row's first real token, and on a model whose forward depends on the longest position in
    the batch (dynamic-NTK RoPE, LongRoPE) rows run in groups of one rotary regime. A
    key/value cache in the inputs
    (``past_key_values`` / ``cache``, with a mask over cache + new tokens or none) is
    copied for every forward, so the call leaves it unchanged and a second call gives the
    same result.

    Raises:
        TypeError / ValueError: malformed inputs, target, baseline or grad_outputs (the
            message names which); a target that does not depend on the inputs; a
            left-padded batch on a model whose forward takes no ``position_ids``.
        RuntimeError: a call under ``torch.inference_mode()``; the model's parameters are
            inference tensors.
        RelevanceRuleUnsupportedError, RelevanceRuleConflictError: see :func:`use_relevance_rules`.
    """
    model = unwrap(model)
    if is_encoder_decoder(model) or decoder_input_ids is not None or decoder_attention_mask is not None:
        return _seq2seq(model, inputs, target, rules, baseline, grad_outputs, attention_mask, generic,
                        decoder_input_ids, decoder_attention_mask, tokenizer)
    precheck_baseline(model, baseline, inputs)
    prep = core.prepare(model, inputs, attention_mask, "relevance", generic)
    batch = prep.input_ids.shape[0]
    tgts, several = T.normalize(target, batch)
    rules = core.rule_defaults(rules)
    groups = G.row_groups(model, prep)
    if groups is None:
        return _relevance(model, prep, tgts, several, rules, baseline, grad_outputs, generic)
    # the forward depends on the batch (dynamic-NTK / LongRoPE): one call per regime
    d = 1 if several else 0
    grad_outputs = None if grad_outputs is None else torch.as_tensor(grad_outputs)
    parts = [_relevance(model, core.select_rows(prep, idx), [t.rows(idx, batch) for t in tgts], several, rules,
                        G.rows_of(baseline, idx, batch) if isinstance(baseline, torch.Tensor) and baseline.dim() == 3
                        else baseline, G.rows_of(grad_outputs, idx, batch, d), generic) for idx in groups]
    dims = {"token_relevance": d, "relevance": d, "target": d, "conservation_delta": d, "target_ids": d,
            "baseline_target": d, "stream_relevance": d}
    return G.merge(parts, groups, batch, dims)


def _seq2seq(model, inputs, target, rules, baseline, grad_outputs, attention_mask, generic, decoder_input_ids,
             decoder_attention_mask, tokenizer):
    if not is_encoder_decoder(model):
        raise ValueError(f"decoder_input_ids / decoder_attention_mask: {type(model).__name__} is not an "
                         "encoder–decoder model (config.is_encoder_decoder is false)")
    # generic=True changes nothing on a mapped encoder–decoder (its map is the plan, as for a
    # mapped decoder); an unmapped one is refused by name when its entries are looked up
    return seq2seq_relevance(model, inputs, target, core.rule_defaults(rules), decoder_input_ids=decoder_input_ids,
                             attention_mask=attention_mask, decoder_attention_mask=decoder_attention_mask,
                             grad_outputs=grad_outputs, tokenizer=tokenizer, baseline=baseline)


def relevance_in_chunks(model: nn.Module, inputs, targets: Sequence[Target], rules, baseline, chunks) -> RelevanceResult:
    """:func:`relevance` of k targets (a list) from one forward, their backward run as
    several batched backwards whose sizes ``chunks`` chooses (see
    :func:`pyattr.methods._core.forward.backward`); :func:`pyattr.generation_relevance`'s
    path. For a model whose forward does not depend on the batch (the caller checks)."""
    model = unwrap(model)
    precheck_baseline(model, baseline, inputs)
    prep = core.prepare(model, inputs, None, "relevance", False)
    tgts, several = T.normalize(list(targets), prep.input_ids.shape[0])
    return _relevance(model, prep, tgts, several, core.rule_defaults(rules), baseline, None, False, chunks,
                      finite=False)


def _relevance(model, prep: core.Prepared, tgts, several: bool, rules: RelevanceRules, baseline, grad_outputs,
               generic: bool, chunks=None, finite: bool = True) -> RelevanceResult:
    store: dict = {}
    with core.attribution_pass(model, rules, generic, "relevance") as cov:
        xs: List[torch.Tensor] = []

        def entry_fn(t):
            xs.append(leaf(t))
            return xs[-1]

        with core.tap(prep.entry, prep.where, entry_fn, once=True), core.record_modules(model, T.module_paths(tgts), store), \
                core.stream_tails() as tails:
            fwd = run_model(model, prep, tgts, store, keep_logits=True)
        if not xs:
            raise core.entry_not_reached(model, prep)
        x = xs[0]
        value, tid, fixed = evaluate_targets(tgts, fwd, several)
        if finite:  # generation checks its steps itself, naming the step
            check_finite(value, "relevance", several)
        go = check_grad_outputs(grad_outputs, value)
        base = check_baseline(baseline, x)
        grad, *g_tails = backward(value, [x] + tails[-1:], go, several, chunks=chunks if several else None,
                                  finite=finite)
        backend_name = backends.select(x.device, "identity")
        del fwd, store
        if base is not None:
            x0, f0, _ = baseline_forward(model, prep, base, x, fixed)
    xd = x.detach()
    diff = xd if base is None else xd - x0
    rel = diff.float() * grad.float()
    tok = rel.sum(-1)
    t64 = value.detach().double()
    w = go.detach().double()
    explained = t64 if base is None else t64 - f0
    sums = rel.double().sum(dim=(-2, -1)) if t64.dim() >= 1 else rel.double().sum()
    # the streams a model appends after the tokens (ProphetNet): their inputs hold no token
    # and take their share of the target, reported apart and in the conservation sum
    streams = core.streams_relevance(tails, g_tails, x.shape[1], torch.float32)
    if streams is not None and base is not None:  # the baseline keeps them: x − x₀ is 0 there
        streams = torch.zeros_like(streams)
    if streams is not None:
        sums = sums + (streams.double().sum(dim=(-2, -1)) if t64.dim() >= 1 else streams.double().sum())
    delta = w * explained - sums
    return RelevanceResult(
        token_relevance=tok,
        relevance=rel,
        target=t64,
        conservation_delta=delta,
        target_ids=tid,
        coverage=cov,
        backend=backend_name,
        baseline_target=None if base is None else f0,
        patch_grid=prep.patch_grid,
        image=_display_image(prep),
        stream_relevance=streams,
    )


def _display_image(prep):
    """The images of an image batch for display (:func:`pyattr.results.overlay.display_image`)."""
    px = prep.kwargs.get("pixel_values") if prep.patch_grid is not None else None
    if not isinstance(px, torch.Tensor) or px.dim() != 4:
        return None
    from pyattr.results.overlay import display_image

    return display_image(px)
