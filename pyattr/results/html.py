"""Panels as self-contained HTML (a notebook's ``_repr_html_``, ``save_html``): inline
styles and SVG only, no script and no network, the colours and legend of the command
line's pages (:mod:`pyattr.results.colours`), every value on hover."""

from __future__ import annotations

import html
import math
import hashlib
from typing import Iterable

from pyattr.results.colours import LEGEND_CSS, _ink, _rgb, legend_html, num
from pyattr.results.panels import (Curves, Graph, Matrix, Note, Picture, Table, Tokens, is_nan, label, port,
                                   scale_of)

_CSS = """
.pyattr-result { font-family: system-ui, sans-serif; font-size: 14px; color: #222; max-width: 100%; }
.pyattr-result h4 { margin: 0.8em 0 0.3em; font-size: 14px; }
.pyattr-result .tok { display: inline-block; padding: 1px 3px; margin: 1px; border-radius: 3px;
  font-family: monospace; white-space: pre; border: 1px solid #ddd; }
.pyattr-result .scroll { overflow-x: auto; max-width: 100%; }
.pyattr-result table.grid { border-collapse: collapse; font: 12px monospace; }
.pyattr-result table.grid td, .pyattr-result table.grid th { padding: 2px 4px; border: 1px solid #eee;
  text-align: right; white-space: pre; }
.pyattr-result table.grid th { background: #f6f6f6; font-weight: normal; }
.pyattr-result .note { margin: 0.4em 0; color: #555; font-style: italic; }
.pyattr-result .tok.nan, .pyattr-result td.nan { background: #888; color: #fff; }
.pyattr-result td.na { background: repeating-linear-gradient(45deg, #ddd, #ddd 3px, #f4f4f4 3px, #f4f4f4 6px); }
.pyattr-result table.plain { border-collapse: collapse; font: 12px monospace; }
.pyattr-result table.plain td, .pyattr-result table.plain th { padding: 2px 8px; border-bottom: 1px solid #eee;
  text-align: left; }
""" + LEGEND_CSS.replace(".legend", ".pyattr-result .legend")

def _cell_style(v: float, s: float) -> str:
    rgb = _rgb(v, s)
    return f"background: rgb{rgb}; color: {_ink(rgb)}"


def _legend(s: float, what: str, ids: str) -> str:
    # the ends signed, as the command line's pages write them ("-13.6", "0", "+13.6")
    return legend_html(num(-s, ".3g"), num(s, "+.3g"), html.escape(f"{what}: blue negative, red positive"), ids=ids)


def _tokens(p: Tokens, ids: str) -> str:
    s = scale_of(p)
    spans = []
    for i, (lab, v) in enumerate(zip(p.labels, p.values)):
        if lab is None:
            continue
        tip = html.escape(f"position {i} · {lab!r} · {p.value_name} {num(v, '+.4g')}", quote=True)
        if is_nan(v):  # the result's own NaN: grey, never a colour of the scale
            spans.append(f'<span class="tok nan" title="{tip}">{html.escape(label(lab))}</span>')
            continue
        spans.append(f'<span class="tok" style="{_cell_style(v, s)}" title="{tip}">{html.escape(label(lab))}</span>')
    return f"<h4>{html.escape(p.title)}</h4><div>{''.join(spans)}</div>{_legend(s, p.value_name, ids)}"


def _matrix(p: Matrix, ids: str) -> str:
    s = scale_of(p)
    head = "".join(f"<th>{html.escape(label(c))}</th>" for c in p.cols)
    body = []
    for r, row in zip(p.rows, p.values):
        cells = []
        for c, v in zip(p.cols, row):
            if v is None:
                cells.append(f'<td class="na" title="{html.escape(f"{r} · {c}: not applicable", quote=True)}"></td>')
                continue
            if is_nan(v):
                tip = html.escape(f"{p.row_name} {r} · {p.col_name} {label(c)!r} · {p.value_name} nan", quote=True)
                cells.append(f'<td class="nan" title="{tip}">nan</td>')
                continue
            tip = html.escape(f"{p.row_name} {r} · {p.col_name} {label(c)!r} · {p.value_name} {num(v, '+.4g')}",
                              quote=True)
            cells.append(f'<td style="{_cell_style(v, s)}" title="{tip}">{num(v, ".2g")}</td>')
        body.append(f"<tr><th>{html.escape(label(r))}</th>{''.join(cells)}</tr>")
    corner = html.escape(f"{p.row_name} \\ {p.col_name}")
    return (f"<h4>{html.escape(p.title)}</h4><div class='scroll'><table class='grid'><tr><th>{corner}</th>{head}"
            f"</tr>{''.join(body)}</table></div>{_legend(s, p.value_name, ids)}")


