"""What `pyattr explain` prints: no negative zeros, a conservation note that names the
cause, and a warning when the CPU was oversubscribed during the timed pass."""

import io
import json
import os
import re

import pytest

from conftest import run_cli
import pyattr.apps.contention as contention
from pyattr.cli import main
from pyattr.apps.explain import Explanation, Segment
from pyattr.apps.render import num, print_terminal, to_html

NEG_ZERO = re.compile(r"-0\.0+(?:e[+-]?\d+)?(?!\d)|-0(?![.\d])")
ATTNLRP = "the AttnLRP rule does not conserve relevance (it scales the q, k, v gradients by ¼, ¼, ½)"
ALL_ON = {"normalization": True, "activation": True, "multiplicative_gate": True, "attention": "frozen"}


def _expl(**kw):
    base = dict(mode="causal", model="m", target_description="t", target=2.0, relevance_sum=1.0,
                conservation_delta=1.0, wall_time_s=0.01, backend="torch", rules=dict(ALL_ON),
                segments=[Segment("t", ["a", "b"], [0.5, 0.5])])
    base.update(kw)
    return Explanation(**base)


def _terminal(expl):
    from rich.console import Console

    buf = io.StringIO()
    print_terminal(expl, Console(file=buf, width=300, soft_wrap=True))
    return buf.getvalue()


@pytest.mark.parametrize(
    "v,spec,out",
    [(-0.0, "+.3e", "0.000e+00"), (-4e-5, "+.4f", "0.0000"), (4e-5, "+.4f", "0.0000"), (-0.0, "+.6f", "0.000000"),
     (-5e-4, "+.4f", "-0.0005"), (1e-9, "+.3e", "+1.000e-09"), (-0.25, "+.4f", "-0.2500"), (0.0, ".1f", "0.0")],
)
def test_num_prints_zero_unsigned(v, spec, out):
    assert num(v, spec) == out


def test_no_negative_zero_anywhere():
    expl = _expl(target=-0.0, relevance_sum=-1e-12, conservation_delta=-0.0,
                 segments=[Segment("t", ["hi", "there", "x"], [-1e-9, -0.0, 0.3])])
    term, page, js = _terminal(expl), to_html(expl), json.dumps(expl.to_json())
    for text in (term, page, js):
        assert not NEG_ZERO.search(text), NEG_ZERO.search(text)
    assert "2 'x' +0.3000, 0 'hi' 0.0000, 1 'there' 0.0000" in term
    assert "target value       0.000000" in term and "conservation delta 0.000e+00" in term
    assert json.loads(js)["segments"][0]["relevance"] == [-1e-9, 0.0, 0.3]
    assert str(json.loads(js)["conservation_delta"]) == "0.0"


@pytest.mark.parametrize(
    "rules,has_bias,delta,note",
    [
        (ALL_ON, True, 1e-9, "conserved: relevance sums to the target"),
        (ALL_ON, True, 0.1, "biases absorb relevance"),
        (dict(ALL_ON, attention="attnlrp"), False, 0.1, ATTNLRP),
        (dict(ALL_ON, attention="attnlrp"), True, 0.1, ATTNLRP + "; biases absorb relevance"),
        (dict(ALL_ON, attention=False), False, 0.1, "relevance is not conserved where a rule is off (AH-rule)"),
        (dict(ALL_ON, normalization=False, activation=False), None, 0.1,
         "relevance is not conserved where a rule is off (LN-rule, Identity-rule); biases absorb relevance"),
        (ALL_ON, False, 0.1, "relevance is lost in modules that carry no rule"),
    ],
)
def test_conservation_note_names_the_cause(rules, has_bias, delta, note):
    expl = _expl(rules=rules, has_bias=has_bias, conservation_delta=delta)
    assert expl.conservation_note == note
    assert f"(target − Σ relevance; {note})" in _terminal(expl)
    assert expl.to_json()["conservation_note"] == note


def _run(*args):
    p = run_cli(*args, env={"COLUMNS": "200"})
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_attnlrp_note_on_a_bias_free_model(causal_dir):
    out = json.loads(_run("explain", "--model", str(causal_dir), "--text", "hello world", "--attention", "attnlrp",
                          "--json"))
    assert abs(out["conservation_delta"]) > 1e-4 * abs(out["target"])  # AttnLRP does not conserve
    assert out["conservation_note"] == ATTNLRP  # and a Llama has no bias to blame
    out = json.loads(_run("explain", "--model", str(causal_dir), "--text", "hello world", "--json"))
    assert out["conservation_note"] == "conserved: relevance sums to the target"


