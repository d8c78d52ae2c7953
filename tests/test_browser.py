"""Every HTML page pyattr writes, opened in a real headless Chromium (driven by Playwright):
``explain --html`` (tokens), ``explain --image --html`` (patches), ``patch --html`` (cells),
``patch --edges --html`` (the circuit graph and the edge grid) and ``generate --html``
(tokens and matrix cells). Each page must load with no console
error, no page error and no request leaving the file (self-contained); show a visible
colour legend with its value range; show the value of the unit under the mouse after a
real hover; keep token text readable on its background (contrast). A full-page
screenshot of each goes to ``$PYATTR_BROWSER_ARTIFACTS`` (CI keeps them), else to a
pytest temporary folder.

Needs Chromium (Debian: ``apt-get install chromium``; ``$PYATTR_CHROMIUM`` names another
binary) and the ``playwright`` package; without them the tests skip, or fail when
``PYATTR_REQUIRE_BROWSER=1`` (as ``.ci/run`` sets).
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

# no network of any kind: Chromium would otherwise call home (updates, sync, safe browsing)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-default-apps", "--disable-extensions", "--no-default-browser-check"]
VIEWPORT = {"width": 1280, "height": 900}


def _chromium():
    for c in (os.environ.get("PYATTR_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
              shutil.which("chromium-browser")):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def _unavailable(reason):
    if os.environ.get("PYATTR_REQUIRE_BROWSER") == "1":
        pytest.fail(f"PYATTR_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed (pip install -e '.[dev]')")
    exe = _chromium()
    if exe is None:
        _unavailable("no Chromium binary (apt-get install chromium, or set PYATTR_CHROMIUM)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    d = os.environ.get("PYATTR_BROWSER_ARTIFACTS")
    path = Path(d) if d else tmp_path_factory.mktemp("browser-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Page:
    """A page opened from a file, recording console errors, page errors and any request
    that is not the file itself or inline data."""

    def __init__(self, browser, path: Path):
        self.problems = []
        self.page = browser.new_page(viewport=VIEWPORT)
        self.page.on("console", lambda m: m.type == "error" and self.problems.append(f"console error: {m.text}"))
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("request", lambda r: r.url.startswith(("file:", "data:"))
                     or self.problems.append(f"request off the page: {r.url}"))
        self.page.goto(path.resolve().as_uri(), wait_until="load")

    def after(self, el) -> str:
        """The text a ``::after`` pseudo-element shows (``none`` if it has no content)."""
        c = el.evaluate("e => getComputedStyle(e, '::after').content")
        return c[1:-1] if c.startswith('"') else c

    def finish(self, artifacts: Path, name: str) -> Path:
        """The full-page screenshot (as the page stands, hover included); then no errors."""
        out = artifacts / f"{name}.png"
        self.page.screenshot(path=str(out), full_page=True)
        self.page.close()
        assert out.stat().st_size > 1000
        assert self.problems == [], self.problems
        return out


def _rgb(css: str):
    return [float(x) for x in css[css.index("(") + 1:css.index(")")].split(",")[:3]]


def contrast(fg: str, bg: str) -> float:
    """WCAG contrast ratio of two computed CSS colours ``rgb(r, g, b)``."""
    def lum(css):
        c = [v / 255 for v in _rgb(css)]
        c = [v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4 for v in c]
        return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]
    a, b = sorted((lum(fg), lum(bg)), reverse=True)
    return (a + 0.05) / (b + 0.05)


def assert_legends(page, lo=None, hi=None, ids="legend"):
    """Every legend is visible with a colour bar (a gradient) a person can see and end
    values; ``lo`` / ``hi``: what the ``ids`` legend's ends must read."""
    legends = page.locator(".legend")
    assert legends.count() >= 1
    for k in range(legends.count()):
        lg = legends.nth(k)
        assert lg.is_visible()
        bar = lg.locator(".lg-bar")
        box = bar.bounding_box()
        assert box["width"] >= 150 and box["height"] >= 10, box
        assert "linear-gradient" in bar.evaluate("e => getComputedStyle(e).backgroundImage")
        ticks = lg.locator(".lg-ticks span").all_inner_texts()
        assert len(ticks) == 3 and ticks[1] == "0" and ticks[0].startswith("-") and ticks[2].startswith("+"), ticks
        assert float(lg.locator(".lg-ticks").evaluate("e => parseFloat(getComputedStyle(e).fontSize)")) >= 12
        assert lg.locator(".lg-cap").inner_text().strip()
    if lo is not None:
        assert page.locator(f"#{ids}-lo").inner_text() == lo
        assert page.locator(f"#{ids}-hi").inner_text() == hi


