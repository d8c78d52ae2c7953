"""A generated step's top sources (:meth:`pyattr.GenerationRelevanceResult.top_sources`, and
the encoder–decoder result's, :mod:`pyattr.methods.seq2seq_names`), and the index checks their
arguments take."""

from __future__ import annotations

import operator
from typing import NamedTuple, Union


class TopSource(NamedTuple):
    """One source of a generated step (:meth:`GenerationRelevanceResult.top_sources`)."""

    column: int  #: position in ``sequences``
    token: Union[str, int]  #: the token's text where the result has it, else its id
    relevance: float


def index_in(value, lo: int, hi: int, name: str) -> int:
    """An int (Python, NumPy or 0-d tensor; not a bool) in [lo, hi), else IndexError."""
    try:
        i = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        i = None
    if i is None or not lo <= i < hi:
        raise IndexError(f"{name} must be an int in [{lo}, {hi}), got {value!r}")
    return i
