"""The interleaved rounds of the benchmark harness (pyattr/bench/rounds.py): the order
rotates, ratios are per round, rounds go on while a ratio's spread is wide."""

import json

import pytest

import pyattr.bench.rounds as rounds


def test_rotated_and_ratio_stats():
    assert rounds.rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rounds.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    s = rounds.ratio_stats([2.0, 3.0, 4.0], [4.0, 4.0, 4.0])
    assert s == {"median": 0.75, "min": 0.5, "max": 1.0, "rounds": 3}
    assert rounds.relative_spread(s) == pytest.approx(0.5 / 0.75)
    assert rounds.ratio_text(s) == "0.75 (0.50–1.00)"


def _fake_children(monkeypatch, times):
    """child_row replaced: each call takes the next time of its variant from ``times``."""
    calls = []

    def child_row(cmd, what):
        v, x = cmd[cmd.index("--variant") + 1], int(cmd[cmd.index("--n") + 1])
        calls.append(v)
        t = times[v][sum(1 for c in calls if c == v) - 1]
        return {"variant": v, "n": x, "seconds": t, "peak_extra_bytes": 100.0}

    monkeypatch.setattr(rounds, "child_row", child_row)
    return calls


def test_order_rotates_and_ratios_pair_rounds(monkeypatch):
    calls = _fake_children(monkeypatch, {"a": [1.0, 2.0, 3.0], "b": [2.0, 2.0, 2.0]})
    rows = rounds.interleaved_grid("m", "--n", [5], ["a", "b"], [], "x", pairs=[("a", "b")], rounds=3, spread=10.0)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    a = next(r for r in rows if r["variant"] == "a")
    assert a["seconds"] == 2.0 and a["seconds_min"] == 1.0 and a["seconds_max"] == 3.0 and a["rounds"] == 3
    assert a["over_b"] == {"median": 1.0, "min": 0.5, "max": 1.5, "rounds": 3}
    json.dumps(rows)


def test_wide_spread_adds_rounds_up_to_the_cap(monkeypatch):
    noisy = {"a": [1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 1.0], "b": [1.0] * 7}
    calls = _fake_children(monkeypatch, noisy)
    rows = rounds.interleaved_grid("m", "--n", [5], ["a", "b"], [], "x", pairs=[("a", "b")], rounds=3,
                                   max_rounds=5, spread=0.1)
    assert len(calls) == 10 and rows[0]["rounds"] == 5
    calls.clear()
    steady = {"a": [2.0] * 7, "b": [1.0] * 7}
    calls = _fake_children(monkeypatch, steady)
    rows = rounds.interleaved_grid("m", "--n", [5], ["a", "b"], [], "x", pairs=[("a", "b")], rounds=3,
                                   max_rounds=5, spread=0.1)
    assert len(calls) == 6 and rows[0]["over_b"]["median"] == 2.0


def test_versions_line_names_what_was_measured():
    line = rounds.versions_line("no-such-package-here")
    assert line.startswith("Versions: Python ") and "torch " in line and "transformers " in line
    assert "no-such-package-here" not in line and "pyattr " in line
    from pyattr.bench.report import cpu_model

    assert f"Machine: {cpu_model() or ''}" in line and ", kernel " in line


def test_a_variant_runs_by_its_own_command(tmp_path):
    """``commands``: a peer measured by another environment's Python (LXT needs transformers 4)
    runs as that command, with the same ``--variant`` and value arguments."""
    import sys

    script = tmp_path / "peer.py"
    script.write_text("import json, sys\n"
                      "a = sys.argv[1:]\n"
                      "print('noise before the row')\n"
                      "print(json.dumps({'variant': a[a.index('--variant') + 1], 'n': int(a[a.index('--n') + 1]),\n"
                      "                  'seconds': 1.5, 'peak_extra_bytes': 7, 'argv': a}))\n")
    rows = rounds.interleaved_grid("no.such.module", "--n", [3], ["peer"], ["--x", "1"], "x", rounds=1,
                                   commands={"peer": [sys.executable, str(script)]})
    (row,) = rows
    assert row["variant"] == "peer" and row["n"] == 3 and row["seconds"] == 1.5 and row["rounds"] == 1
    assert row["argv"] == ["--variant", "peer", "--n", "3", "--x", "1"]


def test_long_context_table_names_lxt_and_the_ratio_to_it():
    from pyattr.bench import long_context

    def row(variant, seconds, **kw):
        return {"variant": variant, "context": 4096, "seconds": seconds, "seconds_min": seconds, "seconds_max": seconds,
                "rounds": 3, "peak_extra_bytes": 2 ** 30, "bytes_per_1k": 2 ** 28, "memory_over_plain": 1.0,
                "model": "Llama 4 layers", **kw}

    stats = {"median": 0.7, "min": 0.6, "max": 0.8, "rounds": 3}
    rows = [row("plain", 2.0), row("attnlrp", 2.0, over_plain=stats, over_lxt=stats, over_lxt_cut=stats),
            row("lxt", 3.0, over_plain=stats, peer_versions="Python 3.11, transformers 4.52.4, lxt 2.1"),
            row("lxt_cut", 2.5, over_plain=stats)]
    md = long_context.markdown(rows)
    assert "| 4096 | LXT AttnLRP, as its README runs it | 3.0 (3.0–3.0) | 0.70 (0.60–0.80) |" in md
    assert "| 4096 | 0.70 (0.60–0.80) | 0.70 (0.60–0.80) |" in md
    assert "LXT ran in its own environment: Python 3.11, transformers 4.52.4, lxt 2.1." in md
    assert "over LXT" not in long_context.markdown(rows[:1])


def test_the_lxt_child_imports_nothing_of_pyattr():
    """LXT runs on transformers 4 in its own environment, where pyattr is not installed: the
    script it runs imports only the standard library, torch, transformers and lxt."""
    import ast

    from pyattr.bench import long_context, long_context_lxt

    tree = ast.parse(open(long_context_lxt.__file__, encoding="utf-8").read())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert roots <= {"__future__", "argparse", "json", "platform", "resource", "time", "importlib", "torch",
                     "transformers", "lxt"}, roots
    assert set(long_context_lxt.VARIANTS).isdisjoint(long_context.VARIANTS)
