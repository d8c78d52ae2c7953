"""The notebook views in a real headless Chromium (driven by Playwright), as
tests/test_browser.py opens the command line's pages: every pyattr HTML view the example
notebooks store (what a notebook shows for a result, ``_repr_html_``), each on a page of
its own; the documentation pages the notebooks render to (``docs/notebooks/render.py``,
built with MkDocs and the Material theme into a small site); and fresh views checked
against their tensors.

Each must load with no console error, no page error and no request leaving the file; show
its colour legends with a colour bar and signed ends; carry every value in the hover title
of the unit the mouse is on (and colour the unit by the value's sign); keep token text
readable on its background; and cut nothing off: nothing sticks out of the view except
inside its scrolling containers, no token's text overflows its box, and a docs page does
not scroll sideways. Full-page screenshots go to ``$PYATTR_BROWSER_ARTIFACTS`` (CI keeps
them), else to a pytest temporary folder.

Needs Chromium and playwright (skip, or fail under ``PYATTR_REQUIRE_BROWSER=1``, as
tests/test_browser.py); the docs pages also need mkdocs with mkdocs-material.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_browser import Page, _unavailable, artifacts, assert_legends, assert_readable, browser  # noqa: F401
from test_notebooks import NAMES, NOTEBOOKS, ex, render

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[1]

_VALUE = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|nan)$")

# what a view's elements may not do: stick out of the view (except inside a scrolling
# container, which must then scroll), overflow their own box (a token's text cut)
_OVERFLOW_JS = """
root => {
  const R = root.getBoundingClientRect(), bad = [];
  const name = e => `${e.tagName.toLowerCase()}${e.className && typeof e.className === 'string' ? '.' + e.className : ''}`
    + ` '${(e.textContent || '').trim().slice(0, 24)}'`;
  for (const e of root.querySelectorAll('*')) {
    if (e.tagName === 'STYLE') continue;
    const b = e.getBoundingClientRect();
    if (b.width === 0 && b.height === 0) continue;
    const sc = e.parentElement && e.parentElement.closest('.scroll, .nb-output');
    if (sc && root.contains(sc) && sc !== root) continue;  // inside a scrolling container: checked below
    if (b.left < R.left - 1 || b.right > R.right + 1) bad.push(`${name(e)} sticks out: ${b.left}..${b.right} of ${R.left}..${R.right}`);
  }
  for (const e of root.querySelectorAll('.scroll')) {
    const ox = getComputedStyle(e).overflowX;
    if (e.scrollWidth > e.clientWidth + 1 && !['auto', 'scroll'].includes(ox)) bad.push(`${name(e)} cuts its content (overflow-x ${ox})`);
  }
  for (const e of root.querySelectorAll('.tok, td, th, .lg-ticks span, h4')) {
    if (e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX === 'hidden') bad.push(`${name(e)} text cut`);
  }
  return bad;
}
"""


def _value(title: str) -> float:
    return float(_VALUE.search(title).group(1))


def _standalone(view: str, title: str) -> str:
    """A view as a notebook shows it: on a white page, in an output area about as wide as
    JupyterLab's (900 px)."""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head>"
            f"<body style='margin: 16px'><div class='output' style='max-width: 900px'>{view}</div></body></html>")


