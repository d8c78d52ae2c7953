"""Every code block of the README and of the documentation site (docs/, in the order of
mkdocs.yml's nav) runs as written, and the site builds with warnings as errors.

Python blocks run in a fresh namespace each, all in one working directory where
``path/to/llama`` is a tiny random Llama; command-line blocks run each ``pyattr ...`` line
there, with ``./my-llama`` a tiny random Llama that carries the bundled MiniLM's tokenizer
(``path/to/vit`` and ``./my-vit`` tiny random ViT classifiers with their image processor,
``photo.png`` a random image). The python blocks of every page run once when that directory
is made, so they leave ``prompts.jsonl`` and ``results`` there as a user's session would,
whatever order the tests run in. The README's ``make``
block is its two commands, which CI itself runs (`.ci/run` calls `make test`, then `make test-slow`).
"""

import re
import shlex
import subprocess
import sys
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


DOC_PAGES = [ROOT / "docs" / p for p in _nav_pages(_load_mkdocs()["nav"])]
FILES = [README, *DOC_PAGES]


def _blocks_of(path):
    return re.findall(r"```(\w*)\n(.*?)```", path.read_text(), flags=re.S)


BLOCKS = {path: _blocks_of(path) for path in FILES}


def _name(path):
    return str(path.relative_to(ROOT))


def _blocks(lang):
    return [(path, i, code) for path in FILES for i, (l, code) in enumerate(BLOCKS[path]) if l == lang]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from conftest import save_image, save_tiny_llama, save_tiny_vit
    from models import minilm

    d = tmp_path_factory.mktemp("docs")
    save_tiny_llama(d / "path" / "to" / "llama", 8000)  # the Quick start's ids go up to 7483
    tok, _ = minilm()
    save_tiny_llama(d / "my-llama", len(tok), tok)
    save_tiny_vit(d / "path" / "to" / "vit")
    save_tiny_vit(d / "my-vit")
    save_image(d / "photo.png")
    # a user's session: every python block once, in the nav's order, before any test, so
    # the command lines find the files the blocks write (prompts.jsonl, results) whatever
    # order the tests run in (each block's own test runs it again: they are idempotent)
    import os

    here = os.getcwd()
    os.chdir(d)
    try:
        for path, index, code in _blocks("python"):
            exec(compile(code, f"{_name(path)} block {index}", "exec"), {"__name__": "__docs__"})
    finally:
        os.chdir(here)
    return d


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
def test_python_block_runs(path, index, code, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    exec(compile(code, f"{_name(path)} block {index}", "exec"), {"__name__": "__docs__"})


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
def test_cli_line_runs(page, line, workdir, monkeypatch, capsys):
    """Each command line of the README and the docs, run in-process through the console
    script's entry point."""
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
    `make ...` (README) and `pyattr ...` lines, and unnamed blocks are output samples."""
    for path in FILES:
        for lang, code in BLOCKS[path]:
            if lang == "bash":
                for line in code.splitlines():
                    line = line.split("  #")[0].strip()
                    assert not line or line.startswith(("make ", "pyattr ")), (_name(path), line)
            else:
                assert lang in ("python", ""), (_name(path), lang)


def test_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: a broken link, a page missing from the nav, or an API
    reference entry whose docstring griffe cannot parse fails the build."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(MKDOCS), "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
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
               "INDUCTION_DIR", "monkey_patch", "undo", "InputRelevance"}
    public.discard("activation")  # pyattr.ops.activation is pyattr.rules.identity_rule, documented there
    missing = sorted(public - documented)
    assert not missing, f"public names without an API reference entry: {missing}"


def test_command_line_reference_is_the_parsers_help():
    """docs/reference/cli.md is generated from the parser; an option added, removed or
    reworded without regenerating it fails here."""
    from pyattr.cli.reference import markdown

    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert page == markdown(), "regenerate with: python -m pyattr.cli.reference > docs/reference/cli.md"
