"""Generation relevance on encoder–decoder models: ``generate`` runs first (its own
stopping criteria observed), then each row's generated steps are explained from one
encoder + decoder forward (teacher forcing) and one batched backward: the relevance of
step ``t``'s logit over the source tokens and over the decoder's inputs before it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

import pyattr.targets as T
from pyattr._repr import summary_repr
from pyattr.results import ResultViews
from pyattr.methods.seq2seq_names import SourcesOfSteps
from pyattr.config import RelevanceRuleCoverage, RelevanceRules
from pyattr.methods._core.forward import check_steps_finite
from pyattr.methods._core.generate import generate
from pyattr.methods._core.inputs import check_token_ids, normalise_inputs
from pyattr.methods._core.tokens import refuse_unknown
import pyattr.methods.seq2seq_baseline as B
import pyattr.methods.seq2seq_inputs as SI
from pyattr.methods.seq2seq import seq2seq_relevance, strings


@dataclass
class Seq2SeqGenerationResult(SourcesOfSteps, ResultViews):
    """Output of :func:`pyattr.generation_relevance` on an encoder–decoder model.

    Attributes:
        source_ids (LongTensor[batch, source_len]): the source (the encoder's input).
        sequences (LongTensor[batch, prefix + generated]): the decoder's sequence as
            ``generate`` returned it: its start token(s), then the generated tokens.
        prefix_width (int): columns before the generated tokens; step ``t``'s token is at
            column ``prefix_width + t`` and its logit is read at column ``prefix_width + t − 1``.
        source_relevance (Tensor[batch, generated, source_len]): row ``t`` is step ``t``'s
            relevance over the source tokens; 0 for steps that do not exist.
        target_relevance (Tensor[batch, generated, prefix + generated − 1]): step ``t``'s
            relevance over the decoder's inputs (start token, earlier generated tokens);
            exactly 0 from column ``prefix_width + t`` on.
        target (Tensor[batch, generated], float64): each step's explained value (its logit,
            log-probability or probability, or the difference to ``contrast``'s; NaN where
            the step does not exist).
        conservation_delta (Tensor[batch, generated], float64): target minus the step's
            relevance over source and decoder inputs (NaN where the step does not exist).
        step_mask (BoolTensor[batch, generated]): steps that exist: up to and including the
            step at which ``generate``'s own stopping criteria finished the row.
        coverage (RelevanceRuleCoverage), backend (str): as :func:`pyattr.relevance`.
        source_tokens, sequence_tokens (list of lists of str, or None): with ``tokenizer=``,
            the source's and the decoder sequence's tokens as strings (None at padding and
            after a row finished).
        baseline_target (Tensor[batch, generated], float64, or None): with a baseline,
            each step's value at it; relevance is then ``(x − x₀) · g`` and the delta is
            taken against ``target − baseline_target``.
    """

    __repr__ = summary_repr
    own_tokens = True

    source_ids: torch.Tensor
    sequences: torch.Tensor
    prefix_width: int
    source_relevance: torch.Tensor
    target_relevance: torch.Tensor
    target: torch.Tensor
    conservation_delta: torch.Tensor
    step_mask: torch.Tensor
    coverage: Optional[RelevanceRuleCoverage]
    backend: str
    source_tokens: Optional[List[List[Optional[str]]]] = None
    sequence_tokens: Optional[List[List[Optional[str]]]] = None
    baseline_target: Optional[torch.Tensor] = None


def _continuation(model: nn.Module, continuation, batch: int, tokenizer):
    """``(ids LongTensor[batch, generated], steps BoolTensor)``: given ids (a tensor, one id
    list, or one per row, lengths may differ) or text (one per row, read with
    ``text_target=`` as the target side, the markers the tokenizer adds included)."""
    if isinstance(continuation, str) or (isinstance(continuation, (list, tuple)) and continuation
                                         and all(isinstance(c, str) for c in continuation)):
        if tokenizer is None:
            raise ValueError("continuation: text needs tokenizer=")
        texts = [continuation] * batch if isinstance(continuation, str) else list(continuation)
        if len(texts) != batch or not all(t.strip() for t in texts):
            raise ValueError(f"continuation: expected one non-empty text, or one per source row ({batch})")
        rows = [[int(i) for i in tokenizer(text_target=t)["input_ids"]] for t in texts]
        for i, (t, r) in enumerate(zip(texts, rows)):
            refuse_unknown(tokenizer, r, t, f"continuation[{i}]")
    else:
        rows = SI.as_id_rows(continuation, "continuation")
        if rows is None:
            try:
                gen = torch.as_tensor(continuation)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError("continuation must be token ids (a LongTensor, a list of ints or of rows of ints) "
                                f"or text, got {type(continuation).__name__}") from None
            gen = gen.unsqueeze(0) if gen.dim() == 1 else gen
            if gen.dtype not in (torch.int64, torch.int32) or gen.dim() != 2 or gen.shape[1] == 0:
                raise ValueError(f"continuation: expected token ids of shape (batch {batch}, generated > 0), got "
                                 f"{gen.dtype} of shape {tuple(gen.shape)}")
            rows = gen.tolist()
        if len(rows) == 1 and batch > 1:
            rows = rows * batch
    if len(rows) != batch:
        raise ValueError(f"continuation: {len(rows)} rows for a source of {batch} rows")
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    gen, mask = SI.padded_rows(rows, pad if isinstance(pad, int) else 0, "continuation")
    SI.check_decoder_ids(model, gen, "continuation")
    return gen, mask.bool()


def seq2seq_generation_relevance(model: nn.Module, inputs, max_new_tokens, continuation, generate_kwargs,
                                 rules: RelevanceRules, attention_mask, tokenizer=None,
                                 step_targets=None, batch_targets=None, baseline=None) -> Seq2SeqGenerationResult:
    """``step_targets(row, tokens, width, generated)``: the targets of one row's steps
    (``tokens`` its generated ids, LongTensor[k]; step ``t`` read at decoder position
    ``width + t − 1``); default each step's logit. ``batch_targets``: at most this many
    steps per batched backward over the row's one forward (default: all of them);
    ``baseline``: ``"zeros"`` or ``"pad"`` at both entries, as :func:`pyattr.relevance`."""
    B.check(baseline)
    kwargs = normalise_inputs(inputs, attention_mask)
    src = kwargs["input_ids"]
    smask = kwargs.get("attention_mask")
    for key in ("decoder_input_ids", "decoder_attention_mask", "labels", "past_key_values", "encoder_outputs"):
        if kwargs.get(key) is not None:
            raise ValueError(f"inputs: {key} is not read by generation_relevance on an encoder–decoder model (the "
                             "decoder's inputs are its start token and the generated or given tokens)")
    if smask is None:
        smask = torch.ones_like(src)
    spec, _ = SI.entries(model, "generation_relevance")
    check_token_ids(model, src, "inputs")
    SI.check_length(model, src.shape[1], "inputs")
    SI.refuse_shifted_positions(model, spec, (("attention_mask", smask),))
    if continuation is not None:
        if max_new_tokens is not None:
            raise ValueError("max_new_tokens and continuation: give one (generate, or explain a given continuation)")
        gen, steps = _continuation(model, continuation, src.shape[0], tokenizer)
        # the model's own start column: its shift of the whole continuation (mBART wraps each
        # row's last real token, its language code, to the front; the others put
        # decoder_start_token_id there)
        seq = torch.cat([SI.shift_labels(model, gen, "continuation")[:, :1].to(gen.device), gen], 1)
        width = seq.shape[1] - gen.shape[1]
    else:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1 (or continuation=), got {max_new_tokens!r}")
        if generate_kwargs is not None:
            if not isinstance(generate_kwargs, dict):
                raise TypeError(f"generate_kwargs must be a dict, got {type(generate_kwargs).__name__}")
            given = [k for k in ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask",
                                 "inputs_embeds", "encoder_outputs") if k in generate_kwargs]
            if given:
                raise ValueError(f"generate_kwargs: {given[0]} is given by the inputs (the source) or by the decoder's "
                                 "own start; drop it from generate_kwargs (or pass continuation=)")
        SI.check_length(model, 1 + max_new_tokens, "max_new_tokens")
        prefix: list = []
        gen, steps = generate(model, src, smask, max_new_tokens, generate_kwargs, prefix=prefix)
        seq = torch.cat([prefix[0], gen], 1)
        width = prefix[0].shape[1]
    SI.check_length(model, seq.shape[1] - 1, "continuation")
    batch, n = gen.shape
    dt = torch.promote_types(torch.float32, next(model.parameters()).dtype)
    s_rel = torch.zeros(batch, n, src.shape[1], dtype=dt)
    t_rel = torch.zeros(batch, n, seq.shape[1] - 1, dtype=dt)
    target = torch.full((batch, n), float("nan"), dtype=torch.float64)
    delta = torch.full((batch, n), float("nan"), dtype=torch.float64)
    base = None if baseline is None else torch.full((batch, n), float("nan"), dtype=torch.float64)
    cov, backend = None, ""
    for b in range(batch):
        k = int(steps[b].sum())
        if k == 0:
            continue
        real = smask[b].bool()
        dec = seq[b:b + 1, :width + k - 1]
        tgts = [T.Logit(int(gen[b, t]), position=width + t - 1) for t in range(k)] if step_targets is None else \
            step_targets(b, gen[b, :k], width, n)
        r = seq2seq_relevance(model, {"input_ids": src[b:b + 1, real], "attention_mask": smask[b:b + 1, real]},
                              tgts, rules, decoder_input_ids=dec, caller="generation_relevance",
                              batch_targets=batch_targets, baseline=baseline, finite=False)
        s_rel[b, :k, real] = r.source_relevance[:, 0].to(dt)
        t_rel[b, :k, :dec.shape[1]] = r.target_relevance[:, 0].to(dt)
        target[b, :k] = r.target[:, 0]
        delta[b, :k] = r.conservation_delta[:, 0]
        if base is not None:
            base[b, :k] = r.baseline_target[:, 0]
        cov, backend = r.coverage, r.backend
    check_steps_finite(steps, target)
    seq_mask = torch.cat([torch.ones(batch, width, dtype=torch.long), steps.to("cpu").long()], 1)
    return Seq2SeqGenerationResult(source_ids=src, sequences=seq, prefix_width=width, source_relevance=s_rel,
                                   target_relevance=t_rel, target=target, conservation_delta=delta,
                                   step_mask=steps.to("cpu"), coverage=cov, backend=backend,
                                   source_tokens=strings(tokenizer, src, smask),
                                   sequence_tokens=strings(tokenizer, seq, seq_mask), baseline_target=base)