def check_view(p: Page, root) -> None:
    """One pyattr view on page ``p``: visible, its legends, readable units whose hover
    titles carry their values with the colour of their sign, the curves where they
    belong, nothing cut off."""
    page = p.page
    assert root.is_visible()
    units = root.locator(".tok[title], td[title]:not(.na)")
    curves = root.locator("svg circle")
    assert units.count() or curves.count() or root.locator("table.plain").count()
    if units.count():
        legends = root.locator(".legend")
        assert legends.count() >= 1
        assert_legends(root)
        assert_readable(root.locator(".tok[style], td[style]"))
        seen = units.evaluate_all("es => es.map(e => [e.getAttribute('title'), getComputedStyle(e).backgroundColor, "
                                  "e.innerText, e.tagName])")
        titles = [t for t, _, _, _ in seen]
        values = [_value(t) for t in titles]
        finite = [i for i, v in enumerate(values) if v == v]
        k = max(finite, key=lambda i: abs(values[i]))  # the strongest unit, under the mouse
        unit = units.nth(k)
        unit.hover()
        box = unit.bounding_box()
        under = page.evaluate("([x, y]) => document.elementFromPoint(x, y).getAttribute('title')",
                              [box["x"] + box["width"] / 2, box["y"] + box["height"] / 2])
        assert under == titles[k]  # the title under the mouse is this unit's: nothing covers it
        for i in finite:
            _, bg, text, tag = seen[i]
            r, g, b = [float(x) for x in bg[bg.index("(") + 1:bg.index(")")].split(",")[:3]]
            if abs(values[i]) > 0.05 * abs(values[k]):  # clearly signed: red positive, blue negative
                assert (r > b) == (values[i] > 0), (titles[i], bg)
            if tag == "TD":  # the printed value (2 digits) is the title's (4 digits)
                assert abs(float(text) - values[i]) <= 0.051 * abs(values[i]) + 1e-12, (text, titles[i])
            else:
                assert f" · {text!r}" in titles[i] or text in titles[i], (text, titles[i])
    if curves.count():
        tips = curves.evaluate_all("es => es.map(e => [e.querySelector('title').textContent, +e.getAttribute('cy')])")
        pts = [(_value(t.split(",")[-1].split()[-1]), cy) for t, cy in tips]
        pts.sort()
        # a larger value is drawn higher (smaller y), whatever the series
        assert all(a[1] >= b[1] - 0.11 for a, b in zip(pts, pts[1:])), pts
        assert root.locator("svg polyline").count() >= 1
        box = root.locator("svg").bounding_box()
        assert box["width"] >= 300 and box["height"] >= 150, box
    bad = root.evaluate(_OVERFLOW_JS)
    assert bad == [], bad


@pytest.mark.parametrize("name", NAMES)
def test_notebook_views(browser, artifacts, tmp_path, name):
    """Every view the notebook stores, on a page of its own, as a notebook shows it."""
    import nbformat

    nb = nbformat.read(str(NOTEBOOKS / f"{name}.ipynb"), as_version=4)
    views = ex.result_views(nb)
    assert views
    for k, (cell, view) in enumerate(views):
        f = tmp_path / f"{name}-{k}.html"
        f.write_text(_standalone(view, f"{name} cell {cell}"), encoding="utf-8")
        p = Page(browser, f)
        roots = p.page.locator(".pyattr-result")
        assert roots.count() == 1
        check_view(p, roots.first)
        p.finish(artifacts, f"notebook-{name}-{k}")


