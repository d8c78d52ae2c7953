"""The attribution benchmarks: the k-target pair of the e2e run, layer-wise conservation
in reduced precision, and integrated-gradients peak memory (tables and ratios from given
rows; the conservation measurement itself on a small model, by value)."""

import json
from pathlib import Path

import pytest
import torch

from pyattr.bench import conservation, e2e, ig_memory
from conftest import run_cli

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def _e2e_rows():
    rows = []
    for v, t in (("plain", 2.0), ("pyattr", 1.8), ("unfused", 2.2), ("k_targets", 4.0), ("k_calls", 16.0)):
        rows.append(dict(variant=v, k=8 if v.startswith("k_") else 1, dtype="float32", median_s=t, min_s=t, max_s=t,
                         peak_bytes=2**20 * (3 if v == "k_targets" else 2), saved_bytes=2**20))
    return rows


def test_e2e_k_target_ratio_and_table():
    rows = _e2e_rows()
    (q,) = e2e.ratios(rows)
    assert q["k"] == 8 and q["time_k_targets_over_k_calls"] == 0.25 and q["peak_k_targets_over_k_calls"] == 1.5
    md = e2e.markdown(rows, [q])
    assert "| float32 | k_targets (k=8) | 4.000 |" in md
    assert "| float32 | 8 | 0.25 | 1.50 |" in md


def test_e2e_plain_kept_ratio_and_table():
    rows = _e2e_rows() + [dict(variant="plain_kept", k=1, dtype="float32", median_s=1.5, min_s=1.5, max_s=1.5,
                               peak_bytes=2**20, saved_bytes=2**20)]
    (q,) = e2e.ratios(rows)
    assert q["time_pyattr_over_plain_kept"] == 1.2 and q["time_pyattr_over_plain"] == 0.9
    assert "| float32 | 1.20 |" in e2e.markdown(rows, [q])


def test_e2e_without_the_k_pair_has_no_k_ratio():
    rows = [r for r in _e2e_rows() if r["k"] == 1]
    (q,) = e2e.ratios(rows)
    assert "k" not in q and "k_targets" not in e2e.markdown(rows, [q])


def test_e2e_k_targets_pass_equals_k_calls(monkeypatch):
    monkeypatch.setitem(e2e.SIZES, "cpu", dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                               num_attention_heads=4, num_key_value_heads=4, seq=16))
    model, seq = e2e.build_model("cpu", torch.float32)
    ids = torch.randint(0, 32000, (1, seq), generator=torch.Generator().manual_seed(0))
    one = e2e.one_pass(model, "k_targets", ids, 5, k=3)
    loop = e2e.one_pass(model, "k_calls", ids, 5, k=3)
    assert one.shape == loop.shape == (3, 1, seq)
    torch.testing.assert_close(one, loop, rtol=1e-5, atol=1e-6)


def test_conservation_float32_is_tight_and_summary_is_the_worst_layer():
    rows = conservation.measure("cpu", [torch.float32], layers=2, seq=8, batch=2)
    impls = {(r["impl"], r["layer"]) for r in rows}
    assert impls == {(i, p) for i in ("pyattr", "unfused") for p in ("model.layers.0", "model.layers.1", "model.norm")}
    assert max(r["max_rel_error"] for r in rows) < 1e-5
    (s,) = conservation.summary(rows)
    assert s["pyattr_max_rel_error"] == max(r["max_rel_error"] for r in rows if r["impl"] == "pyattr")
    assert s["pyattr_over_unfused"] == pytest.approx(s["pyattr_max_rel_error"] / s["unfused_max_rel_error"])
    md = conservation.markdown(rows, [s])
    assert md.count("| float32 | model.") == 3


def test_prompt_level_conservation_and_agreement_with_float32(monkeypatch):
    """measure_prompts on 2 layers: in float32 both implementations conserve to float32
    rounding and the pyattr run agrees with the float32 reference exactly (the same run);
    in bfloat16 the error is larger but the ranking of tokens holds."""
    monkeypatch.setitem(conservation.CONFIG, "hidden_size", 64)
    monkeypatch.setitem(conservation.CONFIG, "intermediate_size", 96)
    rows = conservation.measure_prompts("cpu", [torch.float32, torch.bfloat16], n=6, layers=2, batch=4)
    by = {(r["dtype"], r["impl"]): r for r in rows}
    assert set(by) == {(d, i) for d in ("float32", "bfloat16") for i in ("pyattr", "unfused")}
    f32 = by[("float32", "pyattr")]
    assert f32["pearson_min"] == pytest.approx(1.0, abs=1e-12) and f32["top10_overlap_min"] == 1.0
    for impl in ("pyattr", "unfused"):
        assert by[("float32", impl)]["rel_error_max"] < 1e-5
        assert by[("float32", impl)]["unrounded_rel_error_max"] < 1e-5
        bf = by[("bfloat16", impl)]
        assert by[("float32", impl)]["rel_error_median"] < bf["rel_error_median"] < 3e-2
        assert bf["pearson_min"] > 0.99 and bf["prompts"] == 6 and bf["layers"] == 2
    md = conservation.prompts_markdown(rows)
    assert md.count("| bfloat16 | ") == 3 and md.count("| float32 | ") == 3


