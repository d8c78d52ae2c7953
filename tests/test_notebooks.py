"""The example notebooks (docs/notebooks/*.ipynb) and results in a notebook kernel.

Each notebook executes top to bottom in a fresh kernel of this Python (ipykernel, through
nbclient: ``docs/notebooks/execute.py``) with no error and nothing on stderr but the
machine's noise; every result a cell ends with shows pyattr's HTML view; and what it
shows equals the outputs stored in the repository, which the documentation renders
(volatile parts aside: execution counts, addresses, the backend's name, image bytes;
numbers to their printed precision). After a change to the views or the methods,
``.venv/bin/python docs/notebooks/execute.py`` stores the new outputs.

The notebooks take 10-25 s each (a kernel imports torch and transformers), so they are
in the slow tier; the stored notebooks' own checks, the page renderer and one kernel
session (a result displays its HTML view; save / load round trip) are fast.

Needs ``nbclient``, ``nbformat`` and ``ipykernel`` (the dev extra); without them the
tests skip, or fail when ``PYATTR_REQUIRE_NOTEBOOKS=1``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "docs" / "notebooks"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"pyattr_notebooks_{name}", NOTEBOOKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


ex = _module("execute")
render = _module("render")
NAMES = [p.stem for p in ex.notebooks()]


def _need_jupyter():
    missing = [m for m in ("nbclient", "nbformat", "ipykernel") if importlib.util.find_spec(m) is None]
    if missing:
        reason = f"{', '.join(missing)} not installed (pip install -e '.[dev]')"
        if os.environ.get("PYATTR_REQUIRE_NOTEBOOKS") == "1":
            pytest.fail(f"PYATTR_REQUIRE_NOTEBOOKS=1 but {reason}")
        pytest.skip(reason)


def _stored(name: str):
    _need_jupyter()
    import nbformat

    return nbformat.read(str(NOTEBOOKS / f"{name}.ipynb"), as_version=4)


def test_one_notebook_per_main_task():
    assert set(NAMES) == {"relevance", "sentence-pair", "layer-relevance", "integrated-gradients", "generation",
                          "circuits", "faithfulness", "images"}


# ------------------------------------------------------------------- the stored notebooks (fast)


@pytest.mark.parametrize("name", NAMES)
def test_stored_notebook_is_executed_and_clean(name):
    """What the repository (and so the documentation) holds: every code cell executed in
    order, no error, nothing on stderr, each result shown with its HTML view, at least one
    view, and no output of the machine that ran it (paths, addresses)."""
    nb = _stored(name)
    assert ex.problems(nb) == []
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1))  # one run, top to bottom
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    assert sum(c.cell_type == "markdown" for c in nb.cells) >= 3
    assert ex.result_views(nb), "no pyattr view among the outputs"
    text = json.dumps([{k: v for k, v in o.get("data", {}).items() if not k.startswith("image/")} | {
        "text": o.get("text", "")} for c in nb.cells for o in c.get("outputs", [])])
    for leak in (str(ROOT), os.path.expanduser("~"), "/tmp/", "site-packages"):
        assert leak not in text, leak
    assert not re.search(r"0x[0-9a-f]{8,}", text)
    assert nb.metadata["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("name", NAMES)
def test_rendered_page(name):
    """The page the documentation shows: the markdown, each code cell as a python block,
    each view embedded as raw HTML with no blank line in it (which would end the raw
    block), images as data URIs, a download link to the notebook."""
    nb_path = NOTEBOOKS / f"{name}.ipynb"
    nb = json.loads(nb_path.read_text())
    page = render.render(nb_path, download=nb_path.name)
    assert page.startswith("# ")
    assert f"[download it]({name}.ipynb)" in page
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert page.count("```python\n") == len(code)
    for c in code:
        assert "".join(c["source"]).strip() in page
    views = re.findall(r"<div class=\"nb-output\"><div class='pyattr-result'>.*?(?=\n\n|\Z)", page, re.S)
    assert len(views) == len(ex.result_views(nb))
    for v in views:
        assert "\n\n" not in v and "<script" not in v
    pngs = sum("image/png" in o.get("data", {}) for c in code for o in c["outputs"])
    assert page.count('src="data:image/png;base64,') == pngs
    assert render.pages(ROOT / "docs")[f"notebooks/{name}.md"] == page


def test_render_fences_and_escapes():
    nb = {"cells": [{"cell_type": "markdown", "source": "# T\n\ntext"},
                    {"cell_type": "code", "source": "print('```')", "outputs": [
                        {"output_type": "stream", "name": "stdout", "text": "```\n"},
                        {"output_type": "execute_result", "data": {"text/plain": "<x>"}},
                        {"output_type": "display_data", "data": {"text/html": "<b>\n\n  bold</b>", "text/plain": "b"}},
                    ]}]}
    page = render.render(nb)
    assert "````python\nprint('```')\n````" in page
    assert "````text\n```\n````" in page
    assert "```text\n<x>\n```" in page
    assert '<div class="nb-output"><b>\n  bold</b></div>' in page


def test_compare_text_rounds_to_the_printed_precision():
    same = ex.compare_text
    assert same("delta 1.2e-07", "delta -3.4e-07") is None               # float32 noise (ATOL)
    assert same("x 0.6931", "x 0.6932") is None                          # one unit of the last digit
    assert same("x 0.6931", "x 0.6934") is not None
    assert same("(2, 6)", "(2, 7)") is not None                          # integers exactly
    assert same("'cat' 0.5", "'dog' 0.5") is not None                    # text as written
    assert same("backend='cpp' at 0x7f00aa11bb22", "backend='torch' at 0x7f00cc33dd44") is None
    assert same("id='pyattr-0123456789-0'", "id='pyattr-abcdefabcd-0'") is None
    assert same("rgb(255, 12, 12)", "rgb(255, 13, 11)") is None
    assert same("rgb(255, 12, 12)", "rgb(255, 20, 12)") is not None


def test_clean_drops_only_the_machines_noise():
    _need_jupyter()
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    noise = ("W1202 13:38:10.053000 16111 torch/utils/_pytree.py:630] <enum 'KernelPreference'> is an Enum subclass "
             "and is now natively supported by torch.compile as an opaque value type.\n"
             "Loading weights:   0%|          | 0/21 [00:00<?, ?it/s]\rLoading weights: 100%|██| 21/21 [00:00<00:00]\n")
    nb = new_notebook(cells=[new_code_cell("x", outputs=[
        new_output("stream", name="stderr", text=noise),
        new_output("stream", name="stdout", text="a\n"), new_output("stream", name="stdout", text="b\n"),
        new_output("stream", name="stderr", text=noise + "UserWarning: something real\n")])])
    ex.clean(nb)
    outs = nb.cells[0].outputs
    assert [(o.name, o.text) for o in outs] == [("stdout", "a\nb\n"), ("stderr", "UserWarning: something real\n")]
    nb.cells[0].execution_count = 1
    assert ex.problems(nb) == ["cell 0: printed on stderr: UserWarning: something real"]


# --------------------------------------------------------------------------- in a kernel


KERNEL_CELLS = [
    """
