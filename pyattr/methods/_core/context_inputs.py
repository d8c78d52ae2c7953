"""What :func:`pyattr.context_attribution` reads from its arguments: the prompt's token ids
(with the tokenizer's offsets and special-token flags), the response or query ids, the
response spans, and whether the model is a causal LM or a sentence-embedding model."""

from __future__ import annotations

import contextlib
from typing import List

import torch
from torch import nn

import pyattr.methods._core.sources as S


def named_model(model, tokenizer, query):
    """``(model, tokenizer)``: a model given by name or directory (a bundled name, a local
    directory, a hub id) loaded as the other methods load one, as the class its checkpoint
    names, or the base model when a ``query`` asks for an embedding; else as given."""
    if not (isinstance(model, str) or hasattr(model, "__fspath__")):
        return model, tokenizer
    from pyattr.hub import load_pretrained

    tok, loaded = load_pretrained(model, causal=False if query is not None else None)
    return loaded, tokenizer if tokenizer is not None else tok


def prompt_of(model, tokenizer, text_or_ids, response, name, embedding=False, spec=None):
    """(prompt ids, offsets, special flags, text, response ids or None). An embedding model's
    prompt keeps the markers the tokenizer adds at its end (``[SEP]``): its embedding is of
    the text as the tokenizer encodes it, after the document prompt its checkpoint declares
    (``spec``, :class:`~pyattr.methods._core.embedding.SentenceEmbedding`: the prompt's tokens
    belong to no source, offsets stay the text's own); a causal LM's prompt drops them (the
    response continues the text, not what follows its end)."""
    from pyattr.methods._core.tokens import _drop_appended_end, _encode, continuation_ids

    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise ValueError(f"{name}: a text prompt needs tokenizer= (the model's Hugging Face tokenizer)")
        if embedding and spec is not None:
            # the text as sentence-transformers tokenizes it: the tokenizer's own markers, as they are
            read, at = spec.text(text_or_ids, "document")
            enc = _offsets_after(read, at, _encode(tokenizer, read, markers="tokenizer"))
        else:
            enc = _encode(tokenizer, text_or_ids)
        ids, appended, offsets = enc if embedding else _drop_appended_end(*enc)
        special = appended if offsets is None else [e <= s for s, e in offsets]
        resp = None
        if isinstance(response, str) and not response.strip():
            raise ValueError(f"{'query' if embedding else 'response'}: the text is empty")
        if isinstance(response, str) and not embedding:
            try:
                joint_prompt, resp = continuation_ids(tokenizer, text_or_ids, response)
            except ValueError as e:  # its messages name the continuation: here it is the response
                text = str(e)
                raise ValueError("response" + text[len("continuation"):] if text.startswith("continuation") else text
                                 ) from None
            if joint_prompt != ids:
                raise ValueError("response: the tokenizer reads the prompt's end differently when the response "
                                 "follows it; start the response at a word")
        return ids, offsets, special, text_or_ids, resp
    if hasattr(text_or_ids, "keys") and "input_ids" in text_or_ids:
        # a tokenizer's output (apply_chat_template(..., tokenize=True) returns one): its ids,
        # the real tokens where it carries an attention mask
        ids, mask = text_or_ids["input_ids"], text_or_ids.get("attention_mask") if hasattr(text_or_ids, "get") else None
        t = torch.as_tensor(ids).reshape(-1) if _one_row(ids) else None
        if t is None:
            raise ValueError(f"{name}: a tokenizer output of one prompt is expected here (input_ids of one row); "
                             "for several prompts pass a list of texts")
        if mask is not None:
            t = t[torch.as_tensor(mask).reshape(-1).bool()]
        text_or_ids = t
    try:
        t = torch.as_tensor(text_or_ids)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name}: expected a text, a list of texts, or one prompt's token ids (LongTensor[seq] "
                         f"or [1, seq]), got {type(text_or_ids).__name__}") from None
    if t.is_floating_point() or t.dtype == torch.bool or t.dim() not in (1, 2) or (
            t.dim() == 2 and t.shape[0] != 1) or t.numel() == 0:
        raise ValueError(f"{name}: expected a text, or one prompt's token ids (LongTensor[seq] or [1, seq]), got "
                         f"{t.dtype} of shape {tuple(t.shape)}")
    from pyattr.methods._core.inputs import check_token_ids

    check_token_ids(model, t, name)
    return t.reshape(-1).tolist(), None, None, None, None


def _offsets_after(read: str, at: int, enc):
    """``(ids, appended, offsets)`` of ``read`` (a prompt of ``at`` characters, then the
    text) with the offsets made the text's own: a token of the prompt gets ``(0, 0)`` (no
    character of the text: in no source), one that starts in the prompt's trailing
    whitespace starts at the text's first character."""
    ids, appended, offsets = enc
    if offsets is None or not at:
        return enc
    out = []
    for s, e in offsets:
        if e <= s or e <= at or (s < at and not read[s:at].isspace()):
            out.append((0, 0))
        else:
            out.append((max(s, at) - at, e - at))
    return ids, appended, out


