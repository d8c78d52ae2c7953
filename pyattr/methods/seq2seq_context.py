"""Context attribution on encoder–decoder models (:func:`pyattr.context_attribution`): the
sources are spans of the source text (the encoder's input), the response is what the
decoder reads after its own start token (teacher-forced: a given target text or ids, or
the steps ``generate`` ran).

What each method reads:

- ablations (``foldover``, ``contextcite``, ``loo``): the source without the dropped
  sources' tokens (right-padded in a batch, with its attention mask), the decoder's
  inputs unchanged, the response's log-probability from the decoder's logits;
- ``attnlrp`` / ``relevance`` / ``gradient``: the source relevance of each response
  token's log-probability (:func:`pyattr.relevance` on the encoder–decoder, one batched
  backward for every response token), summed over each source's tokens;
- ``attention``: the decoder's cross-attention weights from the positions that predict
  the response to each source, averaged over layers and heads.

The decoder's start is observed, not re-derived: ``generate``'s own first columns for a
generated response, else the model's own teacher-forcing shift of the response.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import nn

import pyattr.methods._core.ablation as A
import pyattr.methods._core.context_inputs as CI
import pyattr.methods.seq2seq_inputs as SI
from pyattr._module_state import kept_state
from pyattr.methods._core.tokens import refuse_unknown


def source_of(model: nn.Module, tokenizer, text_or_ids):
    """``(ids, offsets, special flags, text)`` of the source: a text as the tokenizer encodes
    it for the encoder, its markers kept (``</s>``, a language code: the encoder was trained
    on them) and in no source; or one row of ids."""
    from pyattr.methods._core.tokens import _encode

    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise ValueError("inputs: a text source needs tokenizer= (the model's Hugging Face tokenizer)")
        ids, appended, offsets = _encode(tokenizer, text_or_ids, markers="tokenizer")
        special = appended if offsets is None else [e <= s for s, e in offsets]
        ids = [int(i) for i in ids]
        SI.check_length(model, len(ids), "inputs")
        return ids, offsets, special, text_or_ids
    ids, offsets, special, text, _ = CI.prompt_of(model, tokenizer, text_or_ids, None, "inputs", embedding=True)
    SI.check_length(model, len(ids), "inputs")
    return ids, offsets, special, text


def _start(model: nn.Module, response: List[int]) -> List[int]:
    """The decoder's start column, as the model's own teacher-forcing shift of the whole
    response puts it (``decoder_start_token_id``; mBART's: the response's last token, its
    language code), :func:`pyattr.methods.seq2seq_inputs.shift_labels`."""
    return SI.shift_labels(model, torch.tensor([list(response)]), "response")[0, :1].tolist()


def response_of(model: nn.Module, tokenizer, source: Sequence[int], response, max_new_tokens, row: int):
    """``(decoder prefix ids, response ids)``: a target text read as the target side
    (``text_target=``, the markers the tokenizer adds included, as
    :func:`pyattr.generation_relevance` reads one), ids, or ``max_new_tokens`` generated
    (greedy, the steps ``generate``'s stopping criteria kept)."""
    if response is None:
        SI.check_length(model, 1 + max_new_tokens if isinstance(max_new_tokens, int) else 1, "max_new_tokens")
        prefix: list = []
        ids = CI.generated(model, source, max_new_tokens, prefix)
        return prefix[0][0].tolist(), ids
    if isinstance(response, str):
        if tokenizer is None:
            raise ValueError(f"response[{row}]: a text response needs tokenizer=")
        if not response.strip():
            raise ValueError("response: the text is empty")
        ids = [int(i) for i in tokenizer(text_target=response)["input_ids"]]
        refuse_unknown(tokenizer, ids, response, f"response[{row}]")
    else:
        ids = CI.ids_of(None, response, f"response[{row}]")
    SI.check_decoder_ids(model, torch.tensor([ids]), f"response[{row}]")
    prefix = _start(model, ids)
    SI.check_length(model, len(prefix) + len(ids) - 1, f"response[{row}]")
    return prefix, ids


def _decoder_inputs(prefix, response, device) -> Tuple[torch.Tensor, int]:
    """The decoder's inputs (its start, the response but its last token) and the column
    that predicts the response's first token."""
    return torch.tensor([list(prefix) + list(response)[:-1]], device=device), len(prefix) - 1


def _span_sums(lp: torch.Tensor, spans) -> torch.Tensor:
    """``lp`` (…, response) summed per response span → (…, spans)."""
    return torch.stack([lp[..., a:b].sum(-1) for a, b in spans], -1)


@torch.no_grad()
def response_logprobs(model: nn.Module, source, ranges, prefix, response, masks: torch.Tensor, spans,
                      batch_size: int = 64) -> torch.Tensor:
    """The response's log-probability (float64, nats) per keep-mask (Tensor[n, S]) and
    span: the source without each mask's dropped sources, the decoder's inputs as they are.

    Returns:
        Tensor[n, len(spans)], float64.
    """
    rows = A.ablated_rows(source, ranges, [], masks)
    device = next(model.parameters()).device
    dec, first = _decoder_inputs(prefix, response, device)
    r = len(response)
    resp = torch.as_tensor(list(response), device=device)
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    out = torch.empty(len(rows), len(spans), dtype=torch.float64)
    if SI.block_sparse(model):
        batch_size = 1  # a padded row is not the row alone under block-sparse attention
    for lo in range(0, len(rows), batch_size):
        ids, mask = SI.padded_rows(rows[lo:lo + batch_size], pad if isinstance(pad, int) else 0, "inputs")
        n = ids.shape[0]
        kwargs = {"input_ids": ids.to(device), "attention_mask": mask.to(device),
                  "decoder_input_ids": dec.expand(n, -1)}
        # each ablated source as the model runs it fresh (BigBird switches itself to full
        # attention on a short source, for every later call)
        with kept_state(model):
            logits = model(**kwargs, **SI.no_cache(model)).logits[:, first:first + r]
        # float64: the logit-probability of a near-certain token is a small difference of large terms
        lp = logits.double().log_softmax(-1).gather(-1, resp[None, :, None].expand(n, -1, 1))[..., 0].cpu()
        out[lo:lo + n] = _span_sums(lp, spans)
    return A.check_values(out)


def relevance_scores(model: nn.Module, source, ranges, prefix, response, spans, method: str):
    """``(scores Tensor[spans, sources], log-probability per span)``: each response token's
    log-probability explained over the source (one batched backward, the targets ``k`` per
    row), summed over each source's tokens and each span's tokens."""
    from pyattr.config import RelevanceRules
    from pyattr.methods.seq2seq import seq2seq_relevance
    import pyattr.targets as T

    rules = {"attnlrp": RelevanceRules.all("attnlrp"), "relevance": RelevanceRules.all(),
             "gradient": RelevanceRules()}[method]
    _, (entry, _) = SI.entries(model, "context_attribution")
    if method == "gradient" and (isinstance(entry, nn.LayerNorm) or type(entry).__name__.endswith(("LayerNorm",
                                                                                                 "RMSNorm"))):
        # source relevance is read at a norm's input (BART's, mBART's embedding LayerNorm): no
        # token's own scale changes the norm's output, so x · ∂f/∂x there is 0 token by token
        # (up to the norm's eps)
        raise ValueError(f"method='gradient': gradient × input is zero on {type(model).__name__}'s source up to "
                         "rounding (the source enters through a LayerNorm, which no token's own scale changes); "
                         "use 'relevance' or 'attnlrp', whose LN-rule passes relevance through that norm")
    device = next(model.parameters()).device
    dec, first = _decoder_inputs(prefix, response, device)
    src = torch.tensor([list(source)], device=device)
    tgts = [T.LogProb(torch.tensor([tok]), first + t) for t, tok in enumerate(response)]
    res = seq2seq_relevance(model, {"input_ids": src, "attention_mask": torch.ones_like(src)}, tgts, rules,
                            decoder_input_ids=dec, caller="context_attribution")
    tok = res.source_relevance[:, 0].double().cpu()           # (response, source)
    lp = res.target[:, 0].double().cpu()
    per = torch.stack([tok[:, a:b].sum(-1) for a, b in ranges], -1)
    return torch.stack([per[a:b].sum(0) for a, b in spans]), _span_sums(lp, spans)


@torch.no_grad()
def attention_scores(model: nn.Module, source, ranges, prefix, response, spans):
    """``(scores Tensor[spans, sources], log-probability per span)`` from the decoder's
    cross-attention weights at the positions that predict the response."""
    device = next(model.parameters()).device
    dec, first = _decoder_inputs(prefix, response, device)
    src = torch.tensor([list(source)], device=device)
    out = model(input_ids=src, decoder_input_ids=dec, output_attentions=True, **SI.no_cache(model))
    cross = getattr(out, "cross_attentions", None)
    if not cross or any(a is None for a in cross):
        raise ValueError("method='attention': the model returned no cross-attention weights (load it with "
                         "attn_implementation='eager', or call model.set_attn_implementation('eager'))")
    if cross[0].shape[-2] != dec.shape[1]:
        raise ValueError(
            f"method='attention': {type(model).__name__}'s cross-attention has {cross[0].shape[-2]} rows for "
            f"{dec.shape[1]} decoder positions (its decoder runs more streams than the tokens', as ProphetNet's "
            "predicting streams), so its rows are not one per response position; use 'attnlrp' or 'relevance'")
    att = torch.stack([a[0].double().mean(0) for a in cross]).mean(0).cpu()   # (decoder, source)
    rows = att[first:first + len(response)]
    per = torch.stack([rows[:, a:b].sum(-1) for a, b in ranges], -1)
    lp = out.logits[0, first:first + len(response)].double().log_softmax(-1).cpu()
    lp = lp.gather(-1, torch.tensor(list(response))[:, None])[:, 0]
    return torch.stack([per[a:b].sum(0) for a, b in spans]), _span_sums(lp, spans)
