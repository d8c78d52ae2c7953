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

import pyattr.architectures as A
import pyattr.backends as backends
import pyattr.methods._core as core
import pyattr.targets as T
from pyattr._repr import summary_repr
from pyattr.results import ResultViews
from pyattr.config import RelevanceRuleCoverage, RelevanceRules
from pyattr.methods._core.forward import backward, check_grad_outputs, evaluate_targets, leaf
from pyattr.methods._core.inputs import check_token_ids, normalise_inputs
from pyattr.methods._core.passes import check_grad_mode, check_parameters_usable
import pyattr.methods.seq2seq_baseline as B
from pyattr.methods._core.stacks import is_encoder_decoder, refuse_encoder_decoder  # noqa: F401 - re-exported


@dataclass
class Seq2SeqRelevanceResult(ResultViews):
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
            each source token and each decoder input token as a string (None at padding).
        target_tokens (list of str, or None): with ``tokenizer=``, the explained token of
            each row (logit targets), as the other results name it.
        baseline_target (Tensor like ``target``, float64, or None): f(x₀) with a baseline;
            relevance is then ``(x − x₀) · g`` and the delta is taken against ``f(x) − f(x₀)``.
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


def _entries(model: nn.Module):
    mt = A.model_type(model)
    spec = A.SEQ2SEQ.get(mt)
    if spec is None:
        raise ValueError(
            f"relevance(): {type(model).__name__} (model type {mt!r}) is an encoder–decoder model without a rule map "
            f"and entries; supported encoder–decoders: {sorted(A.SEQ2SEQ)}")
    prefix = A.base_prefix(model)
    out = []
    for side, arch in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        path = A.join(prefix, arch.entry[0])
        mod = A.get_submodule(model, path)
        if mod is None:
            raise ValueError(f"relevance(): cannot find the {side}'s entry {path!r} in {type(model).__name__}")
        out.append(mod)
    return spec, out


def _mask(mask, ids: torch.Tensor, name: str) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of shape (batch, seq), got {type(mask).__name__}")
    if mask.dim() == 1:
        mask = mask.unsqueeze(0)
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"{name} of shape {tuple(mask.shape)} must match its ids' shape {tuple(ids.shape)}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name} must hold 0 and 1 only")
    if bool((mask.sum(-1) == 0).any()):
        raise ValueError(f"{name}: a row has no real token")
    return mask


def _left_padded(mask: Optional[torch.Tensor]) -> bool:
    """A 0 before a 1 in some row."""
    return mask is not None and bool((mask.long().cummin(-1).values != mask.long()).any())


