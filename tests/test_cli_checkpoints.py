"""The command line decides from a checkpoint's config.json, before loading its weights,
whether a command can explain it (pyattr generate on a sentence encoder or an image
classifier, pyattr explain of an image classifier without --image), and ships its
documentation pages for `pyattr docs`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyattr.cli import main
from pyattr.cli._common import checkpoint_kind
from pyattr.cli.docs import docs_dir, pages, title

ROOT = Path(__file__).resolve().parents[1]


def _config(tmp_path, name, cfg, *extra):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    for f in extra:
        (d / f).write_text("{}")
    return d


def test_the_kind_of_a_checkpoint_is_read_from_its_config(tmp_path):
    assert checkpoint_kind("induction") == ("causal LM", "LlamaForCausalLM")
    assert checkpoint_kind("squares") == ("image classifier", "ViTForImageClassification")
    assert checkpoint_kind("minilm") == ("sentence encoder", "BertModel")
    assert checkpoint_kind(_config(tmp_path, "gpt2", {"architectures": ["GPT2LMHeadModel"]})) == (
        "causal LM", "GPT2LMHeadModel")
    assert checkpoint_kind(_config(tmp_path, "t5", {"architectures": ["T5ForConditionalGeneration"],
                                                    "is_encoder_decoder": True})) == (
        "encoder-decoder", "T5ForConditionalGeneration")
    assert checkpoint_kind(_config(tmp_path, "bert", {"model_type": "bert"})) == ("encoder", "bert")
    assert checkpoint_kind(tmp_path / "missing") is None
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert checkpoint_kind(tmp_path / "broken") is None


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "minilm"],
     "pyattr generate: error: --model minilm is a sentence encoder (BertModel), not a causal language model: pyattr "
     "generate explains the text a causal LM generates; pyattr explain --model minilm explains a pair's cosine "
     "similarity\n"),
    (["generate", "--model", "squares", "--text", "hi"],
     "pyattr generate: error: --model squares is an image classifier (ViTForImageClassification), not a causal "
     "language model: pyattr generate explains the text a causal LM generates; pyattr explain --model squares "
     "--image FILE explains an image\n"),
    (["explain", "--model", "squares", "--text", "hello"],
     "pyattr explain: error: --model squares is an image classifier (ViTForImageClassification): explain an image "
     "with --image FILE (--text and --pair are for language models)\n"),
    (["explain", "--model", "induction", "--image", "x.png"],
     "pyattr explain: error: --image needs an image classifier; --model induction is a causal LM "
     "(LlamaForCausalLM)\n"),
])
def test_a_command_that_cannot_explain_a_checkpoint_says_so_before_loading_it(argv, message, capsys):
    t0 = time.monotonic()
    assert main(argv) == 2
    assert capsys.readouterr().err == message
    assert time.monotonic() - t0 < 5  # the config only: loading the weights took 19-20 s


def test_pyattr_docs_lists_prints_and_finds_the_pages(capsys):
    root = docs_dir()
    assert root == ROOT / "docs"  # a checkout; a wheel ships them as pyattr/_docs
    names = pages(root)
    assert {"index", "getting-started", "tutorials/causal-lm", "reference/cli"} <= set(names)
    assert main(["docs"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"pyattr's documentation ({root}); `pyattr docs PAGE` prints a page:"
    assert len(out) == len(names) + 1
    assert any(line.split() == ["getting-started", "Getting", "started"] for line in out)
    assert main(["docs", "causal-lm"]) == 0  # by its last part
    assert capsys.readouterr().out == (root / "tutorials" / "causal-lm.md").read_text(encoding="utf-8")
    assert main(["docs", "reference/cli.md"]) == 0
    assert capsys.readouterr().out.startswith(f"# {title(root / 'reference' / 'cli.md')}\n")
    assert main(["docs", "--path"]) == 0
    assert capsys.readouterr().out == f"{root}\n"
    assert main(["docs", "causal-llm"]) == 2
    assert capsys.readouterr().err == ("pyattr docs: error: 'causal-llm' is not a page; did you mean tutorials/causal-lm? "
                                       "(`pyattr docs` lists them)\n")


def test_the_toy_loaders_show_no_loading_bars_and_leave_transformers_logging_as_it_was():
    code = ("import sys, pyattr.toy as t\n"
            "from transformers.utils import logging as L\n"
            "L.set_verbosity_info(); L.enable_progress_bar()\n"
            "t.load(); t.load_squares()\n"
            "print(L.get_verbosity(), L.is_progress_bar_enabled())\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [str(20), "True"]  # INFO, bars on: as the user set them
    assert "Loading weights" not in p.stderr and "%|" not in p.stderr
