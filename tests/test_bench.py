"""The benchmark harness produces well-formed results; no timing is asserted."""

import contextlib
import copy
import io
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import run_cli
import pyattr.apps.contention as contention
from pyattr.bench import e2e, micro, report

TINY = {"elementwise": (8, 96), "norm": (8, 64), "attention": ((16, 128), (9, 256))}


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
    cases = [c for c in micro.cases(micro.OPS, ("silu", "relu")) if c[0] != "attention"]
    # the attention op: backward only, at each of its shapes
    assert len(doc["rows"]) == len(cases) * len(providers) * len(micro.MODES) + 2 * len(providers)
    att = [r for r in doc["rows"] if r["op"] == "attention"]
    assert {r["mode"] for r in att} == {"bwd"} and {tuple(r["shape"]) for r in att} == {(16, 128), (9, 256)}
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


def test_frozen_attention_saves_less_than_sdpa(doc):
    """The frozen core keeps q and k (2 of the 3 inputs); SDPA keeps q, k, v, the output
    and the log-sum-exp."""
    att = [r for r in doc["rows"] if r["op"] == "attention" and r["shape"] == [16, 128]]
    by = {r["provider"]: r["saved_ratio_to_inputs"] for r in att}
    for p in [p for p in by if p.startswith("pyattr-")]:
        assert by[p] == pytest.approx(2 / 3)
        assert by[p] < by["native"]


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
    n_cases = len({(r["op"], r["activation"], r["dtype"]) for r in doc["rows"] if r["op"] != "attention"})
    n_attention = len({(r["dtype"], tuple(r["shape"])) for r in doc["rows"] if r["op"] == "attention"})
    # fwd+bwd summary and the attention (bwd) summary: header + one line per case; every
    # measurement: header + one line per row
    assert md.count("\n| ") == (n_cases + 1) + (n_attention + 1) + (len(doc["rows"]) + 1)
    assert "Frozen attention (AH-rule), backward only" in md
    assert "Warning" not in md and "Conditions" not in md  # no contention given


def test_torch_reference_is_measured_and_compared(doc):
    providers = micro.providers_for(torch.device("cpu"))
    assert providers[:3] == ["native", "unfused", "pyattr-torch"]
    rows = doc["rows"]
    index = {(r["op"], r["activation"], r["mode"], tuple(r["shape"]), r["provider"]): r for r in rows}
    for r in rows:
        ref = index[(r["op"], r["activation"], r["mode"], tuple(r["shape"]), "pyattr-torch")]
        assert r["ratio_to_torch"] == r["median_ms"] / ref["median_ms"]
        if r["provider"] == "pyattr-torch":
            assert r["ratio_to_torch"] == 1.0


def test_summary_shows_torch_next_to_each_compiled_backend(doc):
    compiled = [p.split("-", 1)[1] for p in micro.providers_for(torch.device("cpu"))
                if p.startswith("pyattr-") and p != "pyattr-torch"]
    lines = report.summary(doc["rows"]).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    expect = ["op", "dtype", "shape", "native ms", "unfused ms", "pyattr-torch ms"] + [f"pyattr-{b} ms" for b in compiled]
    for b in compiled:
        expect += [f"{b} ÷ torch", f"{b} ÷ native", f"{b} ÷ unfused"]
    expect.append("saved/inputs " + " · ".join(["native", "unfused", "torch"] + compiled))
    assert head == expect
    first = [c.strip() for c in lines[2].strip("|").split("|")]
    r = {x["provider"]: x for x in doc["rows"] if x["op"] == "identity" and x["activation"] == "silu"
         and x["mode"] == "fwd+bwd"}
    assert first[:3] == ["identity silu", "float32", "8×96"]
    assert first[5] == f"{r['pyattr-torch']['median_ms']:.3f}"
    for i, b in enumerate(compiled):
        assert first[6 + len(compiled) + 3 * i] == f"{r[f'pyattr-{b}']['ratio_to_torch']:.2f}"


def test_document_carries_the_cpu_conditions(doc):
    c = doc["contention"]
    assert set(c) == set(report.CONTENTION_FIELDS)
    assert c["cores"] == contention.usable_cores() and c["threads"] == torch.get_num_threads()
    assert c["oversubscribed"] == bool(c["reasons"]) == (c["warning"] is not None)


