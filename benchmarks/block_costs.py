"""Where the time of one relevance call goes on the Llama-3.2-1B shape, per block.

    python benchmarks/block_costs.py --tokens 1024

1. The attention kernels of one block (32 query / 8 key-value heads of 64, causal), min of 3
   calls: sdpa's CPU flash forward and backward (what a plain backward and AttnLRP run) and
   pyattr's AH-rule dV kernel (what the default rules run instead of the backward).
2. ``torch.profiler`` over one call on a 4-block model of that shape (random weights): the
   share of the GEMMs (``aten::mm``), of sdpa's flash kernels and of pyattr's own ops
   (``pyattr::*`` and the rule Functions) in the self CPU time, per variant of
   ``pyattr bench --scale``.
"""

import argparse
import time

import torch


def _best(fn, n: int = 3) -> float:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out) * 1e3


def kernels(tokens: int, dtype: torch.dtype) -> str:
    from pyattr.backends import compiled

    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, tokens, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, 8, tokens, 64, generator=g).to(dtype) for _ in range(2))
    out, lse = fwd(q, k, v, 0.0, True)
    do = torch.randn(out.shape, generator=g).to(dtype)
    a = _best(lambda: fwd(q, k, v, 0.0, True))
    b = _best(lambda: bwd(do, q, k, v, out, lse, 0.0, True))
    c = _best(lambda: compiled.attention_dv(q, k, do, None, 64 ** -0.5, None, True))
    return (f"{dtype} {tokens} tokens, one block: sdpa forward {a:.0f} ms, sdpa flash backward {b:.0f} ms, "
            f"pyattr AH-rule dV {c:.0f} ms")


def shares(tokens: int, dtype: torch.dtype, variant: str) -> str:
    import pyattr
    from pyattr.bench.scale import RULES, SHAPE, _plain
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SHAPE, "num_hidden_layers": 4, "vocab_size": 4096, "bos_token_id": 1, "eos_token_id": 2})
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(dtype).eval().requires_grad_(False)
    ids = torch.randint(3, 4096, (1, tokens), generator=torch.Generator().manual_seed(0))

    def once():
        if variant == "plain":
            _plain(model, ids, 7)
        else:
            pyattr.relevance(model, ids, target=7, rules=RULES[variant])

    once()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        once()
    rows = prof.key_averages()
    total = sum(r.self_cpu_time_total for r in rows)
    mm = sum(r.self_cpu_time_total for r in rows if r.key in ("aten::mm", "aten::bmm", "aten::addmm"))
    sdpa = sum(r.self_cpu_time_total for r in rows if "scaled_dot_product" in r.key)
    own = sum(r.self_cpu_time_total for r in rows if r.key.startswith("pyattr::") or "Rule" in r.key
              or r.key.startswith(("GatedActivation", "FrozenAttention", "SdpaRows", "ScaleGradient")))
    return (f"{dtype} {tokens} tokens, 4 blocks, {variant}: {total / 1e6:.2f} s; GEMMs {mm / total:.0%}, "
            f"sdpa {sdpa / total:.0%}, pyattr's ops {own / total:.1%}")


def main(argv=None):
    from pyattr.bench.scale import VARIANTS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    a = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    for dtype in (torch.bfloat16, torch.float32):
        print(kernels(a.tokens, dtype))
    for v in VARIANTS:
        print(shares(a.tokens, torch.bfloat16, v))


if __name__ == "__main__":
    main()
