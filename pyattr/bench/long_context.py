"""``pyattr bench --long-context``: peak memory of explaining 16 generated tokens after a
long prompt (a document and a question) on a 4-layer, hidden-512 Llama (float32, CPU),
per 1k tokens of context, three ways:

- ``pyattr``: :func:`pyattr.generation_relevance` (all four rules; the AH-rule's attention
  core never holds a seq × seq matrix for the backward);
- ``plain``: one plain forward and backward (the 16 tokens' summed logits with respect to
  the input embeddings), the floor any gradient method pays;
- ``eager``: relevance with eager attention and the attention rule off (LN-, Identity- and
  Half-rule only): the attention probabilities of every layer and head are saved for the
  backward, as relevance code built on eager attention (LXT's) does.

Each measurement runs in its own process; ``peak_extra_bytes`` is its peak RSS minus its
RSS once the model and inputs were built, ``bytes_per_1k`` that divided by the context in
thousands of tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import torch

from pyattr.bench.e2e import child_grid, peak_rss_bytes, rss_bytes

VARIANTS = ("pyattr", "plain", "eager")
CONTEXTS = (1024, 2048, 4096)
GENERATED = 16


def _model(attn: str, hidden: int = 512, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                      max_position_embeddings=32768)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def measure(variant: str, context: int, generated: int = GENERATED, hidden: int = 512, layers: int = 4) -> Dict:
    import pyattr
    from pyattr.config import RelevanceRules

    model = _model("eager" if variant == "eager" else "sdpa", hidden, layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (1, context), generator=g)
    cont = torch.randint(3, 32000, (1, generated), generator=g)
    base = rss_bytes()
    t0 = time.perf_counter()
    if variant == "plain":
        seq = torch.cat([ids, cont], 1)
        x = model.get_input_embeddings()(seq[:, :-1]).detach().requires_grad_(True)
        logits = model(inputs_embeds=x, logits_to_keep=generated).logits[0]
        value = logits.gather(1, cont[0, :, None]).sum()
        torch.autograd.grad(value, x)
    elif variant in ("pyattr", "eager"):
        rules = None if variant == "pyattr" else RelevanceRules(normalization=True, activation=True,
                                                                 multiplicative_gate=True)
        pyattr.generation_relevance(model, ids, continuation=cont, rules=rules)
    else:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    extra = max(0, peak - base)
    return {"variant": variant, "context": context, "generated": generated, "seconds": seconds,
            "peak_rss_bytes": peak, "peak_extra_bytes": extra, "bytes_per_1k": extra / (context / 1024),
            "model": f"Llama {layers} layers, hidden {hidden}, float32"}


def run_all(quick: bool = False) -> List[Dict]:
    contexts = (256, 512) if quick else CONTEXTS
    extra = ["--hidden", "128", "--layers", "2", "--generated", "4"] if quick else []
    return child_grid("pyattr.bench.long_context", "--context", contexts, VARIANTS, extra, "long-context, tokens:")


def markdown(rows: List[Dict], contention=None) -> str:
    from pyattr.bench.report import with_conditions

    lines = [f"Peak memory of explaining {rows[0]['generated']} generated tokens after a long prompt: "
             f"{rows[0]['model']}, CPU", "",
             "| context | method | time (s) | peak RSS (MB) | peak over model (MB) | per 1k tokens (MB) |",
             "|---:|---|---:|---:|---:|---:|"]
    names = {"pyattr": "generation_relevance (AH-rule core)", "plain": "plain forward + backward",
             "eager": "eager attention, attention rule off"}
    for r in rows:
        lines.append(f"| {r['context']} | {names[r['variant']]} | {r['seconds']:.1f} | {r['peak_rss_bytes'] / 2**20:.0f} "
                     f"| {r['peak_extra_bytes'] / 2**20:.0f} | {r['bytes_per_1k'] / 2**20:.0f} |")
    return with_conditions(lines, contention)


def _main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--generated", type=int, default=GENERATED)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args(argv)
    print(json.dumps(measure(a.variant, a.context, a.generated, a.hidden, a.layers)))


if __name__ == "__main__":
    _main()
