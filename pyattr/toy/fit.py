"""What every toy model's training shares: one thread (the same sums in the same order on
every machine), AdamW with a one-cycle learning rate and clipped gradients, a loss logged
every 100 steps; and the word-level tokenizer the text toys use."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Tuple

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread for the block (restored afterwards): deterministic training."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fit(model, loss: Callable[[], torch.Tensor], steps: int, lr: float, log: Optional[Callable[[str], None]] = None,
        betas: Tuple[float, float] = (0.9, 0.999)):
    """``steps`` AdamW steps (weight decay 0.01, one-cycle learning rate peaking at ``lr``
    after 10 %, gradients clipped at norm 1) on ``loss()``, the model in train mode and
    returned in eval mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=betas)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        value = loss()
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log is not None and (step % 100 == 0 or step == steps - 1):
            log(f"step {step:5d}  loss {value.item():.4f}")
    model.eval()
    return model


def word_tokenizer(vocab: dict, template: str, special: str, padding_side: str, **tokens):
    """A ``PreTrainedTokenizerFast`` over whitespace-split words of ``vocab``: ``template``
    (``"<s> $A"``, ``"$A </s>"``) adds the ``special`` token; ``tokens`` name the special
    tokens (``pad_token=``, ``unk_token=``, …)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=tokens["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[(special, vocab[special])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, padding_side=padding_side, **tokens)


def train_main(argv, prog: str, doc: str, shipped, steps: int, seed: int, train, accuracy, what: str = "accuracy"):
    """The command line of a toy's training module: ``(args, model, {"steps", "seed",
    "torch", "accuracy", "seconds"})`` after training and measuring."""
    import argparse
    import time

    p = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    p.add_argument("out", nargs="?", default=str(shipped), help="output directory (default: the shipped copy)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--seed", type=int, default=seed)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    model = train(a.steps, a.seed, log=print)
    seconds = time.perf_counter() - t0
    acc = accuracy(model)
    print(f"trained in {seconds:.1f} s, {what} {acc:.4f}")
    return a, model, {"steps": a.steps, "seed": a.seed, "torch": torch.__version__, "accuracy": acc}
