"""``pyattr run --generate N``: one row per prompt with the generated text, its tokens and
the relevance matrix, equal to generation_relevance on the prompt alone; resumable only
with the same N."""

import json

import pandas as pd
import pytest
import torch

import pyattr
import pyattr.toy as toy
from pyattr.apps.store import RunError
from conftest import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["sun cat red tree sun", "dog owl fish bee ant dog", "", "cat"]


def test_rows_equal_generation_relevance_of_each_prompt_alone(tmp_path):
    model, tok, _ = toy.load()
    summary = pyattr.run(model, PROMPTS, tmp_path / "r", tokenizer=tok, generate=3, progress=False)
    assert summary.stored == 4 and summary.failed == 1
    d = pd.read_parquet(tmp_path / "r").sort_values("index")
    assert list(d.columns) == json.loads((tmp_path / "r" / "_manifest.json").read_text())["columns"]
    assert json.loads((tmp_path / "r" / "_manifest.json").read_text())["generate"] == 3
    assert d.iloc[2].error == "empty text" and pd.isna(d.iloc[2].generated_text)
    for i in (0, 1, 3):
        row = d.iloc[i]
        alone = pyattr.generation_relevance(model, dict(tok([PROMPTS[i]], return_tensors="pt")), max_new_tokens=3)
        assert row.generated_text == tok.decode(alone.generated[0])
        assert list(row.tokens) == tok.convert_ids_to_tokens(alone.sequences[0].tolist())
        matrix = torch.tensor([list(r) for r in row.token_relevance])
        torch.testing.assert_close(matrix, alone.token_relevance[0], rtol=1e-5, atol=1e-5)
        assert list(row.target) == pytest.approx(alone.target[0].tolist(), rel=1e-5)
        assert list(row.target_token) == tok.convert_ids_to_tokens(alone.generated[0].tolist())


def test_another_n_is_refused_and_the_same_resumes(tmp_path):
    model, tok, _ = toy.load()
    out = tmp_path / "r"
    pyattr.run(model, PROMPTS[:2], out, tokenizer=tok, generate=2, progress=False)
    again = pyattr.run(model, PROMPTS[:2], out, tokenizer=tok, generate=2, progress=False)
    assert again.stored == 0 and again.skipped == 2
    with pytest.raises(RunError, match=r"holds a run with another generate \(2, now 3\)"):
        pyattr.run(model, PROMPTS[:2], out, tokenizer=tok, generate=3, progress=False)
    with pytest.raises(RunError, match="generate must be an int ≥ 1, got 0"):
        pyattr.run(model, PROMPTS[:2], tmp_path / "x", tokenizer=tok, generate=0, progress=False)
    with pytest.raises(RunError, match="with generate, each generated token is its own target"):
        pyattr.run(model, [{"text": "sun cat", "t": "red"}], tmp_path / "y", tokenizer=tok, target="t", generate=2,
                   progress=False)


def test_cli_generate_runs(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in PROMPTS[:2]))
    r = run_cli("run", "--model", "induction", "--data", data, "--out", tmp_path / "o", "--generate", "2")
    assert r.returncode == 0, r.stderr
    d = pd.read_parquet(tmp_path / "o").sort_values("index")
    assert list(d.generated_text) == ["cat red", "owl fish"]
