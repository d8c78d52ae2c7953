"""``pyattr bench --long-context``: the cost of one relevance map after a long context, on a
4-layer, hidden-512 Llama (8 heads, sdpa attention, float32, CPU), at 4k, 8k and 16k tokens,
for every rule set, against one plain forward and backward:

- ``plain``: the target logit's gradient with respect to the input embeddings, no rules
  (the floor any gradient method pays);
- ``default``: :func:`pyattr.relevance` with the default rules (LN-, Identity-, Half-rule
  and the AH-rule's attention core, whose backward recomputes the pattern block by block);
- ``attnlrp``: every rule with AttnLRP's attention rule (the q/k/v gradients scaled, the
  attention core's full gradient from sdpa's own blockwise backward);
- ``ln``: the LN-rule alone; ``none``: every rule off (gradient × input);
- with ``--lxt-python``: LXT's AttnLRP (``lxt.efficient``) as its README runs it and with
  pyattr's head cut, run by that development environment's Python
  (:mod:`pyattr.bench.long_context_lxt`).

The target is one next-token logit at the last position. Each measurement runs in its own
process (its peak RSS is its own; ``peak_extra_bytes`` is the peak minus the RSS once the
model and inputs were built), in rounds whose order rotates (:mod:`pyattr.bench.rounds`);
times are medians with their range, ratios to ``plain`` are per round.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import torch

from pyattr.bench.e2e import peak_rss_bytes, rss_bytes

VARIANTS = ("plain", "default", "attnlrp", "ln", "none")
CONTEXTS = (4096, 8192, 16384)
RULES = {"default": None, "attnlrp": "attnlrp", "ln": "ln", "none": "none"}


def _model(attn: str, hidden: int = 512, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                      max_position_embeddings=65536)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _plain(model, ids, target: int) -> None:
    x = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logit = model(inputs_embeds=x, logits_to_keep=1).logits[0, -1, target]
    torch.autograd.grad(logit, x)


def measure(variant: str, context: int, hidden: int = 512, layers: int = 4) -> Dict:
    import pyattr

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    model = _model("sdpa", hidden, layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (1, context), generator=g)
    target = int(torch.randint(3, 32000, (1,), generator=g))
    # warm-up on a short input, every variant alike: one-time costs (the rule scope's first
    # install, the extension's load, the first autograd pass) are not timed
    if variant == "plain":
        _plain(model, ids[:, :16], target)
    else:
        pyattr.relevance(model, ids[:, :16], target=target, rules=RULES[variant])
    base = rss_bytes()
    t0 = time.perf_counter()
    if variant == "plain":
        _plain(model, ids, target)
    else:
        pyattr.relevance(model, ids, target=target, rules=RULES[variant])
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    extra = max(0, peak - base)
    return {"variant": variant, "context": context, "seconds": seconds, "peak_rss_bytes": peak,
            "peak_extra_bytes": extra, "bytes_per_1k": extra / (context / 1024),
            "model": f"Llama {layers} layers, hidden {hidden}, {hidden // 64} heads, sdpa, float32",
            "threads": torch.get_num_threads()}


def run_all(quick: bool = False, rounds: int = None, lxt_python: str = None) -> List[Dict]:
    """Every variant at every context in interleaved rounds (``rounds``: exactly that many;
    default 3, more while a ratio's range is wide); with ``lxt_python`` (the Python
    of an environment where LXT and its transformers 4 are installed) also LXT's two
    variants (:mod:`pyattr.bench.long_context_lxt`), each in that Python's own process."""
    from pyattr.bench.rounds import MAX_ROUNDS, ROUNDS, interleaved_grid

    contexts = (256, 512) if quick else CONTEXTS
    extra = ["--hidden", "128", "--layers", "2"] if quick else []
    variants, commands = VARIANTS, {}
    if lxt_python:
        from pyattr.bench import long_context_lxt

        variants = VARIANTS + long_context_lxt.VARIANTS
        commands = {v: [lxt_python, long_context_lxt.__file__] for v in long_context_lxt.VARIANTS}
    pairs = [(v, "plain") for v in variants if v != "plain"]
    if lxt_python:
        pairs += [("attnlrp", "lxt"), ("attnlrp", "lxt_cut")]
    rows = interleaved_grid("pyattr.bench.long_context", "--context", contexts, variants, extra,
                            "long-context, tokens:", pairs=pairs, rounds=rounds or (2 if quick else ROUNDS),
                            max_rounds=rounds or (2 if quick else MAX_ROUNDS), commands=commands)
    by = {(r["context"], r["variant"]): r for r in rows}
    for r in rows:
        r["bytes_per_1k"] = r["peak_extra_bytes"] / (r["context"] / 1024)
        r["memory_over_plain"] = r["peak_extra_bytes"] / max(1.0, by[(r["context"], "plain")]["peak_extra_bytes"])
    return rows


def markdown(rows: List[Dict], contention=None) -> str:
    from pyattr.bench.report import with_conditions
    from pyattr.bench.rounds import lxt_lines, ratio_text, versions_line

    lines = [f"One relevance map after a long context: {rows[0]['model']}, CPU; time median (range) over "
             f"{min(r['rounds'] for r in rows)} rounds, ratios to the plain forward + backward per round", "",
             "| context | rules | time (s) | time / plain | peak over model (MB) | memory / plain | per 1k tokens (MB) |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    names = {"plain": "plain forward + backward", "default": "default (AH-rule core)", "attnlrp": "AttnLRP",
             "ln": "LN-rule only", "none": "none (gradient × input)", "lxt": "LXT AttnLRP, as its README runs it",
             "lxt_cut": "LXT AttnLRP, logits_to_keep=1"}
    for r in rows:
        lines.append(f"| {r['context']} | {names[r['variant']]} | {r['seconds']:.1f} ({r['seconds_min']:.1f}–"
                     f"{r['seconds_max']:.1f}) | {ratio_text(r.get('over_plain')) or '1'} | "
                     f"{r['peak_extra_bytes'] / 2**20:.0f} | {r['memory_over_plain']:.2f} | "
                     f"{r['bytes_per_1k'] / 2**20:.0f} |")
    lines += lxt_lines(rows, "context", "---:|", lambda r: str(r["context"]))
    return with_conditions(lines + ["", versions_line()], contention)


def _main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args(argv)
    print(json.dumps(measure(a.variant, a.context, a.hidden, a.layers)))


if __name__ == "__main__":
    _main()
