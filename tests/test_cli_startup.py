"""The command line answers `--help`, `--version` and bad arguments without loading torch;
argparse errors and bad output paths are one line on stderr with exit status 2."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pyattr
from pyattr.cli._common import UsageError, check_output_path

PYATTR = shutil.which("pyattr", path=os.path.dirname(sys.executable)) or "pyattr"
ROOT = Path(__file__).resolve().parent.parent

# Runs pyattr.cli.main in a fresh interpreter and reports the exit status, the output and
# whether torch / transformers were imported on the way.
PROBE = """
import contextlib, io, json, sys
from pyattr.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = main(json.loads(sys.argv[1]))
    except SystemExit as e:
        code = e.code
print(json.dumps({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                  "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
"""


def probe(*args):
    p = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(args))], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_version_is_the_package_version():
    p = subprocess.run([PYATTR, "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stderr == ""
    assert p.stdout == f"pyattr {pyattr.__version__}\n"
    declared = re.search(r'(?m)^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert declared == pyattr.__version__


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["explain", "--help"], ["bench", "--help"]])
def test_help_and_version_do_not_import_torch(args):
    r = probe(*args)
    assert r["code"] == 0 and r["stdout"] and r["stderr"] == ""
    assert r["torch"] is False and r["transformers"] is False


def test_import_pyattr_is_lazy_but_complete():
    code = ("import sys, pyattr; assert 'torch' not in sys.modules; "
            "print(pyattr.relevance.__module__, pyattr.ops.layer_norm.__name__, pyattr.RelevanceRules.__name__, "
            "sorted(pyattr.available_backends())[0], 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["pyattr.methods.relevance", "layer_norm", "RelevanceRules", "cpp", "True"]
    with pytest.raises(AttributeError, match="module 'pyattr' has no attribute 'nope'"):
        pyattr.nope  # noqa: B018


@pytest.mark.parametrize(
    "args,line",
    [
        ([], "pyattr: error: the following arguments are required: {explain,generate,cite,patch,run,bench,docs}"),
        (["frobnicate"], "pyattr: error: argument {explain,generate,cite,patch,run,bench,docs}: invalid choice: 'frobnicate'"),
        (["explain", "--attention", "bogus"], "pyattr explain: error: argument --attention: invalid choice: 'bogus'"),
        (["explain", "--backend"], "pyattr explain: error: argument --backend: expected one argument"),
        (["bench", "--repeats", "x"], "pyattr bench: error: argument --repeats: invalid int value: 'x'"),
        (["explain", "--bogus", "x"], "pyattr explain: error: unrecognized arguments: --bogus x"),
        (["patch", "--method", "eap"], "pyattr patch: error: argument --method: invalid choice: 'eap'"),
    ],
)
def test_argparse_errors_are_one_line_with_status_2(args, line):
    p = subprocess.run([PYATTR, *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), p.stderr
    assert "usage:" not in p.stderr
    r = probe(*args)  # and without importing torch
    assert r["code"] == 2 and r["stderr"].startswith(line) and r["torch"] is False


def _sys_refuses():
    try:
        with open("/sys/pyattr-probe.html", "a"):
            pass
    except OSError:
        return True
    return False


@pytest.mark.parametrize("case", ["directory", "missing parent", "parent is a file", "unwritable"])
@pytest.mark.parametrize("command,flag", [("explain", "--html"), ("bench", "--json"), ("bench", "--markdown"),
                                          ("patch", "--png"), ("patch", "--html"), ("patch", "--json")])
def test_output_paths_are_checked_before_any_model_or_benchmark(tmp_path, case, command, flag):
    (tmp_path / "file").write_text("x")
    path, why = {
        "directory": (str(tmp_path), "it is a directory"),
        "missing parent": (str(tmp_path / "no" / "out.x"), f"directory {str(tmp_path / 'no')!r} does not exist"),
        "parent is a file": (str(tmp_path / "file" / "out.x"), f"{str(tmp_path / 'file')!r} is not a directory"),
        "unwritable": ("/sys/pyattr-out.x", "Permission denied"),
    }[case]
    if case == "unwritable" and not _sys_refuses():
        pytest.skip("/sys accepts new files here")
    # --model of a missing directory: the path error must come first, before any model load
    extra = ["--model", "/nonexistent/model"] if command in ("explain", "patch") else ["--ops", "identity"]
    r = probe(command, *extra, flag, path)
    assert r["code"] == 2 and r["stdout"] == ""
    assert r["stderr"] == f"pyattr {command}: error: {flag}: cannot write {path!r}: {why}\n"
    assert r["torch"] is False and r["transformers"] is False


def test_check_output_path_leaves_files_as_they_were(tmp_path, monkeypatch):
    new = tmp_path / "new.html"
    check_output_path("--html", str(new))
    assert not new.exists()  # the probe removes the file it created
    old = tmp_path / "old.html"
    old.write_text("keep me")
    check_output_path("--html", str(old))
    assert old.read_text() == "keep me"
    monkeypatch.chdir(tmp_path)
    check_output_path("--html", "relative.html")  # a bare file name: the current directory
    assert not (tmp_path / "relative.html").exists()
    with pytest.raises(UsageError, match="^--json needs a file path$"):
        check_output_path("--json", "  ")


def test_check_output_path_keeps_symlinks(tmp_path):
    """A dangling symlink is probed through: the link stays, no file is left at its target."""
    target = tmp_path / "target.html"
    link = tmp_path / "link.html"
    link.symlink_to(target)
    check_output_path("--html", str(link))
    assert link.is_symlink() and not target.exists()
    missing = tmp_path / "link2.html"
    missing.symlink_to(tmp_path / "nodir" / "t.html")
    with pytest.raises(UsageError, match=r"directory '.*nodir' does not exist"):
        check_output_path("--html", str(missing))
    assert missing.is_symlink()


def test_later_arguments_are_checked_without_leaving_the_probe_file(tmp_path):
    out = tmp_path / "b.json"
    r = probe("bench", "--json", str(out), "--ops", "nope")
    assert r["code"] == 2 and r["stderr"].startswith("pyattr bench: error: --ops: unknown op(s) ['nope']")
    assert not out.exists()


# --- --help: examples and the documentation ----------------------------------------------

def _examples(text):
    """The example command lines of a help text's ``examples:`` block."""
    block = text.split("\nexamples:\n", 1)[1].split("\n\n", 1)[0]
    return [line.strip() for line in block.splitlines() if line.startswith("  ") and not line.startswith("      ")]


@pytest.mark.parametrize("command", [None, "explain", "generate", "patch", "run", "bench", "docs"])
def test_help_shows_examples_and_the_docs_without_torch(command):
    from pyattr.cli import DOCS

    r = probe(*([command] if command else []), "--help")
    assert r["code"] == 0 and r["torch"] is False and r["transformers"] is False
    out = r["stdout"]
    assert out.rstrip().endswith(DOCS) and "\nexamples:\n" in out
    # the installed package's own pages (pyattr docs), not a path into a source tree
    assert DOCS == ("documentation: `pyattr docs` lists the pages shipped with pyattr (a tutorial per task), "
                    "`pyattr docs PAGE` prints one\nevery command and option: pyattr docs reference/cli")
    examples = _examples(out)
    assert len(examples) >= 2
    import shlex

    from pyattr.cli import build_parser

    for line in examples:  # every example parses (the torchrun one: its pyattr part)
        words = shlex.split(line)
        words = words[words.index("pyattr") + 1:]
        assert words[0] == (command or words[0])
        build_parser().parse_args(words)


@pytest.mark.parametrize("line", [
    "pyattr explain --model induction --text 'sun cat red tree sun' --target cat",
    "pyattr patch --model induction --clean 'sun cat red tree sun' --corrupt 'sun dog red tree sun' --html patch.html",
])
def test_help_examples_run(line, tmp_path, monkeypatch):
    import shlex

    from conftest import run_cli

    assert line in _examples(probe(line.split()[1], "--help")["stdout"])
    monkeypatch.chdir(tmp_path)
    r = run_cli(*shlex.split(line)[1:])
    assert r.returncode == 0, r.stderr
    assert "induction (bundled)" in r.stdout


def test_a_missing_model_directory_fails_before_torch_with_did_you_mean(tmp_path):
    (tmp_path / "my-llama").mkdir()
    (tmp_path / "my-llama" / "config.json").write_text("{}")
    for cmd, rest in (("explain", ()), ("generate", ("--text", "x")), ("patch", ())):
        r = probe(cmd, "--model", str(tmp_path / "my-lama"), *rest)
        assert r["code"] == 2 and r["torch"] is False and r["transformers"] is False
        assert r["stderr"] == (f"pyattr {cmd}: error: model directory {str(tmp_path / 'my-lama')!r} does not exist; "
                               f"did you mean {str(tmp_path / 'my-llama')!r}?\n")
    r = probe("explain", "--model", str(tmp_path))
    assert r["code"] == 2 and r["torch"] is False
    assert r["stderr"] == f"pyattr explain: error: model directory {str(tmp_path)!r} has no config.json\n"
    # a hub id offline and not cached: said at once, before torch
    r = probe("explain", "--model", "pyattr-test/not-cached")
    assert r["code"] == 2 and r["torch"] is False
    assert "so it was looked up on the Hugging Face Hub: offline mode is on (HF_HUB_OFFLINE=1)" in r["stderr"]