import json, torch, pyattr, pyattr.toy
model, tok, circuit = pyattr.toy.load()
r = pyattr.relevance(model, "red blue king frog red blue", tokenizer=tok, target="king")
""",
    "r",
    """
p = r.save("r.safetensors")
back = pyattr.load(p)
print(json.dumps({"path": p, "class": type(back).__name__, "tokens": back.tokens == r.tokens,
                  "arrays": {f: torch.equal(getattr(back, f), getattr(r, f)) for f in
                             ("token_relevance", "relevance", "target", "conservation_delta", "target_ids")},
                  "html": back._repr_html_() == r._repr_html_()}))
""",
]


def test_kernel_displays_a_result_and_round_trips_it(tmp_path):
    """In a notebook kernel: ``r = pyattr.relevance(model, text, tokenizer=tok,
    target=word)`` then ``r`` displays the HTML view (text/html, the view's root class,
    every token of the text in it); ``r.save(p)`` then ``pyattr.load(p)`` gives equal
    tensors (torch.equal), tokens and view; the file is the same when read here."""
    _need_jupyter()
    import html as htmlmod

    import torch
    from nbformat.v4 import new_code_cell, new_notebook

    import pyattr

    nb = new_notebook(cells=[new_code_cell(c.strip()) for c in KERNEL_CELLS])
    out = ex.execute(nb, timeout=300, cwd=str(tmp_path))
    assert ex.problems(out) == []
    shown = out.cells[1].outputs
    assert [o.output_type for o in shown] == ["execute_result"]
    assert set(shown[0].data) >= {"text/html", "text/plain"}
    view = shown[0].data["text/html"]
    assert view.startswith("<div class='pyattr-result'>") and "<script" not in view
    toks = ["red", " blue", " king", " frog", " red", " blue"]
    assert re.findall(r'<span class="tok"[^>]*>(.*?)</span>', view) == ["&lt;s&gt;"] + [htmlmod.escape(t) for t in toks]
    assert "target &#x27; king&#x27;" in view  # the target as the tokenizer spells it after the text
    report = json.loads(out.cells[2].outputs[0].text)
    assert report["class"] == "RelevanceResult" and report["tokens"] and report["html"]
    assert report["arrays"] == dict.fromkeys(report["arrays"], True)
    back = pyattr.load(tmp_path / "r.safetensors")  # the kernel's file, read by this process
    assert back.tokens == [["<s>", *toks]]
    assert back._repr_html_() == view
    assert back.token_relevance.shape == (1, 7) and torch.isfinite(back.token_relevance).all()


# ------------------------------------------------------------------ every notebook (slow)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes_as_stored(name):
    """A fresh kernel runs the notebook with no error or warning, every result a cell ends
    with shows its HTML view, and the outputs equal the stored ones (so the documentation's
    numbers are what the code prints)."""
    stored = _stored(name)
    fresh = ex.execute(stored, timeout=600)
    assert ex.problems(fresh) == []
    ends_with_result = [i for i, c in enumerate(fresh.cells) if c.cell_type == "code" and any(
        o.output_type == "execute_result" and ex.RESULT_REPR.match(o.data.get("text/plain", "")) for o in c.outputs)]
    assert ends_with_result
    for i in ends_with_result:
        html = [o.data.get("text/html", "") for o in fresh.cells[i].outputs if o.output_type == "execute_result"]
        assert html and "pyattr-result" in html[0], f"cell {i}"
    diff = ex.differences(stored, fresh)
    assert diff == [], (f"{name}.ipynb no longer shows what is stored (.venv/bin/python "
                        f"docs/notebooks/execute.py {name} stores the new outputs):\n" + "\n".join(diff))