_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _curves(p: Curves, width: int = 420, height: int = 240) -> str:
    xs = [float(x) for x in p.x]
    ys = [[float(v) for v in y] for y in p.ys]
    vals = [v for y in ys for v in y if math.isfinite(v)]  # NaN / inf points are left out of the lines
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    if hi == lo:
        lo, hi = lo - 1, hi + 1
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    x1 = x1 if x1 > x0 else x0 + 1
    m = 40

    def px(x, y):
        return (m + (x - x0) / (x1 - x0) * (width - 2 * m), height - m - (y - lo) / (hi - lo) * (height - 2 * m))

    lines = []
    for i, (y, name) in enumerate(zip(ys, p.names)):
        colour = "#000" if name == "mean" else _COLOURS[i % len(_COLOURS)]
        pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in (px(x, v) for x, v in zip(xs, y) if math.isfinite(v)))
        lines.append(f'<polyline fill="none" stroke="{colour}" stroke-width="{2 if name == "mean" else 1.2}" '
                     f'points="{pts}"><title>{html.escape(name)}</title></polyline>')
        for x, v in zip(xs, y):
            if math.isfinite(v):
                a, b = px(x, v)
                tip = html.escape(f"{name}: {p.x_name} {num(x, '.3g')}, {p.y_name} {num(v, '.4g')}")
                lines.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2.5" fill="{colour}"><title>{tip}</title></circle>')
    axes = (f'<line x1="{m}" y1="{height - m}" x2="{width - m}" y2="{height - m}" stroke="#444"/>'
            f'<line x1="{m}" y1="{m}" x2="{m}" y2="{height - m}" stroke="#444"/>'
            f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle" font-size="12">{html.escape(p.x_name)}</text>'
            f'<text x="12" y="{height / 2}" text-anchor="middle" font-size="12" '
            f'transform="rotate(-90 12 {height / 2})">{html.escape(p.y_name)}</text>'
            f'<text x="{m - 4}" y="{m + 4}" text-anchor="end" font-size="10">{num(hi, ".3g")}</text>'
            f'<text x="{m - 4}" y="{height - m}" text-anchor="end" font-size="10">{num(lo, ".3g")}</text>'
            f'<text x="{m}" y="{height - m + 14}" text-anchor="middle" font-size="10">{num(x0, ".3g")}</text>'
            f'<text x="{width - m}" y="{height - m + 14}" text-anchor="middle" font-size="10">{num(x1, ".3g")}</text>')
    def named(n, y):
        bad = [num(v, "g") for v in y if not math.isfinite(v)]
        return n + (f" ({len(bad)} points not drawn: {', '.join(sorted(set(bad)))})" if bad else "")

    key = " ".join(f'<span style="color:{"#000" if n == "mean" else _COLOURS[i % len(_COLOURS)]}">■ '
                   f'{html.escape(named(n, y))}</span>' for i, (n, y) in enumerate(zip(p.names, ys)))
    return (f"<h4>{html.escape(p.title)}</h4><svg width='{width}' height='{height}' role='img'>{axes}{''.join(lines)}"
            f"</svg><div>{key}</div>")