def test_ig_memory_table():
    rows = [dict(n_steps=n, internal_batch_size=c, peak_bytes=2**30, seconds=1.5, abs_convergence_delta=1e-3)
            for n, c in ((16, 16), (64, None))]
    md = ig_memory.markdown(rows)
    assert "| 16 | 16 | 1024 | 1.50 | 1.00e-03 |" in md and "| 64 | all | 1024 |" in md


def test_ig_memory_child_reports_a_row(monkeypatch, capsys):
    monkeypatch.setitem(e2e.SIZES, "cpu", dict(num_hidden_layers=1, hidden_size=32, intermediate_size=48,
                                               num_attention_heads=4, num_key_value_heads=4, seq=16))
    row = ig_memory.measure("cpu", torch.float32, n_steps=4, chunk=2, layers=1, seq=6)
    assert row["n_steps"] == 4 and row["internal_batch_size"] == 2 and row["peak_bytes"] > 0
    assert row["abs_convergence_delta"] >= 0 and json.dumps(row)


def test_saved_attribution_documents_validate_and_bad_rows_are_named():
    import copy

    from pyattr.bench import report

    for name in ("cpu_conservation", "cpu_ig_memory", "cpu_e2e_k_targets", "cpu_patching", "cpu_dataset",
                 "cpu_dataset_quick", "cpu_faithfulness", "cpu_estimators", "cpu_generation"):
        with open(RESULTS / f"{name}.json", encoding="utf-8") as f:
            doc = json.load(f)
        report.validate(doc)
    bad = copy.deepcopy(doc)
    bad["kind"] = "ig-memory"
    bad["rows"] = [{"dtype": "float32", "device": "cpu", "n_steps": 16, "peak_bytes": -1, "seconds": 1.0,
                    "abs_convergence_delta": 0.0}]
    with pytest.raises(ValueError, match=r"row 0 field 'peak_bytes'"):
        report.validate(bad)
    bad["kind"] = "speed"
    with pytest.raises(ValueError, match=r"kind 'speed', expected one of \['micro', 'e2e', 'conservation', 'ig-memory', 'patching', 'generation', "
                                         r"'generation-long', 'long-context', 'scale', 'estimators', 'frameworks', 'faithfulness', 'citations', "
                                         r"'circuits', 'dataset'\]"):
        report.validate(bad)
    bad["kind"] = "patching"
    bad["rows"] = [{"model": "m", "method": "atp", "variant": "atp", "node": "mlp", "nodes": 3, "pairs": 1,
                    "seconds": 0.1, "pearson": 1.5, "spearman": 0.2}]
    with pytest.raises(ValueError, match=r"row 0 field 'pearson' must be a correlation in \[-1, 1\] or null"):
        report.validate(bad)


