"""The inputs of an encoder–decoder call, checked: the source, the target prefix the decoder
reads (token ids, rows of different lengths, text, or ``labels`` shifted by the model's
own method), their masks, their vocabularies and lengths, and the two entries where
relevance is read. Every refusal names the argument."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

import pyattr.architectures as A
from pyattr.methods._core.inputs import check_token_ids, max_positions, normalise_inputs
from pyattr.methods._core.taps import mark_entry_streams
from pyattr.methods._core.passes import check_grad_mode, check_parameters_usable

#: inputs that would replace what the explained forward computes from the source
_UNSUPPORTED = ("past_key_values", "cache", "encoder_outputs", "inputs_embeds", "decoder_inputs_embeds")


def entries(model: nn.Module, caller: str = "relevance"):
    """``(Seq2Seq entry of the table, [encoder entry module, decoder entry module])``."""
    mt = A.model_type(model)
    spec = A.SEQ2SEQ.get(mt)
    if spec is None:
        raise ValueError(
            f"{caller}(): {type(model).__name__} (model type {mt!r}) is an encoder–decoder model without a rule map "
            f"and entries; supported encoder–decoders: {sorted(A.SEQ2SEQ)}")
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if not isinstance(head, nn.Module) and A.classifier_head(model) is None:
        raise ValueError(
            f"{caller}(): {type(model).__name__} has neither a language-model head nor a sequence classifier's "
            f"head ({' or '.join(A.CLASSIFIER_HEADS)}: a base model, or another head); encoder–decoder models are "
            "explained through their "
            "conditional-generation class (T5ForConditionalGeneration, BartForConditionalGeneration, MarianMTModel, …) "
            "or their sequence-classification class")
    prefix = A.base_prefix(model)
    out = []
    for side, arch in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        path = A.join(prefix, arch.entry[0])
        mod = A.get_submodule(model, path)
        if mod is None:
            raise ValueError(f"{caller}(): cannot find the {side}'s entry {path!r} in {type(model).__name__}")
        mark_entry_streams(model, arch, mod)
        out.append(mod)
    return spec, out


def check_mask(mask, ids: torch.Tensor, name: str) -> Optional[torch.Tensor]:
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


def not_right_padded(mask: Optional[torch.Tensor]) -> bool:
    """A 0 before a 1 in some row (left padding, or a hole)."""
    return mask is not None and bool((mask.long().cummin(-1).values != mask.long()).any())


def one_per_token(fn, length: int, model: nn.Module, caller: str):
    """A tap body for the encoder's entry that first checks it holds one position per
    source token, then calls ``fn`` (None: leaves the tensor as it is). BigBird-Pegasus'
    block-sparse encoder pads the source itself to whole blocks: its relevance would have
    positions no token of the input has (fail closed)."""
    def checked(t):
        if t.dim() >= 2 and t.shape[1] != length:
            raise ValueError(
                f"{caller}(): {type(model).__name__}'s encoder runs on {t.shape[1]} positions for a source of {length} "
                "tokens (it pads the source itself, as block-sparse attention pads to whole blocks), so its relevance "
                "has positions no input token has; pad the source on the right yourself (attention_mask 0) to a "
                "length the encoder keeps (a multiple of config.block_size), or load it with "
                "attention_type='original_full'")
        return None if fn is None else fn(t)
    return checked


def block_sparse(model: nn.Module) -> bool:
    """The encoder runs block-sparse attention now (BigBird-Pegasus' ``attention_type``, as
    the model has it set): its output on a padded row is not the row alone's (the padded
    length decides the sparse pattern, and a short row alone runs full attention)."""
    get = getattr(model, "get_encoder", None)
    enc = get() if callable(get) else None
    return isinstance(enc, nn.Module) and any(getattr(m, "attention_type", None) == "block_sparse"
                                              for m in enc.modules())


def refuse_shifted_positions(model: nn.Module, spec, masks) -> None:
    """BART-family models number positions absolutely and take no position ids: a 0 before
    a 1 in a mask would shift the real tokens' positions (T5's relative bias does not)."""
    if spec.gated_ff is not None:
        return
    for name, m in masks:
        if not_right_padded(m):
            raise ValueError(
                f"{name}: a 0 before a 1 (left padding, or a hole) on {type(model).__name__} shifts the real tokens' "
                "absolute positions (its forward takes no position ids), so a padded row would not equal the row "
                "alone; pad on the right")


def padded_rows(rows: List[List[int]], pad: int, name: str):
    """Rows of ids of different lengths → ``(LongTensor[batch, longest], mask)``, right-padded."""
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError(f"{name}: every row needs at least one token")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask


def as_id_rows(value, name: str) -> Optional[List[List[int]]]:
    """A list of id lists (rows of different lengths allowed), else None; TypeError for a
    list that mixes other things in."""
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(r, (list, tuple)) for r in value):
        return None
    try:
        return [[int(i) for i in r] for r in value]
    except (TypeError, ValueError):
        raise TypeError(f"{name}: rows of token ids must hold integers only") from None


def _pad_id(model: nn.Module, tokenizer=None) -> int:
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    pad = pad if pad is not None else getattr(getattr(model, "config", None), "pad_token_id", None)
    return int(pad) if isinstance(pad, int) else 0


def shift_labels(model: nn.Module, labels: torch.Tensor, name: str) -> torch.Tensor:
    """The decoder's inputs the model makes from ``labels`` (LongTensor[batch, n], right-padded
    with the pad id) for teacher forcing: its own ``prepare_decoder_input_ids_from_labels``
    (the decoder start first, the last label dropped; mBART wraps each row's last real label,
    its language code, to the front), or, where the model has none (M2M100 / NLLB shift in
    their forward), the ids its decoder receives in a forward given ``labels`` alone, stopped
    there: observed, not re-derived."""
    shift = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(shift):
        return shift(labels=labels)
    source = torch.zeros(labels.shape[0], 1, dtype=torch.long, device=labels.device)  # any source: the encoder's
    try:                                                                                # output is not read
        return derived_decoder_ids(model, {"input_ids": source, "labels": labels}, name)
    except ValueError:
        raise ValueError(f"{name}: {type(model).__name__} has no prepare_decoder_input_ids_from_labels, and its "
                         "forward makes no decoder inputs from labels; pass decoder_input_ids as token ids") from None


def shifted(model: nn.Module, rows: List[torch.Tensor], name: str, tokenizer=None):
    """Each row of labels shifted by the model's own teacher-forcing shift
    (:func:`shift_labels`), right-padded with a mask."""
    return padded_rows([shift_labels(model, r.reshape(1, -1), name)[0].tolist() for r in rows],
                       _pad_id(model, tokenizer), name)


def decoder_inputs_from_text(model: nn.Module, tokenizer, text, rows: int):
    """``(decoder_input_ids, decoder_attention_mask)`` of a target text (one string, or one
    per row): each row's labels as the tokenizer makes them (``text_target=``, with the
    language codes and end-of-text marker it adds), then the model's own teacher-forcing
    shift, rows padded on the right. The logit at a row's last decoder position predicts
    its last label (the end-of-text marker for a whole sentence)."""
    if tokenizer is None:
        raise ValueError("decoder_input_ids: the target prefix is text; pass tokenizer= (the model's tokenizer)")
    texts = [text] * rows if isinstance(text, str) else list(text)
    if len(texts) != rows or not all(isinstance(t, str) and t.strip() for t in texts):
        raise ValueError(f"decoder_input_ids: expected one non-empty target text, or one per source row ({rows}), "
                         f"got {text!r}")
    labels = [torch.as_tensor(tokenizer(text_target=t)["input_ids"], dtype=torch.long) for t in texts]
    return shifted(model, labels, "decoder_input_ids", tokenizer)


def check_decoder_ids(model: nn.Module, ids: torch.Tensor, name: str) -> None:
    """Ids the decoder's own embedding has rows for (Marian may size it apart from the encoder's)."""
    get = getattr(model, "get_decoder", None)
    dec = get() if callable(get) else None
    emb = getattr(dec, "embed_tokens", None)
    rows = getattr(emb, "num_embeddings", None)
    if not isinstance(rows, int):
        check_token_ids(model, ids, name)
        return
    bad = (ids < 0) | (ids >= rows)
    if bool(bad.any()):
        raise ValueError(f"{name}: token ids must be in [0, {rows}) (the decoder's input embedding), "
                         f"got {sorted(set(ids[bad].tolist()))[:5]}")


def check_length(model: nn.Module, length: int, name: str) -> None:
    limit = max_positions(model)
    if limit is not None and length > limit:
        raise ValueError(f"{name}: {length} positions, but {type(model).__name__} reads at most {limit} "
                         "(config.max_position_embeddings)")


def _decoder_ids(model, kwargs, src, decoder_input_ids, decoder_attention_mask, tokenizer, caller):
    if decoder_input_ids is None:
        decoder_input_ids = kwargs.pop("decoder_input_ids", None)
    else:
        kwargs.pop("decoder_input_ids", None)
    if decoder_attention_mask is None:
        decoder_attention_mask = kwargs.pop("decoder_attention_mask", None)
    else:
        kwargs.pop("decoder_attention_mask", None)
    labels = kwargs.pop("labels", None)
    if A.classifier_head(model) is not None:
        labels = None  # a classifier's labels are classes (its loss's), not a target text
    if decoder_input_ids is None and labels is not None:
        lab = torch.as_tensor(labels)
        lab = lab.unsqueeze(0) if lab.dim() == 1 else lab
        # -100 marks padding in labels (the loss's ignore index): each row's real labels, shifted
        return shifted(model, [r[r != -100] for r in lab], "labels", tokenizer)
    if isinstance(decoder_input_ids, str) or (isinstance(decoder_input_ids, (list, tuple)) and decoder_input_ids
                                              and all(isinstance(t, str) for t in decoder_input_ids)):
        if decoder_attention_mask is not None:
            raise ValueError("decoder_attention_mask: the target prefix is text, whose mask the tokenizer gives; "
                             "pass decoder_attention_mask= only with token ids")
        return decoder_inputs_from_text(model, tokenizer, decoder_input_ids, src.shape[0])
    if decoder_input_ids is None:
        # the model's own shift of the source: the same length, its real positions the
        # source's (a right-padded row's last real decoder position is the row alone's), so
        # the source mask masks the decoder's pads unless the caller gave a decoder mask
        derived = derived_decoder_ids(model, kwargs, caller)
        if decoder_attention_mask is None and kwargs.get("attention_mask") is not None \
                and tuple(kwargs["attention_mask"].shape) == tuple(derived.shape):
            decoder_attention_mask = kwargs["attention_mask"]
        return derived, decoder_attention_mask
    rows = as_id_rows(decoder_input_ids, "decoder_input_ids")
    if rows is not None and len({len(r) for r in rows}) > 1:
        if decoder_attention_mask is not None:
            raise ValueError("decoder_attention_mask: the rows of decoder_input_ids have different lengths and are "
                             "padded here; pass the mask only with a tensor")
        return padded_rows(rows, _pad_id(model, tokenizer), "decoder_input_ids")
    try:
        dec = torch.as_tensor(rows if rows is not None else decoder_input_ids)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError("decoder_input_ids must be token ids: a LongTensor[batch, target_len], a list of ints or of "
                        f"rows of ints, or text with tokenizer=; got {type(decoder_input_ids).__name__}") from None
    return dec, decoder_attention_mask


def no_cache(model: nn.Module) -> dict:
    """``use_cache=False`` where the model's forward names it (T5Gemma's classifier passes
    its own and takes none)."""
    import inspect

    try:
        named = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        named = False
    return {"use_cache": False} if named else {}


class _Seen(Exception):
    """Stops the observing forward once the decoder's inputs are seen."""


