"""Relevance of generated text: every generated token's target explained over the prompt
and the tokens generated before it.

The steps run in segments (:func:`segment_end`): one forward of :func:`pyattr.relevance`'s
pass on the sequence cut after the segment's last target position, then the segment's
targets as batched backwards of ``batch_targets`` targets each over that one forward's
graph (:func:`pyattr.methods.relevance.relevance_in_chunks`). A causal model's target at
position ``p`` does not depend on later positions, so the cut changes no value: the
per-step loop's forwards become one per segment (16 steps after a 16k-token context: one),
and each backward runs at its segment's length.
"""

from __future__ import annotations

from pyattr._repr import summary_repr
from pyattr.results import ResultViews

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from pyattr.methods._core.stacks import is_encoder_decoder
from pyattr.methods.seq2seq_generation import seq2seq_generation_relevance
import pyattr.architectures as A
import pyattr.methods._core as core
import pyattr.methods._core.text as text
import pyattr.methods._core.positions as P
from pyattr.methods._core.generate import generate
from pyattr.methods._core.words import words
import pyattr.targets as T
from pyattr.config import RelevanceRules
from pyattr.integration.wrappers import unwrap
from pyattr.methods._core.inputs import input_device
from pyattr.methods._core.chunks import DEFAULT_BUDGET, SEGMENT_GROWTH, ChunkSizes, default_batch_targets, segment_end  # noqa: F401
from pyattr.methods._core.peak_memory import PeakMemory
from pyattr.methods.relevance import relevance, relevance_in_chunks
from pyattr.methods._core.forward import check_steps_finite
from pyattr.methods._core.top import TopSource, index_in as _index  # noqa: F401 - TopSource re-exported

TARGETS = ("logit", "logprob", "prob")


