"""``pyattr bench --scale``: the Llama-3.2-1B-shaped rows (pyattr/bench/scale.py), on the
quick shape here; the full run is a benchmark, not a test."""

import json

import pytest

from pyattr.bench import report, scale


def _row(variant, seconds, dtype="bfloat16", context=1024, **kw):
    return {"variant": variant, "context": context, "dtype": dtype, "point": f"{dtype}:{context}",
            "seconds": seconds, "seconds_min": seconds * 0.9, "seconds_max": seconds * 1.1, "rounds": 3,
            "peak_rss_bytes": 2 ** 32, "peak_extra_bytes": 2 ** 30, "memory_over_plain": 0.5, "parameters": 1.24e9,
            "threads": 2, "model": "Llama-3.2-1B-shaped (16 layers)", **kw}


def test_the_shape_is_llama_3_2_1b():
    from transformers import LlamaConfig

    cfg = LlamaConfig(**scale.SHAPE)
    # embeddings (tied) + 16 × (attention 2048·(2048 + 2·512 + 2048) + MLP 3·2048·8192 + 2 norms) + final norm
    per_layer = 2048 * (2048 + 2 * 512 + 2048) + 3 * 2048 * 8192 + 2 * 2048
    assert 128256 * 2048 + 16 * per_layer + 2048 == 1_235_814_400
    assert cfg.num_key_value_heads == 8 and cfg.tie_word_embeddings and cfg.head_dim == 64


def test_the_table_has_every_row_and_the_ratio_to_lxt():
    stats = {"median": 0.8, "min": 0.75, "max": 0.85, "rounds": 3}
    rows = [_row("plain", 10.0), _row("attnlrp", 8.0, over_plain=stats, over_lxt=stats, over_lxt_cut=stats),
            _row("lxt", 12.0, over_plain=stats, peer_versions="Python 3.11, transformers 4.57.6, lxt 2.1"),
            _row("lxt_cut", 10.0, over_plain=stats)]
    md = scale.markdown(rows)
    assert "| bfloat16 | 1024 | AttnLRP | 8.0 (7.2–8.8) | 0.80 (0.75–0.85) | 1024 | 0.50 |" in md
    assert "| bfloat16 | 1024 | 0.80 (0.75–0.85) | 0.80 (0.75–0.85) |" in md
    assert "LXT ran in its own environment: Python 3.11, transformers 4.57.6, lxt 2.1." in md
    doc = report.document("scale", __import__("torch").device("cpu"), rows)
    report.validate(json.loads(json.dumps(doc)))


def test_a_row_without_its_dtype_is_refused_by_the_schema():
    import torch

    bad = dict(_row("plain", 1.0))
    del bad["dtype"]
    with pytest.raises(ValueError, match="'dtype' missing"):
        report.validate(report.document("scale", torch.device("cpu"), [bad]))


def test_the_peak_is_the_calls_own():
    """The high-water mark is reset before the timed call: an earlier, larger allocation
    (loading a model) does not count."""
    import numpy as np

    big = np.ones(50_000_000)  # 400 MB, touched
    del big
    if not scale.reset_peak():
        pytest.skip("this kernel cannot reset the peak resident set size (/proc/self/clear_refs)")
    from pyattr.bench.e2e import rss_bytes

    assert scale.peak_bytes() - rss_bytes() < 100 * 2 ** 20


@pytest.mark.slow
def test_quick_run_measures_every_variant_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PYATTR_CACHE_DIR", str(tmp_path))
    path = scale.checkpoint(quick=True)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    rows = scale.run_all(quick=True, dtypes=("bfloat16",))
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # drawn once, reused
    assert [r["variant"] for r in rows] == list(scale.VARIANTS)
    for r in rows:
        assert r["dtype"] == "bfloat16" and r["context"] == scale.QUICK_CONTEXTS[0] and r["rounds"] == 1
        assert r["seconds"] > 0 and r["peak_reset"] is True
        assert r["parameters"] == sum(v for v in [1024 * 128, 2 * (128 * (128 + 2 * 64 + 128) + 3 * 128 * 512 + 256),
                                                   128])
    plain = next(r for r in rows if r["variant"] == "plain")
    assert plain["memory_over_plain"] == 1.0 and "over_plain" in rows[1]
    report.validate(report.document("scale", __import__("torch").device("cpu"), rows))


def test_the_returned_allocator_unmaps_freed_blocks():
    """With ``allocator="returned"`` a freed tensor of 8 MB leaves the resident set (glibc's
    default keeps it once its threshold has risen past that size); the table says which
    allocator measured it; a name it does not know is refused."""
    import subprocess
    import sys

    code = ("import sys, torch; from pyattr.bench.micro import return_freed_memory; "
            "from pyattr.bench.e2e import rss_bytes; "
            "ok = return_freed_memory() is not None if sys.argv[1] == 'returned' else True; "
            "x = torch.ones(2**22); del x; "  # 16 MiB: raises glibc's dynamic threshold
            "y = torch.ones(2**21); held = rss_bytes(); del y; print(ok, (held - rss_bytes()) / 2**20)")
    dropped = {}
    for mode in ("glibc", "returned"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True)
        ok, mb = out.stdout.strip().splitlines()[-1].split()
        assert ok == "True"
        dropped[mode] = float(mb)
    assert dropped["returned"] > 7.0 and dropped["glibc"] < 1.0, dropped
    md = scale.markdown([_row("plain", 1.0, allocator="returned")])
    assert "with every block of 64 KiB or more unmapped when freed" in md
    with pytest.raises(ValueError, match="allocator must be one of"):
        scale.run_all(quick=True, allocator="jemalloc")


@pytest.mark.parametrize("name", ["cpu_scale", "cpu_scale_float32", "cpu_scale_rerun", "cpu_scale_rerun_float32",
                                  "cpu_scale_returned"])
def test_the_saved_documents_validate(name):
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / f"{name}.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    report.validate(doc)
    rows = doc["rows"]
    assert {r["variant"] for r in rows} >= set(scale.VARIANTS)
    assert all(r["parameters"] == 1_235_814_400 for r in rows if r["variant"] in scale.VARIANTS)
    if name == "cpu_scale_returned":
        assert {r["allocator"] for r in rows} == {"returned"}
