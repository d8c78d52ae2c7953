"""``pyattr bench --estimators``: patching estimators scored against exact activation
patching and against the known circuit of the toy induction decoders (:mod:`pyattr.toy`:
the shipped one, the second 2-layer one and the 4-layer one), and timed against exact
patching on a model with GPT-2 small's 144 heads.

Two kinds of clean/corrupt pairs (:class:`pyattr.toy.task.Pair`): ``value`` (the copied
word differs: the effect runs through the induction heads' values) and ``key`` (the word
before it differs: the effect runs through a previous-token head into the induction
heads' keys, which no estimate that freezes or linearises attention sees well).

Per estimator and pair kind: Pearson / Spearman with exact patching per node type
(per position), and on heads (each head summed over positions): the share of pairs whose
top-2 heads equal exact patching's top-2, and the share whose top-2 are circuit heads
(where the model's ``circuit.json`` names heads), and the time of the summed estimate over
exact head patching's.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Dict, List

import torch

NODES = ("residual", "attention", "heads", "mlp")


def variants():
    """(name, attribution_patching keyword arguments)."""
    from pyattr.config import RelevanceRules as R

    return [
        ("atp", {"method": "atp"}),
        ("atp* (QK fix on residual nodes)", {"method": "atp*"}),
        ("relp (default: LN-rule)", {"method": "relp"}),
        ("relp all rules (AH)", {"method": "relp", "rules": R.all()}),
        ("relp all rules, AttnLRP attention", {"method": "relp", "rules": R.all("attnlrp")}),
        ("ig, 4 steps", {"method": "ig", "steps": 4}),
        ("ig, 16 steps", {"method": "ig", "steps": 16}),
        ("blockwise (exact, block by block)", {"method": "blockwise"}),
    ]


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


#: timed repetitions of each heads-summed estimate and of exact head patching (the median
#: is reported: one run of the 144-head model's rows varied up to 3.5x between two runs)
REPEATS = 3


def _median_timed(fn, repeats: int = REPEATS):
    runs = [_timed(fn) for _ in range(repeats)]
    return runs[0][0], statistics.median(t for _, t in runs)


def _top2(x: torch.Tensor) -> List[set]:
    flat = x.double().abs().reshape(x.shape[0], -1)
    return [set(r.tolist()) for r in flat.topk(2, dim=-1).indices]


def toy_models():
    """(name, directory) of the toy decoders the estimators are scored on."""
    import pyattr.toy as toy

    return [("toy induction decoder", None), ("toy induction decoder B (seed 1)", toy.INDUCTION_B_DIR),
            ("toy induction decoder, 4 layers", toy.INDUCTION_4L_DIR)]


def toy_rows(kind: str, count: int = 64, path=None, model_name: str = "toy induction decoder") -> List[Dict]:
    import pyattr.patching as P
    import pyattr.targets as T
    import pyattr.toy as toy
    import pyattr.toy.circuit as C
    import pyattr.toy.task as task
    from pyattr.patching.result import correlations

    model, _, circuit = toy.load(path)
    heads = model.config.num_attention_heads
    pairs = task.pairs(torch.Generator().manual_seed(11), count, kind=kind)
    clean, corrupt, answer, alternative = C.pair_tensors(pairs)
    metric = T.LogitDiff(answer, alternative)
    true_heads = {l * heads + h for l, h in circuit["previous_token_heads"] + circuit["induction_heads"]}
    P.attribution_patching(model, clean, corrupt, metric, nodes="heads", method="atp")  # warm-up
    exact, t_exact = _timed(lambda: P.activation_patching(model, clean, corrupt, metric, nodes=list(NODES)))
    exact_heads, t_heads = _median_timed(lambda: P.activation_patching(model, clean, corrupt, metric, nodes="heads",
                                                                       sum_positions=True, progress=False))
    top_exact = _top2(exact_heads["heads"])
    name = f"{model_name}, {kind} pairs"

    def in_circuit(tops):  # None where the model's circuit.json names no heads
        return sum(t <= true_heads for t in tops) / count if true_heads else None

    rows = [{"model": name, "variant": "exact (activation patching)", "node": "heads", "pairs": count,
             "seconds": t_heads, "pearson": 1.0, "spearman": 1.0, "top2_equal_exact": 1.0,
             "top2_in_circuit": in_circuit(top_exact), "seconds_summed": t_heads, "time_over_exact": 1.0}]
    for var, kw in variants():
        est, secs = _timed(lambda: P.attribution_patching(model, clean, corrupt, metric, nodes=list(NODES), **kw))
        summed, t_sum = _median_timed(lambda: P.attribution_patching(model, clean, corrupt, metric, nodes="heads",
                                                                    sum_positions=True, **kw))
        top = _top2(summed["heads"])
        for node in NODES:
            pr, sr = correlations(est[node].flatten(), exact[node].flatten())
            row = {"model": name, "variant": var, "node": node, "pairs": count, "seconds": secs,
                   "pearson": pr, "spearman": sr}
            if node == "heads":
                hp, hs = correlations(summed["heads"].flatten(), exact_heads["heads"].flatten())
                row.update(pearson_summed=hp, spearman_summed=hs,
                           top2_equal_exact=sum(a == b for a, b in zip(top, top_exact)) / count,
                           top2_in_circuit=in_circuit(top), seconds_summed=t_sum, time_over_exact=t_sum / t_heads)
            rows.append(row)
    return rows


#: GPT-2's vocabulary size
VOCAB_GPT2 = 50257


def gpt2_size_rows(pairs: int = 8, seq: int = 16) -> List[Dict]:
    """Time of each estimator and of exact head patching (each head summed over positions:
    one forward per head) on a random Llama of GPT-2 small's shape and vocabulary (12
    layers × 12 heads, hidden 768, 50,257 tokens: the head's share of a forward is a real
    model's), float32; the median of :data:`REPEATS` runs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import pyattr.patching as P
    import pyattr.targets as T

    cfg = LlamaConfig(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=12,
                      num_hidden_layers=12, vocab_size=VOCAB_GPT2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(3, VOCAB_GPT2, (pairs, seq), generator=g)
    corrupt = clean.clone()
    corrupt[:, seq // 2] = torch.randint(3, VOCAB_GPT2, (pairs,), generator=g)
    metric = T.LogitDiff(3, 7)
    name = "random Llama, 12 layers x 12 heads (144), hidden 768, GPT-2's vocabulary"
    P.attribution_patching(model, clean, corrupt, metric, nodes="heads", method="atp")  # warm-up
    _, t_exact = _median_timed(lambda: P.activation_patching(model, clean, corrupt, metric, nodes="heads",
                                                             sum_positions=True, progress=False))
    rows = [{"model": name, "variant": "exact (activation patching)", "node": "heads", "pairs": pairs,
             "seconds": t_exact, "speedup_vs_exact": 1.0}]
    for var, kw in variants():
        _, secs = _median_timed(lambda: P.attribution_patching(model, clean, corrupt, metric, nodes="heads",
                                                               sum_positions=True, **kw))
        rows.append({"model": name, "variant": var, "node": "heads", "pairs": pairs, "seconds": secs,
                     "speedup_vs_exact": t_exact / secs})
    return rows


#: (architecture, hidden size, heads) of the 2-layer models whose blockwise time is measured
#: against activation patching's where the blocks' arithmetic, not the calls, costs most
TWO_LAYER_SHAPES = (("Llama", 64, 4), ("Llama", 128, 8), ("Llama", 256, 8), ("GPT-2", 256, 8))


def _two_layer(arch: str, hidden: int, heads: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "GPT-2":
        cfg = GPT2Config(n_embd=hidden, n_head=heads, n_layer=2, vocab_size=vocab, n_positions=64, bos_token_id=0,
                         eos_token_id=0)
        return GPT2LMHeadModel._from_config(cfg, attn_implementation="eager").eval()
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=heads,
                      num_key_value_heads=heads, num_hidden_layers=2, vocab_size=vocab)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="eager").eval()


def two_layer_rows(pairs: int = 32, seq: int = 24, vocab: int = 512) -> List[Dict]:
    """Blockwise head patching (every head summed over positions) against activation
    patching on random 2-layer models (:data:`TWO_LAYER_SHAPES`), both in this run, with
    and without the last block's MLP cut to the metric's position
    (:mod:`pyattr.patching.last_block`); medians of :data:`REPEATS` interleaved runs each.
    The corrupt run changes one token, mid-sequence or the second: each re-run MLP computes
    from the changed token on (:mod:`pyattr.patching.mlp_positions`), so where it sits
    matters to blockwise, not to activation patching."""
    from unittest import mock

    import pyattr.patching as P
    import pyattr.patching.blockwise as BW
    import pyattr.targets as T

    rows = []
    for (arch, hidden, heads), at in itertools.product(TWO_LAYER_SHAPES, (seq // 2, 1)):
        model = _two_layer(arch, hidden, heads, vocab)
        g = torch.Generator().manual_seed(1)
        clean = torch.randint(3, vocab, (pairs, seq), generator=g)
        corrupt = clean.clone()
        corrupt[:, at] = torch.randint(3, vocab, (pairs,), generator=g)
        metric = T.LogitDiff(3, 7)
        kw = dict(nodes="heads", sum_positions=True)
        block = lambda: P.attribution_patching(model, clean, corrupt, metric, method="blockwise", **kw)  # noqa: E731
        block()  # warm-up
        exact_run = lambda: P.activation_patching(model, clean, corrupt, metric, progress=False, **kw)  # noqa: E731
        times: Dict[str, List[float]] = {"exact": [], "block": [], "whole": []}
        for _ in range(REPEATS):  # interleaved: the three see the same load
            exact, t = _timed(exact_run)
            times["exact"].append(t)
            est, t = _timed(block)
            times["block"].append(t)
            with mock.patch.object(BW.BlockCalls, "cut_last_mlp", lambda *a, **k: None):
                whole, t = _timed(block)
            times["whole"].append(t)
        t_exact, t_block, t_whole = (statistics.median(times[k]) for k in ("exact", "block", "whole"))
        diff = max(float((e["heads"].double() - exact["heads"].double()).abs().max()) for e in (est, whole))
        rows.append({"model": f"random {arch}, 2 layers, hidden {hidden}, {heads} heads", "pairs": pairs,
                     "variant": "blockwise (exact, block by block)", "node": "heads",
                     "seq": seq, "changed_token": at, "seconds": t_block, "seconds_exact": t_exact, "seconds_blockwise": t_block,
                     "seconds_whole_last_block": t_whole, "blockwise_over_exact": t_block / t_exact,
                     "whole_over_exact": t_whole / t_exact, "max_abs_diff": diff})
    return rows


def run_all(quick: bool = False) -> List[Dict]:
    n = 16 if quick else 64
    rows = [r for name, path in toy_models() for kind in ("value", "key")
            for r in toy_rows(kind, n, path, name)]
    return (rows + gpt2_size_rows(pairs=2 if quick else 8, seq=8 if quick else 16)
            + two_layer_rows(pairs=8 if quick else 32, seq=12 if quick else 24))


def _f(v, spec="+.3f"):
    return "n/a" if v is None else format(v, spec)


def _pct(v):
    return "n/a" if v is None else f"{v:.0%}"


def markdown(rows: List[Dict], contention=None) -> str:
    from pyattr.bench.report import conditions

    lines = [conditions(contention).rstrip("\n"), ""] if contention is not None else []
    for model in dict.fromkeys(r["model"] for r in rows if r["model"].startswith("toy")):
        rs = [r for r in rows if r["model"] == model]
        ex = rs[0]
        circ = ("its circuit.json names no circuit heads" if ex["top2_in_circuit"] is None else
                f"its top-2 heads are circuit heads on {ex['top2_in_circuit']:.0%} of pairs")
        lines += [f"**{model}** ({ex['pairs']} pairs; exact head patching {ex['seconds'] * 1e3:.0f} ms, "
                  f"{circ}). Pearson / Spearman with exact patching per node type (per position), and the time "
                  "of that estimate; heads summed over positions: Pearson, the share of pairs whose top-2 heads "
                  f"equal exact patching's / are circuit heads, and the time over exact head patching's (medians of "
                  f"{REPEATS} runs):",
                  "", "| estimator | " + " | ".join(NODES) + " | time (ms) | heads summed | top-2 = exact "
                  "| top-2 in circuit | time / exact |", "|---|" + "---:|" * (len(NODES) + 5)]
        for var in dict.fromkeys(r["variant"] for r in rs[1:]):
            vr = {r["node"]: r for r in rs if r["variant"] == var}
            h = vr["heads"]
            cells = [f"{_f(vr[n]['pearson'])} / {_f(vr[n]['spearman'])}" for n in NODES]
            lines.append(f"| {var} | " + " | ".join(cells) + f" | {h['seconds'] * 1e3:.0f} | "
                         f"{_f(h['pearson_summed'])} | {h['top2_equal_exact']:.0%} | {_pct(h['top2_in_circuit'])} | "
                         f"{h['time_over_exact']:.2f} |")
        lines.append("")
    two = [r for r in rows if "seconds_blockwise" in r]
    if two:
        lines += [f"**Random 2-layer models** ({two[0]['pairs']} pairs of {two[0]['seq']} tokens, vocabulary 512, "
                  "float32, eager attention): every head summed over positions, blockwise against activation "
                  f"patching in this run (medians of {REPEATS} interleaved runs each); the last block whole is blockwise without "
                  "its MLP cut to the metric's position; the changed token is the one position where the corrupt "
                  "run differs (0-based)",
                  "", "| model | changed token | activation patching (ms) | blockwise (ms) | blockwise / exact | last "
                  "block whole / exact | max abs difference |", "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r.get('changed_token', r['seq'] // 2)} | {r['seconds_exact'] * 1e3:.0f} | "
                  f"{r['seconds_blockwise'] * 1e3:.0f} | "
                  f"{r['blockwise_over_exact']:.2f} | {r['whole_over_exact']:.2f} | {r['max_abs_diff']:.1e} |"
                  for r in two]
        lines.append("")
    big = [r for r in rows if not r["model"].startswith("toy") and "seconds_blockwise" not in r]
    if big:
        lines += [f"**{big[0]['model']}**, {big[0]['pairs']} pairs: every head summed over positions "
                  f"(median of {REPEATS} runs)",
                  "", "| method | time (s) | speed-up vs exact |", "|---|---:|---:|"]
        lines += [f"| {r['variant']} | {r['seconds']:.2f} | {r['speedup_vs_exact']:.1f}× |" for r in big]
    return "\n".join(lines) + "\n"