def test_markdown_warns_when_oversubscribed(doc):
    busy = contention.judge(2, 2, 2, 9.0, None)
    md = report.markdown(doc["rows"], doc["copy_bandwidth_gbps"], "t", busy)
    assert ("**Warning: timings unreliable, the CPU is oversubscribed: load average 9.00 above the 2 CPUs of "
            "the machine. For stable numbers run on an idle machine, or with OMP_NUM_THREADS=1.**") in md
    quiet = contention.judge(2, 2, 2, 0.1, 0.0)
    md = report.markdown(doc["rows"], doc["copy_bandwidth_gbps"], "t", quiet)
    assert "Warning" not in md
    assert ("Conditions: 2 torch threads on 2 cores, load average 0.10 on 2 CPUs at the start, other processes "
            "kept 0.0 of those cores busy during the run.") in md
    rows = [dict(variant=v, dtype="float32", median_s=1.0, min_s=1.0, max_s=1.0, peak_bytes=2**20, saved_bytes=2**20)
            for v in e2e.VARIANTS]
    md = e2e.markdown(rows, e2e.ratios(rows), busy)
    assert md.startswith("**Warning: timings unreliable, the CPU is oversubscribed: load average 9.00")


def test_legacy_schema_still_validates(doc):
    old = copy.deepcopy(doc)
    old["schema"] = "pyattr-bench/1"
    del old["contention"]
    for r in old["rows"]:
        del r["ratio_to_torch"]
    report.validate(old)
    new = copy.deepcopy(old)
    new["schema"] = report.SCHEMA
    with pytest.raises(ValueError, match="field 'contention' missing"):
        report.validate(new)


@pytest.mark.slow
def test_cli_bench_reports_oversubscription(tmp_path, monkeypatch, capsys):
    from pyattr.cli import main

    monkeypatch.setattr(os, "getloadavg", lambda: (50.0, 50.0, 50.0))
    # no window measurement: the load average is what decides then (a measured window would)
    monkeypatch.setattr(contention, "_busy_seconds", lambda cpus: None)
    # in this process the allocator stays as it is: keep_freed_memory's mallopt is for a bench's
    # own process (it made a later test's freed 256 MiB come back as the next block's memory)
    from pyattr.bench import micro

    monkeypatch.setattr(micro, "keep_freed_memory", lambda: None)
    out, md = tmp_path / "b.json", tmp_path / "b.md"
    assert main(["bench", "--ops", "identity", "--dtypes", "float32", "--shapes", "16x64,16x32", "--repeats", "2",
                 "--json", str(out), "--markdown", str(md)]) == 0
    printed = capsys.readouterr().out
    d = json.loads(out.read_text())
    report.validate(d)
    cpus = os.cpu_count()
    assert d["contention"]["oversubscribed"] is True
    assert d["contention"]["reasons"][0] == f"load average 50.00 above the {cpus} CPUs of the machine"
    warning = f"**Warning: timings unreliable, the CPU is oversubscribed: load average 50.00 above the {cpus} CPUs"
    assert warning in printed and warning in md.read_text()
    assert {r["provider"] for r in d["rows"]} >= {"native", "unfused", "pyattr-torch"}
    p = subprocess.run([sys.executable, "-m", "pyattr.bench.check", str(out)], capture_output=True, text=True)
    assert p.returncode == 0
    assert p.stdout == (f"{out}: valid {report.SCHEMA} document, {len(d['rows'])} rows "
                        "(measured on an oversubscribed CPU: timings unreliable)\n")


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
    # the plain gradient with the head at the target position only: the same gradient
    torch.testing.assert_close(e2e.one_pass(model, "plain_kept", ids, 5), c, atol=1e-6, rtol=1e-5)
    row = e2e.measure("cpu", torch.float32, "pyattr", repeats=1)
    assert row["median_s"] > 0 and row["peak_bytes"] > 0 and row["variant"] == "pyattr"