def test_no_norm_rule_on_bert_prints_no_negative_zero():
    # the plain LayerNorm gradient makes every relevance ~1e-9: rounded, they are zeros
    out = _run("explain", "--no-norm-rule")
    assert "top tokens by |relevance|" in out
    assert not NEG_ZERO.search(out), NEG_ZERO.search(out)
    assert "relevance is not conserved where a rule is off (LN-rule); biases absorb relevance" in out


# --- oversubscription ----------------------------------------------------------------------

def _quiet(monkeypatch, load=0.0):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(contention, "_busy_seconds", lambda cpus: None)  # no window measurement


def test_judge_the_three_checks():
    assert contention.judge(2, 2, 2, 1.9, 0.4).reasons == []
    assert contention.judge(2, 2, 2, 2.5, None).reasons == ["load average 2.50 above the 2 CPUs of the machine"]
    assert contention.judge(2, 2, 4, 0.0, None).reasons == ["4 torch threads on 2 usable cores"]
    busy = contention.judge(2, 2, 2, 0.0, 1.2)
    assert busy.reasons == ["other processes kept 1.2 of 2 cores busy during the run, leaving 0.8 free for 2 torch threads"]
    assert busy.warning == (
        "timings unreliable, the CPU is oversubscribed: other processes kept 1.2 of 2 cores busy during the run, "
        "leaving 0.8 free for 2 torch threads. For stable numbers run on an idle machine, or with OMP_NUM_THREADS=1"
    )
    assert contention.judge(2, 2, 1, 0.0, 1.2).reasons == []  # one thread fits in 0.8 free cores (+0.5 slack)
    one = contention.judge(2, 2, 1, 3.0, None)
    assert one.oversubscribed and one.warning.endswith("For stable numbers run on an idle machine")


