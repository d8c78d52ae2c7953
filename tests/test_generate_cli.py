"""``pyattr generate``: JSON equal to the API, the HTML page's script run under node with a
stand-in DOM (hover a generated token: its sources light up), the PNG, one-line errors."""

import json
import re
import shutil
import subprocess

import pytest
import torch

from conftest import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")


def test_default_run_json_equals_the_api():
    r = run_cli("generate", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["generated_text"] == "cat red tree sun cat red tree sun"
    assert doc["tokens"][:6] == ["<s>", "sun", "cat", "red", "tree", "sun"] and doc["prompt_tokens"] == 6
    m = torch.tensor(doc["token_relevance"])
    assert m.shape == (8, 14)
    import pyattr
    import pyattr.toy as toy

    model, tok, _ = toy.load()
    api = pyattr.generation_relevance(model, dict(tok(["sun cat red tree sun"], return_tensors="pt")), max_new_tokens=8)
    torch.testing.assert_close(m, api.token_relevance[0])
    assert doc["target_values"] == pytest.approx(api.target[0].tolist(), rel=1e-6)


def test_terminal_lists_top_sources():
    r = run_cli("generate", "--text", "dog owl fish bee dog", "--max-new-tokens", "2", "--top", "1")
    assert r.returncode == 0, r.stderr
    assert "generated  owl fish" in r.stdout
    assert "2 'owl'" in r.stdout and "3 'fish'" in r.stdout  # each step's top source: the word it copies


@pytest.mark.skipif(shutil.which("node") is None, reason="node runs the page's script")
def test_html_page_lights_up_the_sources_of_a_hovered_token(tmp_path):
    out, png = tmp_path / "g.html", tmp_path / "g.png"
    r = run_cli("generate", "--continuation", "cat red", "--html", out, "--png", png)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    page = out.read_text()
    script = re.search(r"<script>(.*)</script>", page, re.S).group(1)
    harness = """
const made = [];
function el() { return { children: [], style: {}, title: "", className: "", textContent: "", handlers: {},
  classList: { set: new Set(), add(c) { this.set.add(c); }, remove(c) { this.set.delete(c); } },
  appendChild(c) { this.children.push(c); }, addEventListener(e, f) { this.handlers[e] = f; } }; }
const nodes = { text: el(), info: el() };
global.document = { getElementById: id => nodes[id], createTextNode: t => ({ t }),
  createElement: () => { const e = el(); made.push(e); return e; } };
""" + script + """
made[6].handlers.mouseenter();   // step 0: 'cat' (column 6)
const first = made.map(s => s.style.background);
made[7].handlers.click();        // step 1: 'red'
console.log(JSON.stringify({ first, second: made.map(s => s.style.background),
  classes: made.map(s => s.className), info: nodes.info.textContent, sel: [...made[7].classList.set] }));
"""
    js = tmp_path / "h.js"
    js.write_text(harness)
    res = subprocess.run(["node", str(js)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["classes"] == ["tok"] * 6 + ["tok gen"] * 2
    # step 0 ('cat') sees columns 0-5; its largest source, the earlier 'cat' (column 2), is full red
    assert got["first"][2] == "rgb(255,0,0)" and got["first"][6:] == ["", ""]
    assert all(c.startswith("rgb(") for c in got["first"][:6])
    assert got["second"][3] == "rgb(255,0,0)" and got["second"][7] == ""  # step 1: 'red' at column 3
    assert got["info"].startswith("step 1: 'red', target ") and got["sel"] == ["sel"]


@pytest.mark.parametrize("args, message", [
    (("--max-new-tokens", "0"), "--max-new-tokens must be >= 1, got 0"),
    (("--max-new-tokens", "2", "--continuation", "cat"), "--max-new-tokens generates, --continuation explains"),
    (("--model", "/tmp", ), "--model needs --text (the prompt); only the toy model has a built-in one"),
    (("--model", ""), "--model is empty"),
    (("--top", "0"), "--top must be >= 1, got 0"),
    (("--text", "  "), "--text is empty"),
    (("--html", "/nonexistent-dir/g.html"), "--html: cannot write '/nonexistent-dir/g.html': directory"),
    (("--batch-targets", "0"), "--batch-targets must be >= 1, got 0"),
    # the tokenizer's <unk> would be explained in its place: refused, as an unknown --target is
    (("--continuation", "zzz-not-a-word"), "--continuation: the tokenizer reads part of 'zzz-not-a-word' as its unknown token"),
    (("--target", "loss"), "argument --target: invalid choice: 'loss'"),
    (("--model", "/nonexistent-model", "--text", "x"), "model directory '/nonexistent-model' does not exist"),
])
def test_errors_are_one_line_with_status_2(args, message):
    r = run_cli("generate", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("pyattr generate: error: ")
    assert message in r.stderr


def test_model_induction_needs_no_text():
    r = run_cli("generate", "--model", "induction", "--max-new-tokens", "2", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["generated_text"] == "cat red"


def test_png_draws_out_of_context_cells_grey_as_the_page():
    """In the PNG as on the page, a cell outside its step's context (the generated token
    itself and what follows) is grey, not white: white is a relevance of zero."""
    import numpy as np
    from matplotlib.colors import to_rgba

    from pyattr.apps.generate import OUT_OF_CONTEXT, figure, run_generate, to_html
    from pyattr.config import RelevanceRules

    rep = run_generate("induction", "sun cat red tree sun", 3, None, "logit", RelevanceRules.all())
    assert rep.model == "induction (bundled)" and rep.prompt_tokens == 6 and len(rep.tokens) == 9
    fig = figure(rep)
    ax = fig.axes[0]
    im = ax.images[0]
    outside = [[i >= rep.prompt_tokens + s for i in range(len(rep.tokens))] for s in range(3)]
    assert np.ma.getmaskarray(im.get_array()).tolist() == outside
    assert OUT_OF_CONTEXT == "#dddddd" and im.cmap.get_bad().tolist() == list(to_rgba(OUT_OF_CONTEXT))
    lim = max(abs(v) for s, row in enumerate(rep.matrix) for v in row[:rep.prompt_tokens + s])
    assert im.get_clim() == pytest.approx((-lim, lim))
    fig.canvas.draw()
    buf = np.asarray(fig.canvas.buffer_rgba())

    def pixel(row, col):
        x, y = ax.transData.transform((col, row))
        return tuple(int(v) for v in buf[int(round(buf.shape[0] - y)), int(round(x))][:3])

    assert pixel(0, 8) == pixel(0, 6) == pixel(2, 8) == (221, 221, 221)  # outside: grey
    # the matrix's largest |relevance|: full colour (the scale is the whole matrix's)
    v, s, i = max((abs(v), s, i) for s, row in enumerate(rep.matrix) for i, v in enumerate(row[:6 + s]))
    assert pixel(s, i) == ((255, 0, 0) if rep.matrix[s][i] > 0 else (0, 0, 255))
    page = to_html(rep)
    assert "table.m td.na { background: #dddddd; }" in page
    assert page.count('<td class="na"></td>') == sum(map(sum, outside))
    import matplotlib.pyplot as plt

    plt.close(fig)