@dataclass
class GenerationRelevanceResult(ResultViews):
    """Output of :func:`generation_relevance`.

    Attributes:
        sequences (LongTensor[batch, seq]): prompt (left-padded) then the generated tokens.
        attention_mask (LongTensor[batch, seq]): 1 at the real prompt tokens and at every
            generated column (steps after a row's end of sequence included).
        prompt_width (int): columns of the (padded) prompt; step ``t``'s token is at
            column ``prompt_width + t``.
        prompt_length (LongTensor[batch]): real prompt tokens per row.
        token_relevance (Tensor[batch, generated, seq], float32): row ``t`` is the relevance
            of step ``t``'s target over every column; exactly 0 at columns ≥ the step's own
            token and at padding, and for steps that do not exist (``step_mask`` False).
        target (Tensor[batch, generated], float64): each step's explained value (NaN where
            the step does not exist).
        conservation_delta (Tensor[batch, generated], float64): target (or its change from
            the baseline) minus the row's relevance sum.
        step_mask (BoolTensor[batch, generated]): steps that exist: up to and including the
            step at which ``generate``'s own stopping criteria finished the row (an
            end-of-sequence id, ``stop_strings``, a custom ``StoppingCriteria``, max time:
            observed, not re-derived), or the row's continuation length.
        target_kind (str): ``"logit"``, ``"logprob"`` or ``"prob"``; ``contrast`` (bool).
        batch_targets (int): the most steps one batched backward ran.
        backend (str): the backend that ran the rule backwards.
    """

    __repr__ = summary_repr

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_width: int
    prompt_length: torch.Tensor
    token_relevance: torch.Tensor
    target: torch.Tensor
    conservation_delta: torch.Tensor
    step_mask: torch.Tensor
    target_kind: str
    contrast: bool
    batch_targets: int
    backend: str
    tokens: Optional[List[List[Optional[str]]]] = None

    @property
    def generated(self) -> torch.Tensor:
        """The generated (or given) token ids, LongTensor[batch, generated]."""
        return self.sequences[:, self.prompt_width:]

    def _step(self, step) -> int:
        g = self.token_relevance.shape[1]
        return _index(step, -g, g, "step") % g

    def _row(self, row) -> int:
        return _index(row, 0, self.token_relevance.shape[0], "row")

    def top_sources(self, step: int, k: int = 5, row: int = 0) -> List["TopSource"]:
        """The ``k`` columns with the largest relevance for step ``step`` of row ``row``:
        ``[TopSource(column, token, relevance), …]`` (named tuples), largest first
        (positive relevance first; columns the step cannot see are never listed; ``[]`` for
        a step that does not exist, see ``step_mask``). ``token`` is the token's text
        where the result has it (text in, or ``tokenizer=``: ``tokens``), else its id."""
        step, row = self._step(step), self._row(row)
        k = core.check_count("k", k, allow_none=False)
        if not bool(self.step_mask[row, step]):
            return []  # a step after the row's end of sequence (or its continuation) does not exist
        rel = self.token_relevance[row, step]
        visible = self.attention_mask[row, : self.prompt_width + step].bool()
        cols = visible.nonzero()[:, 0]
        vals = rel[cols]
        order = torch.argsort(vals, descending=True, stable=True)[:k]
        names = self.tokens[row] if self.tokens is not None else None

        def token(c: int):
            return names[c] if names is not None and names[c] is not None else int(self.sequences[row, c])

        return [TopSource(int(cols[i]), token(int(cols[i])), float(vals[i])) for i in order]

    def span(self, start: int, end: int) -> torch.Tensor:
        """Relevance of the steps ``start … end − 1`` explained as one target (their summed
        targets, LXT issue 39): the sum of their rows, Tensor[batch, seq]."""
        g = self.token_relevance.shape[1]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= g):
            raise ValueError(f"span: need 0 <= start < end <= {g} (generated steps), got ({start!r}, {end!r})")
        return self.token_relevance[:, start:end].sum(1)

    def aggregate(self, by: Union[str, Sequence[Tuple[int, int]]], tokenizer=None, row: int = 0):
        """Relevance summed over groups of columns, for each step of row ``row``.

        ``by="word"``: words of the sequence as the tokenizer's own decoding spells it (runs
        of non-whitespace characters; a line break or tab separates words as a space does;
        a special token is a word of its own; needs ``tokenizer``). ``by`` a list of
        ``(start, end)`` column ranges: segments of the prompt (passages of a document).

        Returns ``(labels, Tensor[generated, groups])``: the words (or ``"start:end"``).
        """
        row = self._row(row)
        rel = self.token_relevance[row]
        if isinstance(by, str):
            if by != "word":
                raise ValueError(f"aggregate: by must be 'word' or a list of (start, end) column ranges, got {by!r}")
            if tokenizer is None:
                raise ValueError("aggregate('word') needs tokenizer= (to read where words start)")
            return words(self.sequences[row], self.attention_mask[row], rel, tokenizer)
        seq = rel.shape[-1]
        groups = list(by)
        if not groups:
            raise ValueError("aggregate: by must be 'word' or a non-empty list of (start, end) column ranges")
        for s, e in groups:
            if not (isinstance(s, int) and isinstance(e, int) and 0 <= s < e <= seq):
                raise ValueError(f"aggregate: segment ({s!r}, {e!r}) is not a column range within [0, {seq}]")
        out = torch.stack([rel[:, s:e].sum(-1) for s, e in groups], -1)
        return [f"{s}:{e}" for s, e in groups], out


def refuse_other_inputs(inputs) -> None:
    """The steps are explained from the prompt's ids alone (one forward of ids and mask):
    another input in the mapping (an image's ``pixel_values``, embeddings, positions, a
    cache) would be dropped from that forward, and the explanation would be of another
    model call. ``token_type_ids`` of zeros (a tokenizer's default) change nothing."""
    if not hasattr(inputs, "keys"):
        return
    for key in inputs.keys():
        value = inputs[key]
        if key in ("input_ids", "attention_mask") or value is None:
            continue
        if key == "token_type_ids" and not bool(torch.as_tensor(value).any()):
            continue
        raise ValueError(f"inputs: {key} is not read by generation_relevance, which explains each step from the "
                         "prompt's token ids and attention mask alone; pass those (an image or other inputs are not "
                         "explained here)")


