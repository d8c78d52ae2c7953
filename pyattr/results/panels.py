"""What a result shows, independent of where it is shown: a result lays itself out as
panels (a token heatmap, a matrix, curves, a table), and one renderer per medium (HTML
for notebooks, matplotlib for ``plot()``, text for the terminal, a DataFrame for
``to_pandas()``) draws every panel kind. A cell that does not apply (a context position
after the step it would explain, padding) is None: drawn hatched, left out of tables; a
value that is NaN is the result's own (a NaN relevance) and is drawn and listed as NaN."""

from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence


@dataclass
class Tokens:
    """One sequence: a label and a value per token (``labels[i]`` None: not shown)."""

    title: str
    labels: List[Optional[str]]
    values: List[float]
    value_name: str = "relevance"
    scale: Optional[float] = None  # the colour scale's end; None: this panel's largest |value|
    # what to_pandas() names the columns: the label and its index (a context's sources:
    # "source", "source_index"), the batch row and the target set the panel shows
    label_name: str = "token"
    index_name: str = "position"
    row: Optional[int] = None
    target_set: Optional[int] = None


@dataclass
class Matrix:
    """A grid: ``values[i][j]`` for row label ``rows[i]`` and column label ``cols[j]``."""

    title: str
    rows: List[str]
    cols: List[str]
    values: List[List[float]]
    row_name: str = "row"
    col_name: str = "column"
    value_name: str = "relevance"
    scale: Optional[float] = None  # the colour scale's end; None: this panel's largest |value|
    row: Optional[int] = None  # the batch row the panel shows (to_pandas()'s "row" column)
    target_set: Optional[int] = None
    # coordinates every cell of the panel shares, as to_pandas() columns (a position's token)
    coords: Optional[dict] = None


@dataclass
class Curves:
    """Lines over a shared x axis: ``ys[i]`` named ``names[i]``."""

    title: str
    x: List[float]
    ys: List[List[float]]
    names: List[str]
    x_name: str = "x"
    y_name: str = "value"


@dataclass
class Table:
    """Rows of named columns."""

    title: str
    columns: List[str]
    rows: List[list] = field(default_factory=list)


@dataclass
class Graph:
    """Nodes at (x, y) positions and weighted edges between them: a circuit drawn as a graph.
    ``edges`` are ``(from node, to node, label, value)``; ``nodes`` ``(name, x, y)`` with x, y
    in [0, 1] (y up)."""

    title: str
    nodes: List[tuple]
    edges: List[tuple]
    value_name: str = "score"


def port(edge_label: str) -> int:
    """Where an edge enters its node: -1 / 0 / +1 for a query / key / value input (``<q>``,
    ``<k>``, ``<v>`` at the end of its label), so that a head's three inputs from one node are
    three lines, not one; 0 otherwise."""
    return {"<q>": -1, "<k>": 0, "<v>": 1}.get(edge_label[-3:], 0)


@dataclass
class Picture:
    """An RGB image (``rgb``: height × width × 3, uint8, a numpy array): an image result's
    relevance drawn over the image."""

    title: str
    rgb: Any


@dataclass
class Note:
    """A line of text about the view (what it leaves out: rows past the first few, panels too
    wide to draw); drawn above the panels, not a table row."""

    text: str


def finite(values: Sequence[float]) -> List[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def is_nan(v) -> bool:
    """A value that is NaN (not None: None is a cell that does not apply)."""
    return isinstance(v, float) and math.isnan(v)


def scale(values: Sequence[float]) -> float:
    """The colour scale's end: the largest finite |value| (1 where every value is 0 or
    none is finite; ±inf then saturate the colour, NaN is drawn apart)."""
    m = max((abs(v) for v in finite(values)), default=0.0)
    return m if m > 0 else 1.0


def flat(panel) -> List[float]:
    if isinstance(panel, Tokens):
        return [v for v, lab in zip(panel.values, panel.labels) if lab is not None]
    if isinstance(panel, Matrix):
        return [v for row in panel.values for v in row]
    return []


_SHOWN = {"\n": "⏎", "\t": "⇥", "\r": "␍"}
#: bidirectional controls: they would reorder the text drawn after them (escaped everywhere)
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c")


def _char(ch: str) -> str:
    if ch in _SHOWN:
        return _SHOWN[ch]
    if unicodedata.category(ch) == "Cc" or ch in _BIDI:  # control characters (a terminal's escape codes)
        return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"
    return ch


def label(text: Optional[str]) -> str:
    """A token string for display: line breaks, tabs and control characters always visible
    (``⏎``, ``⇥``, ``␍``, ``\\x1b``: never a terminal escape sequence or a carriage return
    that overwrites the line), bidirectional controls escaped; a token of whitespace or
    zero-width characters only shown by symbols (``␣`` for each space of any width,
    ``\\u200b`` for a zero-width one)."""
    if text is None:
        return ""
    if text == "":
        return "∅"
    shown = "".join(_char(ch) for ch in text)
    if any(not (ch.isspace() or unicodedata.category(ch) == "Cf") for ch in shown):
        return shown
    return "".join("␣" if ch.isspace() else f"\\u{ord(ch):04x}" for ch in shown)


def share_scale(panels) -> None:
    """One colour scale for every heatmap panel given (the largest |value| over all of
    them), so that rows of one result compare by colour: a row with a small target is
    pale, not as saturated as a row with a large one."""
    heat = [p for p in panels if isinstance(p, (Tokens, Matrix))]
    common = scale([v for p in heat for v in flat(p)])
    for p in heat:
        p.scale = common


def scale_of(p) -> float:
    return p.scale if p.scale is not None else scale(flat(p))
