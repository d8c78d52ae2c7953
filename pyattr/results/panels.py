"""What a result shows, independent of where it is shown: a result lays itself out as
panels (a token heatmap, a matrix, curves, a table), and one renderer per medium (HTML
for notebooks, matplotlib for ``plot()``, text for the terminal, a DataFrame for
``to_pandas()``) draws every panel kind. A cell that does not apply (a context position
after the step it would explain, padding) is NaN: drawn grey, left out of tables."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence


@dataclass
class Tokens:
    """One sequence: a label and a value per token (``labels[i]`` None: not shown)."""

    title: str
    labels: List[Optional[str]]
    values: List[float]
    value_name: str = "relevance"


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


def finite(values: Sequence[float]) -> List[float]:
    return [v for v in values if v is not None and not math.isnan(v)]


def scale(values: Sequence[float]) -> float:
    """The colour scale's end: the largest |value| (1 where every value is 0)."""
    m = max((abs(v) for v in finite(values)), default=0.0)
    return m if m > 0 else 1.0


def flat(panel) -> List[float]:
    if isinstance(panel, Tokens):
        return [v for v, lab in zip(panel.values, panel.labels) if lab is not None]
    if isinstance(panel, Matrix):
        return [v for row in panel.values for v in row]
    return []


def label(text: Optional[str]) -> str:
    """A token string for display: whitespace made visible where it is the whole token."""
    if text is None:
        return ""
    if text == "":
        return "∅"
    shown = text.replace("\n", "⏎").replace("\t", "⇥")
    return shown if shown.strip() else shown.replace(" ", "␣")
