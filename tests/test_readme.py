"""Every code block of the README runs as written.

Python blocks run in a fresh namespace in a directory where ``path/to/llama`` is a tiny
random Llama; command-line blocks run each ``pyattr ...`` line there, with ``./my-llama`` a
tiny random Llama that carries the bundled MiniLM's tokenizer (``path/to/vit`` and ``./my-vit``
tiny random ViT classifiers with their image processor, ``photo.png`` a random image) (the python blocks, which run
first, leave ``prompts.jsonl`` and ``results`` there as a user's session would). The ``make`` block is the
README's two commands, which CI itself runs (`.ci/run` calls `make test`).
"""

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README.read_text(), flags=re.S)


def _blocks(lang):
    return [(i, code) for i, (l, code) in enumerate(BLOCKS) if l == lang]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from conftest import save_image, save_tiny_llama, save_tiny_vit
    from models import minilm

    d = tmp_path_factory.mktemp("readme")
    save_tiny_llama(d / "path" / "to" / "llama", 8000)  # the Quick start's ids go up to 7483
    tok, _ = minilm()
    save_tiny_llama(d / "my-llama", len(tok), tok)
    save_tiny_vit(d / "path" / "to" / "vit")
    save_tiny_vit(d / "my-vit")
    save_image(d / "photo.png")
    return d


def test_readme_has_blocks():
    langs = [l for l, _ in BLOCKS]
    assert langs.count("python") >= 2 and langs.count("bash") >= 2


@pytest.mark.parametrize("index", [i for i, _ in _blocks("python")])
def test_python_block_runs(index, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    code = BLOCKS[index][1]
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "__readme__"})


def _command_lines():
    for i, code in _blocks("bash"):
        for line in code.splitlines():
            line = line.split("  #")[0].strip()
            if line:
                yield i, line


def test_make_block_is_the_two_commands():
    makes = [line for _, line in _command_lines() if line.startswith("make")]
    assert makes == ["make demo", "make test"]


CLI = [line for _, line in _command_lines() if line.startswith("pyattr ")]


@pytest.mark.parametrize("line", CLI)
def test_cli_line_runs(line, workdir, monkeypatch, capsys):
    """Each command line of the README, run in-process through the console script's entry point."""
    from pyattr.cli import main

    monkeypatch.chdir(workdir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        rc = main(shlex.split(line)[1:])
    except SystemExit as e:  # argparse's --version / --help exit through SystemExit
        rc = e.code
    out = capsys.readouterr()
    assert rc == 0, (line, out.out[-2000:], out.err[-2000:])
    assert out.out.strip()


def test_every_block_is_covered():
    """No README block is left out of the tests above: python blocks run, bash blocks hold
    only `make demo`/`make test` and `pyattr ...` lines, and text blocks are output samples."""
    for i, (lang, code) in enumerate(BLOCKS):
        if lang == "bash":
            for line in code.splitlines():
                line = line.split("  #")[0].strip()
                assert not line or line.startswith(("make ", "pyattr ")), line
        else:
            assert lang in ("python", ""), lang
