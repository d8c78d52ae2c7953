"""Relevance on encoder–decoder models (T5, mT5, BART, mBART, Marian, M2M100 / NLLB,
Pegasus): one forward of the encoder on the source and of the decoder on the target
prefix (teacher forcing), one backward of the explained decoder value, and gradient ×
input read where each stack's residual stream enters its first block. The source tokens
and the target prefix each get their relevance; one conservation sum covers both, since
relevance reaches the source only through the decoder's cross-attention (its value path
under the AH-rule)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

import pyattr.backends as backends
import pyattr.methods._core as core
import pyattr.targets as T
from pyattr._repr import summary_repr
from pyattr.results import ResultViews
from pyattr.methods.seq2seq_names import TwoStacks
from pyattr.config import RelevanceRuleCoverage, RelevanceRules
from pyattr.methods._core.forward import backward, check_finite, check_grad_outputs, evaluate_targets, leaf
import pyattr.methods.seq2seq_baseline as B
import pyattr.methods.seq2seq_inputs as SI
import pyattr.methods.seq2seq_targets as ST
from pyattr.methods.seq2seq_inputs import prepare  # noqa: F401 - read from here by the other seq2seq methods
from pyattr.methods._core.stacks import is_encoder_decoder, refuse_encoder_decoder  # noqa: F401 - re-exported


@dataclass
class Seq2SeqRelevanceResult(TwoStacks, ResultViews):
    """Output of :func:`pyattr.relevance` on an encoder–decoder model.

    With k targets per row every tensor field gains a leading ``k`` dimension.

    Attributes:
        source_relevance (Tensor[batch, source_len], float32; float64 for a float64 model):
            relevance per source token
            (the encoder's input), summed over the hidden dimension.
        target_relevance (Tensor[batch, target_len], like ``source_relevance``): relevance per token of the
            target prefix (the decoder's input, ``decoder_input_ids``).
        source_hidden_relevance (Tensor[batch, source_len, hidden]): ``x · g`` per
            embedding dimension at the encoder's entry.
        target_hidden_relevance (Tensor[batch, target_len, hidden]): the same at
            the decoder's entry.
        target (Tensor[batch], float64): the explained value f(x).
        conservation_delta (Tensor like ``target``, float64): ``w·target − Σ source − Σ
            target prefix``; near 0 for bias-free models with all rules on.
        target_ids (Tensor[batch] or None): the token ids explained, for logit targets.
        coverage (RelevanceRuleCoverage): what the rule scope installed and skipped.
        backend (str): the backend that ran the rule backwards.
        source_tokens, decoder_tokens (list of lists of str, or None): with ``tokenizer=``,
            each source token and each decoder input token as a string, as decoded in its row
            (``" RED"``, as a decoder-only result's ``tokens``; None at padding).
        target_tokens (list of str, or None): with ``tokenizer=``, the explained token of
            each row (logit targets), as the other results name it.
        baseline_target (Tensor like ``target``, float64, or None): f(x₀) with a baseline;
            relevance is then ``(x − x₀) · g`` and the delta is taken against ``f(x) − f(x₀)``.
        stream_relevance (Tensor[batch, streams, target_len] or None): like
            ``source_relevance``, for a decoder that appends streams after the tokens
            (ProphetNet's ``ngram`` predicting streams: an n-gram embedding and a position
            embedding, no token), the relevance reaching each stream position's input;
            part of the conservation sum. None for every other model.
    """

    __repr__ = summary_repr
    own_tokens = True  # source_tokens / decoder_tokens, not the one-sequence ``tokens`` of other results

    source_relevance: torch.Tensor
    target_relevance: torch.Tensor
    source_hidden_relevance: torch.Tensor
    target_hidden_relevance: torch.Tensor
    target: torch.Tensor
    conservation_delta: torch.Tensor
    target_ids: Optional[torch.Tensor]
    coverage: RelevanceRuleCoverage
    backend: str
    source_tokens: Optional[List[List[Optional[str]]]] = None
    decoder_tokens: Optional[List[List[Optional[str]]]] = None
    target_tokens: Optional[list] = None
    baseline_target: Optional[torch.Tensor] = None
    stream_relevance: Optional[torch.Tensor] = None


def _word(tokenizer, word: str) -> int:
    """The token id of a target-side word: one token as the tokenizer reads it in a target
    text (``text_target=``, no special tokens), else ValueError."""
    if tokenizer is None:
        raise ValueError(f"target={word!r}: a word target needs tokenizer=")
    ids = tokenizer(text_target=word, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"target={word!r} is {len(ids)} tokens as the tokenizer reads it in a target text; explain a "
                         "single token (or its pieces one by one with generation_relevance(continuation=...))")
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and int(ids[0]) == int(unk) and word != getattr(tokenizer, "unk_token", None):
        raise ValueError(f"target token {word!r} is not in the vocabulary (the tokenizer reads it as its unknown "
                         "token)")
    return int(ids[0])


def _words_to_ids(target, tokenizer):
    if isinstance(target, str):
        return _word(tokenizer, target)
    if isinstance(target, (list, tuple)) and target and all(isinstance(t, str) for t in target):
        return [_word(tokenizer, t) for t in target]
    return target


def seq2seq_relevance(model: nn.Module, inputs, target, rules: RelevanceRules, *, decoder_input_ids=None,
                      attention_mask=None, decoder_attention_mask=None, grad_outputs=None,
                      caller: str = "relevance", tokenizer=None, baseline=None,
                      batch_targets: Optional[int] = None, finite: bool = True) -> Seq2SeqRelevanceResult:
    """:func:`pyattr.relevance` of a decoder-side target of an encoder–decoder model
    (``batch_targets``: with k targets, at most this many per batched backward over the
    one forward's graph)."""
    B.check(baseline)
    kwargs, dec, dmask, (enc_entry, dec_entry) = prepare(model, inputs, attention_mask, decoder_input_ids,
                                                         decoder_attention_mask, caller, tokenizer)
    target = _words_to_ids(target, tokenizer)
    tgts, several = T.normalize(target, dec.shape[0])
    side = ST.side_of(model, tgts, caller)
    with core.attribution_pass(model, rules, False, caller) as cov:
        xs: List[List[torch.Tensor]] = [[], []]

        def fn_for(i):
            def fn(t):
                xs[i].append(leaf(t))
                return xs[i][-1]
            return fn

        src_fn = SI.one_per_token(fn_for(0), kwargs["input_ids"].shape[1], model, caller)
        store: dict = {}
        with core.tap(enc_entry, "input", src_fn, once=True), core.tap(dec_entry, "input", fn_for(1), once=True), \
                ST.recording(model, tgts, store), core.stream_tails() as tails:
            out = model(**kwargs)
        if not xs[0] or not xs[1]:
            raise ValueError(f"{caller}(): the {'encoder' if not xs[0] else 'decoder'}'s entry was not reached during "
                             f"{type(model).__name__}'s forward pass")
        fwd = ST.forward(side, out, kwargs, store)
        value, tid, fixed = evaluate_targets(tgts, fwd, several)
        if finite:  # generation checks its steps itself, naming the step
            check_finite(value, caller, several)
        go = check_grad_outputs(grad_outputs, value)
        x_src, x_tgt = xs[0][0], xs[1][0]
        chunks = None
        if several and batch_targets is not None:
            from pyattr.methods._core.chunks import ChunkSizes

            chunks = ChunkSizes(batch_targets, fixed=True)
        g_src, g_tgt, *g_tails = backward(value, [x_src, x_tgt] + tails[-1:], go, several, chunks=chunks,
                                          finite=finite)
        backend_name = backends.select(x_src.device, "identity")
        del out, fwd, store
        if baseline is not None:
            x0 = B.entries_at(model, kwargs, (enc_entry, dec_entry), baseline, x_src, x_tgt)
            f0 = B.value_at(model, kwargs, (enc_entry, dec_entry), x0, fixed, side, several)
    g_src = torch.zeros_like(x_src) if g_src is None else g_src
    g_tgt = torch.zeros_like(x_tgt) if g_tgt is None else g_tgt
    # float32, or the model's dtype where it is wider (a float64 oracle compares to 1e-10)
    dt = torch.promote_types(torch.float32, x_src.dtype)
    d_src, d_tgt = (x_src.detach(), x_tgt.detach()) if baseline is None else \
        (x_src.detach() - x0[0], x_tgt.detach() - x0[1])
    rel_s = d_src.to(dt) * g_src.to(dt)
    rel_t = d_tgt.to(dt) * g_tgt.to(dt)
    t64 = value.detach().double()
    sums = rel_s.double().sum(dim=(-2, -1)) + rel_t.double().sum(dim=(-2, -1))
    # the decoder's appended streams (ProphetNet): no token, their share reported apart
    streams = core.streams_relevance(tails, g_tails, x_tgt.shape[1], dt)
    if streams is not None and baseline is not None:  # the baseline keeps them: x − x₀ is 0 there
        streams = torch.zeros_like(streams)
    if streams is not None:
        sums = sums + streams.double().sum(dim=(-2, -1))
    explained_value = t64 if baseline is None else t64 - f0
    return Seq2SeqRelevanceResult(
        source_relevance=rel_s.sum(-1), target_relevance=rel_t.sum(-1), source_hidden_relevance=rel_s,
        target_hidden_relevance=rel_t, target=t64, conservation_delta=go.detach().double() * explained_value - sums,
        baseline_target=None if baseline is None else f0,
        target_ids=tid, coverage=cov, backend=backend_name,
        source_tokens=strings(tokenizer, kwargs["input_ids"], kwargs.get("attention_mask")),
        decoder_tokens=strings(tokenizer, dec, dmask), target_tokens=explained(tokenizer, tid),
        stream_relevance=streams)


def explained(tokenizer, tid: Optional[torch.Tensor]):
    """The explained token ids as strings (nested for k targets), or None."""
    if tokenizer is None or tid is None:
        return None
    return [tokenizer.convert_ids_to_tokens(row) for row in tid.tolist()] if tid.dim() > 1 else \
        tokenizer.convert_ids_to_tokens(tid.tolist())


def strings(tokenizer, ids: torch.Tensor, mask) -> Optional[List[List[Optional[str]]]]:
    """Each token as the decoder-only results show it (what the tokenizer's decoding of the
    row adds for it, :func:`pyattr.methods._core.text.token_strings`; None at padding), or
    None without a tokenizer."""
    if tokenizer is None:
        return None
    from pyattr.methods._core.text import token_strings

    return token_strings(tokenizer, ids, mask)
