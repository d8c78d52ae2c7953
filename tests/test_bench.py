"""The benchmark harness produces well-formed results; no timing is asserted."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import pyattr
from pyattr.bench import e2e, micro, report

TINY = {"elementwise": (8, 96), "norm": (8, 64)}


@pytest.fixture(scope="module")
def doc():
    copy_bw, rows = micro.run_suite(
        torch.device("cpu"), micro.OPS, [torch.float32], TINY, activations=("silu", "relu"),
        warmup=1, repeats=3, progress=False,
    )
    return report.document("micro", torch.device("cpu"), micro.rows_as_dicts(rows), copy_bandwidth_gbps=copy_bw)


def test_schema_and_coverage(doc):
    report.validate(doc)
    providers = micro.providers_for(torch.device("cpu"))
    cases = list(micro.cases(micro.OPS, ("silu", "relu")))
    assert len(doc["rows"]) == len(cases) * len(providers) * len(micro.MODES)
    assert doc["copy_bandwidth_gbps"] > 0 and doc["torch_version"] == torch.__version__
    for r in doc["rows"]:
        if r["provider"] == "native":
            assert r["ratio_to_native"] == 1.0
        assert r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
    json.dumps(doc)  # serialisable


def _saved(doc, op, provider):
    return next(r["saved_ratio_to_inputs"] for r in doc["rows"] if r["op"] == op and r["provider"] == provider and r["mode"] == "fwd")


def test_bytes_saved_for_backward(doc):
    for p in [p for p in micro.providers_for(torch.device("cpu")) if p.startswith("pyattr-")]:
        assert _saved(doc, "identity", p) == 1.0  # x only
        assert _saved(doc, "gated", p) == 1.0  # gate and up only
        assert _saved(doc, "half", p) == 1.0
    assert _saved(doc, "identity", "unfused") == 2.0  # x and y
    assert _saved(doc, "gated", "native") == 1.5  # gate, up and act(gate)


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda d: d.pop("rows"), "field 'rows' missing"),
        (lambda d: d["rows"][0].pop("gbps"), "row 0 lacks"),
        (lambda d: d["rows"][0].update(median_ms="fast"), "field 'median_ms' has type str"),
        (lambda d: d.update(schema="other/9"), "schema 'other/9'"),
        (lambda d: d["rows"][0].update(p20_ms=1e9), "percentiles out of order"),
    ],
)
def test_validate_rejects_broken_documents(doc, mutate, msg):
    bad = copy.deepcopy(doc)
    mutate(bad)
    with pytest.raises(ValueError, match=msg):
        report.validate(bad)


def test_markdown_table(doc):
    md = report.markdown(doc["rows"], doc["copy_bandwidth_gbps"], "t")
    assert md.count("\n| ") == len(doc["rows"]) + 1


def test_unfused_baseline_computes_the_same_rules(monkeypatch):
    """The e2e baseline (unfused composition) and pyattr implement the same rules:
    equal relevance on a small Llama, and the plain gradient differs."""
    monkeypatch.setitem(e2e.SIZES, "cpu", dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                             num_attention_heads=4, num_key_value_heads=4, seq=12))
    model, seq = e2e.build_model("cpu", torch.float32)
    ids = torch.randint(0, 32000, (1, seq))
    a = e2e.one_pass(model, "pyattr", ids, 5)
    b = e2e.one_pass(model, "unfused", ids, 5)
    c = e2e.one_pass(model, "plain", ids, 5)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert not torch.allclose(a, c, atol=1e-6, rtol=1e-4)
    row = e2e.measure("cpu", torch.float32, "pyattr", repeats=1)
    assert row["median_s"] > 0 and row["peak_bytes"] > 0 and row["variant"] == "pyattr"


def test_cli_bench_quick_json(tmp_path):
    out = tmp_path / "b.json"
    p = subprocess.run(
        [sys.executable, "-m", "pyattr", "bench", "--ops", "identity,rms_norm", "--dtypes", "float32",
         "--shapes", "16x64,16x32", "--repeats", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    report.validate(d)
    assert {r["op"] for r in d["rows"]} == {"identity", "rms_norm"}
    bad = subprocess.run([sys.executable, "-m", "pyattr", "bench", "--shapes", "16by64"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--shapes: expected ROWSxHIDDEN" in bad.stderr


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda d: d.update(copy_bandwidth_gbps=float("nan")), "copy_bandwidth_gbps must be a finite positive"),
        (lambda d: d["rows"][0].update(gbps=float("-inf")), "field 'gbps' must be a finite non-negative"),
        (lambda d: d["rows"][0].update(saved_bytes=-5), "field 'saved_bytes' must be"),
        (lambda d: d["rows"][0].update(shape=["a", 1]), "shape must be two positive integers"),
        (lambda d: d.update(kind="other"), "kind 'other'"),
        (lambda d: d.update(kind="e2e", rows=[1, 2]), "row 0 is not an object"),
    ],
)
def test_validate_rejects_bad_values(doc, mutate, msg):
    bad = copy.deepcopy(doc)
    mutate(bad)
    with pytest.raises(ValueError, match=msg):
        report.validate(bad)


def test_check_tool_one_line_errors(tmp_path):
    cases = {"bad.json": "{not json", "list.json": "[1, 2]", "empty.json": json.dumps({"schema": "pyattr-bench/1"})}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    for name in list(cases) + ["missing.json"]:
        p = subprocess.run([sys.executable, "-m", "pyattr.bench.check", str(tmp_path / name)], capture_output=True, text=True)
        assert p.returncode == 1 and "invalid:" in p.stderr and "Traceback" not in p.stderr, (name, p.stderr)


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--dtypes", "float8_e4m3fn"], "--dtypes: expected some of"),
        (["--device", "cuda:abc"], "--device: expected cpu or cuda"),
        (["--json", ""], "--json needs a file path"),
        (["--json", "/nonexistent/dir/x.json"], "--json: cannot write"),
        (["--e2e", "--layers", "-1"], "--layers must be >= 1"),
    ],
)
def test_cli_bench_bad_arguments(args, msg):
    p = subprocess.run([sys.executable, "-m", "pyattr", "bench", "--quick", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr
