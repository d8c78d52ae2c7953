"""pyattr.run / ``pyattr run``: the Parquet store read back against pyattr.relevance,
per-prompt errors, bad data files, resume after SIGKILL, torchrun with 2 gloo processes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import pyattr
from conftest import run_cli, save_tiny_llama
from pyattr.apps.prompts import RunError, read_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["the cat sat on the mat", "a dog", "paris is the capital of france and a city of light",
         "one two three four five six seven", "hello", "the quick brown fox jumps over the lazy dog"]


def _prompt(tok, text):
    """The ids a run explains: the prompt without the [SEP] the tokenizer appends (the
    next token of the prompt, as `pyattr explain` reads it)."""
    from pyattr.methods._core.tokens import prompt_ids

    return torch.tensor([prompt_ids(tok, text)])


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from models import minilm

    tok, _ = minilm()
    d = save_tiny_llama(tmp_path_factory.mktemp("run-llama"), len(tok), tok, max_position_embeddings=24)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return d, AutoTokenizer.from_pretrained(d), AutoModelForCausalLM.from_pretrained(d).eval()


def _jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def _read(out):
    import pandas as pd

    return pd.read_parquet(out)


def test_store_reads_back_as_relevance_per_prompt_in_input_order(lm, tmp_path):
    d, tok, model = lm
    data = _jsonl(tmp_path / "p.jsonl", [{"text": t} for t in TEXTS])
    summary = pyattr.run(model, data, tmp_path / "out", tokenizer=tok, shard_size=4, max_tokens_per_batch=40)
    assert summary.stored == 6 and summary.failed == 0 and summary.shards == ["part-00000-000000.parquet",
                                                                            "part-00000-000001.parquet"]
    df = _read(tmp_path / "out")
    assert list(df["id"]) == [str(i) for i in range(6)] and list(df["index"]) == list(range(6))
    assert list(df["text"]) == TEXTS and df["error"].isna().all()
    assert list(df["target_token"]) == tok.convert_ids_to_tokens([int(t) for t in df["target_id"]])
    for i, text in enumerate(TEXTS):
        ids = _prompt(tok, text)
        want = pyattr.relevance(model, ids)
        got = torch.tensor(list(df["token_relevance"][i]))
        torch.testing.assert_close(got, want.token_relevance[0], atol=1e-5, rtol=1e-4)
        assert list(df["tokens"][i]) == tok.convert_ids_to_tokens(ids[0])
        assert int(df["target_id"][i]) == int(want.target_ids[0])
        assert df["target"][i] == pytest.approx(float(want.target), abs=1e-5)
        assert df["conservation_delta"][i] == pytest.approx(float(want.conservation_delta), abs=1e-4)
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["complete"] is True and manifest["rows"] == 6 and manifest["model_type"] == "llama"
    assert manifest["rules"]["attention"] == "frozen" and manifest["pyattr_version"] == pyattr.__version__


def test_csv_parquet_and_target_field(lm, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d, tok, model = lm
    rows = [{"id": f"p{i}", "text": t, "answer": "the"} for i, t in enumerate(TEXTS[:3])]
    with open(tmp_path / "p.csv", "w", encoding="utf-8") as f:
        f.write("id,text,answer\n" + "".join(f"{r['id']},{r['text']},{r['answer']}\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    a = pyattr.run(model, tmp_path / "p.csv", tmp_path / "a", tokenizer=tok, target="answer")
    b = pyattr.run(model, tmp_path / "p.parquet", tmp_path / "b", tokenizer=tok, target="answer")
    assert a.stored == b.stored == 3
    da, db = _read(tmp_path / "a"), _read(tmp_path / "b")
    the = tok.convert_tokens_to_ids("the")
    assert list(da["id"]) == ["p0", "p1", "p2"] and (da["target_id"] == the).all()
    assert list(da["target"]) == list(db["target"])
    ids = _prompt(tok, TEXTS[0])
    assert da["target"][0] == pytest.approx(float(pyattr.relevance(model, ids, target=the).target), abs=1e-5)


def test_bad_prompts_are_recorded_not_skipped(lm, tmp_path):
    d, tok, model = lm
    path = tmp_path / "bad.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"text": "a fine prompt"}\n')
        f.write(b'{"text": ""}\n')                                        # empty
        f.write(b'{"txt": "wrong field"}\n')                              # missing field
        f.write(b'{"text": "bad \xff byte"}\n')                           # not UTF-8
        f.write(b'not json\n')
        f.write(json.dumps({"text": "word " * 40}).encode() + b"\n")     # longer than 24 positions
        f.write(b'{"text": 7}\n')
    s = pyattr.run(model, path, tmp_path / "out", tokenizer=tok)
    df = _read(tmp_path / "out")
    assert len(df) == 7 and s.failed == 6
    errors = list(df["error"])
    assert df["error"].isna()[0]
    assert errors[1] == "empty text"
    assert errors[2] == "line 3: field 'text' missing"
    assert errors[3] == "line 4: not UTF-8 (byte 14)"
    assert errors[4].startswith("line 5: not JSON")
    assert errors[5] == "41 tokens; the model reads at most 24"  # [CLS] and 40 words
    assert errors[6] == "line 7: field 'text' not a string (int)"
    assert df["token_relevance"][1] is None and df["target"].isna()[1:].all()


@pytest.mark.parametrize("content, name, message", [
    ("", "empty.jsonl", "holds no prompts"),
    ("id,prompt\n1,hello\n", "p.csv", "has no column 'text' (columns: ['id', 'prompt']); pass text_field= (--text-field)"),
    ('{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n', "dup.jsonl", "the id '1' appears more than once"),
    ("hello", "p.txt", "expected a .jsonl, .csv or .parquet file"),
    # a JSON-lines file none of whose rows has the field: one error, as a table without the column
    ('{"body": "a"}\n{"body": "b"}\n', "nofield.jsonl",
     "data (--data): no row of nofield.jsonl has the field 'text'; pass text_field= (--text-field)"),
])
def test_bad_data_files_raise_one_clear_error(tmp_path, content, name, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(RunError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        read_prompts(path)


def test_cli_errors_and_another_configuration(lm, tmp_path):
    d, tok, model = lm
    data = _jsonl(tmp_path / "p.jsonl", [{"text": t} for t in TEXTS[:2]])
    r = run_cli("run", "--model", d, "--data", data, "--out", tmp_path / "o", "--rules", "bogus")
    assert r.returncode == 2 and "pyattr run: error: --rules: expected all, attnlrp, ln, none" in r.stderr
    r = run_cli("run", "--model", d, "--data", tmp_path / "nope.jsonl", "--out", tmp_path / "o")
    assert r.returncode == 2 and "--data: " in r.stderr and "is not a file" in r.stderr
    r = run_cli("run", "--model", d, "--data", data, "--out", tmp_path / "o")
    assert r.returncode == 0 and r.stdout.startswith("2 prompts stored (0 with an error), 0 already stored, 1 shard, ")
    r = run_cli("run", "--model", d, "--data", data, "--out", tmp_path / "o", "--rules", "none")
    assert r.returncode == 2 and "holds a run with another rules" in r.stderr
    r = run_cli("run", "--model", d, "--data", data, "--out", tmp_path / "o")
    assert r.returncode == 0 and "0 prompts stored (0 with an error), 2 already stored" in r.stdout


def _pyattr_cmd():
    return [sys.executable, "-m", "pyattr"]


@pytest.mark.slow
def test_resume_after_sigkill_stores_every_prompt_once(lm, tmp_path):
    d, tok, model = lm
    n = 300
    data = _jsonl(tmp_path / "p.jsonl", [{"text": f"{TEXTS[i % 6]} {i}"} for i in range(n)])
    out = tmp_path / "out"
    cmd = [*_pyattr_cmd(), "run", "--model", str(d), "--data", str(data), "--out", str(out), "--shard-size", "2",
           "--max-tokens-per-batch", "16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None and len(list(out.glob("part-*.parquet"))) < 3:
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    done_before = len(list(out.glob("part-*.parquet")))
    assert 3 <= done_before < n // 2, "the run was not killed part-way"
    (out / ".part-00000-000999.parquet.tmp").write_bytes(b"half a shard")  # what a kill mid-write leaves
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    df = _read(out)
    assert sorted(df["id"], key=int) == [str(i) for i in range(n)] and df["id"].is_unique
    assert list(df["index"]) == list(range(n)) and df["error"].isna().all()
    assert not list(out.glob(".*tmp"))
    assert json.loads((out / "_manifest.json").read_text())["complete"] is True


@pytest.mark.slow
def test_torchrun_two_gloo_processes_equal_one(lm, tmp_path):
    d, tok, model = lm
    data = _jsonl(tmp_path / "p.jsonl", [{"text": t} for t in TEXTS] + [{"text": ""}])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    one = pyattr.run(model, data, tmp_path / "one", tokenizer=tok)
    assert one.stored == 7
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
           "-m", "pyattr", "run", "--model", str(d), "--data", str(data), "--out", str(tmp_path / "two"), "--shard-size", "2"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    a = _read(tmp_path / "one").sort_values("index").reset_index(drop=True)
    b = _read(tmp_path / "two").sort_values("index").reset_index(drop=True)
    assert list(a["id"]) == list(b["id"]) and len(b) == 7  # each prompt once, no sampler padding
    assert {f.name.split("-")[1] for f in (tmp_path / "two").glob("part-*")} == {"00000", "00001"}
    for x, y in zip(a["token_relevance"], b["token_relevance"]):
        if x is None:
            assert y is None
        else:
            torch.testing.assert_close(torch.tensor(list(y)), torch.tensor(list(x)), atol=1e-5, rtol=1e-4)
    assert list(a["error"].fillna("")) == list(b["error"].fillna(""))
    manifest = json.loads((tmp_path / "two" / "_manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["complete"] is True and manifest["rows"] == 7


def test_a_second_run_into_the_same_directory_at_once_is_refused(lm, tmp_path):
    from pyattr.apps.store import lock_output as lock

    d, tok, model = lm
    data = _jsonl(tmp_path / "p.jsonl", [{"text": t} for t in TEXTS[:2]])
    (tmp_path / "out").mkdir()
    held = lock(tmp_path / "out", 0)  # as a running process holds it
    try:
        with pytest.raises(RunError, match="another run is writing to"):
            pyattr.run(model, data, tmp_path / "out", tokenizer=tok)
    finally:
        held.close()
    assert pyattr.run(model, data, tmp_path / "out", tokenizer=tok).stored == 2


# --------------------------------------------------------------------------- found by an adversarial pass


def test_targets_are_tokens_unless_given_as_integers(lm, tmp_path):
    d, tok, model = lm
    five = tok.convert_tokens_to_ids("5")
    with open(tmp_path / "num.csv", "w", encoding="utf-8") as f:
        f.write("text,answer\ntwo plus three is,5\nthe year is, 1999\n")
    pyattr.run(model, tmp_path / "num.csv", tmp_path / "a", tokenizer=tok, target="answer")
    df = _read(tmp_path / "a")
    assert list(df["target_id"]) == [five, tok.convert_tokens_to_ids("1999")]  # the tokens, not ids 5 / 1999
    data = _jsonl(tmp_path / "ids.jsonl", [{"text": "two plus three is", "answer": 5}, {"text": "x", "answer": "--5"},
                                           {"text": "y", "answer": 1.5}])
    pyattr.run(model, data, tmp_path / "b", tokenizer=tok, target="answer")
    df = _read(tmp_path / "b")
    assert int(df["target_id"][0]) == 5  # a JSON number is an id
    assert df["error"][1] == "target token '--5' is not in the vocabulary (it splits into 3 tokens after the text, not one)"
    assert df["error"][2] == "line 3: target 1.5 is neither a token nor an integer id"


def test_an_id_never_collides_with_another_prompts_target(lm, tmp_path):
    d, tok, model = lm
    rows = [{"id": "a", "text": "the cat sat"}, {"id": "a\0target", "text": "paris is the capital"}]
    pyattr.run(model, rows, tmp_path / "o", tokenizer=tok)
    df = _read(tmp_path / "o")
    want = pyattr.relevance(model, _prompt(tok, "the cat sat"))
    assert int(df["target_id"][0]) == int(want.target_ids[0])


def _csv_without_text(tmp_path):
    (tmp_path / "nt.csv").write_text("id,prompt\n1,hello\n")
    return tmp_path / "nt.csv"


def test_edited_data_or_another_list_is_another_run(lm, tmp_path):
    d, tok, model = lm
    pyattr.run(model, ["the cat sat", "a dog"], tmp_path / "o", tokenizer=tok)
    with pytest.raises(RunError, match="holds a run with another data_sha256"):
        pyattr.run(model, ["paris is", "one two"], tmp_path / "o", tokenizer=tok)
    # float32: another batch budget (a smaller one after running out of memory) resumes
    assert pyattr.run(model, ["the cat sat", "a dog"], tmp_path / "o", tokenizer=tok, max_tokens_per_batch=8).skipped == 2
    bf16 = model.to(torch.bfloat16)
    try:
        pyattr.run(bf16, ["the cat sat"], tmp_path / "b", tokenizer=tok)
        with pytest.raises(RunError, match="holds a run with another max_tokens_per_batch"):
            pyattr.run(bf16, ["the cat sat"], tmp_path / "b", tokenizer=tok, max_tokens_per_batch=8)
    finally:
        model.to(torch.float32)
    with pytest.raises(RunError, match="nt.csv has no column 'text'"):
        pyattr.run(model, _csv_without_text(tmp_path), tmp_path / "new", tokenizer=tok)
    assert not (tmp_path / "new").exists()  # a refused file creates no output directory
    (tmp_path / "a_file").write_text("")
    with pytest.raises(RunError, match="out \\(--out\\): '.*a_file' is a file; expected a directory"):
        pyattr.run(model, ["the cat sat"], tmp_path / "a_file", tokenizer=tok)


def test_file_forms_and_unusual_text(lm, tmp_path):
    import pandas as pd

    d, tok, model = lm
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "the cat"}\n\n{"text": "a dog"}\n')
    prompts = read_prompts(tmp_path / "bom.jsonl")
    assert [(p.id, p.text, p.error) for p in prompts] == [("0", "the cat", None), ("1", "a dog", None)]
    (tmp_path / "arr.json").write_text('[\n  {"text": "the cat"},\n  {"text": "a dog"}\n]\n')
    assert [p.text for p in read_prompts(tmp_path / "arr.json")] == ["the cat", "a dog"]
    (tmp_path / "sur.jsonl").write_text('{"text": "bad \\ud800 text"}\n{"text": "fine"}\n')
    pyattr.run(model, tmp_path / "sur.jsonl", tmp_path / "o", tokenizer=tok)
    df = _read(tmp_path / "o")
    assert df["error"][0] == "line 1: field 'text' is not valid Unicode (a lone surrogate)" and df["error"].isna()[1]
    with pytest.raises(RunError, match="target \\(--target\\): no prompt of bom.jsonl has the field 'answr'"):
        read_prompts(tmp_path / "bom.jsonl", target_field="answr")
    with pytest.raises(RunError, match="data: item 0 is a int; expected strings or dicts"):
        read_prompts([1, 2])
    assert [p.text for p in read_prompts(pd.DataFrame({"text": ["x", "y"]}))] == ["x", "y"]
    before = (tok.padding_side, tok.pad_token)
    pyattr.run(model, ["the cat"], tmp_path / "o2", tokenizer=tok)
    assert (tok.padding_side, tok.pad_token) == before


def test_gradient_checkpointing_flag_gives_the_same_rows(lm, tmp_path):
    d, tok, model = lm
    data = _jsonl(tmp_path / "p.jsonl", [{"text": t} for t in TEXTS])
    assert run_cli("run", "--model", d, "--data", data, "--out", tmp_path / "a").returncode == 0
    r = run_cli("run", "--model", d, "--data", data, "--out", tmp_path / "b", "--gradient-checkpointing")
    assert r.returncode == 0, r.stderr
    a, b = _read(tmp_path / "a"), _read(tmp_path / "b")
    for x, y in zip(a["token_relevance"], b["token_relevance"]):
        x, y = torch.tensor(list(x)), torch.tensor(list(y))
        assert (x - y).abs().max() <= 1e-6 * x.abs().max()


@pytest.mark.slow
def test_dataset_benchmark_configuration(tmp_path, monkeypatch):
    """One configuration of ``pyattr bench --dataset`` on a 1-layer model: the row counts
    what the store holds and its rates follow from them."""
    from pyattr.bench import dataset

    size = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                num_key_value_heads=2, prompts=5, lo=8, hi=20, dtype="float32")
    model_dir, data, params = dataset.prepare(tmp_path, size)
    lengths = [len(json.loads(line)["text"].split()) + 1 for line in data.read_text().splitlines()]
    assert len(lengths) == 5 and all(8 <= n <= 20 for n in lengths) and params > 0
    row = dataset.run_config("1 process, checkpointing", model_dir, data, tmp_path / "out", size, "cpu", 1)
    assert row["prompts"] == 5 and row["tokens"] == sum(lengths) and row["processes"] == 1
    assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
    assert row["peak_rss_bytes"] > 100e6  # a Python process with torch loaded
    md = dataset.markdown([row], {"parameters": params, "num_hidden_layers": 1, "hidden_size": 32,
                                  "intermediate_size": 48, "dtype": "float32", "prompts": 5, "prompt_tokens": [8, 20]})
    assert "| 1 process, checkpointing | 1 |" in md


def test_an_architecture_without_a_rule_map_is_one_error_or_runs_generic(tmp_path):
    """Reported: every row was stored with RelevanceRuleUnsupportedError (and never retried)
    and `--generic` did not exist. Now the run refuses before OUT exists, naming --generic;
    with it the rows are the generic relevance."""
    from models import minilm, tiny_unmapped

    tok, _ = minilm()
    model = tiny_unmapped("CohereConfig", torch.float32, attn=None, vocab_size=len(tok), pad_token_id=0)
    d = tmp_path / "cohere"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    data = _jsonl(tmp_path / "p.jsonl", [{"text": t} for t in TEXTS[:3]])
    r = run_cli("run", "--model", d, "--data", data, "--out", tmp_path / "o")
    assert r.returncode == 2 and "model type 'cohere'" in r.stderr and "Pass --generic" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()
    r = run_cli("run", "--model", d, "--data", data, "--out", tmp_path / "o", "--generic")
    assert r.returncode == 0, r.stderr
    df = _read(tmp_path / "o")
    assert df["error"].isna().all()
    want = pyattr.relevance(model, _prompt(tok, TEXTS[0]), generic=True)
    torch.testing.assert_close(torch.tensor(list(df["token_relevance"][0])), want.token_relevance[0], rtol=1e-4, atol=1e-5)
    assert abs(df["conservation_delta"][0]) <= 1e-4 * abs(df["target"][0])
    with pytest.raises(RunError, match=r"model: model type 'cohere'"):
        pyattr.run(model, data, tmp_path / "o2", tokenizer=tok)
    assert not (tmp_path / "o2").exists()


def test_an_encoder_is_not_a_causal_lm(tmp_path):
    from models import minilm

    tok, _ = minilm()
    cfg = __import__("models")._cfg("modernbert", "sdpa")
    cfg.vocab_size = len(tok)
    from transformers import AutoModelForMaskedLM

    AutoModelForMaskedLM.from_config(cfg).save_pretrained(tmp_path / "enc")
    tok.save_pretrained(tmp_path / "enc")
    data = _jsonl(tmp_path / "p.jsonl", [{"text": "x"}])
    for args in (["run", "--data", data, "--out", tmp_path / "o"], ["explain", "--text", "the cat"]):
        r = run_cli(args[0], "--model", tmp_path / "enc", *args[1:])
        assert r.returncode == 2 and "holds a 'modernbert' model, which is not a causal language model" in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1
    assert not (tmp_path / "o").exists()