@pytest.mark.slow
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
        (lambda d: d["rows"][0].pop("ratio_to_torch"), "lacks \\['ratio_to_torch'\\]"),
        (lambda d: d["contention"].pop("threads"), "contention lacks 'threads'"),
        (lambda d: d["contention"].update(threads=0), "contention field 'threads' must be a finite positive"),
        (lambda d: d["contention"].update(oversubscribed="yes"), "contention field 'oversubscribed' has type str"),
        (lambda d: d["contention"].update(oversubscribed=not d["contention"]["oversubscribed"]), "'oversubscribed', 'reasons' and 'warning' disagree"),
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
    from pyattr.bench.check import main

    for name in list(cases) + ["missing.json"]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main([str(tmp_path / name)])
        assert code == 1 and "invalid:" in err.getvalue() and "Traceback" not in err.getvalue(), (name, err.getvalue())
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        main([str(tmp_path / "bad.json")])
    assert "invalid: not a JSON document" in err.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--help"]) == 0
    assert out.getvalue().startswith("usage: python -m pyattr.bench.check FILE.json")
    # the module entry point CI runs, once in its own process
    p = subprocess.run([sys.executable, "-m", "pyattr.bench.check", str(tmp_path / "bad.json")], capture_output=True, text=True)
    assert p.returncode == 1 and "invalid:" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--dtypes", "float8_e4m3fn"], "--dtypes: expected some of"),
        (["--device", "cuda:abc"], "--device: expected cpu or cuda"),
        (["--json", ""], "--json needs a file path"),
        (["--json", "/nonexistent/dir/x.json"], "--json: cannot write"),
        (["--e2e", "--layers", "-1"], "--layers must be >= 1"),
        (["--e2e", "--targets", "-1"], "--targets must be >= 0"),
        (["--ig-memory", "--chunk", "0"], "--chunk must be >= 1"),
        (["--e2e", "--conservation"], "--e2e, --conservation, --ig-memory, --patching, --dataset, --faithfulness, "
                                      "--estimators, --generation, --long-context, --scale, --citations, --circuits and "
                                      "--frameworks are separate runs"),
        (["--scale", "--long-context"], "are separate runs; pass one"),
        (["--faithfulness", "--estimators"], "are separate runs; pass one"),
        (["--png", "/tmp/x.png"], "--png is the perturbation-curve plot of --faithfulness"),
        (["--faithfulness", "--png", "/nonexistent/dir/x.png"], "--png: cannot write"),
        (["--long-context", "--lxt-python", "/nonexistent/bin/python"],
         "--lxt-python: expected the path of a Python interpreter, got '/nonexistent/bin/python'"),
        (["--generation", "--lxt-python", "python3"], "--lxt-python adds LXT to --long-context and --scale; pass one"),
        (["--long-context", "--context", "16384"], "--context sets the context lengths of --generation's long-context "
                                                   "table and of --scale; pass one"),
        (["--scale", "--context", "1k"], "--context: expected positive token counts separated by commas, got '1k'"),
        (["--generation", "--context", "0"], "--context: expected positive token counts separated by commas, got '0'"),
        (["--generation", "--rounds", "0"], "--rounds must be >= 1, got 0"),
        (["--faithfulness", "--rounds", "2"], "--rounds sets the interleaved rounds of --generation, --long-context, "
                                              "--scale and --frameworks; pass one"),
        (["--generation", "--context", "16k"], "--context: expected positive token counts separated by commas, got '16k'"),
        (["--e2e", "--allocator", "returned"], "--allocator applies to --scale; pass it"),
        (["--scale", "--dtypes", "float16"], "--dtypes: --scale runs bfloat16 and float32, got 'float16'"),
        (["--scale", "--dtypes", "bfloat16,float64"], "--dtypes: --scale runs bfloat16 and float32, got 'float64'"),
        (["--scale", "--allocator", "returned", "--lxt-python", "python3"],
         "--allocator returned measures pyattr's processes only; run --lxt-python without it"),
    ],
)
def test_cli_bench_bad_arguments(args, msg):
    p = run_cli("bench", "--quick", *args)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.slow
