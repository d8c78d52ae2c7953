"""Heatmaps of token relevance: coloured terminal text (rich) and a self-contained HTML page."""

from __future__ import annotations

import html
from typing import Iterable, Tuple

from pyattr.apps.explain import Explanation
from pyattr.results.colours import _BAR, LEGEND_CSS, _ink, _rgb, legend_html, num  # noqa: F401 - re-exported


def _scale(expl: Explanation) -> float:
    m = max((abs(v) for s in expl.segments for v in s.relevance), default=0.0)
    return m if m > 0 else 1.0


def _display(token: str) -> str:
    return token.replace("Ġ", " ").replace("▁", " ").replace("Ċ", "\\n")


def conservation_note(expl: Explanation) -> str:
    return expl.conservation_note


def print_terminal(expl: Explanation, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.text import Text

    # soft_wrap: no hard line breaks when stdout is a file or a pipe
    console = console or Console(soft_wrap=True)
    scale = _scale(expl)
    console.print(f"[bold]model[/bold]   {escape(expl.model)}")
    console.print(f"[bold]target[/bold]  {escape(expl.target_description)}")
    if expl.patch_grid is not None:
        _print_grid(console, expl, scale)
    for i, seg in enumerate(expl.segments if expl.patch_grid is None else ()):
        line = Text(f"[{i + 1}] " if len(expl.segments) > 1 else "")
        for j, (tokn, v) in enumerate(zip(seg.tokens, seg.relevance)):
            r, g, b = _rgb(v, scale)
            if j:
                line.append(" ")
            line.append(_display(tokn), style=f"black on rgb({r},{g},{b})")
        console.print(line)
    if expl.patch_grid is None:
        console.print(legend_line(scale, "tokens", console.is_terminal))
    if expl.image_png:
        console.print(f"relevance map written to {escape(expl.image_png)}")
    console.print(Text(top_line(expl)))
    warning = expl.contention.warning if expl.contention is not None else None
    console.print(
        Text(
            f"target value       {num(expl.target, '+.6f')}\n"
            f"relevance sum      {num(expl.relevance_sum, '+.6f')}\n"
            f"conservation delta {num(expl.conservation_delta, '+.3e')}  (target − Σ relevance; {conservation_note(expl)})\n"
            f"wall time          {expl.wall_time_s * 1e3:.1f} ms  (forward + rule backward)\n"
            + (f"warning            {warning}\n" if warning else "")
            + f"backend            {expl.backend}   rules on {expl.installed} modules"
        )
    )


def legend_line(scale: float, what: str, colour: bool) -> "Text":
    """The terminal heatmap's legend: the values at the two ends of the colour scale and,
    on a terminal (``colour``), the bar between them (blue, white, red); in a pipe or file,
    where no colour is printed, the colours in words."""
    from rich.text import Text

    lo, hi = num(-scale, "+.4f"), num(scale, "+.4f")
    full = f"(full colour at the {what}' largest |relevance|)"
    if not colour:
        return Text(f"legend  blue {lo} … white 0 … red {hi}  {full}")
    line = Text(f"legend  {lo} ")
    for i in range(-8, 9):
        red, g, b = _rgb(scale * i / 8, scale)
        line.append(" ", style=f"on rgb({red},{g},{b})")
    line.append(f" {hi}  blue negative, white zero, red positive {full}")
    return line


def top_line(expl: Explanation, k: int = 5) -> str:
    """The ``k`` tokens of largest |relevance|, each with its position (0-based; with two
    sentences ``sentence:position``): ``top tokens by |relevance| (position 'token'
    relevance): 2 'cat' +13.4901, ...``; an image's patches name their grid cell."""
    ranked = sorted(
        ((v, t, i, j) for i, s in enumerate(expl.segments) for j, (t, v) in enumerate(zip(s.tokens, s.relevance))),
        key=lambda z: -abs(z[0]),
    )[:k]
    if expl.patch_grid is not None:
        return "top patches by |relevance|: " + ", ".join(f"{t} {num(v, '+.4f')}" for v, t, _, _ in ranked)
    two = len(expl.segments) > 1
    where = "sentence:position" if two else "position"
    return (f"top tokens by |relevance| ({where} 'token' relevance): "
            + ", ".join(f"{f'{i + 1}:' if two else ''}{j} {_display(t)!r} {num(v, '+.4f')}" for v, t, i, j in ranked))


def _print_grid(console, expl: Explanation, scale: float) -> None:
    """The patch relevance as a grid, one cell per patch, on the patches' own scale (as the
    PNG; the [CLS] value, often the largest, is printed apart): coloured cells on a
    terminal, numbers when the output is a file or a pipe."""
    from rich.text import Text

    rows, cols = expl.patch_grid
    rel = expl.segments[0].relevance
    patches = rel[1:]
    scale = max((abs(v) for v in patches), default=0.0) or 1.0
    console.print(Text(f"image   {expl.segments[0].text}  ({rows}×{cols} patches; [CLS] {num(rel[0], '+.4f')})"))
    for r in range(rows):
        line = Text()
        for c in range(cols):
            v = patches[r * cols + c]
            if console.is_terminal:
                red, g, b = _rgb(v, scale)
                line.append("  ", style=f"on rgb({red},{g},{b})")
            else:
                line.append(("" if c == 0 else " ") + num(v, "+.4f"))
        console.print(line)
    console.print(legend_line(scale, "patches", console.is_terminal))


def _png_size(data: bytes) -> Tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk ((0, 0) if it is not a PNG)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return 0, 0
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _image_html(expl: Explanation) -> str:
    """Two panels of the same size: the relevance map (the PNG ``explain_image`` wrote,
    drawn at least ~450 pixels wide, whole multiples, pixelated) and the patches as a plain
    heatmap on the legend's colours (the image's own colours can hide the overlay's); each
    under a grid of one cell per patch that shows the patch's value on hover."""
    import base64

    if not expl.image_png and not expl.image_overlay:
        return ""
    raw = expl.image_overlay
    if raw is None:  # an Explanation made elsewhere: the file is the overlay
        try:
            with open(expl.image_png, "rb") as f:
                raw = f.read()
        except OSError:
            return f"<p>relevance map: {html.escape(expl.image_png)}</p>"
    data = base64.b64encode(raw).decode("ascii")
    rel = expl.segments[0].relevance if expl.segments else []
    cls = num(rel[0], "+.5f") if rel else "–"
    rows, cols = expl.patch_grid
    patches = list(rel[1:1 + rows * cols])
    peak = max((abs(v) for v in patches), default=0.0) or 1.0
    w, h = _png_size(raw)
    w, h = (w, h) if w and h else (64 * cols, 64 * rows)
    k = max(1, round(450 / w)) if w < 450 else 1
    w, h = w * k, h * k
    grid = f"grid-template-columns:repeat({cols},1fr);grid-template-rows:repeat({rows},1fr)"
    tips = [f"patch ({i // cols},{i % cols}): {num(v, '+.5f')}" for i, v in enumerate(patches)]
    hover = "".join(f'<div class="patch" data-tip="{t}" title="{t}"></div>' for t in tips)
    label = w / cols >= 64 and h / rows >= 24  # room to print each patch's value
    heat = "".join(
        f'<div class="patch" style="background:rgb{_rgb(v, peak)};color:{_ink(_rgb(v, peak))}" data-tip="{t}" '
        f'title="{t}">{num(v, "+.3g") if label else ""}</div>' for v, t in zip(patches, tips))
    legend = legend_html(num(-peak, "+.4f"), num(peak, "+.4f"),
                         "Patch relevance: blue negative, white zero, red positive (full colour at the patches' "
                         "largest |relevance|). Over the image, greyed so that only relevance is coloured, the same "
                         "hues are laid on with opacity growing with |relevance|. Hover a patch for its value.")
    return (f'<div class="maps"><figure><div class="imgwrap" style="width:{w}px;height:{h}px">'
            f'<img alt="patch relevance over the image" src="data:image/png;base64,{data}">'
            f'<div class="grid" style="{grid}">{hover}</div></div><figcaption>over the image the model saw'
            f'</figcaption></figure>\n<figure><div class="grid heat" style="width:{w}px;height:{h}px;{grid}">{heat}'
            f"</div><figcaption>relevance per patch</figcaption></figure></div>\n{legend}\n"
            f"<p>[CLS] token relevance: {cls}</p>")


def to_html(expl: Explanation) -> str:
    """A self-contained page without scripts: the tokens coloured by relevance (hovering one
    shows its value above it, CSS only), or for an image the patch map; a colour legend;
    the numbers."""
    scale = _scale(expl)

    def spans(tokens: Iterable[str], rel: Iterable[float]) -> str:
        out = []
        for t, v in zip(tokens, rel):
            rgb = _rgb(v, scale)
            out.append(
                f'<span class="tok" style="background:rgb{rgb};color:{_ink(rgb)}" '
                f'data-v="{num(v, "+.5f")}" title="{num(v, "+.5f")}">{html.escape(_display(t))}</span>'
            )
        return " ".join(out)

    image = expl.patch_grid is not None
    warning = expl.contention.warning if expl.contention is not None else None
    warn_html = f'<br><span class="warn">{html.escape(warning)}</span>' if warning else ""
    if image:
        body = _image_html(expl)
    else:
        body = "\n".join(f"<p class='seg'><span class='lbl'>{i + 1}</span> {spans(s.tokens, s.relevance)}</p>"
                         for i, s in enumerate(expl.segments))
        body += "\n" + legend_html(num(-scale, "+.4f"), num(scale, "+.4f"),
                                   "Token relevance: blue negative, white zero, red positive "
                                   "(full colour at the largest |relevance|). Hover a token for its value.")
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>pyattr explain</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 60em; color: #111; font-size: 16px; }}
p.seg {{ line-height: 2.4; }}
.tok {{ position: relative; padding: 0.15em 0.25em; border-radius: 3px; font-family: monospace; font-size: 15px; }}
.tok:hover {{ outline: 2px solid #111; }}
.tok:hover::after, .patch:hover::after {{ position: absolute; left: 50%; bottom: 100%; transform: translate(-50%, -6px);
  background: #222; color: #fff; font: 13px monospace; padding: 2px 6px; border-radius: 3px; white-space: nowrap;
  z-index: 10; pointer-events: none; }}
.tok:hover::after {{ content: attr(data-v); }}
.patch:hover::after {{ content: attr(data-tip); }}
.lbl {{ color: #666; margin-right: 0.5em; }}
.maps {{ display: flex; flex-wrap: wrap; gap: 2em; margin-top: 2em; }}
.maps figure {{ margin: 0; }}
.maps figcaption {{ font-size: 14px; color: #333; margin-top: 0.3em; }}
.imgwrap {{ position: relative; }}
.imgwrap img {{ display: block; width: 100%; height: 100%; image-rendering: pixelated; }}
.imgwrap .grid {{ position: absolute; inset: 0; }}
.grid {{ display: grid; }}
.heat {{ border: 1px solid #999; }}
.heat .patch {{ display: flex; align-items: center; justify-content: center; font: 13px monospace; }}
.patch {{ position: relative; }}
.patch:hover {{ outline: 2px solid #111; outline-offset: -2px; }}
td {{ padding: 0.15em 1em 0.15em 0; vertical-align: top; }} td:first-child {{ white-space: nowrap; }}
.warn {{ color: #8a4b00; font-size: 14px; }}
{LEGEND_CSS}</style></head><body>
<h1>{"Patch" if image else "Token"} relevance</h1>
<p>{html.escape(expl.target_description)} — model <code>{html.escape(expl.model)}</code></p>
{body}
<table>
<tr><td>target value</td><td>{num(expl.target, "+.6f")}</td></tr>
<tr><td>relevance sum</td><td>{num(expl.relevance_sum, "+.6f")}</td></tr>
<tr><td>conservation delta</td><td>{num(expl.conservation_delta, "+.3e")} ({html.escape(conservation_note(expl))})</td></tr>
<tr><td>wall time</td><td>{expl.wall_time_s * 1e3:.1f} ms{warn_html}</td></tr>
<tr><td>backend</td><td>{html.escape(expl.backend)}</td></tr>
</table>
<p>Red: positive relevance, blue: negative; {"each block is one patch, opacity by |relevance| on the patches' scale; hover a patch for its value" if image else "hover a token for its value"}.</p>
</body></html>
"""
