"""Words of a token sequence as the tokenizer's own decoding spells it
(:meth:`pyattr.GenerationRelevanceResult.aggregate`): read from the decoded text, never
from marker characters (``Ġ``, ``▁``, ``##``), which miss line breaks and tabs."""

from __future__ import annotations

from typing import List, Optional

import torch


def _pieces(tokenizer, ids: List[int], window: int = 16) -> List[str]:
    """Each token's characters in the tokenizer's own decoding of the run ``ids``: what
    decoding it adds after the tokens before it (``window`` of them as context, enough for
    a byte-level token that completes a multi-byte character or a SentencePiece space)."""
    out = []
    for i in range(len(ids)):
        j = max(0, i - window)
        before = tokenizer.decode(ids[j:i], skip_special_tokens=False, clean_up_tokenization_spaces=False) if i > j else ""
        text = tokenizer.decode(ids[j:i + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        k = 0
        while k < min(len(before), len(text)) and before[k] == text[k]:
            k += 1
        out.append(text[k:] if i > j else text)
    return out


def words(ids: torch.Tensor, mask: torch.Tensor, rel: torch.Tensor, tokenizer):
    """Words as the tokenizer's own decoding spells the sequence: a word is a run of
    non-whitespace characters; a token belongs to the word its first visible character is
    in, a token of whitespace only (a byte-level ``Ċ`` line break) to the word after it;
    a special token is a word of its own. Read from the decoded text, never from marker
    characters (``Ġ``, ``▁``, ``##``), which miss line breaks and tabs (issue 31)."""
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
    groups: List[List[int]] = []   # column indices (into cols) per word
    labels: List[str] = []
    pending: List[int] = []        # whitespace-only tokens waiting for the next word
    open_word = False

    def close_pending():
        if pending:
            if groups and open_word:
                groups[-1].extend(pending)
            else:
                groups.append(list(pending))
                labels.append("".join(pieces[i] for i in pending).strip() or pieces[pending[0]])
            pending.clear()

    for n, piece in enumerate(pieces):
        if piece is None:  # a special token
            close_pending()
            groups.append([n])
            labels.append(tokenizer.convert_ids_to_tokens([tok_ids[n]])[0])
            open_word = False
        elif not piece.strip():
            pending.append(n)
        elif open_word and not pending and not piece[0].isspace():
            groups[-1].append(n)
            labels[-1] += piece.strip()
        else:
            groups.append(pending + [n])
            labels.append(piece.strip())
            pending = []
            open_word = True
    close_pending()
    out = torch.stack([rel[:, [cols[i] for i in g]].sum(-1) for g in groups], -1)
    return labels, out
