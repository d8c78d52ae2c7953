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

With ``--checkpoint DIR`` (``pyattr bench --scale``) the model is that checkpoint, loaded in
``--dtype`` with the shape its ``shape.json`` holds, and the peak memory is the call's own
(the high-water mark reset just before it), as the pyattr variants of that run measure it.
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


def reset_peak() -> bool:
    """Reset this process's peak resident set size (Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    """This process's peak resident set size since the last :func:`reset_peak` (bytes)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _checkpoint_model(path: str, dtype: str):
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    with open(f"{path}/shape.json") as f:
        shape = json.load(f)
    cfg = LlamaConfig(**shape)
    model = modeling_llama.LlamaForCausalLM.from_pretrained(path, config=cfg, torch_dtype=getattr(torch, dtype),
                                                            attn_implementation="sdpa")
    n = sum(p.numel() for p in model.parameters())
    what = (f"Llama-3.2-1B-shaped ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab "
            f"{cfg.vocab_size}, {n / 1e9:.2f}B parameters, random weights), sdpa")
    return model, what


def measure(variant: str, context: int, hidden: int = 512, layers: int = 4, checkpoint: str = None,
            dtype: str = "float32") -> dict:
    import torch
    import transformers
    from importlib import metadata
    from lxt.efficient import monkey_patch
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    monkey_patch(modeling_llama)
    if checkpoint:
        model, what = _checkpoint_model(checkpoint, dtype)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                          num_hidden_layers=layers, num_attention_heads=hidden // 64,
                          num_key_value_heads=hidden // 64, max_position_embeddings=65536)
        cfg._attn_implementation = "sdpa"  # what from_pretrained picks on this torch
        torch.manual_seed(0)
        model = modeling_llama.LlamaForCausalLM(cfg)
        what = f"Llama {layers} layers, hidden {hidden}, {hidden // 64} heads, sdpa, float32"
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, context), generator=g)
    target = int(torch.randint(3, vocab, (1,), generator=g))
    keep = {"logits_to_keep": 1} if variant == "lxt_cut" else {}

    def once(x_ids):
        embeds = model.get_input_embeddings()(x_ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds, use_cache=False, **keep).logits
        logits[0, -1, target].backward()
        return (embeds * embeds.grad).float().sum(-1)

    once(ids[:, :16])  # warm-up, as the pyattr variants do
    reset = checkpoint is not None and reset_peak()  # the scale run's measure: the call's own peak
    base = _rss_bytes()
    t0 = time.perf_counter()
    once(ids)
    seconds = time.perf_counter() - t0
    peak = peak_bytes() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    extra = max(0, peak - base)
    row = {"dtype": dtype, "point": f"{dtype}:{context}", "peak_reset": reset,
           "parameters": sum(p.numel() for p in model.parameters())} if checkpoint else {}
    return {"variant": variant, "context": context, "seconds": seconds, "peak_rss_bytes": peak,
            "peak_extra_bytes": extra, "bytes_per_1k": extra / (context / 1024), **row,
            "model": what, "threads": torch.get_num_threads(),
            "peer_versions": f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
                             f"{transformers.__version__}, lxt {metadata.version('lxt')}"}


def _main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--context", type=int)
    p.add_argument("--point", help="DTYPE:TOKENS (with --checkpoint)")
    p.add_argument("--checkpoint", help="a pyattr bench --scale checkpoint directory")
    p.add_argument("--quick", action="store_true", help="ignored: the checkpoint sets the size")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args(argv)
    if a.point:
        dtype, _, context = a.point.partition(":")
        print(json.dumps(measure(a.variant, int(context), checkpoint=a.checkpoint, dtype=dtype)))
    else:
        print(json.dumps(measure(a.variant, a.context, a.hidden, a.layers)))


if __name__ == "__main__":
    _main()
