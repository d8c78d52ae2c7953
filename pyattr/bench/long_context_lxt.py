"""One AttnLRP relevance map by LXT (``lxt.efficient``), for ``pyattr bench --long-context``.

Run as a script by a development environment's Python where LXT and the transformers 4
it is tested with are installed (LXT is a peer to measure against, never a dependency of
pyattr, and does not run on transformers 5): it imports neither pyattr nor anything
outside torch, transformers and lxt, builds the benchmark's Llama from the same
configuration and seed, and prints one JSON row as the pyattr variants do.

- ``lxt``: as LXT's README and examples run it: ``monkey_patch(modeling_llama)``, the
  model called on ``inputs_embeds`` with ``use_cache=False``, its full logits, the target
  logit at the last position backpropagated, relevance = (embeddings × gradient) summed
  over the hidden size;
- ``lxt_cut``: the same with ``logits_to_keep=1``, the head cut pyattr makes.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time

VARIANTS = ("lxt", "lxt_cut")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(variant: str, context: int, hidden: int = 512, layers: int = 4) -> dict:
    import torch
    import transformers
    from importlib import metadata
    from lxt.efficient import monkey_patch
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    monkey_patch(modeling_llama)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                      max_position_embeddings=65536)
    cfg._attn_implementation = "sdpa"  # what from_pretrained picks on this torch
    torch.manual_seed(0)
    model = modeling_llama.LlamaForCausalLM(cfg).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (1, context), generator=g)
    target = int(torch.randint(3, 32000, (1,), generator=g))
    keep = {"logits_to_keep": 1} if variant == "lxt_cut" else {}

    def once(x_ids):
        embeds = model.get_input_embeddings()(x_ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds, use_cache=False, **keep).logits
        logits[0, -1, target].backward()
        return (embeds * embeds.grad).float().sum(-1)

    once(ids[:, :16])  # warm-up, as the pyattr variants do
    base = _rss_bytes()
    t0 = time.perf_counter()
    once(ids)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    extra = max(0, peak - base)
    return {"variant": variant, "context": context, "seconds": seconds, "peak_rss_bytes": peak,
            "peak_extra_bytes": extra, "bytes_per_1k": extra / (context / 1024),
            "model": f"Llama {layers} layers, hidden {hidden}, {hidden // 64} heads, sdpa, float32",
            "threads": torch.get_num_threads(),
            "peer_versions": f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
                             f"{transformers.__version__}, lxt {metadata.version('lxt')}"}


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