def decoder_inputs_from_text(model: nn.Module, tokenizer, text, rows: int):
    """``(decoder_input_ids, decoder_attention_mask)`` of a target text (one string, or one
    per row): each row's labels as the tokenizer makes them (``text_target=``, with the
    language codes and end-of-text marker it adds), then the model's own teacher-forcing
    shift (``prepare_decoder_input_ids_from_labels``: its decoder start first, the last
    label dropped), rows padded on the right. The logit at a row's last decoder position
    predicts its last label (the end-of-text marker for a whole sentence)."""
    if tokenizer is None:
        raise ValueError("decoder_input_ids: the target prefix is text; pass tokenizer= (the model's tokenizer)")
    texts = [text] * rows if isinstance(text, str) else list(text)
    if len(texts) != rows or not all(isinstance(t, str) and t.strip() for t in texts):
        raise ValueError(f"decoder_input_ids: expected one non-empty target text, or one per source row ({rows}), "
                         f"got {text!r}")
    shift = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if not callable(shift):
        raise ValueError(f"decoder_input_ids: {type(model).__name__} has no prepare_decoder_input_ids_from_labels to "
                         "shift the target text's labels; pass decoder_input_ids as token ids")
    out = []
    for t in texts:
        labels = tokenizer(text_target=t, return_tensors="pt")["input_ids"]
        out.append(shift(labels=labels)[0])
    width = max(len(r) for r in out)
    pad = getattr(tokenizer, "pad_token_id", None)
    ids = torch.full((rows, width), 0 if pad is None else int(pad), dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i, r in enumerate(out):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    return ids, mask


def prepare(model: nn.Module, inputs, attention_mask, decoder_input_ids, decoder_attention_mask, caller: str,
            tokenizer=None):
    """The model's kwargs: the source (``input_ids``, ``attention_mask``) and the target
    prefix (``decoder_input_ids``, given, from the inputs, or from ``labels`` as the model
    shifts them itself with ``prepare_decoder_input_ids_from_labels``)."""
    check_grad_mode(caller)
    kwargs = normalise_inputs(inputs, attention_mask)
    check_parameters_usable(model, caller)
    src = kwargs["input_ids"]
    if decoder_input_ids is None:
        decoder_input_ids = kwargs.pop("decoder_input_ids", None)
    else:
        kwargs.pop("decoder_input_ids", None)
    labels = kwargs.pop("labels", None)
    if decoder_input_ids is None and isinstance(labels, torch.Tensor):
        shift = getattr(model, "prepare_decoder_input_ids_from_labels", None)
        if callable(shift):
            decoder_input_ids = shift(labels=labels)
    if isinstance(decoder_input_ids, str) or (isinstance(decoder_input_ids, (list, tuple)) and decoder_input_ids
                                              and all(isinstance(t, str) for t in decoder_input_ids)):
        if decoder_attention_mask is not None:
            raise ValueError("decoder_attention_mask: the target prefix is text, whose mask the tokenizer gives; "
                             "pass decoder_attention_mask= only with token ids")
        decoder_input_ids, decoder_attention_mask = decoder_inputs_from_text(model, tokenizer, decoder_input_ids,
                                                                             src.shape[0])
    if decoder_input_ids is None:
        raise ValueError(
            f"{caller}(): {type(model).__name__} is an encoder–decoder model: pass the target prefix as "
            "decoder_input_ids (LongTensor[batch, target_len], starting with the decoder start token) or labels "
            "in the inputs; the explained value is read on the decoder side")
    dec = torch.as_tensor(decoder_input_ids)
    if dec.dim() == 1:
        dec = dec.unsqueeze(0)
    if dec.dtype not in (torch.int64, torch.int32) or dec.dim() != 2 or dec.shape[1] == 0:
        raise TypeError(f"decoder_input_ids must be an integer tensor of shape (batch, target_len) with "
                        f"target_len > 0, got {dec.dtype} of shape {tuple(dec.shape)}")
    if dec.shape[0] != src.shape[0]:
        raise ValueError(f"decoder_input_ids has {dec.shape[0]} rows, the source (input_ids) has {src.shape[0]}")
    if decoder_attention_mask is None:
        decoder_attention_mask = kwargs.pop("decoder_attention_mask", None)
    else:
        kwargs.pop("decoder_attention_mask", None)
    dmask = _mask(decoder_attention_mask, dec, "decoder_attention_mask")
    smask = kwargs.get("attention_mask")
    check_token_ids(model, src, "inputs")
    check_token_ids(model, dec, "decoder_input_ids")
    spec, entries = _entries(model)
    if spec.gated_ff is None:  # absolute positions (BART family): a left pad shifts every real token's
        for name, m in (("attention_mask", smask), ("decoder_attention_mask", dmask)):
            if _left_padded(m):
                raise ValueError(
                    f"{name}: left padding on {type(model).__name__} shifts the real tokens' absolute positions (its "
                    "forward takes no position ids), so a padded row would not equal the row alone; pad on the right")
    kwargs["decoder_input_ids"] = dec
    if dmask is not None:
        kwargs["decoder_attention_mask"] = dmask
    kwargs["use_cache"] = False
    return kwargs, dec, dmask, entries


def _word(tokenizer, word: str) -> int:
    """The token id of a target-side word: one token as the tokenizer reads it in a target
    text (``text_target=``, no special tokens), else ValueError."""
    if tokenizer is None:
        raise ValueError(f"target={word!r}: a word target needs tokenizer=")
    ids = tokenizer(text_target=word, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"target={word!r} is {len(ids)} tokens as the tokenizer reads it in a target text; explain a "
                         "single token (or its pieces one by one with generation_relevance(continuation=...))")
    return int(ids[0])


def _words_to_ids(target, tokenizer):
    if isinstance(target, str):
        return _word(tokenizer, target)
    if isinstance(target, (list, tuple)) and target and all(isinstance(t, str) for t in target):
        return [_word(tokenizer, t) for t in target]
    return target


def seq2seq_relevance(model: nn.Module, inputs, target, rules: RelevanceRules, *, decoder_input_ids=None,
                      attention_mask=None, decoder_attention_mask=None, grad_outputs=None,
                      caller: str = "relevance", tokenizer=None, baseline=None) -> Seq2SeqRelevanceResult:
    """:func:`pyattr.relevance` of a decoder-side target of an encoder–decoder model."""
    B.check(baseline)
    kwargs, dec, dmask, (enc_entry, dec_entry) = prepare(model, inputs, attention_mask, decoder_input_ids,
                                                         decoder_attention_mask, caller, tokenizer)
    target = _words_to_ids(target, tokenizer)
    tgts, several = T.normalize(target, dec.shape[0])
    if any(T.module_paths([t]) for t in tgts):
        raise ValueError("target: module-output targets are not supported on encoder–decoder models yet; explain a "
                         "logit (a token id), a LogitDiff or a callable of the output")
    with core.attribution_pass(model, rules, False, caller) as cov:
        xs: List[List[torch.Tensor]] = [[], []]

        def fn_for(i):
            def fn(t):
                xs[i].append(leaf(t))
                return xs[i][-1]
            return fn

        with core.tap(enc_entry, "input", fn_for(0), once=True), core.tap(dec_entry, "input", fn_for(1), once=True):
            out = model(**kwargs)
        if not xs[0] or not xs[1]:
            raise ValueError(f"{caller}(): the {'encoder' if not xs[0] else 'decoder'}'s entry was not reached during "
                             f"{type(model).__name__}'s forward pass")
        fwd = T.Forward(out, dec, dmask, {}, None)
        value, tid, fixed = evaluate_targets(tgts, fwd, several)
        go = check_grad_outputs(grad_outputs, value)
        x_src, x_tgt = xs[0][0], xs[1][0]
        g_src, g_tgt = backward(value, [x_src, x_tgt], go, several)
        backend_name = backends.select(x_src.device, "identity")
        del out, fwd
        if baseline is not None:
            x0 = B.entries_at(model, kwargs, (enc_entry, dec_entry), baseline, x_src, x_tgt)
            f0 = B.value_at(model, kwargs, (enc_entry, dec_entry), x0, fixed, dec, dmask, several)
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
    explained_value = t64 if baseline is None else t64 - f0
    return Seq2SeqRelevanceResult(
        source_relevance=rel_s.sum(-1), target_relevance=rel_t.sum(-1), source_hidden_relevance=rel_s,
        target_hidden_relevance=rel_t, target=t64, conservation_delta=go.detach().double() * explained_value - sums,
        baseline_target=None if baseline is None else f0,
        target_ids=tid, coverage=cov, backend=backend_name,
        source_tokens=strings(tokenizer, kwargs["input_ids"], kwargs.get("attention_mask")),
        decoder_tokens=strings(tokenizer, dec, dmask), target_tokens=explained(tokenizer, tid))


def explained(tokenizer, tid: Optional[torch.Tensor]):
    """The explained token ids as strings (nested for k targets), or None."""
    if tokenizer is None or tid is None:
        return None
    return [tokenizer.convert_ids_to_tokens(row) for row in tid.tolist()] if tid.dim() > 1 else \
        tokenizer.convert_ids_to_tokens(tid.tolist())


def strings(tokenizer, ids: torch.Tensor, mask) -> Optional[List[List[Optional[str]]]]:
    """Each token as the tokenizer writes it (None at padding), or None without a tokenizer."""
    if tokenizer is None:
        return None
    rows = []
    for i, row in enumerate(ids.tolist()):
        toks = tokenizer.convert_ids_to_tokens(row)
        rows.append([t if mask is None or int(mask[i, j]) else None for j, t in enumerate(toks)])
    return rows