def _graph(p: Graph, ids: str, width: int = 760, height: int = 420) -> str:
    """Inline SVG: each node a labelled box, each edge a line coloured and weighted by its
    value (blue negative, red positive), strongest drawn last; its name and value on hover."""
    pad = 40
    pos = {n: (pad + x * (width - 2 * pad), height - pad - y * (height - 2 * pad)) for n, x, y in p.nodes}
    vals = [abs(v) for *_, v in p.edges if not is_nan(v)]
    s = max(vals) if vals else 1.0
    s = s if s > 0 else 1.0
    lines = []
    for a, b, lab, v in sorted(p.edges, key=lambda e: abs(e[3]) if not is_nan(e[3]) else 0.0):
        (x1, y1), (x2, y2) = pos[a], pos[b]
        x2 += 16 * port(lab)
        rgb = _rgb(v, s)
        w = 0.8 + 5.2 * min(1.0, abs(v) / s)
        tip = html.escape(f"{lab}: {num(v, '+.4g')}", quote=True)
        lines.append(f'<line class="edge" data-w="{tip}" x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
                     f'stroke="rgb{rgb}" stroke-width="{w:.2f}" stroke-opacity="0.9"><title>{tip}</title></line>')
    boxes = []
    for n, _, _ in p.nodes:
        x, y = pos[n]
        boxes.append(f'<g class="node"><rect x="{x - 26:.1f}" y="{y - 10:.1f}" width="52" height="20" rx="4" '
                     f'fill="#fff" stroke="#444"/><text x="{x:.1f}" y="{y + 4:.1f}" text-anchor="middle" '
                     f'font-size="12" font-family="monospace" fill="#111">{html.escape(n)}</text></g>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(p.title, quote=True)}">'
           f'<rect width="100%" height="100%" fill="#fafafa"/>{"".join(lines)}{"".join(boxes)}</svg>')
    return f"<h4>{html.escape(p.title)}</h4><div class='scroll'>{svg}</div>{_legend(s, p.value_name, ids)}"


def _cell(v) -> str:
    if isinstance(v, float):
        return num(v, ".4g")
    return html.escape(str(v))


def _table(p: Table, limit: int = 200) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in p.columns)
    rows = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in r) + "</tr>" for r in p.rows[:limit])
    more = f"<div>… {len(p.rows) - limit} more rows (to_pandas() has them all)</div>" if len(p.rows) > limit else ""
    return (f"<h4>{html.escape(p.title)}</h4><div class='scroll'><table class='plain'><tr>{head}</tr>{rows}</table>"
            f"</div>{more}")


def _picture(p: Picture) -> str:
    """The image inline as PNG (a data URI: the page stays one self-contained file)."""
    import base64
    import io
    import zlib

    h, w = p.rgb.shape[:2]
    raw = b"".join(b"\x00" + p.rgb[y].tobytes() for y in range(h))  # filter 0 per scanline

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (len(data).to_bytes(4, "big") + kind + data
                + (zlib.crc32(kind + data) & 0xFFFFFFFF).to_bytes(4, "big"))

    png = io.BytesIO()
    png.write(b"\x89PNG\r\n\x1a\n")
    png.write(chunk(b"IHDR", w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])))
    png.write(chunk(b"IDAT", zlib.compress(raw, 9)))
    png.write(chunk(b"IEND", b""))
    data = base64.b64encode(png.getvalue()).decode()
    return (f"<h4>{html.escape(p.title)}</h4><img class='overlay' alt='{html.escape(p.title)}' width='{w}' "
            f"height='{h}' src='data:image/png;base64,{data}'>")


def render(panels: Iterable, heading: str, notes: Iterable[str] = ()) -> str:
    """One ``<div>`` (with its own ``<style>``) holding every panel."""
    panels = list(panels)
    # element ids unique per view (several results on one notebook page) and the same for
    # the same result (a saved and reloaded result renders identically)
    key = hashlib.sha1("\x00".join([heading] + [getattr(p, "title", None) or getattr(p, "text", "")
                                                 for p in panels]).encode()).hexdigest()[:10]
    parts = []
    for i, p in enumerate(panels):
        if isinstance(p, Note):
            parts.append(f"<div class='note'>{html.escape(p.text)}</div>")
        elif isinstance(p, Tokens):
            parts.append(_tokens(p, f"pyattr-{key}-{i}"))
        elif isinstance(p, Matrix):
            parts.append(_matrix(p, f"pyattr-{key}-{i}"))
        elif isinstance(p, Curves):
            parts.append(_curves(p))
        elif isinstance(p, Graph):
            parts.append(_graph(p, f"pyattr-{key}-{i}"))
        elif isinstance(p, Table):
            parts.append(_table(p))
        elif isinstance(p, Picture):
            parts.append(_picture(p))
    note = "".join(f"<div>{html.escape(n)}</div>" for n in notes)
    return f"<div class='pyattr-result'><style>{_CSS}</style><b>{html.escape(heading)}</b>{note}{''.join(parts)}</div>"


def page(panels: Iterable, heading: str, notes: Iterable[str] = ()) -> str:
    """A whole HTML document (``save_html``)."""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(heading)}</title></head>"
            f"<body>{render(panels, heading, notes)}</body></html>")
