"""Panels as a matplotlib figure (``plot()``): token heatmaps and matrices in the
diverging blue–white–red map with a colour bar centred on 0 (NaN cells grey), curves as
lines; and as a pandas DataFrame (``to_pandas()``) and plain text (``show()`` outside a
notebook)."""

from __future__ import annotations

import math
import textwrap
from typing import List

from pyattr.results.panels import (Curves, Graph, Matrix, Note, Picture, Table, Tokens, is_nan, label, port,
                                   scale_of)


def _cmap():
    from matplotlib.colors import LinearSegmentedColormap

    cmap = LinearSegmentedColormap.from_list("pyattr", [(0, 0, 1), (1, 1, 1), (1, 0, 0)])
    return cmap.with_extremes(bad="#cccccc", under=(0, 0, 1), over=(1, 0, 0))  # ±inf saturate


def figure(panels: List, heading: str):
    """A ``matplotlib.figure.Figure`` with one axes per panel (at most 12)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plot() draws with matplotlib, which is not installed (pip install matplotlib)") from None
    del matplotlib  # the figure is built without pyplot: the user's backend is left as it is
    import numpy as np
    from matplotlib.figure import Figure

    _notebook_png()
    notes = [p.text for p in panels if isinstance(p, Note)]
    drawable = [p for p in panels if not isinstance(p, (Table, Note))]
    panels = drawable[:12]
    if not panels:
        raise ValueError("plot(): this result has nothing to draw (only tables; use to_pandas())")
    if len(drawable) > len(panels):
        notes.append(f"the first {len(panels)} of {len(drawable)} panels are drawn; to_pandas() holds them all")
    heights = [max(1.6, 0.35 * len(p.rows) + 1.2) if isinstance(p, Matrix) else 3.0 if isinstance(p, Curves) else
               4.5 if isinstance(p, (Graph, Picture)) else
               3.2 if isinstance(p, Tokens) and any(lab and len(label(lab)) > 12 for lab in p.labels) else 1.6
               for p in panels]
    widths = [max(6.0, 0.5 * len(p.cols) + 2) if isinstance(p, Matrix) else
              max(6.0, 0.55 * sum(lab is not None for lab in p.labels) + 2) if isinstance(p, Tokens) else 6.0
              for p in panels]
    width = min(max(widths), 24)
    fig = Figure(figsize=(width, sum(heights) + 0.6), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    # titles wrapped to what the figure's width holds at their font size (a 6-inch figure: about
    # 60 characters at 9 pt, the axes narrower than the figure by the colour bar)
    chars = max(40, int(width * 10))
    fig.suptitle(_plain("\n".join([heading] + [textwrap.fill(n, chars + 10) for n in notes])),
                 fontsize=10 if notes else None)
    cmap = _cmap()
    for ax, p in zip(axes, panels):
        if isinstance(p, Graph):
            _draw_graph(fig, ax, p, cmap)
        elif isinstance(p, Picture):
            ax.imshow(p.rgb, interpolation="nearest")
            ax.set_axis_off()
        elif isinstance(p, Curves):
            for y, name in zip(p.ys, p.names):
                ax.plot(p.x, y, color="black" if name == "mean" else None, lw=2 if name == "mean" else 1,
                        label=_plain(name))
            ax.set_xlabel(_plain(p.x_name))
            ax.set_ylabel(_plain(p.y_name))
            ax.legend(fontsize=7)
        else:
            s = scale_of(p)
            if isinstance(p, Tokens):
                keep = [i for i, lab in enumerate(p.labels) if lab is not None]
                cells = [[p.values[i] for i in keep]]
                # long labels (sentences as sources) cut and turned, so that they do not overlap
                ticks, yt = [_plain(_cut(label(p.labels[i]))) for i in keep], []
            else:
                cells = p.values
                ticks, yt = [_plain(label(c)) for c in p.cols], [_plain(label(r)) for r in p.rows]
            data = np.array([[math.nan if v is None else v for v in row] for row in cells], dtype=float)
            # grey where a cell does not apply (None) or is NaN, the NaN cells labelled; ±inf
            # take the scale's end colours
            im = ax.imshow(np.ma.masked_where(np.isnan(data), data), cmap=cmap, vmin=-s, vmax=s, aspect="auto")
            for i, row in enumerate(cells):
                for j, v in enumerate(row):
                    if is_nan(v):
                        ax.text(j, i, "nan", ha="center", va="center", fontsize=7)
            turn = len(ticks) > 6 or max((len(t) for t in ticks), default=0) > 12
            ax.set_xticks(range(len(ticks)), ticks, rotation=90 if len(ticks) > 6 else 30 if turn else 0,
                          ha="right" if turn and len(ticks) <= 6 else "center", fontsize=8)
            ax.set_yticks(range(len(yt)), yt, fontsize=8)
            if isinstance(p, Matrix):
                ax.set_xlabel(_plain(p.col_name))
                ax.set_ylabel(_plain(p.row_name))
            fig.colorbar(im, ax=ax, label=_plain(p.value_name), shrink=0.9)
        ax.set_title(_plain(textwrap.fill(p.title, chars)), fontsize=9)
    return fig


def _draw_graph(fig, ax, p: Graph, cmap) -> None:
    """Nodes as labelled boxes, edges as lines coloured and weighted by value (strongest on top)."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    pos = {n: (x, y) for n, x, y in p.nodes}
    vals = [abs(v) for *_, v in p.edges if not is_nan(v)]
    s = max(vals) if vals and max(vals) > 0 else 1.0
    norm = Normalize(-s, s)
    for a, b, lab, v in sorted(p.edges, key=lambda e: abs(e[3]) if not is_nan(e[3]) else 0.0):
        (x1, y1), (x2, y2) = pos[a], pos[b]
        x2 += 0.022 * port(lab)
        ax.plot([x1, x2], [y1, y2], color=cmap(norm(v)), lw=0.6 + 4.4 * min(1.0, abs(v) / s), alpha=0.9, zorder=1)
    for n, x, y in p.nodes:
        ax.text(x, y, _plain(n), ha="center", va="center", fontsize=7, zorder=2, family="monospace",
                bbox=dict(boxstyle="round,pad=0.25", fc="white", ec="#444"))
    ax.set_xlim(-0.05, 1.05)
    ax.set_ylim(-0.08, 1.08)
    ax.axis("off")
    fig.colorbar(ScalarMappable(norm, cmap), ax=ax, label=_plain(p.value_name), shrink=0.9)