def derived_decoder_ids(model: nn.Module, kwargs: dict, caller: str) -> torch.Tensor:
    """The target prefix the model makes itself from the source when none is given (BART,
    mBART, PLBART and MVP shift ``input_ids`` right: their denoising use, and their
    classifiers'), read back from the ids its decoder receives in a forward that stops
    there — observed, not re-derived. A model that makes none (T5, Marian) is refused."""
    get = getattr(model, "get_decoder", None)
    dec = get() if callable(get) else None
    need = ValueError(
        f"{caller}(): {type(model).__name__} is an encoder–decoder model that does not make its decoder's inputs "
        "from the source: pass the target prefix as decoder_input_ids (LongTensor[batch, target_len], starting with "
        "the decoder start token), as text with tokenizer=, or labels in the inputs; the explained value is read on "
        "the decoder side")
    if not isinstance(dec, nn.Module):
        raise need
    seen: List[torch.Tensor] = []

    def pre(mod, args, kw):
        ids = kw.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):
            seen.append(ids.detach().clone())
        raise _Seen()

    handle = dec.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**{k: v for k, v in kwargs.items() if k in ("input_ids", "attention_mask", "labels")},
                  **no_cache(model))
    except _Seen:
        pass
    except (ValueError, TypeError) as e:  # the model's own refusal to run without decoder inputs
        raise ValueError(f"{need} (the model's forward said: {' '.join(str(e).split())[:200]})") from e
    finally:
        handle.remove()
    if not seen:
        raise need
    return seen[0]