def _one_row(ids) -> bool:
    try:
        t = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError):
        return False
    return t.dim() == 1 or (t.dim() == 2 and t.shape[0] == 1)


def generated(model, prompt, max_new_tokens, prefix=None) -> List[int]:
    """The response ``generate`` gives after ``prompt`` (greedy, the steps its stopping
    criteria kept); ``prefix`` (a list, encoder–decoders) receives the decoder's start."""
    if max_new_tokens is None or max_new_tokens < 1:
        raise ValueError("context_attribution: give response= (text or token ids) or max_new_tokens= (>= 1) "
                         "to generate it")
    from pyattr.architectures import streams_decoder
    from pyattr.methods._core.generate import generate

    if streams_decoder(model) is not None:
        raise ValueError(
            f"max_new_tokens: {type(model).__name__}'s logits depend on the length of its decoder input (its predicting "
            "streams' position bias is gathered by a length-dependent index), so the response's log-probability "
            "explained in one teacher-forced forward is not the one that generated it; pass response= to explain "
            "the teacher-forced log-probability of a given response")
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    with generation_config_named():
        gen, steps = generate(model, ids, torch.ones_like(ids), max_new_tokens, None, prefix=prefix)
    return gen[0][steps[0].to(gen.device)].tolist()


def joint_ids(model, prompt, response) -> torch.Tensor:
    """LongTensor[1, prompt + response] on the model's device, after the length check (the
    last response token is read by no position that predicts one)."""
    from pyattr.methods._core.inputs import check_length

    check_length(model, [len(prompt) + len(response) - 1], "inputs", "the prompt and the response but its last token")
    return torch.tensor([list(prompt) + list(response)], device=next(model.parameters()).device)


def response_ids(model, prompt, response, max_new_tokens, row):
    if response is None:
        return generated(model, prompt, max_new_tokens)
    if isinstance(response, str):
        raise ValueError(f"response[{row}]: a text response needs the prompt as text with tokenizer=")
    return ids_of(model, response, f"response[{row}]")


@contextlib.contextmanager
def generation_config_named():
    """context_attribution has no ``generate_kwargs``: a generation config it cannot run
    (beams, several sequences, assisted decoding) is named as the model's, with what to do."""
    try:
        yield
    except ValueError as e:
        text = str(e)
        if not text.startswith("generate_kwargs: "):
            raise
        why = text[len("generate_kwargs: "):].split(" (pass them in generate_kwargs")[0]
        raise ValueError(f"max_new_tokens: context_attribution generates one greedy sequence with the model's "
                         f"generation config, and it cannot here ({why}); set model.generation_config (num_beams=1, "
                         "num_return_sequences=1, no assisted decoding) or pass the response= to explain") from None


def check_spans(spans, length: int):
    if spans is None:
        return [(0, length)]
    if isinstance(spans, str):
        if spans != "tokens":
            raise ValueError(f"spans: expected 'tokens', a list of response token ranges (start, end) or None, "
                             f"got {spans!r}")
        return [(i, i + 1) for i in range(length)]
    if not isinstance(spans, (list, tuple)) or not spans:
        raise ValueError(f"spans: expected 'tokens', a non-empty list of response token ranges (start, end) or "
                         f"None, got {spans!r}")
    return S.check_ranges(spans, length, "spans", "the response's")


def ids_of(model, value, name: str) -> List[int]:
    """One sequence of token ids: a list of ints, a LongTensor[n] or [1, n], or one id."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is not None and t.dim() == 0 and not t.is_floating_point() and t.dtype != torch.bool:
        t = t.reshape(1)  # one token id
    if t is None or t.is_floating_point() or t.dtype == torch.bool or t.dim() not in (1, 2) or (
            t.dim() == 2 and t.shape[0] != 1) or t.numel() == 0:
        got = f"{t.dtype} of shape {tuple(t.shape)}" if t is not None else type(value).__name__
        raise ValueError(f"{name}: expected a text or one sequence of token ids (a non-empty list of ints, "
                         f"LongTensor[n] or [1, n]), got {got}")
    t = t.reshape(-1)
    if model is not None:
        from pyattr.methods._core.inputs import check_token_ids

        check_token_ids(model, t, name)
    return t.tolist()


def has_lm_head(model: nn.Module) -> bool:
    get = getattr(model, "get_output_embeddings", None)
    return callable(get) and get() is not None


def query_ids(model, tokenizer, query, row, spec=None):
    """An embedding model's query as the tokenizer encodes it (its ``[CLS]``/``[SEP]`` kept),
    after the query prompt its checkpoint declares (``spec``)."""
    from pyattr.methods._core.tokens import _encode

    if isinstance(query, str):
        if tokenizer is None:
            raise ValueError(f"query[{row}]: a text query needs tokenizer= (the model's Hugging Face tokenizer)")
        return _encode(tokenizer, spec.text(query, "query")[0] if spec is not None else query, markers="tokenizer")[0]
    return ids_of(model, query, f"query[{row}]")