# the site's own hooks (mkdocs_hooks.py: notebooks made into pages, Sphinx roles shown short)
HOOK = (Path(__file__).resolve().parents[1] / "mkdocs_hooks.py").read_text()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A MkDocs site of the notebook pages, built as the documentation builds them (the
    Material theme, the docs' stylesheet, the hook that renders the notebooks; strict)."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        _unavailable("mkdocs and mkdocs-material are not installed (pip install -e '.[dev]')")
    import shutil

    root = tmp_path_factory.mktemp("notebook-site")
    docs = root / "docs"
    shutil.copytree(NOTEBOOKS, docs / "notebooks", ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    css = ROOT / "docs" / "stylesheets" / "extra.css"
    if css.exists():
        (docs / "stylesheets").mkdir()
        shutil.copy(css, docs / "stylesheets" / "extra.css")
    (docs / "index.md").write_text("# Notebooks\n")
    (root / "hooks.py").write_text(HOOK)
    nav = "\n".join(f"      - {n}: notebooks/{n}.md" for n in NAMES)
    (root / "mkdocs.yml").write_text(f"""site_name: notebooks
docs_dir: docs
site_dir: site
strict: true
theme: {{name: material, font: false, features: [navigation.sections, toc.integrate, content.code.copy]}}
{"extra_css: [stylesheets/extra.css]" if css.exists() else ""}
hooks: [hooks.py]
exclude_docs: |
  notebooks/*.py
  __pycache__/
plugins: []
validation: {{nav: {{omitted_files: warn, not_found: warn}}, links: {{not_found: warn, anchors: warn, unrecognized_links: warn}}}}
markdown_extensions: [toc: {{permalink: true}}, tables, admonition, pymdownx.highlight: {{use_pygments: true}}, pymdownx.superfences]
nav:
  - Home: index.md
  - Notebooks:
{nav}
""")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's notice about its successor
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(root / "mkdocs.yml")],
                       cwd=root, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not re.search(r"^(WARNING|ERROR)\b", r.stderr, re.M), r.stderr
    assert not [p for p in (root / "site").rglob("*") if p.suffix in (".py", ".pyc")]
    return root / "site"


@pytest.mark.parametrize("width", [1280, 760])
def test_notebook_pages_in_the_docs(browser, artifacts, site, width):
    """Each notebook's documentation page: the code blocks, every view and picture the
    notebook stores, each checked as a view; the page does not scroll sideways; the
    notebook downloads from it."""
    import nbformat

    for name in NAMES:
        nb = nbformat.read(str(NOTEBOOKS / f"{name}.ipynb"), as_version=4)
        f = site / "notebooks" / name / "index.html"
        assert (site / "notebooks" / f"{name}.ipynb").is_file()  # the download link's target
        p = Page(browser, f)
        page = p.page
        page.set_viewport_size({"width": width, "height": 900})
        title = nb.cells[0].source.splitlines()[0][2:]
        assert page.locator(".md-content h1").first.inner_text().strip().rstrip("¶").strip() == title
        fences = re.findall(r"^`{3,}(python|text)$", render.render(NOTEBOOKS / f"{name}.ipynb"), re.M)
        assert fences.count("python") == sum(c.cell_type == "code" for c in nb.cells)
        assert page.locator(".md-content div.highlight").count() == len(fences)  # code cells, text outputs
        roots = page.locator(".md-content .pyattr-result")
        assert roots.count() == len(ex.result_views(nb))
        content = page.locator(".md-content__inner").bounding_box()
        for k in range(roots.count()):
            root = roots.nth(k)
            root.scroll_into_view_if_needed()
            box = root.bounding_box()
            assert box["x"] >= content["x"] - 1 and box["x"] + box["width"] <= content["x"] + content["width"] + 1
            check_view(p, root)
        # the stored image outputs (plots), and the overlays image results draw in their views
        imgs = page.locator(".md-content .nb-output img:not(.overlay)")
        assert imgs.count() == sum(any(k.startswith("image/") for k in o.get("data", {}))
                                   for c in nb.cells for o in c.get("outputs", []))
        overlays = page.locator(".md-content .pyattr-result img.overlay")
        assert overlays.count() == sum(_text(o).count("<img class='overlay'") for c in nb.cells
                                       for o in c.get("outputs", []))
        imgs = page.locator(".md-content .nb-output img")
        for k in range(imgs.count()):
            img = imgs.nth(k)
            assert img.evaluate("e => e.complete && e.naturalWidth > 0")
            b = img.bounding_box()
            assert b["x"] + b["width"] <= content["x"] + content["width"] + 1
        wide = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
        assert wide[0] <= wide[1], f"{name}: the page scrolls sideways {wide}"
        link = page.locator(f'.md-content a[href$="{name}.ipynb"]')
        assert link.count() == 1
        page.evaluate("window.scrollTo(0, 0)")  # the screenshot from the top (the header where it belongs)
        p.finish(artifacts, f"docs-{name}-{width}")


def _text(output) -> str:
    """An output's HTML (a view's markup), "" for other outputs."""
    html = output.get("data", {}).get("text/html", "")
    return "".join(html) if isinstance(html, list) else html


def test_fresh_views_carry_their_tensors(browser, artifacts, tmp_path):
    """Views made here, against the tensors they show: each token's hover title is its
    position, string and value; each layer cell's is its layer, token and summed value."""
    import pyattr
    import pyattr.toy
    from pyattr.results.colours import num

    model, tok, _ = pyattr.toy.load()
    r = pyattr.relevance(model, ["cat dog owl fox cat dog", "red blue king red"], tokenizer=tok, target=["owl", "blue"])
    lay = pyattr.layer_relevance(model, "cat dog owl fox cat dog", "residual", tokenizer=tok, target="owl")
    f = tmp_path / "relevance.html"
    f.write_text(r.to_html(), encoding="utf-8")
    p = Page(browser, f)
    toks = p.page.locator(".tok")
    want = [f"position {i} · {t!r} · relevance {num(float(r.token_relevance[row, i]), '+.4g')}"
            for row in range(2) for i, t in enumerate(r.tokens[row]) if t is not None]
    assert toks.evaluate_all("es => es.map(e => e.getAttribute('title'))") == want
    check_view(p, p.page.locator(".pyattr-result"))
    assert p.page.locator(".legend").count() == 2
    p.finish(artifacts, "fresh-relevance")

    f = tmp_path / "layers.html"
    f.write_text(lay.to_html(), encoding="utf-8")
    p = Page(browser, f)
    cells = p.page.locator("td[title]")
    want = [f"layer {path} · token {t!r} · relevance {num(float(lay[path].relevance[0, i].double().sum()), '+.4g')}"
            for path in lay.paths for i, t in enumerate(lay.tokens[0])]
    assert cells.evaluate_all("es => es.map(e => e.getAttribute('title'))") == want
    check_view(p, p.page.locator(".pyattr-result"))
    p.finish(artifacts, "fresh-layers")
