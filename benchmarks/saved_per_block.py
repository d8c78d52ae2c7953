"""Bytes each rule set keeps for the backward in one block of the Llama-3.2-1B shape.

One block's unique saved storages (``torch.autograd.graph.saved_tensors_hooks``; parameters
and their views left out, each storage counted once) while ``pyattr.relevance`` (or the plain
gradient of ``pyattr bench --scale``) runs on a 2-block model of that shape, random weights:

    python benchmarks/saved_per_block.py --dtype float32 --tokens 1024

prints, per variant, the MB the first block saves. The resident peak that ``pyattr bench
--scale`` reports adds transients and the allocator's behaviour on top of these.
"""

import argparse

import torch


def saved_mb(model, ids, target: int, variant: str) -> float:
    import pyattr
    from pyattr.bench.scale import RULES, _plain

    where = ["outside"]
    block = model.model.layers[0]
    pre = block.register_forward_pre_hook(lambda *_: where.__setitem__(0, "block"))
    post = block.register_forward_hook(lambda *_: where.__setitem__(0, "outside"))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if where[0] == "block" and ptr not in params and ptr not in seen:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if variant == "plain":
                _plain(model, ids, target)
            else:
                pyattr.relevance(model, ids, target=target, rules=RULES[variant])
    finally:
        pre.remove()
        post.remove()
    return sum(seen.values()) / 2 ** 20


def main(argv=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    from pyattr.bench.scale import SHAPE, VARIANTS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--tokens", type=int, default=1024)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SHAPE, "num_hidden_layers": 2, "vocab_size": 4096, "bos_token_id": 1, "eos_token_id": 2})
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(getattr(torch, a.dtype)).eval()
    model.requires_grad_(False)
    ids = torch.randint(3, 4096, (1, a.tokens), generator=torch.Generator().manual_seed(0))
    for v in VARIANTS:
        print(f"{a.dtype} {a.tokens} tokens {v}: {saved_mb(model, ids, 7, v):.1f} MB saved by block 0")


if __name__ == "__main__":
    main()