def _cut(s: str, n: int = 40) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def _plain(s: str) -> str:
    """Text drawn as written: a ``$`` would start matplotlib's mathtext (a token ``"$$"``
    failed to draw, ``"$x$"`` was drawn as an italic x)."""
    return str(s).replace("$", r"\$")


def _notebook_png() -> None:
    """In IPython (a notebook kernel), show a figure that is a cell's value as a PNG.

    IPython registers its PNG formatter for matplotlib figures only when pyplot's inline
    backend starts; ``plot()`` builds its figure without pyplot, so until the notebook
    imports pyplot the cell would print ``<Figure size 600x220 with 2 Axes>`` and no
    picture. A format the user chose (inline backend, ``%config InlineBackend``) stays."""
    import sys

    if "IPython" not in sys.modules:
        return
    try:
        from IPython import get_ipython
        from IPython.core.pylabtools import print_figure
        from matplotlib.figure import Figure
    except ImportError:
        return
    ip = get_ipython()
    if ip is None or getattr(ip, "display_formatter", None) is None:
        return
    formatters = ip.display_formatter.formatters
    for f in formatters.values():
        try:
            f.lookup_by_type(Figure)
            return  # some format is registered for figures already
        except KeyError:
            continue
    png = formatters.get("image/png")
    if png is not None:
        png.for_type(Figure, lambda fig: print_figure(fig, "png"))


def _interactive() -> bool:
    import sys

    return "ipykernel" in sys.modules


