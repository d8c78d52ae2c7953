"""Perturbation curves on encoder–decoder models (:func:`pyattr.evaluate.perturbation_curve`):
the source tokens (the encoder's input) are ranked by their relevance and perturbed level
by level; the decoder's inputs (the target prefix) stay as given, so every level explains
the same decoder-side value with less of the source.

A perturbation acts where it acts on one stack, on the encoder: ``zero_embedding`` sets the
perturbed positions to 0 where the encoder's residual stream enters its first block (where
source relevance is measured), ``mean_embedding`` replaces the encoder's input embedding
output there by its mean over the vocabulary, ``pad`` / ``mask`` replace the source ids.
The source's attention mask stays the unperturbed one.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import pyattr.methods._core as core
import pyattr.methods.seq2seq_inputs as SI
import pyattr.methods.seq2seq_targets as ST
import pyattr.targets as T
from pyattr.evaluate.levels import checked_relevance, perturbed_masks
from pyattr.methods._core.forward import evaluate_targets


def source_relevance(relevance, shape) -> torch.Tensor:
    """Tensor[batch, source_len]: a Seq2Seq result's source relevance (``source_relevance``,
    ``source_attribution``) or a tensor of that shape, finite and floating."""
    for name in ("source_relevance", "source_attribution"):
        if hasattr(relevance, name):
            relevance = getattr(relevance, name)
            break
    else:
        if hasattr(relevance, "token_relevance") or hasattr(relevance, "token_attribution"):
            raise TypeError("relevance: on an encoder–decoder model, a result with source_relevance (relevance(), "
                            "integrated_gradients() on the model) or a Tensor[batch, source_len]; got a one-stack "
                            f"{type(relevance).__name__}")
    if not isinstance(relevance, torch.Tensor):
        raise TypeError("relevance must be a Tensor[batch, source_len] or a result with source_relevance / "
                        f"source_attribution, got {type(relevance).__name__}")
    return checked_relevance(relevance, shape, "the source", "(batch, source_len), one value per source token")


def _encoder_embedding(model: nn.Module) -> nn.Module:
    enc = model.get_encoder() if callable(getattr(model, "get_encoder", None)) else None
    emb = _own_embedding(enc)
    if not isinstance(emb, nn.Module):
        raise ValueError(f"perturbation='mean_embedding': cannot find the encoder's token embedding (its "
                         f"get_input_embeddings() or embed_tokens) of {type(model).__name__}; use 'zero_embedding'")
    return emb


def _own_embedding(stack) -> "nn.Module | None":
    """The token embedding a stack reports as its own (``get_input_embeddings()``: ProphetNet's
    ``word_embeddings``), else its ``embed_tokens``."""
    get = getattr(stack, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        emb = None
    if isinstance(getattr(emb, "weight", None), torch.Tensor):
        return emb
    emb = getattr(stack, "embed_tokens", None)
    return emb if isinstance(emb, nn.Module) else None


@torch.no_grad()
def seq2seq_curve(model: nn.Module, inputs, relevance, target, order: str, perturbation: str, steps: int,
                  batch_size: int, replace_id, attention_mask, decoder_input_ids, decoder_attention_mask,
                  tokenizer, mean_of):
    """``(values Tensor[batch, steps + 1] float64, masks)`` of the decoder-side target as the
    source is perturbed (``mean_of(embedding module)``: the vocabulary mean of an input
    embedding, :func:`pyattr.evaluate.perturbation._vocabulary_mean`)."""
    from pyattr.methods.seq2seq import _words_to_ids

    kwargs, dec, dmask, (enc_entry, _) = SI.prepare(model, inputs, attention_mask, decoder_input_ids,
                                                    decoder_attention_mask, "perturbation_curve", tokenizer)
    src = kwargs["input_ids"]
    batch, seq = src.shape
    rel = source_relevance(relevance, (batch, seq)).to(src.device)
    tgts, several = T.normalize(_words_to_ids(target, tokenizer), batch)
    if several:
        raise ValueError("target: a perturbation curve scores one target per row, got k targets per row")
    side = ST.side_of(model, tgts, "perturbation_curve")
    smask = kwargs.get("attention_mask")
    real = smask.bool() if smask is not None else torch.ones(batch, seq, dtype=torch.bool, device=src.device)
    levels = perturbed_masks(rel, real, order, steps)
    values = torch.empty(batch, steps + 1, dtype=torch.float64)
    emb = _encoder_embedding(model) if perturbation == "mean_embedding" else None
    mean = mean_of(emb) if emb is not None else None
    with core.inference_state(model):
        with core.tap(enc_entry, "input", SI.one_per_token(None, seq, model, "perturbation_curve"), once=True), \
                ST.recording(model, tgts, store := {}):
            out = model(**kwargs)
        _, _, fixed = evaluate_targets(tgts, ST.forward(side, out, kwargs, store), False)
        pairs = torch.cartesian_prod(torch.arange(batch), torch.arange(steps + 1)).reshape(-1, 2)
        for chunk in pairs.split(batch_size):
            r, lv = chunk[:, 0].to(src.device), chunk[:, 1].to(src.device)
            mask = levels[r, lv]
            kw = {k: (v[r] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch else v)
                  for k, v in kwargs.items()}
            if replace_id is not None:
                kw["input_ids"] = kw["input_ids"].masked_fill(mask, replace_id)
                tap = contextlib.nullcontext()
            elif perturbation == "zero_embedding":
                tap = core.tap(enc_entry, "input", lambda t, m=mask: t.masked_fill(m[..., None], 0.0), once=True)
            else:  # mean_embedding, at the encoder's own embedding (a shared table is also the decoder's)
                tap = core.tap(emb, "output",
                               lambda t, m=mask: torch.where(m[..., None], mean.to(device=t.device, dtype=t.dtype), t),
                               once=True)
            tg = [t.rows(r, batch) for t in fixed]
            with tap, ST.recording(model, tg, store := {}):
                o = model(**kw)
            value, _, _ = evaluate_targets(tg, ST.forward(side, o, kw, store), False)
            values[r.cpu(), lv.cpu()] = value.double().cpu()
    return values
