"""``pyattr bench --scale``: one relevance map on a Llama-3.2-1B-shaped model (random
weights; 16 layers, hidden 2048, MLP 8192, 32 query / 8 key-value heads, a tied
128256-token vocabulary: 1.24B parameters), in bfloat16 and float32, after 1k and 4k
tokens, under every rule set, against one plain forward and backward:

- ``plain``: the target logit's gradient with respect to the input embeddings, no rules,
  the head cut to the last position (``logits_to_keep=1``) and no parameter gradients:
  the floor any gradient method pays;
- ``default``, ``attnlrp``, ``ln``: :func:`pyattr.relevance` under those rules;
- with ``--lxt-python``: LXT's AttnLRP (``lxt.efficient``) as its README runs it (full
  logits) and with the same head cut (``logits_to_keep=1``), run by that development
  environment's Python on the same checkpoint (:mod:`pyattr.bench.long_context_lxt`).

The weights are drawn once (seed 0) and saved in bfloat16 under
``<cache>/bench/llama-1b-shaped`` (``PYATTR_CACHE_DIR``); float32 runs load the same
weights upcast. Each measurement runs in its own process; its peak memory is the peak
resident set size from just before the timed call to its end (the kernel's high-water
mark, reset through ``/proc/self/clear_refs``), minus the resident size at that reset:
what the call itself adds over the loaded model; with ``allocator="returned"``
(``--allocator returned``) every freed block of 64 KiB or more is unmapped, so that peak is
the tensors' and not glibc's heap. Rounds rotate the order (:mod:`pyattr.bench.rounds`);
times are medians with their range, ratios per round.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from pyattr.bench.long_context_lxt import peak_bytes, reset_peak  # the peer's script shares them

VARIANTS = ("plain", "default", "attnlrp", "ln")
RULES = {"default": None, "attnlrp": "attnlrp", "ln": "ln"}
CONTEXTS = (1024, 4096)
DTYPES = ("bfloat16", "float32")

#: Llama-3.2-1B's shape (its published config), as LlamaConfig keyword arguments
SHAPE = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
         "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "bos_token_id": 128000,
         "eos_token_id": 128001}
#: ``--quick``: the same form, small enough for a test
QUICK_SHAPE = {**SHAPE, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
QUICK_CONTEXTS = (64,)


def checkpoint(quick: bool = False) -> Path:
    """The directory of the benchmark's checkpoint (``config.json``, safetensors weights in
    bfloat16, and ``shape.json``: :data:`SHAPE` for the peer's process), drawn and saved on
    the first call."""
    from pyattr.backends.build import cache_root

    shape = QUICK_SHAPE if quick else SHAPE
    path = cache_root() / "bench" / ("llama-1b-shaped-quick" if quick else "llama-1b-shaped")
    if (path / "shape.json").is_file() and json.loads((path / "shape.json").read_text()) == shape:
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**shape), dtype=torch.bfloat16)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    (tmp / "shape.json").write_text(json.dumps(shape))  # last: its presence marks a whole checkpoint
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


def _plain(model, ids, target: int) -> None:
    x = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logit = model(inputs_embeds=x, logits_to_keep=1, use_cache=False).logits[0, -1, target]
    torch.autograd.grad(logit, x)


#: ``allocator``: glibc as the process starts (its heap keeps freed holes resident), or
#: ``returned``: blocks of 64 KiB or more unmapped when freed (:func:`pyattr.bench.micro.return_freed_memory`)
ALLOCATORS = ("glibc", "returned")


def measure(variant: str, context: int, dtype: str, quick: bool = False, allocator: str = "glibc") -> Dict:
    import pyattr
    from pyattr.bench.e2e import rss_bytes
    from transformers import LlamaForCausalLM

    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    if allocator == "returned":
        from pyattr.bench.micro import return_freed_memory

        if return_freed_memory() is None:
            raise RuntimeError("allocator='returned' needs glibc's malloc (Linux)")

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    path = checkpoint(quick)
    model = LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
    for p in model.parameters():
        p.requires_grad_(False)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, context), generator=g)
    target = int(torch.randint(3, vocab, (1,), generator=g))

    def once(x):
        if variant == "plain":
            _plain(model, x, target)
        else:
            pyattr.relevance(model, x, target=target, rules=RULES[variant])

    once(ids[:, :16])  # warm-up: the scope's first install, the kernels' load, autograd's first pass
    reset = reset_peak()
    base = rss_bytes()
    t0 = time.perf_counter()
    once(ids)
    seconds = time.perf_counter() - t0
    peak = peak_bytes()
    n = sum(p.numel() for p in model.parameters())
    return {"variant": variant, "context": context, "dtype": dtype, "point": f"{dtype}:{context}",
            "seconds": seconds, "peak_rss_bytes": peak, "peak_extra_bytes": max(0, peak - base),
            "peak_reset": reset, "parameters": n, "allocator": allocator,
            "model": f"Llama-3.2-1B-shaped ({model.config.num_hidden_layers} layers, hidden "
                     f"{model.config.hidden_size}, vocab {vocab}, {n / 1e9:.2f}B parameters, random weights), sdpa",
            "threads": torch.get_num_threads()}


def run_all(quick: bool = False, rounds: int = None, lxt_python: str = None,
            contexts: Sequence[int] = None, dtypes: Sequence[str] = DTYPES, allocator: str = "glibc") -> List[Dict]:
    """Every variant at every (dtype, context) point in interleaved rounds; with
    ``lxt_python`` also LXT's two variants, each in that Python's own process. With
    ``allocator="returned"`` pyattr's processes unmap freed blocks (:data:`ALLOCATORS`): their
    peak memory is then the tensors', not the heap's (LXT's processes are not run then)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    if allocator != "glibc" and lxt_python:
        raise ValueError("allocator='returned' applies to pyattr's processes only: run LXT with allocator='glibc'")
    from pyattr.bench.rounds import MAX_ROUNDS, ROUNDS, interleaved_grid

    path = checkpoint(quick)  # drawn once, before any timed process
    contexts = tuple(contexts or (QUICK_CONTEXTS if quick else CONTEXTS))
    points = [f"{d}:{c}" for d in dtypes for c in contexts]
    extra = (["--quick"] if quick else []) + (["--allocator", allocator] if allocator != "glibc" else [])
    variants, commands = VARIANTS, {}
    if lxt_python:
        from pyattr.bench import long_context_lxt

        variants = VARIANTS + long_context_lxt.VARIANTS
        commands = {v: [lxt_python, long_context_lxt.__file__, "--checkpoint", str(path)]
                    for v in long_context_lxt.VARIANTS}
    pairs = [(v, "plain") for v in variants if v != "plain"]
    if lxt_python:
        pairs += [("attnlrp", "lxt"), ("attnlrp", "lxt_cut")]
    rows = interleaved_grid("pyattr.bench.scale", "--point", points, variants, extra, "scale, dtype:tokens",
                            pairs=pairs, rounds=rounds or (1 if quick else ROUNDS),
                            max_rounds=rounds or (1 if quick else MAX_ROUNDS), commands=commands)
    by = {(r["point"], r["variant"]): r for r in rows}
    for r in rows:
        r["memory_over_plain"] = r["peak_extra_bytes"] / max(1.0, by[(r["point"], "plain")]["peak_extra_bytes"])
    return rows


NAMES = {"plain": "plain forward + backward", "default": "default (AH-rule core)", "attnlrp": "AttnLRP",
         "ln": "LN-rule only", "lxt": "LXT AttnLRP, as its README runs it", "lxt_cut": "LXT AttnLRP, logits_to_keep=1"}


def markdown(rows: List[Dict], contention=None) -> str:
    from pyattr.bench.report import with_conditions
    from pyattr.bench.rounds import lxt_lines, ratio_text, versions_line

    lines = [f"One relevance map, one target at the last position: {rows[0]['model']}, CPU, "
             f"{rows[0]['threads']} threads; time median (range) over {min(r['rounds'] for r in rows)} rounds, "
             "ratios to the plain forward + backward per round; memory: the call's peak over the loaded model"
             + ("" if rows[0].get("allocator", "glibc") == "glibc" else
                ", with every block of 64 KiB or more unmapped when freed (the tensors' peak, not the heap's)"), "",
             "| dtype | tokens | rules | time (s) | time / plain | peak over model (MB) | memory / plain |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['context']} | {NAMES[r['variant']]} | {r['seconds']:.1f} "
                     f"({r['seconds_min']:.1f}–{r['seconds_max']:.1f}) | {ratio_text(r.get('over_plain')) or '1'} | "
                     f"{r['peak_extra_bytes'] / 2**20:.0f} | {r['memory_over_plain']:.2f} |")
    lines += lxt_lines(rows, "dtype | tokens", "---|---:|", lambda r: f"{r['dtype']} | {r['context']}")
    return with_conditions(lines + ["", versions_line()], contention)


def _main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--point", required=True, help="DTYPE:TOKENS")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--allocator", choices=ALLOCATORS, default="glibc")
    a = p.parse_args(argv)
    dtype, _, context = a.point.partition(":")
    print(json.dumps(measure(a.variant, int(context), dtype, a.quick, a.allocator)))


if __name__ == "__main__":
    _main()
