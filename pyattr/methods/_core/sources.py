"""A context's sources as token ranges: given as ranges, as text spans of the prompt, or split
by sentence / line / paragraph / word, mapped to tokens by the tokenizer's own character
offsets (never by re-tokenizing pieces: a piece tokenized alone is not what the model read)."""

from __future__ import annotations

import re
from typing import List, Optional, Sequence, Tuple

#: the splitting rules ``sources=`` accepts by name: a regular expression for one source each
SPLITS = {
    "sentence": r"[^.!?\n]+(?:[.!?]+|$)",
    "line": r"[^\n]+",
    "paragraph": r"(?:[^\n]|\n(?!\s*\n))+",
    "word": r"\S+",
}


def _char_spans_by_split(text: str, how: str) -> List[Tuple[int, int]]:
    spans = []
    for m in re.finditer(SPLITS[how], text):
        a, b = m.span()
        while a < b and text[a].isspace():
            a += 1
        while b > a and text[b - 1].isspace():
            b -= 1
        if b > a:
            spans.append((a, b))
    return spans


def _whole_word(text: str, piece: str, at: int) -> int:
    """The first occurrence of ``piece`` from ``at`` that is not inside a longer word ("cat" in
    "A cat", not in "category"), else the first occurrence (-1 if none)."""
    first = i = text.find(piece, at)
    while i >= 0:
        before = i > 0 and piece[0].isalnum() and text[i - 1].isalnum()
        after = i + len(piece) < len(text) and piece[-1].isalnum() and text[i + len(piece)].isalnum()
        if not before and not after:
            return i
        i = text.find(piece, i + 1)
    return first


def _char_spans_of_texts(text: str, pieces: Sequence[str]) -> List[Tuple[int, int]]:
    spans, at = [], 0
    for k, piece in enumerate(pieces):
        if not isinstance(piece, str) or not piece.strip():
            raise ValueError(f"sources[{k}]: expected a non-empty text span of the prompt, got {piece!r}")
        i = _whole_word(text, piece, at)
        if i < 0:
            where = " after the previous source" if at else ""
            raise ValueError(f"sources[{k}]: {piece!r} does not occur in the prompt{where} (sources are spans of "
                             "the prompt text, in order)")
        spans.append((i, i + len(piece)))
        at = i + len(piece)
    return spans


def _tokens_of(char_spans, offsets, special, text: str) -> List[Tuple[int, int]]:
    out = []
    for k, (a, b) in enumerate(char_spans):
        toks = [i for i, ((s, e), sp) in enumerate(zip(offsets, special)) if not sp and e > a and s < b]
        if not toks:
            raise ValueError(f"sources[{k}]: {text[a:b]!r} covers no token of the prompt")
        first, last = offsets[toks[0]][0], offsets[toks[-1]][1]
        if any(c.isalnum() for c in text[first:a] + text[b:last]):
            # the source is part of a word the tokenizer reads as one token with letters outside
            # it ("cat" in "category"): its scores would be the whole token's
            raise ValueError(f"sources[{k}]: {text[a:b]!r} is part of {text[min(first, a):max(last, b)]!r}, which "
                             "the tokenizer reads as one token or more with letters outside the source; give whole "
                             "words (sources are found as the first match after the previous source)")
        out.append((toks[0], toks[-1] + 1))
    for k in range(1, len(out)):
        if out[k][0] < out[k - 1][1]:
            raise ValueError(f"sources[{k - 1}] and sources[{k}] share the token at {out[k][0]} (the tokenizer reads "
                             "across their boundary); split the context at word boundaries")
    return out


def check_ranges(ranges, length: int, name: str = "sources", whose: str = "the prompt's") -> List[Tuple[int, int]]:
    """Token ranges ``(start, end)``: within ``length`` tokens (``whose``: of what, for the
    message), non-empty, in order, not overlapping."""
    out = []
    for k, r in enumerate(ranges):
        if (not isinstance(r, (tuple, list)) or len(r) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in r)):
            raise ValueError(f"{name}[{k}]: expected a token range (start, end) of ints, got {r!r}")
        a, b = r
        if not 0 <= a < b <= length:
            raise ValueError(f"{name}[{k}]: token range {tuple(r)} is not a non-empty range within {whose} "
                             f"{length} tokens")
        if out and a < out[-1][1]:
            raise ValueError(f"{name}[{k}]: token range {tuple(r)} overlaps or precedes {out[-1]}; give them in "
                             "order, not overlapping")
        out.append((a, b))
    if not out:
        raise ValueError(f"{name}: expected at least one (a text span of the prompt, or a token range "
                         "(start, end))" if name == "sources" else f"{name}: expected at least one token range")
    return out


def resolve(sources, text: Optional[str], offsets, special, length: int) -> List[Tuple[int, int]]:
    """Each source's token range in a prompt of ``length`` tokens.

    Args:
        sources: ``"sentence"`` / ``"line"`` / ``"paragraph"`` / ``"word"`` (split ``text``),
            a list of text spans of ``text`` (in order), or a list of token ranges.
        text: the prompt text (None where the prompt was given as ids).
        offsets, special: the tokenizer's character offsets and special-token flags of the
            prompt's tokens (None without a tokenizer that gives offsets).

    Raises:
        ValueError: an unknown split name, a span not in the text, a range outside the
            prompt, overlapping sources, text sources without text or offsets.
    """
    if isinstance(sources, str):
        if sources not in SPLITS:
            raise ValueError(f"sources: expected one of {sorted(SPLITS)}, a list of text spans or a list of token "
                             f"ranges, got {sources!r}")
        kind = "split"
    elif isinstance(sources, (list, tuple)) and sources and all(isinstance(s, str) for s in sources):
        kind = "spans"
    else:
        return check_ranges(list(sources) if isinstance(sources, (list, tuple)) else [sources], length)
    if text is None:
        raise ValueError("sources: text spans or a split need the prompt as text with tokenizer=; with token ids, "
                         "give token ranges (start, end)")
    if offsets is None:
        raise ValueError("sources: text spans need a tokenizer that returns character offsets (a fast tokenizer); "
                         "give token ranges (start, end) instead")
    spans = _char_spans_by_split(text, sources) if kind == "split" else _char_spans_of_texts(text, sources)
    if not spans:
        raise ValueError(f"sources: splitting the prompt by {sources!r} gives no source")
    return check_ranges(_tokens_of(spans, offsets, special, text), length)
