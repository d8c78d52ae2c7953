"""Checks of the token inputs a method is given as ids (text is tokenized with its mask):
padding without its attention mask, and token type ids the model has no embedding row for."""

from __future__ import annotations

import warnings

import torch
from torch import nn


def warn_padding_without_mask(model: nn.Module, kwargs: dict, name: str, caller: str) -> None:
    """Ids whose first or last column holds the model's pad token, given without an attention
    mask: the pad tokens are read as text and change every number (as transformers' own
    ``warn_if_padding_and_no_attention_mask`` reads it; not where the pad token is also the
    BOS or EOS token, which legitimately starts or ends a row)."""
    ids = kwargs.get("input_ids")
    cfg = getattr(model, "config", None)
    pad = getattr(cfg, "pad_token_id", None)
    if kwargs.get("attention_mask") is not None or not isinstance(ids, torch.Tensor) or ids.dim() != 2 \
            or ids.shape[1] == 0 or not isinstance(pad, int) or ids.is_meta:
        return
    ends = [getattr(cfg, "bos_token_id", None), getattr(cfg, "eos_token_id", None)]
    ends = [i for e in ends for i in (e if isinstance(e, (list, tuple)) else [e])]  # eos may be a list
    if pad in ends:
        return
    if bool((ids[:, [0, -1]] == pad).any()):
        warnings.warn(f"{caller}: {name} hold the pad token (id {pad}) at a row's start or end and no attention_mask "
                      "was given, so the padding is read as text; pass the tokenizer's attention_mask (or text)",
                      UserWarning, stacklevel=4)


def check_token_types(model: nn.Module, kwargs: dict) -> None:
    """``token_type_ids`` the model's token-type embedding has rows for (``config.type_vocab_size``),
    else a ValueError naming them (an id past the table failed inside the model's embedding
    with ``IndexError: index out of range in self``)."""
    types = kwargs.get("token_type_ids")
    rows = getattr(getattr(model, "config", None), "type_vocab_size", None)
    if not isinstance(types, torch.Tensor) or not isinstance(rows, int) or types.numel() == 0 or types.is_meta:
        return
    bad = (types < 0) | (types >= rows)
    if bool(bad.any()):
        raise ValueError(f"token_type_ids: must be in [0, {rows}) (config.type_vocab_size), got "
                         f"{sorted(set(types[bad].tolist()))[:5]}")


#: input names that carry another modality beside the tokens (vision-language and speech models)
MEDIA_WORDS = ("pixel", "image", "video", "audio", "input_features")


def refuse_media_with_tokens(model: nn.Module, kwargs: dict, caller: str) -> None:
    """Token ids together with an image, video or audio input (a vision-language model whose
    text stack has a rule map: Gemma 3, PaliGemma): the model writes the media features over
    the placeholder tokens' embeddings after the word embedding, where relevance is read, so
    those positions would read 0 relevance and the rest would not add up. ValueError."""
    media = sorted(k for k, v in kwargs.items() if v is not None and any(w in k for w in MEDIA_WORDS))
    if media and kwargs.get("input_ids") is not None:
        raise ValueError(f"inputs: {caller}() reads relevance at the token embeddings, and {type(model).__name__} "
                         f"writes its {', '.join(media)} features over the placeholder tokens after them, so those "
                         "positions would read 0 relevance; token inputs with media are not supported (explain the "
                         "text alone, or the media alone on a model that takes it)")