def test_monitor_measures_other_processes_during_the_window(monkeypatch):
    clock = iter([100.0, 110.0])
    busy = iter([50.0, 65.0])  # 15 CPU-seconds busy on our cores over 10 s
    own = iter([1.0, 6.0])  # 5 of them ours
    monkeypatch.setattr(contention.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(contention, "_busy_seconds", lambda cpus: next(busy))
    monkeypatch.setattr(contention, "_own_seconds", lambda: next(own))
    monkeypatch.setattr(contention, "usable_cores", lambda: 2)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    c = contention.start().stop(threads=2)
    assert c.window_s == 10.0 and c.others_busy_cores == 1.0 and c.load_avg_1min == 0.5
    assert c.reasons == ["other processes kept 1.0 of 2 cores busy during the run, leaving 1.0 free for 2 torch threads"]


def test_snapshot_counts_torch_threads(monkeypatch):
    _quiet(monkeypatch)
    monkeypatch.setattr(contention, "_torch_threads", lambda: 64)
    c = contention.snapshot()
    assert c.threads == 64 and c.reasons == [f"64 torch threads on {contention.usable_cores()} usable cores"]


def test_explain_warns_when_oversubscribed(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    _quiet(monkeypatch, load=50.0)
    assert main(["explain", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cpus = os.cpu_count()
    c = out["contention"]
    assert c["oversubscribed"] is True and c["load_avg_1min"] == 50.0
    assert c["reasons"] == [f"load average 50.00 above the {cpus} CPUs of the machine"]
    assert c["warning"].startswith(f"timings unreliable, the CPU is oversubscribed: load average 50.00 above the {cpus} CPUs")
    assert main(["explain"]) == 0
    text = capsys.readouterr().out
    assert f"warning            timings unreliable, the CPU is oversubscribed: load average 50.00 above the {cpus} CPUs" in text


def test_explain_quiet_machine_no_warning(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    _quiet(monkeypatch, load=0.0)
    monkeypatch.setattr(contention, "_torch_threads", lambda: 1)
    assert main(["explain", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)["contention"]
    assert c["oversubscribed"] is False and c["warning"] is None and c["reasons"] == [] and c["threads"] == 1
    assert main(["explain"]) == 0
    assert "warning" not in capsys.readouterr().out


def test_measured_window_overrides_a_trailing_load_average():
    """Right after a build the 1-minute load average is still above the core count on an idle
    machine; a measured window with no other process busy is not oversubscribed."""
    assert contention.judge(2, 2, 2, 2.3, 0.1).reasons == []
    assert contention.judge(2, 2, 2, 2.3, None).reasons == ["load average 2.30 above the 2 CPUs of the machine"]


# --- the terminal heatmap: legend and top tokens with positions ------------------------------

def test_terminal_legend_in_a_pipe_and_on_a_terminal():
    from rich.console import Console

    expl = _expl(segments=[Segment("t", ["a", "b", "c"], [0.25, -0.5, 0.1])])
    assert "\nlegend  blue -0.5000 … white 0 … red +0.5000  (full colour at the tokens' largest |relevance|)\n" \
        in _terminal(expl)
    buf = io.StringIO()
    print_terminal(expl, Console(file=buf, width=300, force_terminal=True, color_system="truecolor"))
    line = next(ln for ln in buf.getvalue().splitlines() if ln.startswith("legend"))
    # a bar of 17 cells from full blue through white to full red, the values at its ends
    cells = re.findall(r"\x1b\[48;2;(\d+);(\d+);(\d+)m \x1b\[0m", line)
    assert len(cells) == 17 and cells[0] == ("0", "0", "255") and cells[8] == ("255", "255", "255")
    assert cells[-1] == ("255", "0", "0")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", line)
    assert plain == ("legend  -0.5000" + " " * 19 + "+0.5000  blue negative, white zero, red positive (full colour "
                     "at the tokens' largest |relevance|)")


def test_top_tokens_carry_their_positions():
    one = _expl(segments=[Segment("t", ["<s>", "sun", "cat", "sun"], [0.1, 0.9, 13.5, -0.4])])
    assert ("top tokens by |relevance| (position 'token' relevance): 2 'cat' +13.5000, 1 'sun' +0.9000, "
            "3 'sun' -0.4000, 0 '<s>' +0.1000") in _terminal(one)
    pair = _expl(mode="pair", segments=[Segment("a", ["[CLS]", "guitar"], [0.0, 0.155]),
                                        Segment("b", ["[CLS]", "a", "guitar"], [0.01, 0.0, 0.129])])
    assert ("top tokens by |relevance| (sentence:position 'token' relevance): 1:1 'guitar' +0.1550, "
            "2:2 'guitar' +0.1290, 2:0 '[CLS]' +0.0100, 1:0 '[CLS]' 0.0000, 2:1 'a' 0.0000") in _terminal(pair)
    image = _expl(mode="image", patch_grid=(1, 2),
                  segments=[Segment("img.png", ["[CLS]", "patch(0,0)", "patch(0,1)"], [0.2, -0.7, 0.3])])
    text = _terminal(image)
    assert "top patches by |relevance|: patch(0,0) -0.7000, patch(0,1) +0.3000, [CLS] +0.2000" in text
    assert "legend  blue -0.7000 … white 0 … red +0.7000  (full colour at the patches' largest |relevance|)" in text


def test_cli_top_tokens_of_the_toy_decoder():
    out = _run("explain", "--model", "induction")  # the toy's own prompt when --text is not given
    # <s> is -0.16165: its last digit depends on the thread count
    assert re.search(r"top tokens by \|relevance\| \(position 'token' relevance\): 2 'cat' \+13\.4901, 1 'sun' "
                     r"\+0\.9342, 5 'sun' -0\.3953, 0 '<s>' -0\.161[67], 3 'red' \+0\.0151\n", out), out


# --- torchao's import notices ----------------------------------------------------------------

def test_torchao_import_notices_are_not_printed(tmp_path):
    """torchao's import logs that it skips its C++ extensions where the torch is not the one
    it wants (forced here with TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1), and torch 2.14 that
    its Enum constants are deprecated; transformers imports torchao while loading any
    model. A command prints neither; a plain import of torchao prints both."""
    import subprocess
    import sys

    from conftest import need_torchao

    need_torchao()

    env = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", HF_HUB_OFFLINE="1")
    plain = subprocess.run([sys.executable, "-c", "import torchao"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert "Skipping import of cpp extensions due to TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1" in plain.stderr
    assert "is an Enum subclass and is now natively supported" in plain.stderr
    r = subprocess.run([sys.executable, "-m", "pyattr", "explain", "--model", "induction", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert json.loads(r.stdout)["model"] == "induction (bundled)"
    # and the command's model load does import torchao (the notices had something to drop)
    loaded = subprocess.run([sys.executable, "-c", "import sys, pyattr.hub; pyattr.hub.load_pretrained('induction', "
                             "causal=True); print('torchao' in sys.modules)"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert loaded.stdout.strip() == "True", loaded.stderr
    assert "Skipping import of cpp extensions" in loaded.stderr
