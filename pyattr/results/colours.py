"""The colours every pyattr view shares (the command line's pages, the terminal, the result
objects' notebook views): blue for negative, white at zero, red for positive relevance, the
legend bar with its end values, and numbers printed without a signed zero."""

from __future__ import annotations

from typing import Tuple


def _rgb(v: float, scale: float) -> Tuple[int, int, int]:
    """Red for positive, blue for negative relevance, white at zero."""
    a = max(-1.0, min(1.0, v / scale))
    k = int(round(255 * (1 - abs(a))))
    return (255, k, k) if a >= 0 else (k, k, 255)


def _ink(rgb: Tuple[int, int, int]) -> str:
    """Black or white text, whichever contrasts more with the background ``rgb`` (WCAG
    relative luminance): white on the deep blues, black on everything else."""
    def lin(c: int) -> float:
        c = c / 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    lum = 0.2126 * lin(rgb[0]) + 0.7152 * lin(rgb[1]) + 0.0722 * lin(rgb[2])
    return "#000" if (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) else "#fff"


# The colour legend every HTML page carries (explain, image, patch, generate): a bar from
# blue (negative) through white (zero) to red (positive), its end values, and a caption.
LEGEND_CSS = """
.legend { margin: 1em 0; font-size: 14px; color: #222; }
.legend .lg-cap { margin-bottom: 0.3em; }
.legend .lg-bar { width: 320px; height: 16px; border: 1px solid #666; border-radius: 2px; }
.legend .lg-ticks { width: 322px; display: grid; grid-template-columns: 1fr auto 1fr; font: 13px monospace; margin-top: 2px; }
.legend .lg-ticks span:last-child { text-align: right; }
"""
_BAR = "linear-gradient(to right, rgb(0,0,255), rgb(255,255,255), rgb(255,0,0))"


def legend_html(lo: str, hi: str, caption: str, ids: str = "legend", bar: str = _BAR) -> str:
    """A legend: ``caption`` over the colour bar, ``lo`` / 0 / ``hi`` under its ends and
    middle; ``ids`` names the element (and its end labels ``ids-lo``, ``ids-hi``)."""
    return (f'<div class="legend" id="{ids}"><div class="lg-cap">{caption}</div>'
            f'<div class="lg-bar" style="background:{bar}"></div>'
            f'<div class="lg-ticks"><span id="{ids}-lo">{lo}</span><span>0</span><span id="{ids}-hi">{hi}</span></div></div>')


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