def _as_batch(inputs, attention_mask) -> Tuple[torch.Tensor, torch.Tensor]:
    if isinstance(inputs, torch.Tensor):
        ids, mask = inputs, attention_mask
    elif hasattr(inputs, "keys") and "input_ids" in inputs:
        # as pyattr.relevance: an attention_mask argument wins over the mapping's
        ids = inputs["input_ids"]
        mask = attention_mask if attention_mask is not None else inputs.get("attention_mask")
    else:
        raise TypeError("inputs must be token ids (LongTensor[batch, seq]) or a tokenizer output with input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.dim() not in (1, 2):
        raise TypeError("inputs: input_ids must be an integer tensor of shape (batch, seq) or (seq,)")
    ids = ids.long()
    if ids.dim() == 1:
        ids = ids[None]
        mask = None if mask is None else torch.as_tensor(mask).reshape(1, -1)
    mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask).to(ids.device).long()
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} must match input_ids {tuple(ids.shape)}")
    if bool((mask.sum(1) == 0).any()):
        raise ValueError("inputs: a prompt row has no real token (attention_mask all 0)")
    # generation appends at the right end: the prompt's real tokens must end there
    if bool((mask[:, -1] == 0).any()):
        raise ValueError("inputs: the prompt must be left-padded (each row's real tokens end at the last column), "
                         "as for model.generate; use tokenizer(..., padding_side='left')")
    return ids, mask


def _continuation(continuation, batch: int, device, pad: int):
    if isinstance(continuation, torch.Tensor):
        if continuation.dtype not in (torch.int64, torch.int32) or continuation.dim() not in (1, 2):
            raise TypeError("continuation must be token ids: LongTensor[batch, generated] or [generated]")
        c = continuation.long().to(device)
        c = c.expand(batch, -1) if c.dim() == 1 else c
        if c.shape[0] != batch:
            raise ValueError(f"continuation has {c.shape[0]} rows, the prompt {batch}")
        return c, torch.ones_like(c, dtype=torch.bool)
    if isinstance(continuation, (list, tuple)) and continuation and all(isinstance(r, (list, tuple)) for r in continuation):
        if len(continuation) != batch:
            raise ValueError(f"continuation has {len(continuation)} rows, the prompt {batch}")
        g = max(len(r) for r in continuation)
        c = torch.full((batch, g), pad, dtype=torch.long, device=device)
        steps = torch.zeros(batch, g, dtype=torch.bool, device=device)
        for i, r in enumerate(continuation):
            c[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            steps[i, : len(r)] = True
        return c, steps
    if isinstance(continuation, (list, tuple)) and all(isinstance(v, int) for v in continuation):
        return _continuation(torch.tensor(continuation, dtype=torch.long), batch, device, pad)
    raise TypeError("continuation must be token ids: a LongTensor[batch, generated] / [generated], or a list of "
                    "lists of ids (rows of different lengths)")


def _contrast(contrast, batch: int, generated: int, device) -> Optional[torch.Tensor]:
    if contrast is None:
        return None
    if isinstance(contrast, int) and not isinstance(contrast, bool):
        return torch.full((batch, generated), contrast, dtype=torch.long, device=device)
    c = None if isinstance(contrast, (str, bytes)) else torch.as_tensor(contrast)
    if c is None or c.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"contrast must be a token id or token ids (batch, generated) / (generated,), got "
                        f"{type(contrast).__name__} {contrast!r:.40}; a word's id is "
                        "tokenizer.convert_tokens_to_ids(word)")
    c = c.long().to(device)
    if c.dim() == 1:
        c = c.expand(batch, -1)
    if tuple(c.shape) != (batch, generated):
        raise ValueError(f"contrast of shape {tuple(c.shape)}: expected (batch, generated) = {(batch, generated)}, "
                         "one alternative token per step")
    return c


def _step_target(kind: str, token: torch.Tensor, position: int, alt: Optional[torch.Tensor]):
    if kind == "logit":
        return T.Logit(token, position) if alt is None else T.LogitDiff(token, alt, position)
    return T.LogProb(token, position, contrast=alt, prob=kind == "prob")


def _cut_baseline(baseline, seq: int, length: int):
    """A tensor baseline covers the whole sequence (prompt and generated tokens): each
    chunk gets its first ``length`` positions."""
    if not isinstance(baseline, torch.Tensor):
        return baseline
    if baseline.dim() < 2 or baseline.shape[-2] != seq:
        raise ValueError(f"baseline of shape {tuple(baseline.shape)}: a tensor baseline covers the whole sequence "
                         f"(prompt and generated tokens, {seq} positions): (batch, {seq}, hidden) or ({seq}, hidden)")
    return baseline[..., :length, :]


