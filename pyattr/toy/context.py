"""The context-attribution task of the toy induction decoders: which source holds the answer.

An example is a context of ``sources`` sources of ``words`` distinct words each (all words
of the context distinct), followed by a query word taken from the context; the answer is
the word that followed the query word there::

    <s> | sun cat red | dog fish owl | bee tea key | fish        → owl

The trained toy decoders answer by induction (:mod:`pyattr.toy.task`): the previous-token
head marks ``owl`` as "after fish", and the induction head, queried by the last ``fish``,
finds it and copies it. Two sources matter, with known roles:

- the **answer source** holds the copied word (``owl``): what the induction head reads
  through its values. Every faithful context attribution ranks it first (top-1 hit).
- the **cue source** holds the query word's earlier occurrence (``fish``): where the model
  looks, through the previous-token head into the induction head's keys. It is the answer
  source itself when the query word is not its source's last word.

Removing a source takes its tokens out of the context (as ContextCite removes a source's
text), so the remaining sources close up and positions are the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

import pyattr.toy.task as task

#: Sources per example and words per source in the benchmark (``pyattr bench --citations``).
SOURCES = 4
WORDS_PER_SOURCE = 3


@dataclass(frozen=True)
class ContextExample:
    """One example, as token ids of the toy tokenizer.

    prompt: ``<s>``, the sources' words, the query word.
    ranges: each source's token range ``(start, end)`` in ``prompt``.
    answer: the token id of the copied word (the response).
    answer_source / cue_source: index of the source holding the copied word / the query
        word's earlier occurrence.
    """

    prompt: List[int]
    ranges: List[Tuple[int, int]]
    answer: int
    answer_source: int
    cue_source: int

    def text(self, vocabulary=None) -> str:
        """The prompt after ``<s>`` as words (what the toy tokenizer reads back to ``prompt``)."""
        inv = {i: w for w, i in (vocabulary or task.vocabulary()).items()}
        return " ".join(inv[i] for i in self.prompt[1:])

    def source_texts(self, vocabulary=None) -> List[str]:
        inv = {i: w for w, i in (vocabulary or task.vocabulary()).items()}
        return [" ".join(inv[i] for i in self.prompt[a:b]) for a, b in self.ranges]


def examples(generator: torch.Generator, count: int, sources: int = SOURCES,
             words: int = WORDS_PER_SOURCE) -> List[ContextExample]:
    """``count`` examples drawn with ``generator`` (see the module docstring).

    Raises:
        ValueError: ``sources`` or ``words`` < 1, or more words than the vocabulary holds.
    """
    if sources < 1 or words < 1:
        raise ValueError(f"sources and words must be >= 1, got sources={sources}, words={words}")
    total = sources * words
    if total > len(task.WORDS):
        raise ValueError(f"sources * words must be <= {len(task.WORDS)} (the vocabulary), got {total}")
    if total < 2:
        raise ValueError("the context needs at least 2 words (a query word and the word after it)")
    first = len(task.SPECIALS)
    bos = task.vocabulary()[task.BOS]
    out = []
    for _ in range(count):
        ctx = (torch.randperm(len(task.WORDS), generator=generator)[:total] + first).tolist()
        q = int(torch.randint(total - 1, (1,), generator=generator))  # any word but the last
        prompt = [bos, *ctx, ctx[q]]
        ranges = [(1 + s * words, 1 + (s + 1) * words) for s in range(sources)]
        out.append(ContextExample(prompt, ranges, ctx[q + 1], (q + 1) // words, q // words))
    return out


@torch.no_grad()
def answered(model, generator: torch.Generator, count: int, sources: int = SOURCES,
             words: int = WORDS_PER_SOURCE, max_draws: int = 100_000) -> List[ContextExample]:
    """The first ``count`` examples drawn with ``generator`` whose answer is the model's own
    greedy next token: an attribution explains what the model says (the shipped decoder
    answers about 99 % of draws, the second one about 70 %).

    Raises:
        RuntimeError: fewer than ``count`` answered in ``max_draws`` draws.
    """
    out, drawn = [], 0
    while len(out) < count:
        if drawn >= max_draws:
            raise RuntimeError(f"the model answered {len(out)} of {drawn} examples, fewer than {count}")
        batch = examples(generator, 64, sources, words)
        drawn += len(batch)
        device = next(model.parameters()).device
        pred = model(input_ids=torch.tensor([e.prompt for e in batch], device=device)).logits[:, -1].argmax(-1)
        out += [e for e, p in zip(batch, pred.tolist()) if p == e.answer]
    return out[:count]
