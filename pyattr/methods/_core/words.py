"""Words of a token sequence as the tokenizer's own decoding spells it
(:meth:`pyattr.GenerationRelevanceResult.aggregate`): read from the decoded text, never
from marker characters (``Ġ``, ``▁``, ``##``), which miss line breaks and tabs."""

from __future__ import annotations

from typing import List, Optional

import torch


def _stable(text: str) -> str:
    """Decoded text without the replacement characters a byte-level decoding ends with
    while a multi-byte character is still incomplete (the next token completes it)."""
    return text.rstrip("\ufffd")


def _pieces(tokenizer, ids: List[int], window: int = 16) -> List[str]:
    """Each token's characters in the tokenizer's own decoding of the run ``ids``: what
    decoding it adds after the tokens before it (``window`` of them as context, enough for
    a byte-level token that completes a multi-byte character or a SentencePiece space).
    A token that holds only part of a character adds nothing (``""``); the token that
    completes the character adds all of it."""
    out = []
    for i in range(len(ids)):
        j = max(0, i - window)
        def dec(seq):
            return _stable(tokenizer.decode(seq, skip_special_tokens=False, clean_up_tokenization_spaces=False))
        before = dec(ids[j:i]) if i > j else ""
        text = dec(ids[j:i + 1])
        k = 0
        while k < min(len(before), len(text)) and before[k] == text[k]:
            k += 1
        out.append(text[k:])
    return out


def _flush(waiting: List[int], groups: List[List[int]], labels: List[str], pieces) -> List[int]:
    """Tokens still waiting for a next word when none follows (a special token or the end):
    with the word before them, or a group of their own at the start."""
    if waiting:
        if groups:
            groups[-1].extend(waiting)
        else:
            groups.append(list(waiting))
            labels.append("".join(pieces[i] or "" for i in waiting))
    return []


def words(ids: torch.Tensor, mask: torch.Tensor, rel: torch.Tensor, tokenizer):
    """Words as the tokenizer's own decoding spells the sequence: a word is a run of
    non-whitespace characters; a token belongs to the word its first visible character is
    in; a token of whitespace only (a byte-level ``Ċ`` line break) belongs to the word
    after it, and a token that holds only part of a character to the token that completes
    it; a token whose text ends in whitespace (``'.ĊĊ'``) ends its word; a special token is
    a word of its own. Returns ``(labels, Tensor[generated, words])``."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    cols = mask.bool().nonzero()[:, 0].tolist()
    tok_ids = [int(ids[c]) for c in cols]
    pieces: List[Optional[str]] = [None] * len(cols)
    run: List[int] = []
    for n in range(len(cols) + 1):  # decode each run between special tokens
        if n < len(cols) and tok_ids[n] not in special:
            run.append(n)
            continue
        for i, piece in zip(run, _pieces(tokenizer, [tok_ids[i] for i in run])):
            pieces[i] = piece
        run = []
    groups: List[List[int]] = []   # indices into cols, per word
    labels: List[str] = []
    waiting: List[int] = []        # tokens (whitespace, partial characters) placed with the next token
    open_word = False              # the last group is a word the next token may continue
    for n, piece in enumerate(pieces):
        if piece is None:  # a special token
            waiting = _flush(waiting, groups, labels, pieces)
            groups.append([n])
            labels.append(tokenizer.convert_ids_to_tokens([tok_ids[n]])[0])
            open_word = False
            continue
        if not piece:  # part of a character: goes where the token completing it goes
            waiting.append(n)
            continue
        if not piece.strip():  # whitespace only: ends the word, joins the next one
            waiting.append(n)
            open_word = False
            continue
        if open_word and not piece[0].isspace():
            groups[-1].extend(waiting + [n])
            labels[-1] += piece.strip()
        else:
            groups.append(waiting + [n])
            labels.append(piece.strip())
        waiting = []
        open_word = not piece[-1].isspace()
    _flush(waiting, groups, labels, pieces)
    out = torch.stack([rel[:, [cols[i] for i in g]].sum(-1) for g in groups], -1)
    return labels, out
