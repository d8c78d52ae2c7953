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
