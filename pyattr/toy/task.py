"""The induction task of the trained toy decoder: a segment of distinct words repeated.

A sequence is ``<s>`` followed by a segment of ``n`` distinct words (``n`` drawn from
``PERIODS``) repeated until the sequence holds ``LENGTH`` words: ``<s> sun cat red sun cat
red sun ...``. The first ``n`` words cannot be predicted; every later word is the one that
followed the previous occurrence of the current word, which is what an induction head
(a previous-token head in layer 0 feeding a head in layer 1 that attends to the token
after the current token's earlier occurrence; Olsson et al. 2022, "In-context learning
and induction heads") computes. Because the period varies, no fixed relative offset
solves the task: the model has to find the earlier occurrence.

Words, not characters, so that a person can check an explanation by eye.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

#: The words of the vocabulary (one token each).
WORDS = (
    "cat dog sun red tree blue fish bird moon star rain snow wind fire milk tea "
    "bread salt king queen ship road lamp door book pen cup key ring bell drum "
    "fox owl bee ant wolf bear frog duck gold iron wood stone sand leaf rose corn"
).split()
PAD, BOS, UNK = "<pad>", "<s>", "<unk>"
SPECIALS = (PAD, BOS, UNK)
#: Segment lengths the model is trained on.
PERIODS = tuple(range(3, 11))
#: Words after ``<s>`` in a training sequence.
LENGTH = 24


def vocabulary() -> dict:
    """Token → id: the special tokens first (``<pad>`` 0, ``<s>`` 1, ``<unk>`` 2), then the words."""
    return {w: i for i, w in enumerate((*SPECIALS, *WORDS))}


def tokenizer():
    """A ``PreTrainedTokenizerFast`` for the task: whitespace-split words, ``<s>`` prepended,
    ``<pad>`` for padding (left, as for generation). Save it with ``save_pretrained``."""
    from pyattr.toy.fit import word_tokenizer

    return word_tokenizer(vocabulary(), f"{BOS} $A", BOS, "left", bos_token=BOS, pad_token=PAD, unk_token=UNK)


def word_ids(words: List[str]) -> List[int]:
    vocab = vocabulary()
    return [vocab[w] for w in words]


def segments(generator: torch.Generator, count: int, periods=PERIODS) -> List[List[int]]:
    """``count`` segments of distinct word ids, each of a length drawn from ``periods``."""
    first = len(SPECIALS)
    out = []
    lengths = torch.tensor(periods)[torch.randint(len(periods), (count,), generator=generator)]
    for n in lengths.tolist():
        out.append((torch.randperm(len(WORDS), generator=generator)[:n] + first).tolist())
    return out


def batch(generator: torch.Generator, count: int, length: int = LENGTH) -> Tuple[torch.Tensor, torch.Tensor]:
    """``count`` training sequences and the mask of positions whose next word is
    determined (the loss positions).

    Returns:
        ids (LongTensor[count, length + 1]): ``<s>`` then the repeated segment.
        determined (BoolTensor[count, length + 1]): True at position p when the word at
            p + 1 repeats an earlier one (p ≥ the segment's length).
    """
    segs = segments(generator, count)
    ids = torch.empty(count, length + 1, dtype=torch.long)
    determined = torch.zeros(count, length + 1, dtype=torch.bool)
    ids[:, 0] = vocabulary()[BOS]
    for i, seg in enumerate(segs):
        n = len(seg)
        ids[i, 1:] = torch.tensor([seg[j % n] for j in range(length)])
        determined[i, n:length] = True
    return ids, determined


@dataclass(frozen=True)
class Pair:
    """A clean/corrupt prompt pair for patching.

    clean: ``<s> w1 .. wn w1 .. wk``, answer ``w(k+1)``. Corrupt, by ``kind``:

    - ``"value"``: ``w(k+1)`` replaced by ``x`` in the first segment, answer ``x``. The
      effect runs through what the induction head copies (its values).
    - ``"key"``: ``wk`` replaced by ``x`` in the first segment: the current word has no
      earlier occurrence, so the induction head finds nothing to copy. The effect runs
      through the previous-token head, whose output at the position after ``wk`` is the
      key the induction head's query matches (K-composition).

    The metric is ``logit(answer) − logit(alternative)`` with ``alternative = x``.
    """

    clean: List[int]
    corrupt: List[int]
    answer: int          # token id the clean prompt predicts
    alternative: int     # token id the corrupt prompt predicts
    source: int          # position (in the prompt) of the copied word's earlier occurrence
    kind: str = "value"


KINDS = ("value", "key")


def pairs(generator: torch.Generator, count: int, period: int = 6, kind: str = "value") -> List[Pair]:
    """``count`` patching pairs of equal length (``1 + period + period // 2`` tokens), with
    a segment of ``period`` words and the prompt cut after ``period // 2`` repeated words;
    ``kind`` as :class:`Pair`."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    first = len(SPECIALS)
    bos = vocabulary()[BOS]
    k = period // 2
    out = []
    for _ in range(count):
        words = (torch.randperm(len(WORDS), generator=generator)[: period + 1] + first).tolist()
        seg, x = words[:period], words[period]
        clean = [bos, *seg, *seg[:k]]
        bad = list(seg)
        bad[k if kind == "value" else k - 1] = x
        corrupt = [bos, *bad, *seg[:k]]
        out.append(Pair(clean, corrupt, seg[k], x, 1 + k, kind))
    return out
