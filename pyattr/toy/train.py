"""Train the toy induction decoder, deterministically, on the CPU.

``python -m pyattr.toy.train [DIR]`` writes the model, its tokenizer and its circuit
(``circuit.json``, see :mod:`pyattr.toy.circuit`) to ``DIR`` (default: the copy shipped in
the package). Same seed, same torch, one thread: the same weights.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import pyattr.toy.task as task
from pyattr.toy.fit import fit, one_thread

#: Where the shipped model lives.
SHIPPED = Path(__file__).resolve().parent / "induction"

SEED = 0
STEPS = 1000
BATCH = 64
LR = 3e-3


def config(layers: int = 2):
    """A ``layers``-layer (default 2), 4-head Llama (hidden 64, SwiGLU MLP of width 128, RoPE,
    RMSNorm)."""
    from transformers import LlamaConfig

    vocab = task.vocabulary()
    return LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=vocab[task.PAD],
        bos_token_id=vocab[task.BOS], eos_token_id=None, attention_bias=False,
    )


def loss_of(model, ids, determined):
    logits = model(input_ids=ids).logits[:, :-1]
    target = ids[:, 1:]
    mask = determined[:, :-1]
    return torch.nn.functional.cross_entropy(logits[mask], target[mask])


def train(steps: int = STEPS, seed: int = SEED, log=None, layers: int = 2):
    """The trained ``LlamaForCausalLM`` (eval mode, float32). Adam, cosine-decayed
    learning rate, loss on the determined positions only."""
    from transformers import LlamaForCausalLM

    with one_thread():  # the same sums in the same order on every machine
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config(layers)).float()
        model.config._attn_implementation = "eager"
        g = torch.Generator().manual_seed(seed)
        return fit(model, lambda: loss_of(model, *task.batch(g, BATCH)), steps, LR, log, betas=(0.9, 0.98))


@torch.no_grad()
def accuracy(model, count: int = 512, seed: int = 1) -> float:
    """Top-1 accuracy on the determined positions of ``count`` fresh sequences."""
    g = torch.Generator().manual_seed(seed)
    ids, determined = task.batch(g, count)
    pred = model(input_ids=ids).logits[:, :-1].argmax(-1)
    mask = determined[:, :-1]
    return (pred[mask] == ids[:, 1:][mask]).float().mean().item()


def save(model, out: Path, meta: dict) -> None:
    import pyattr.toy.circuit as circuit

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    task.tokenizer().save_pretrained(out)
    found = circuit.analyse(model)
    found["training"] = meta
    (out / "circuit.json").write_text(json.dumps(found, indent=1) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pyattr.toy.train", description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=str(SHIPPED), help="output directory (default: the shipped copy)")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2, as shipped)")
    a = p.parse_args(argv)
    if a.layers < 2:
        p.error(f"--layers must be at least 2 (a previous-token head feeds an induction head), got {a.layers}")
    t0 = time.perf_counter()
    model = train(a.steps, a.seed, log=print, layers=a.layers)
    seconds = time.perf_counter() - t0
    acc = accuracy(model)
    print(f"trained in {seconds:.1f} s, accuracy {acc:.4f}")
    save(model, Path(a.out), {"steps": a.steps, "seed": a.seed, "layers": a.layers, "batch": BATCH, "lr": LR,
                              "torch": torch.__version__, "accuracy": acc})
    print(f"saved to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
