"""Heatmaps of token relevance: coloured terminal text (rich) and a self-contained HTML page."""

from __future__ import annotations

import html
from typing import Iterable, Tuple

from pyattr.apps.explain import Explanation


def _scale(expl: Explanation) -> float:
    m = max((abs(v) for s in expl.segments for v in s.relevance), default=0.0)
    return m if m > 0 else 1.0


def _rgb(v: float, scale: float) -> Tuple[int, int, int]:
    """Red for positive, blue for negative relevance, white at zero."""
    a = max(-1.0, min(1.0, v / scale))
    k = int(round(255 * (1 - abs(a))))
    return (255, k, k) if a >= 0 else (k, k, 255)


def _display(token: str) -> str:
    return token.replace("Ġ", " ").replace("▁", " ").replace("Ċ", "\\n")


def num(v: float, spec: str) -> str:
    """``format(v, spec)``, except that a value that rounds to zero prints as an unsigned
    zero (``0.0000``, ``0.000e+00``), never ``-0.0000`` or ``+0.0000``."""
    s = format(v, spec)
    try:
        if float(s) == 0.0:
            return format(0.0, spec.replace("+", "").replace(" ", ""))
    except ValueError:  # nan, inf
        pass
    return s


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
    if expl.image_png:
        console.print(f"relevance map written to {escape(expl.image_png)}")
    top = sorted(
        ((v, t, i) for i, s in enumerate(expl.segments) for t, v in zip(s.tokens, s.relevance)),
        key=lambda z: -abs(z[0]),
    )[:5]
    what = "patches" if expl.patch_grid is not None else "tokens"
    console.print(Text(f"top {what} by |relevance|: " + ", ".join(f"{_display(t)!r}={num(v, '+.4f')}" for v, t, _ in top)))
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


def _image_html(expl: Explanation) -> str:
    import base64

    if not expl.image_png:
        return ""
    try:
        with open(expl.image_png, "rb") as f:
            data = base64.b64encode(f.read()).decode("ascii")
    except OSError:
        return f"<p>relevance map: {html.escape(expl.image_png)}</p>"
    cls = num(expl.segments[0].relevance[0], "+.5f") if expl.segments and expl.segments[0].relevance else "–"
    return (f'<p><img alt="patch relevance" src="data:image/png;base64,{data}"></p>\n'
            f"<p>[CLS] token relevance: {cls}</p>")


def to_html(expl: Explanation) -> str:
    scale = _scale(expl)

    def spans(tokens: Iterable[str], rel: Iterable[float]) -> str:
        out = []
        for t, v in zip(tokens, rel):
            r, g, b = _rgb(v, scale)
            out.append(
                f'<span class="tok" style="background:rgb({r},{g},{b})" '
                f'title="{num(v, "+.5f")}">{html.escape(_display(t))}</span>'
            )
        return " ".join(out)

    warning = expl.contention.warning if expl.contention is not None else None
    warn_html = f" <strong>({html.escape(warning)})</strong>" if warning else ""
    rows = _image_html(expl) if expl.patch_grid is not None else "\n".join(
        f"<p><span class='lbl'>{i + 1}</span> {spans(s.tokens, s.relevance)}</p>"
        for i, s in enumerate(expl.segments)
    )
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>pyattr explain</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 60em; }}
.tok {{ padding: 0.1em 0.2em; border-radius: 3px; font-family: monospace; }}
.lbl {{ color: #888; margin-right: 0.5em; }}
td {{ padding: 0.1em 1em 0.1em 0; }}
</style></head><body>
<h1>{"Patch" if expl.patch_grid is not None else "Token"} relevance</h1>
<p>{html.escape(expl.target_description)} — model <code>{html.escape(expl.model)}</code></p>
{rows}
<table>
<tr><td>target value</td><td>{num(expl.target, "+.6f")}</td></tr>
<tr><td>relevance sum</td><td>{num(expl.relevance_sum, "+.6f")}</td></tr>
<tr><td>conservation delta</td><td>{num(expl.conservation_delta, "+.3e")} ({html.escape(conservation_note(expl))})</td></tr>
<tr><td>wall time</td><td>{expl.wall_time_s * 1e3:.1f} ms{warn_html}</td></tr>
<tr><td>backend</td><td>{html.escape(expl.backend)}</td></tr>
</table>
<p>Red: positive relevance, blue: negative; {"each block is one patch, opacity by |relevance| on the patches' scale" if expl.patch_grid is not None else "hover a token for its value"}.</p>
</body></html>
"""