def test_patching_bench_rows_and_table():
    """The comparison on a tiny model: one exact row and one row per variant for each node
    type, correlations that match scipy's on the same numbers, a table that shows them."""
    from models import tiny_causal_lm
    from scipy import stats

    from pyattr import patching as P
    from pyattr import targets as T
    from pyattr.bench import patching as PB
    from pyattr.config import RelevanceRules as R

    model = tiny_causal_lm("llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, 6), generator=g)
    cor = ids.clone()
    cor[:, 1] = (cor[:, 1] + 9) % 96
    clean, corrupt = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {"input_ids": cor, "attention_mask": torch.ones_like(ids)}
    variants = [("atp", "atp", None, False), ("relp all", "relp", R.all(), False)]
    rows = PB.compare(model, clean, corrupt, lambda cn: T.Logit(3), ("residual", "mlp"), 10, 64, "tiny", variants)
    assert [(r["method"], r["node"]) for r in rows] == [
        ("exact", "residual"), ("exact", "mlp"), ("atp", "residual"), ("atp", "mlp"), ("relp", "residual"), ("relp", "mlp")]
    ex = P.activation_patching(model, clean, corrupt, T.Logit(3), nodes="mlp")
    est = P.attribution_patching(model, clean, corrupt, T.Logit(3), nodes="mlp", rules=R.all())
    assert rows[5]["pearson"] == pytest.approx(stats.pearsonr(est["mlp"].flatten().double(), ex["mlp"].flatten().double())[0], abs=1e-6)
    assert rows[5]["nodes"] == 2 * 2 * 6
    md = PB.markdown(rows)
    assert "**tiny**: 2 pairs" in md and f"| relp all | {rows[4]['pearson']:+.3f} / {rows[4]['spearman']:+.3f} |" in md


@pytest.mark.slow
def test_faithfulness_bench_quick_run(tmp_path):
    from pyattr.bench import report

    out, png = tmp_path / "f.json", tmp_path / "f.png"
    p = run_cli("bench", "--faithfulness", "--quick", "--json", out, "--png", png)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    report.validate(doc)
    assert doc["kind"] == "faithfulness" and png.read_bytes()[:4] == b"\x89PNG"
    models = {r["model"] for r in doc["rows"]}
    assert models == {"all-MiniLM-L6-v2", "toy induction decoder"}
    for r in doc["rows"]:
        assert len(r["morf_mean"]) == len(r["lerf_mean"]) == 21
        # ABPC is the area between the mean curves (trapezoid rule over 20 steps)
        gap = [a - b for a, b in zip(r["lerf_mean"], r["morf_mean"])]
        assert r["abpc"] == pytest.approx(sum((x + y) / 2 for x, y in zip(gap, gap[1:])) / 20, abs=1e-9)
    toy = {r["method"]: r["abpc"] for r in doc["rows"] if r["model"] == "toy induction decoder"}
    assert toy["relevance, all rules (default)"] > toy["random"]
    assert "| toy induction decoder (16 rows) | relevance, all rules (default) |" in p.stdout


@pytest.mark.slow
def test_estimators_bench_quick_run(tmp_path):
    from pyattr.bench import report

    out = tmp_path / "e.json"
    p = run_cli("bench", "--estimators", "--quick", "--json", out)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    report.validate(doc)
    value = [r for r in doc["rows"] if r["model"] == "toy induction decoder, value pairs" and r["node"] == "heads"]
    assert {r["variant"] for r in value} >= {"exact (activation patching)", "atp", "ig, 16 steps",
                                             "blockwise (exact, block by block)"}
    assert all(0 <= r["top2_equal_exact"] <= 1 and r["time_over_exact"] > 0 for r in value)
    for kind in ("key", "value"):  # exact on the 2-layer models by construction
        for model in ("toy induction decoder", "toy induction decoder B (seed 1)"):
            bw = next(r for r in doc["rows"] if r["model"] == f"{model}, {kind} pairs" and r["node"] == "heads"
                      and r["variant"] == "blockwise (exact, block by block)")
            assert bw["top2_equal_exact"] == 1.0 and bw["pearson_summed"] > 0.9999, bw
    four = [r for r in doc["rows"] if r["model"] == "toy induction decoder, 4 layers, key pairs" and r["node"] == "heads"]
    assert len(four) == 9 and all(r["top2_in_circuit"] is None for r in four)  # exact and 8 estimators
    big = [r for r in doc["rows"] if r["model"].startswith("random Llama, 12 layers x 12 heads")]
    assert len(big) == 9 and all(r["speedup_vs_exact"] > 0 for r in big)
    two = [r for r in doc["rows"] if "seconds_blockwise" in r]
    shapes = [f"random {a}, 2 layers, hidden {h}, {n} heads" for a, h, n in
              (("Llama", 64, 4), ("Llama", 128, 8), ("Llama", 256, 8), ("GPT-2", 256, 8))]
    # the changed token mid-sequence, then the second one
    assert [(r["model"], r["changed_token"]) for r in two] == [(m, at) for m in shapes for at in (two[0]["seq"] // 2, 1)]
    for r in two:   # blockwise is exact patching, with and without the last block's MLP cut
        assert r["max_abs_diff"] < 1e-5 and r["blockwise_over_exact"] > 0 and r["whole_over_exact"] > 0, r
    assert "top-2 = exact" in p.stdout and "Random 2-layer models" in p.stdout


@pytest.mark.slow
def test_frameworks_bench_quick_run(tmp_path):
    from pyattr.bench import report

    out = tmp_path / "f.json"
    p = run_cli("bench", "--frameworks", "--quick", "--json", out)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    report.validate(doc)
    by = {r["variant"]: r for r in doc["rows"]}
    assert set(by) == {"bridge_plain", "bridge_rules", "bridge_same", "bridge_hooks", "nnsight_plain", "nnsight_rules"}
    assert all(r["rounds"] == 2 and r["seq"] == 128 for r in doc["rows"])
    for v, base in (("bridge_rules", "bridge_plain"), ("bridge_same", "bridge_hooks"), ("nnsight_rules", "nnsight_plain")):
        o = by[v][f"over_{base}"]
        assert o["rounds"] == 2 and o["min"] <= o["median"] <= o["max"]
    assert "| 128 | TransformerBridge, pyattr's default rules |" in p.stdout


def test_frameworks_bench_variants_compute_what_they_name():
    """The timed steps: pyattr's rules and the same rules as TransformerLens hooks give one
    relevance; the nnsight trace under the scope gives the bridge's under the scope."""
    import warnings

    from nnsight import NNsight
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    from pyattr.bench import frameworks as F

    ids = torch.randint(3, 32000, (1, 12), generator=torch.Generator().manual_seed(0))
    out = {}
    for v in F.VARIANTS:
        model = F._model(128, 2).double()
        if v.startswith("bridge"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                runner = build_bridge_from_module(model, type(model).__name__, hf_config=model.config)
            out[v] = F._bridge_step(runner, ids, 5, v).detach()
        else:
            out[v] = F._nnsight_step(NNsight(model), ids, 5, v).detach()
    torch.testing.assert_close(out["bridge_same"], out["bridge_hooks"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out["nnsight_rules"], out["bridge_rules"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out["nnsight_plain"], out["bridge_plain"], rtol=1e-5, atol=1e-7)
    assert float((out["bridge_rules"] - out["bridge_plain"]).abs().max()) > 1e-3


@pytest.mark.slow
def test_generation_after_a_long_context_quick_run(tmp_path):
    from pyattr.bench import report

    out = tmp_path / "g.json"
    p = run_cli("bench", "--generation", "--context", "48", "--quick", "--json", out)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    report.validate(doc)
    assert doc["kind"] == "generation-long" and {r["variant"] for r in doc["rows"]} == {"loop", "batched"}
    assert all(r["prompt"] == 48 and r["steps"] == 16 and r["rounds"] == 2 for r in doc["rows"])
    b = next(r for r in doc["rows"] if r["variant"] == "batched")
    assert b["time_over_loop"] == b["over_loop"]["median"] and 1 <= b["batch_targets"] <= 16
    assert "| 48 | (c) generation_relevance |" in p.stdout


@pytest.mark.slow
@pytest.mark.parametrize("flag, kind", [("--generation", "generation"), ("--long-context", "long-context")])
def test_generation_benches_quick_run(tmp_path, flag, kind):
    from pyattr.bench import report

    out = tmp_path / "g.json"
    p = run_cli("bench", flag, "--quick", "--json", out)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    report.validate(doc)
    assert doc["kind"] == kind
    variants = {r["variant"] for r in doc["rows"]}
    if kind == "generation":
        assert variants == {"loop", "inseq", "batched"} and len(doc["rows"]) == 6
        assert all(r["time_over_loop"] > 0 and r["rounds"] == 2 for r in doc["rows"])
        b = next(r for r in doc["rows"] if r["variant"] == "batched")
        assert b["time_over_loop"] == b["over_loop"]["median"] and b["over_inseq"]["rounds"] == 2
        assert "(c) generation_relevance" in p.stdout
    else:
        assert variants == {"plain", "default", "attnlrp", "ln", "none"} and {r["context"] for r in doc["rows"]} == {256, 512}
        assert all(r["bytes_per_1k"] == pytest.approx(r["peak_extra_bytes"] / (r["context"] / 1024))
                   for r in doc["rows"])
        for r in doc["rows"]:  # two interleaved rounds; ratios to plain per round
            assert r["rounds"] == 2 and len(r["seconds_rounds"]) == 2
            assert r["seconds_min"] <= r["seconds"] <= r["seconds_max"]
            if r["variant"] != "plain":
                o = r["over_plain"]
                assert o["rounds"] == 2 and o["min"] <= o["median"] <= o["max"]
        assert "| 512 | AttnLRP |" in p.stdout and "Versions: Python" in p.stdout