def test_micro_keeps_freed_memory_in_its_own_process():
    """``pyattr bench`` (micro) turns glibc's mmap and trimming off in its process, and the
    report says so; the markdown carries the line."""
    p = subprocess.run([sys.executable, "-c", "from pyattr.bench import micro; print(micro.keep_freed_memory())"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    import platform

    if platform.libc_ver()[0] == "glibc":
        assert p.stdout.startswith("glibc malloc with mmap and heap trimming off (mallopt)")
    else:
        assert p.stdout.strip() == "None"
    md = report.markdown([], 10.0, "t", None, "ALLOC")
    assert "Allocator: ALLOC.\n\nCopy bandwidth" in md and "Allocator" not in report.markdown([], 10.0, "t")


def test_micro_providers_are_timed_in_turn():
    """time_interleaved runs one of each provider per round, after each one's warm-up;
    the order within a round is reshuffled (seeded), so that no provider always follows
    the same one."""
    order = []
    runs = [lambda i=i: order.append(i) for i in range(3)]
    out = micro.time_interleaved(runs, torch.device("cpu"), warmup=2, repeats=12)
    assert order[:6] == [0, 0, 1, 1, 2, 2]
    rounds = [tuple(order[6 + 3 * r: 9 + 3 * r]) for r in range(12)]
    assert all(sorted(r) == [0, 1, 2] for r in rounds)
    assert len(set(rounds)) > 1  # not one fixed order
    # each provider is preceded by each other one in some round (2 is not always after 1)
    after = {(r[k - 1], r[k]) for r in rounds for k in range(1, 3)}
    assert {(0, 1), (1, 0), (1, 2), (2, 1), (0, 2), (2, 0)} <= after
    # the same seed, the same orders: runs are comparable between invocations
    again = []
    micro.time_interleaved([lambda i=i: again.append(i) for i in range(3)], torch.device("cpu"), warmup=2, repeats=12)
    assert again == order
    assert [len(t) for t in out] == [12, 12, 12] and all(v >= 0 for t in out for v in t)
    # a provider's scope (its backend) is entered around its runs, outside the timed window
    import contextlib as cl

    seen = []

    @cl.contextmanager
    def scope(i):
        seen.append(("enter", i))
        yield
        seen.append(("exit", i))

    order.clear()
    micro.time_interleaved(runs[:2], torch.device("cpu"), warmup=0, repeats=1,
                           contexts=[lambda: scope(0), lambda: scope(1)])
    assert seen[:4] == [("enter", 0), ("exit", 0), ("enter", 1), ("exit", 1)]  # warm-up, in order
    assert sorted(order) == [0, 1]
    assert seen[4:] == [x for i in order for x in (("enter", i), ("exit", i))]


def test_micro_providers_of_a_case_share_their_inputs():
    """Every provider of a case reads the same input tensors (where a tensor lies in memory
    moved an op's time by a quarter here): the pool hands the i-th input to each."""
    pool = {}
    cases = [micro._Case("layer_norm", None, p, (8, 16), torch.float32, torch.device("cpu"), "fwd+bwd", pool)
             for p in ("native", "pyattr-torch")]
    assert len(pool) == 3  # x, weight, bias
    fn_native, ins_native, _ = micro.build("layer_norm", None, "native", (8, 16), torch.float32, torch.device("cpu"), pool)
    fn_torch, ins_torch, _ = micro.build("layer_norm", None, "pyattr-torch", (8, 16), torch.float32,
                                         torch.device("cpu"), pool)
    assert all(a is b for a, b in zip(ins_native, ins_torch)) and all(a is pool[i] for i, a in enumerate(ins_native))
    # without a pool each build draws its own tensors (same values, other memory)
    _, own, _ = micro.build("layer_norm", None, "native", (8, 16), torch.float32, torch.device("cpu"))
    assert all(a is not b and torch.equal(a, b) for a, b in zip(own, ins_native))
    assert [c.provider for c in cases] == ["native", "pyattr-torch"]


@pytest.mark.slow
def test_e2e_cpu_times_come_from_one_interleaved_process():
    """On CPU the e2e rows keep each variant's own peak and saved bytes (one process per
    variant) and take their times from one process that runs the variants in turn."""
    rows = e2e.run_all("cpu", [torch.float32], repeats=2, layers=1, k=0, seq=8)
    assert [r["variant"] for r in rows] == list(e2e.VARIANTS)
    for r in rows:
        assert r["timing"] == "interleaved" and 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["peak_bytes"] > 0 and r["saved_bytes"] > 0 and r["seq"] == 8 and r["layers"] == 1
    md = e2e.markdown(rows, e2e.ratios(rows))
    assert "Times from one process that runs the variants in turn" in md


def test_e2e_interleaved_timing_in_process(monkeypatch):
    monkeypatch.setitem(e2e.SIZES, "cpu", dict(num_hidden_layers=1, hidden_size=64, intermediate_size=96,
                                             num_attention_heads=4, num_key_value_heads=4, seq=8))
    calls = []
    real = e2e.one_pass
    monkeypatch.setattr(e2e, "one_pass", lambda model, v, ids, t, k=8: calls.append(v) or real(model, v, ids, t, k))
    out = e2e.time_interleaved("cpu", torch.float32, ["plain", "pyattr"], repeats=3)
    assert calls == ["plain", "pyattr"] * 4 and {v: len(t) for v, t in out.items()} == {"plain": 3, "pyattr": 3}