@text.text_inputs("generation_relevance", target=None, left=True,
                   tokens_of=lambda r: (r.sequences, r.attention_mask))
def generation_relevance(
    model: nn.Module,
    inputs,
    *,
    max_new_tokens: Optional[int] = None,
    continuation=None,
    generate_kwargs: Optional[dict] = None,
    target: str = "logit",
    contrast=None,
    rules: Optional[RelevanceRules] = None,
    baseline=None,
    attention_mask: Optional[torch.Tensor] = None,
    batch_targets: Optional[int] = None,
    tokenizer=None,
) -> GenerationRelevanceResult:
    """Relevance of every generated token over the prompt and the tokens before it.

    Args:
        model (nn.Module): a Hugging Face causal LM (``model.can_generate()``), or an
            encoder–decoder with its language-model head (the prompt is its source; the
            result a :class:`~pyattr.methods.seq2seq_generation.Seq2SeqGenerationResult`
            over the source and the decoder's inputs).
        inputs (LongTensor[batch, seq] | Mapping): the prompt ids, or a tokenizer output;
            rows of different lengths left-padded (``attention_mask``).
        max_new_tokens (int): generate this many tokens first (greedy unless
            ``generate_kwargs`` say otherwise), then explain them. Or:
        continuation: explain a given continuation, teacher-forced: LongTensor[batch,
            generated] / [generated], or a list of id lists (rows of different lengths).
        generate_kwargs (dict, optional): passed to ``model.generate``.
        target (str): per step, the generated token's ``"logit"`` (default), ``"logprob"``
            or ``"prob"``.
        contrast: an alternative token per step (an int, or LongTensor[batch, generated] /
            [generated]): the target becomes the difference to the alternative's logit
            (log-probability, probability), inseq's contrastive attribution.
        rules (RelevanceRules, optional): as :func:`pyattr.relevance` (default all four
            rules; ``RelevanceRules()`` is gradient × input).
        baseline: as :func:`pyattr.relevance`; a tensor baseline covers the whole sequence
            (prompt and generated tokens): (batch, seq, hidden) or (seq, hidden). On an
            encoder–decoder model ``"zeros"`` or ``"pad"`` at both stacks' entries.
        attention_mask (Tensor[batch, seq], optional): the prompt's mask, with ids.
        batch_targets (int, optional): steps per batched backward; the steps of one
            segment share one forward whatever this is (a segment ends where its cut
            would pass 1.25 times the length its first step needs). Default: measured (:class:`ChunkSizes`): from 8 steps,
            doubled while the seconds per step fall and while the memory each chunk is
            measured to take says the batching adds at most 2 GiB over a single step; the
            first chunk is bounded by a deliberately high estimate
            (:func:`default_batch_targets`). On a model whose forward depends on the
            length it runs at (dynamic-NTK RoPE, LongRoPE) every step runs at its own length
            and this is 1 whatever is asked: a longer cut would change the earlier values.
            On an encoder–decoder model each row's steps share its one forward, run as
            backwards of at most this many steps (default: all at once).
        tokenizer (optional): the model's Hugging Face tokenizer, for text inputs and
            the result's ``tokens`` (each token as a string). Prompts as text (a string
            or list of strings) are left-padded and read without the end-of-text markers
            the tokenizer appends; ``continuation`` may be text too (one string, or one
            per prompt), tokenized with its prompt as one joint text. ``model`` may be a
            hub id, a directory or a bundled name, and ``rules`` a shorthand (``"all"``,
            ``"attnlrp"``, ``"ln"``, ``"none"``), as for :func:`pyattr.relevance`.

    On an encoder–decoder model (T5, BART, Marian, …; see :func:`pyattr.relevance`) the
    inputs are the source; the result is a
    :class:`~pyattr.methods.seq2seq_generation.Seq2SeqGenerationResult` with each step's
    relevance over the source and over the decoder's inputs before it (the generated ×
    (source + target prefix) matrices), from one forward and one batched backward per row;
    ``target``, ``contrast`` (one id, or one per step for every row), ``batch_targets``
    (steps per backward over the row's one forward) and ``baseline`` (``"zeros"`` /
    ``"pad"``) work as here.

    Returns:
        GenerationRelevanceResult. Row ``t`` equals :func:`pyattr.relevance` on the
        sequence up to step ``t``'s token (exclusive) with that token as target.

    Raises:
        ValueError / TypeError: neither or both of ``max_new_tokens`` and ``continuation``;
            a model that cannot generate (not a causal LM); a right-padded prompt; an
            unknown ``target``; ``contrast`` or ``continuation`` of the wrong shape; bad
            ``batch_targets``; prompt ids outside the vocabulary; a prompt (plus
            ``max_new_tokens``, or plus the continuation) longer than the model's position
            table; a generation whose stopping criteria cannot be observed; a non-finite
            model output at a step; everything :func:`pyattr.relevance` refuses.
    """
    model = unwrap(model)
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if (max_new_tokens is None) == (continuation is None):
        raise ValueError("pass exactly one of max_new_tokens= (generate, then explain) and continuation= "
                         "(explain given tokens)")
    if generate_kwargs is not None and continuation is not None:
        raise ValueError("generate_kwargs: a continuation is given, nothing is generated")
    refuse_other_inputs(inputs)
    A.refuse_one_forward_of_steps(model, "generation_relevance")
    if is_encoder_decoder(model):
        batch_targets = core.check_count("batch_targets", batch_targets)

        def step_targets(row, tokens, width, generated):
            alt = _contrast(contrast, 1, generated, tokens.device)
            return [_step_target(target, tokens[t:t + 1], width + t - 1, None if alt is None else alt[0, t:t + 1])
                    for t in range(tokens.shape[0])]

        if contrast is not None and not isinstance(contrast, int):
            c = torch.as_tensor(contrast)
            contrast = c[0] if c.dim() == 2 and c.shape[0] == 1 else c
            if contrast.dim() != 1:
                raise ValueError("contrast: on an encoder–decoder model, one token id or one id per step "
                                 "(generated,), the same for every row")
        return seq2seq_generation_relevance(model, inputs, max_new_tokens, continuation, generate_kwargs,
                                            core.rule_defaults(rules), attention_mask, tokenizer, step_targets,
                                            batch_targets, baseline)
    can = getattr(model, "can_generate", None)
    if not callable(can) or not can():
        raise ValueError(f"model: {type(model).__name__} is not a causal language model (can_generate() is False); "
                         "generation_relevance explains generated tokens")
    batch_targets = core.check_count("batch_targets", batch_targets)
    ids, mask = _as_batch(inputs, attention_mask)
    core.check_token_ids(model, ids)
    ids = ids.to(input_device(model))
    mask = mask.to(ids.device)
    batch, width = ids.shape
    prompt_lengths = mask.sum(1).tolist()
    core.check_length(model, prompt_lengths)
    if continuation is None:
        max_new_tokens = core.check_count("max_new_tokens", max_new_tokens, allow_none=False)
        # refused before generating: generate would carry the rows past the position table
        # (the model reads every token but the last one generated)
        core.check_length(model, [n + max_new_tokens - 1 for n in prompt_lengths], "inputs",
                          f"prompt + max_new_tokens={max_new_tokens} - 1: the last generated token is not read")
        gen, steps = generate(model, ids, mask, max_new_tokens, generate_kwargs)
    else:
        pad = getattr(model.config, "pad_token_id", None)
        gen, steps = _continuation(continuation, batch, ids.device, 0 if pad is None else int(pad))
        core.check_token_ids(model, gen, "continuation")
        core.check_length(model, [n + int(c) - 1 for n, c in zip(prompt_lengths, steps.sum(1).tolist())], "inputs",
                          "prompt + continuation - 1: the last token is not read")
    generated = gen.shape[1]
    if generated == 0:
        raise ValueError("nothing to explain: the continuation is empty (or generation stopped at once)")
    alt = _contrast(contrast, batch, generated, ids.device)
    if alt is not None:
        core.check_token_ids(model, alt, "contrast")
    seqs = torch.cat([ids, gen], 1)
    full_mask = torch.cat([mask, torch.ones_like(gen)], 1)
    seq = seqs.shape[1]
    per_step = P.depends_on_batch(model)
    # a forward that depends on the length it runs at (dynamic-NTK, LongRoPE): a cut after
    # a later step would change every earlier value, so each step runs at its own length,
    # as the per-step loop does (issue 31)
    k = 1 if per_step else batch_targets or default_batch_targets(model, batch, seq, generated)
    chunks = ChunkSizes(k, fixed=batch_targets is not None or per_step, meter=PeakMemory(ids.device))
    rel = torch.zeros(batch, generated, seq, dtype=torch.float32)
    value = torch.full((batch, generated), float("nan"), dtype=torch.float64)
    delta = torch.full((batch, generated), float("nan"), dtype=torch.float64)
    backend = "none"
    t0 = 0
    while t0 < generated:
        t1 = t0 + 1 if per_step else segment_end(width, t0, generated)
        last = width + t1 - 2          # column of the segment's last target (step t1 - 1)
        cut = {"input_ids": seqs[:, : last + 1], "attention_mask": full_mask[:, : last + 1]}
        tg = [_step_target(target, gen[:, t], -(last - (width + t - 1)) - 1, None if alt is None else alt[:, t])
              for t in range(t0, t1)]
        cut_baseline = _cut_baseline(baseline, seq, last + 1)
        if per_step:
            r = relevance(model, cut, target=tg, rules=rules, baseline=cut_baseline)
            chunks.measured(1, 0.0)
        else:
            r = relevance_in_chunks(model, cut, tg, rules, cut_baseline, chunks)
        backend = r.backend
        rel[:, t0:t1, : last + 1] = r.token_relevance.transpose(0, 1).float().cpu()
        value[:, t0:t1] = r.target.transpose(0, 1).double().cpu()
        delta[:, t0:t1] = r.conservation_delta.transpose(0, 1).double().cpu()
        t0 = t1
    check_steps_finite(steps, value)
    # exact zeros: the step's own column and later, padding, and steps that do not exist
    cols = torch.arange(seq)
    own = width + torch.arange(generated)
    rel.masked_fill_(cols[None, None, :] >= own[None, :, None], 0.0)
    rel.masked_fill_(~full_mask.bool().cpu()[:, None, :], 0.0)
    gone = ~steps.cpu()
    rel.masked_fill_(gone[..., None], 0.0)
    value.masked_fill_(gone, float("nan"))
    delta.masked_fill_(gone, float("nan"))
    return GenerationRelevanceResult(
        sequences=seqs, attention_mask=full_mask, prompt_width=width, prompt_length=mask.sum(1),
        token_relevance=rel, target=value, conservation_delta=delta, step_mask=steps.cpu(),
        target_kind=target, contrast=alt is not None, batch_targets=chunks.largest, backend=backend,
    )