def dataframe(panels: List):
    """Every panel's cells as rows of one long, tidy table: ``panel``, the batch ``row`` and
    ``target_set`` where the panels have them, then the panel's own coordinates (``position``
    / ``token``, a context's ``source_index`` / ``source``, row and column of a matrix,
    series and x) and the value; cells that do not apply (None: after a generation step)
    left out, NaN values kept as NaN. Each panel's title is in ``df.attrs["titles"]``
    (``{panel: title}``), not repeated on its rows."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("to_pandas() needs pandas, which is not installed (pip install pandas)") from None
    frames, titles = [], {}
    keys = [k for k in ("row", "target_set") if any(getattr(p, k, None) is not None for p in panels)]
    for n, p in enumerate(panels):
        titles[n] = p.title
        lead = [n] + [getattr(p, k, None) for k in keys]
        head = ["panel"] + keys
        if isinstance(p, Tokens):
            rows = [lead + [i, lab, v] for i, (lab, v) in enumerate(zip(p.labels, p.values)) if lab is not None]
            frames.append(pd.DataFrame(rows, columns=head + [p.index_name, p.label_name, p.value_name]))
        elif isinstance(p, Matrix):
            extra = dict(p.coords or {})
            rows = [lead + list(extra.values()) + [i, r, j, c, v] for i, (r, vals) in enumerate(zip(p.rows, p.values))
                    for j, (c, v) in enumerate(zip(p.cols, vals)) if v is not None]
            frames.append(pd.DataFrame(rows, columns=head + list(extra) + [
                f"{p.row_name}_index", p.row_name, f"{p.col_name}_index", p.col_name, p.value_name]))
        elif isinstance(p, Curves):
            rows = [lead + [name, x, v] for y, name in zip(p.ys, p.names) for x, v in zip(p.x, y)]
            frames.append(pd.DataFrame(rows, columns=head + ["series", p.x_name, p.y_name]))
        elif isinstance(p, Graph):
            rows = [lead + [a, b, lab, v] for a, b, lab, v in p.edges]
            frames.append(pd.DataFrame(rows, columns=head + ["from", "to", "edge", p.value_name]))
        elif isinstance(p, Table):
            df = pd.DataFrame(p.rows, columns=p.columns)
            for i, k in reversed(list(enumerate(head))):
                df.insert(0, k, lead[i])
            frames.append(df)
    if not frames:
        out = pd.DataFrame()
    elif len(frames) == 1:
        out = frames[0]
    else:
        out = pd.concat(frames, ignore_index=True, sort=False)
    for k in keys:  # a panel without a batch row (a table of notes) has none: <NA>, not a float NaN
        out[k] = out[k].astype("Int64")
    out.attrs["titles"] = titles
    return out


def text(panels: List, heading: str, width: int = 100) -> str:
    """Plain text: token panels as ``token(value)`` runs, matrices and tables as rows."""
    from pyattr.results.colours import num

    out = [heading]
    for p in panels:
        if isinstance(p, Note):
            out.append(p.text)
            continue
        out.append("")
        out.append(p.title)
        if isinstance(p, Tokens):
            line = ""
            for lab, v in zip(p.labels, p.values):
                if lab is None:
                    continue
                piece = f"{label(lab)}({num(v, '+.3g')}) "
                if len(line) + len(piece) > width:
                    out.append("  " + line.rstrip())
                    line = ""
                line += piece
            out.append("  " + line.rstrip())
        elif isinstance(p, Matrix):
            # row labels as wide as the longest (up to 32 characters, cut on the left behind "…"
            # so that "model.layers.0" and "model.layers.1" stay apart), one space before each cell
            w = min(max((len(label(r)) for r in p.rows), default=0), 32)
            cols = [label(c)[:8] for c in p.cols][:16]
            out.append("  " + " " * w + "".join(f" {c:>8}" for c in cols) + (" …" if len(p.cols) > 16 else ""))
            for r, vals in list(zip(p.rows, p.values))[:24]:
                cells = "".join("        ·" if v is None else f" {num(v, '8.2g'):>8}" for v in vals[:16])
                name = label(r)
                name = name if len(name) <= w else "…" + name[1 - w:]
                out.append(f"  {name:>{w}}" + cells)
        elif isinstance(p, Curves):
            for y, name in zip(p.ys, p.names):
                out.append(f"  {name}: " + " ".join(num(v, ".3g") for v in y))
        elif isinstance(p, Graph):  # a drawing: in text, what it joins (its values are in the result's tables)
            nodes = sorted({n for a, b, *_ in p.edges for n in (a, b)})
            out.append(f"  {len(p.edges)} edges among {', '.join(nodes)} (drawn by the HTML view and plot())")
        elif isinstance(p, Picture):  # an image: drawn by the HTML view and plot(); its values follow
            out.append(f"  {p.rgb.shape[1]}×{p.rgb.shape[0]} pixels (drawn by the HTML view and plot())")
        elif isinstance(p, Table):
            out.append("  " + " | ".join(p.columns))
            for r in p.rows[:40]:
                out.append("  " + " | ".join(num(v, ".4g") if isinstance(v, float) else str(v) for v in r))
    return "\n".join(out)