def assert_readable(loc, minimum=4.5):
    """Each element's text contrasts with its own background (WCAG AA: 4.5) and is at
    least 12 px."""
    styles = loc.evaluate_all(
        "es => es.map(e => { const s = getComputedStyle(e); return [s.color, s.backgroundColor, s.fontSize, "
        "e.textContent]; })")
    assert styles
    for fg, bg, size, text in styles:
        if bg in ("rgba(0, 0, 0, 0)", "transparent"):
            continue
        assert contrast(fg, bg) >= minimum, (text, fg, bg)
        assert float(size[:-2]) >= 12, (text, size)


def _argmax_abs(values):
    return max(range(len(values)), key=lambda i: abs(values[i]))


def test_explain_page(browser, artifacts, tmp_path):
    from pyattr.apps.render import num

    page_file = tmp_path / "explain.html"
    r = run_cli("explain", "--html", page_file, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    rel = [v for s in doc["segments"] for v in s["relevance"]]
    scale = max(abs(v) for v in rel)
    p = Page(browser, page_file)
    page = p.page
    assert_legends(page, num(-scale, "+.4f"), num(scale, "+.4f"))
    toks = page.locator(".tok")
    assert toks.count() == len(rel)
    assert_readable(toks)
    k = _argmax_abs(rel)
    tok = toks.nth(k)
    assert p.after(tok) == "none"  # no readout before the mouse is there
    tok.hover()
    shown = p.after(tok)
    assert float(shown) == pytest.approx(rel[k], abs=1e-5) and shown == num(rel[k], "+.5f")
    assert tok.evaluate("e => getComputedStyle(e, '::after').visibility") == "visible"
    p.finish(artifacts, "explain")


VISION_SIZE, VISION_PATCH = 32, 8  # 4 × 4 patches + [CLS]


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    """A tiny random ViT classifier with its image processor, and a picture to show it."""
    T = pytest.importorskip("transformers")
    Image = pytest.importorskip("PIL.Image")
    import numpy as np
    import torch

    root = tmp_path_factory.mktemp("vit")
    torch.manual_seed(0)
    cfg = T.ViTConfig(image_size=VISION_SIZE, patch_size=VISION_PATCH, hidden_size=32, intermediate_size=48,
                      num_attention_heads=4, num_hidden_layers=2, num_labels=3, initializer_range=0.2,
                      id2label={0: "cat", 1: "dog", 2: "bird"}, label2id={"cat": 0, "dog": 1, "bird": 2})
    T.ViTForImageClassification(cfg).eval().save_pretrained(root / "vit")
    T.ViTImageProcessor(size={"height": VISION_SIZE, "width": VISION_SIZE}).save_pretrained(root / "vit")
    y, x = np.mgrid[0:96, 0:96]  # a grey ground, a yellow disc, a dark bar
    img = np.full((96, 96, 3), 180, dtype=np.uint8)
    img[(x - 34) ** 2 + (y - 40) ** 2 < 18 ** 2] = (235, 190, 40)
    img[64:80, 40:90] = (40, 40, 60)
    Image.fromarray(img).save(root / "img.png")
    return root


def test_image_page(browser, artifacts, tmp_path, vit_dir):
    from pyattr.apps.render import num

    page_file = tmp_path / "image.html"
    r = run_cli("explain", "--model", vit_dir / "vit", "--image", vit_dir / "img.png", "--png", tmp_path / "m.png",
                "--html", page_file, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    rows, cols = doc["patch_grid"]
    patches = doc["segments"][0]["relevance"][1:]
    peak = max(abs(v) for v in patches)
    p = Page(browser, page_file)
    page = p.page
    assert_legends(page, num(-peak, "+.4f"), num(peak, "+.4f"))
    img = page.locator(".imgwrap img")
    assert img.is_visible() and img.evaluate("e => e.complete && e.naturalWidth > 0")
    box = img.bounding_box()
    assert box["width"] >= 400, box  # the 64-pixel map drawn large enough to see
    over, heat = page.locator(".imgwrap .patch"), page.locator(".heat .patch")
    assert over.count() == heat.count() == rows * cols == len(patches)
    cell_box = over.nth(rows * cols - 1).bounding_box()  # the hover grid lies on the image
    assert abs(cell_box["x"] + cell_box["width"] - (box["x"] + box["width"])) < 2
    assert abs(cell_box["y"] + cell_box["height"] - (box["y"] + box["height"])) < 2
    heat_box = page.locator(".heat").bounding_box()
    assert abs(heat_box["width"] - box["width"]) < 4 and abs(heat_box["height"] - box["height"]) < 4
    assert_readable(heat)  # the heatmap's printed values
    k = _argmax_abs(patches)
    want = f"patch ({k // cols},{k % cols}): {num(patches[k], '+.5f')}"
    assert p.after(heat.nth(k)) == "none"
    over.nth(k).hover()
    assert p.after(over.nth(k)) == want
    heat.nth(k).hover()
    assert p.after(heat.nth(k)) == want
    assert heat.nth(k).inner_text() == num(patches[k], "+.3g")
    p.finish(artifacts, "explain-image")


def test_image_result_view(browser, artifacts, tmp_path):
    """The notebook view of an image result (to_html: the same markup as _repr_html_) draws
    the patch relevance over the image, whole inside 1280 px, before the patch grid."""
    import numpy as np
    from PIL import Image

    import pyattr

    model, proc = pyattr.toy.load_squares()
    img = np.full((32, 32, 3), 255, np.uint8)
    img[4:12, 20:28] = (255, 0, 0)
    res = pyattr.relevance(model, dict(proc(Image.fromarray(img), return_tensors="pt")))
    page_file = tmp_path / "image-result.html"
    page_file.write_text(res.to_html(), encoding="utf-8")
    p = Page(browser, page_file)
    over = p.page.locator("img.overlay")
    assert over.count() == 1 and over.is_visible() and over.evaluate("e => e.complete && e.naturalWidth > 0")
    box = over.bounding_box()
    assert box["width"] >= 256 and box["x"] + box["width"] <= VIEWPORT["width"], box
    grid = p.page.locator("table.grid").first.bounding_box()
    assert grid["y"] > box["y"] + box["height"] - 1  # the numbers follow the picture
    p.finish(artifacts, "image-result")


def test_patch_page(browser, artifacts, tmp_path):
    from pyattr.apps.render import num

    page_file, js = tmp_path / "patch.html", tmp_path / "patch.json"
    r = run_cli("patch", "--model", "induction", "--clean", "sun cat red tree sun", "--corrupt", "dog cat red tree sun",
                "--method", "all", "--nodes", "residual,heads", "--html", page_file, "--json", js)
    assert r.returncode == 0, r.stderr
    doc = json.loads(js.read_text())
    res = doc["methods"]["relp"]["effects"]["residual"]  # (layer, position)
    flat = [(v, layer, pos) for layer, row in enumerate(res) for pos, v in enumerate(row)]
    v, layer, pos = max(flat, key=lambda z: abs(z[0]))
    p = Page(browser, page_file)
    page = p.page
    assert page.locator("table").count() == 1 + 3 * 2
    assert page.locator(".legend").count() == 3 * 2  # one per heatmap table, each on its own scale
    lim = max(abs(z[0]) for z in flat)
    assert_legends(page, num(-lim, "+.3g"), num(lim, "+.3g"), ids="legend-0")  # relp: residual
    cells = page.locator("td[data-v]")
    assert_readable(cells)
    readout = page.locator("#readout")
    assert readout.is_visible() and readout.inner_text() == "hover a cell for its value"
    cell = page.locator(f'td[data-w^="relp: residual, layer {layer},"][data-w$="(position {pos})"]')
    assert cell.count() == 1
    cell.hover()
    tok = doc["clean_tokens"][pos]
    assert readout.inner_text() == f"relp: residual, layer {layer}, token {tok!r} (position {pos}): {num(v, '+.6f')}"
    assert readout.is_visible()
    p.finish(artifacts, "patch")


def test_edges_page(browser, artifacts, tmp_path):
    from pyattr.results.colours import num

    page_file, js = tmp_path / "edges.html", tmp_path / "edges.json"
    r = run_cli("patch", "--edges", "--html", page_file, "--json", js)
    assert r.returncode == 0, r.stderr
    doc = json.loads(js.read_text())
    strongest = max(doc["edges"], key=lambda e: abs(e["score"]))
    p = Page(browser, page_file)
    page = p.page
    assert page.locator("svg").count() == 2               # the circuit graph, the faithfulness curve
    svg = page.locator("svg:has(line.edge)")
    assert svg.count() == 1 and svg.is_visible()
    heading = page.locator("b").first.inner_text()
    assert "clean 'sun cat red tree sun cat', corrupt 'sun ant red tree sun cat'" in heading, heading
    assert page.get_by_text("faithfulness (CPR ").count() == 1
    box = svg.bounding_box()
    assert box["width"] >= 600 and box["height"] >= 300, box
    lines = page.locator("line.edge")
    assert lines.count() == 30                            # the 30 strongest edges
    assert page.locator("svg g.node").count() == 1 + 2 * 4 + 2 + 1   # input, 8 heads, 2 MLPs, logits
    top = page.locator(f'line.edge[data-w="{strongest["edge"]}: {num(strongest["score"], "+.4g")}"]')
    assert top.count() == 1
    assert top.locator("title").text_content() == f'{strongest["edge"]}: {num(strongest["score"], "+.4g")}'
    assert float(top.get_attribute("stroke-width")) == max(float(w) for w in lines.evaluate_all(
        "ls => ls.map(l => l.getAttribute('stroke-width'))"))
    assert page.locator(".legend").count() == 2           # the graph's and the grid's
    assert_legends(page)
    assert_readable(page.locator("td[style]"))
    # every node label readable on its white box
    for t in page.locator("svg g.node text").all()[:3]:
        assert t.is_visible()
    # the edge grid (27 downstream inputs) is wider than 1280 px and scrolls; its strongest
    # rows and columns come first, so the strongest edge's cell is in view, not cut off
    up, down = strongest["edge"].split("->")
    cell = page.locator(f'td[title^="upstream {up} · downstream input \'{down}\' · score"]')
    assert cell.count() == 1
    grid_box = page.locator("table.grid").last.bounding_box()
    cell_box = cell.bounding_box()
    assert cell_box["x"] + cell_box["width"] <= VIEWPORT["width"], (cell_box, grid_box)
    p.finish(artifacts, "edges")


def test_generate_page(browser, artifacts, tmp_path):
    page_file = tmp_path / "generate.html"
    r = run_cli("generate", "--html", page_file, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    m, prompt = doc["token_relevance"], doc["prompt_tokens"]
    p = Page(browser, page_file)
    page = p.page

    def fmt(v):
        return format(0.0, ".4f") if float(format(v, ".4f")) == 0 else format(v, "+.4f")

    info = page.locator("#info")
    toks = page.locator("#text .tok")
    assert toks.count() == len(doc["tokens"])
    # on load: step 0 shown, its legend on its own scale
    own = prompt
    top = max(abs(v) for v in m[0][:own])
    assert_legends(page, fmt(-top), fmt(top))
    scale = max(abs(v) for row in m for v in row)
    assert_legends(page, fmt(-scale), fmt(scale), ids="legend-matrix")
    # hover the second generated token: its step is shown, the legend follows its scale
    toks.nth(prompt + 1).hover()
    assert info.inner_text().startswith(f"step 1: '{doc['tokens'][prompt + 1]}', target ")
    own = prompt + 1
    top = max(abs(v) for v in m[1][:own])
    assert_legends(page, fmt(-top), fmt(top))
    coloured = [toks.nth(i) for i in range(own)]
    assert all(t.evaluate("e => e.style.background") != "" for t in coloured)
    assert_readable(page.locator("#text .tok[style*=background]"))
    # a context token of that step: the readout names it and its value
    i = _argmax_abs(m[1][:own])
    toks.nth(i).hover()
    assert info.inner_text() == f"step 1 '{doc['tokens'][own]}' <- '{doc['tokens'][i]}' (position {i}): {fmt(m[1][i])}"
    # a matrix cell
    cell = page.locator('#matrix td[data-s="3"][data-i="2"]')
    cell.hover()
    assert info.inner_text() == (f"step 3 '{doc['tokens'][prompt + 3]}' <- '{doc['tokens'][2]}' (position 2): "
                                 f"{fmt(m[3][2])}")
    assert info.is_visible()
    p.finish(artifacts, "generate")