def loop_reference(model, sequences: torch.Tensor, attention_mask: Optional[torch.Tensor], prompt_width: int,
                   **kw) -> Dict[str, torch.Tensor]:
    """What a per-step loop of :func:`pyattr.relevance` computes: for each column ``c ≥
    prompt_width`` of ``sequences`` (batch, seq), the relevance of that token's logit over
    the columns before it (one forward and one backward per step). ``kw`` go to
    ``relevance``. Returns ``{"token_relevance" (batch, generated, seq), "target" (batch,
    generated)}``, laid out as :class:`GenerationRelevanceResult`'s fields. The tests'
    oracle and the benchmark's baseline (a)."""
    batch, seq = sequences.shape
    generated = seq - prompt_width
    mask = torch.ones_like(sequences) if attention_mask is None else attention_mask
    rel = torch.zeros(batch, generated, seq)
    val = torch.zeros(batch, generated, dtype=torch.float64)
    for t in range(generated):
        cut = {"input_ids": sequences[:, : prompt_width + t], "attention_mask": mask[:, : prompt_width + t]}
        r = relevance(model, cut, target=T.Logit(sequences[:, prompt_width + t]), **kw)
        rel[:, t, : prompt_width + t] = r.token_relevance.float().cpu()
        val[:, t] = r.target.double().cpu()
    return {"token_relevance": rel, "target": val}