def prepare(model: nn.Module, inputs, attention_mask, decoder_input_ids, decoder_attention_mask, caller: str,
            tokenizer=None):
    """``(kwargs, decoder ids, decoder mask, [encoder entry, decoder entry])``: the model's
    kwargs with the source (``input_ids``, ``attention_mask``) and the target prefix
    (``decoder_input_ids``: given as ids or text, from the inputs, or from ``labels`` as the
    model shifts them itself)."""
    check_grad_mode(caller)
    kwargs = normalise_inputs(inputs, attention_mask)
    check_parameters_usable(model, caller)
    for key in _UNSUPPORTED:
        if kwargs.get(key) is not None:
            raise ValueError(f"inputs: {key} is not supported on encoder–decoder models (the explained forward "
                             "computes the encoder's output and the decoder's keys and values from the source itself)")
    src = kwargs["input_ids"]
    spec, ents = entries(model, caller)
    dec, dmask = _decoder_ids(model, kwargs, src, decoder_input_ids, decoder_attention_mask, tokenizer, caller)
    if dec.dim() == 1:
        dec = dec.unsqueeze(0)
    if dec.dtype not in (torch.int64, torch.int32) or dec.dim() != 2 or dec.shape[1] == 0:
        raise TypeError(f"decoder_input_ids must be an integer tensor of shape (batch, target_len) with "
                        f"target_len > 0, got {dec.dtype} of shape {tuple(dec.shape)}")
    if dec.shape[0] != src.shape[0]:
        raise ValueError(f"decoder_input_ids has {dec.shape[0]} rows, the source (input_ids) has {src.shape[0]}")
    dmask = check_mask(dmask, dec, "decoder_attention_mask")
    check_token_ids(model, src, "inputs")
    check_decoder_ids(model, dec, "decoder_input_ids")
    check_length(model, src.shape[1], "inputs")
    check_length(model, dec.shape[1], "decoder_input_ids")
    refuse_shifted_positions(model, spec, (("attention_mask", kwargs.get("attention_mask")),
                                           ("decoder_attention_mask", dmask)))
    smask = kwargs.get("attention_mask")
    if smask is not None and not bool(torch.as_tensor(smask).bool().all()) and block_sparse(model):
        raise ValueError(f"attention_mask: {type(model).__name__}'s encoder runs block-sparse attention, whose output "
                         "on a padded row is not the row alone's (the padded length chooses the sparse pattern); "
                         "explain the rows one at a time, or load the model with attention_type='original_full'")
    kwargs["decoder_input_ids"] = dec
    if dmask is not None:
        A.refuse_padded_streams(model, dmask, "decoder_attention_mask", caller)
        kwargs["decoder_attention_mask"] = dmask
    kwargs.update(no_cache(model))
    return kwargs, dec, dmask, ents
