"""An executed notebook as a documentation page: Markdown with its outputs.

    python docs/notebooks/render.py docs/notebooks/relevance.ipynb   # the page, on stdout

Markdown cells stay as they are; code cells become fenced ``python`` blocks; outputs
follow their cell: HTML (pyattr's views, pandas tables) embedded as it is, images as
``data:`` URIs, text and streams as ``text`` blocks. Nothing is executed here (the stored
outputs are what ``execute.py`` wrote, checked by tests/test_notebooks.py), and nothing
but the standard library is imported, so that the documentation build needs no Jupyter.

For MkDocs, :func:`pages` gives every notebook's page by its path in the site
(``notebooks/<name>.md``), for a hook to add as generated files (``on_files``).
"""

from __future__ import annotations

import html
import json
import re
import sys
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent

#: the output kinds shown, best first (a notebook stores several for one value)
_PREFERRED = ("text/html", "image/png", "image/jpeg", "image/svg+xml", "text/markdown", "text/plain")

_CSS = ("<style>.nb-output{margin:0 0 1.2em;overflow-x:auto;max-width:100%}"
        ".nb-output img{max-width:100%;height:auto}"
        ".nb-output table.dataframe{border-collapse:collapse;font-size:12px}"
        ".nb-output table.dataframe td,.nb-output table.dataframe th{padding:2px 8px;"
        "border-bottom:1px solid #ddd;text-align:right}</style>")


def _text(v) -> str:
    return "".join(v) if isinstance(v, list) else str(v)


def _fence(code: str, lang: str = "") -> str:
    """A fenced block that ``code`` cannot close (a longer fence than any run inside)."""
    longest = max((len(m) for m in re.findall(r"`{3,}", code)), default=2)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{lang}\n{code.rstrip()}\n{ticks}"


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _raw_html(markup: str) -> str:
    """HTML that Markdown passes through untouched: one block that starts a line, with no
    blank line inside (one could end the raw block; HTML gives blank lines no meaning
    outside ``<pre>``, which pyattr's views and pandas' tables do not use)."""
    return "\n".join(line for line in markup.strip().splitlines() if line.strip())


def _output(out: dict) -> str:
    kind = out.get("output_type")
    if kind == "stream":
        return _fence(_ANSI.sub("", _text(out.get("text", ""))), "text")
    if kind == "error":
        tb = _ANSI.sub("", "\n".join(out.get("traceback", [])) or f"{out.get('ename')}: {out.get('evalue')}")
        return _fence(tb, "text")
    data = out.get("data", {})
    mime = next((m for m in _PREFERRED if m in data), None)
    if mime is None:
        return ""
    value = _text(data[mime])
    if mime == "text/html":
        body = value
    elif mime in ("image/png", "image/jpeg"):
        alt = html.escape(_text(data.get("text/plain", "output")), quote=True)
        body = f'<img alt="{alt}" src="data:{mime};base64,{"".join(value.split())}">'
    elif mime == "image/svg+xml":
        body = value
    elif mime == "text/markdown":
        return value.strip()
    else:
        return _fence(value, "text")
    return _raw_html(f'<div class="nb-output">{body}</div>')


def render(notebook, download: str | None = None) -> str:
    """The Markdown page of ``notebook`` (a path, or the notebook as a dict). ``download``:
    a link target for the notebook file, written under the page's first heading."""
    nb = json.loads(Path(notebook).read_text(encoding="utf-8")) if isinstance(notebook, (str, Path)) else notebook
    parts: List[str] = []
    titled = False
    for cell in nb.get("cells", []):
        source = _text(cell.get("source", ""))
        if cell.get("cell_type") == "markdown":
            parts.append(source.strip())
            if download and not titled and source.lstrip().startswith("# "):
                parts.append(f"*An executed notebook: [download it]({download}) to run it yourself.*")
                titled = True
        elif cell.get("cell_type") == "code":
            if source.strip():
                parts.append(_fence(source, "python"))
            parts.extend(p for p in (_output(o) for o in cell.get("outputs", [])) if p)
    return "\n\n".join(p for p in parts + [_CSS] if p) + "\n"


def pages(docs_dir, folder: str = "notebooks") -> Dict[str, str]:
    """``{"notebooks/<name>.md": page}`` for every ``<docs_dir>/notebooks/<name>.ipynb``,
    each page linking its notebook for download."""
    root = Path(docs_dir) / folder
    return {f"{folder}/{p.stem}.md": render(p, download=p.name) for p in sorted(root.glob("*.ipynb"))}


if __name__ == "__main__":
    for arg in sys.argv[1:] or sorted(str(p) for p in HERE.glob("*.ipynb")):
        sys.stdout.write(render(arg, download=Path(arg).name))
