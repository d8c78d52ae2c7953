"""``pyattr docs``: the documentation pages shipped with pyattr, offline.

A wheel carries the Markdown pages of ``docs/`` as ``pyattr/_docs`` (``setup.py``); a
checkout reads ``docs/`` itself. With no page: the list (name and title); with a page:
its text; ``--path``: the folder, to open the pages in an editor or a Markdown viewer.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import List, Optional

from pyattr.cli._common import fail


def docs_dir() -> Optional[Path]:
    """The shipped pages (``pyattr/_docs``), else ``docs/`` of the checkout pyattr runs
    from, else None."""
    pkg = Path(__file__).resolve().parents[1]
    for cand in (pkg / "_docs", pkg.parent / "docs"):
        if (cand / "index.md").is_file():
            return cand
    return None


def pages(root: Path) -> List[str]:
    """Every page, by its path under ``root`` without ``.md`` (``tutorials/relevance``)."""
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.md"))


def title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return ""


def run(args) -> int:
    root = docs_dir()
    if root is None:
        return fail("docs", "this install ships no documentation pages (reinstall pyattr from a checkout or sdist)")
    if args.path:
        print(root)
        return 0
    names = pages(root)
    if args.page is None:
        width = max(len(n) for n in names)
        print(f"pyattr's documentation ({root}); `pyattr docs PAGE` prints a page:")
        for n in names:
            print(f"  {n:{width}s}  {title(root / (n + '.md'))}")
        return 0
    want = args.page[:-3] if args.page.endswith(".md") else args.page
    # a page by its path, or by its last part when that is unique (relevance = tutorials/relevance)
    hits = [n for n in names if n == want] or [n for n in names if n.rsplit("/", 1)[-1] == want]
    if len(hits) != 1:
        by_last = {n.rsplit("/", 1)[-1]: n for n in names}
        close = difflib.get_close_matches(want, names + list(by_last), n=3)
        close = list(dict.fromkeys(by_last.get(c, c) for c in close))  # one name per page
        why = "names more than one page: " + ", ".join(hits) if hits else "is not a page"
        hint = f"; did you mean {', '.join(close)}?" if close and not hits else ""
        return fail("docs", f"{args.page!r} {why}{hint} (`pyattr docs` lists them)")
    print((root / (hits[0] + ".md")).read_text(encoding="utf-8"), end="")
    return 0
