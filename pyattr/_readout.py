"""Read-outs at a fixed position ([CLS]) under left padding.

BERT's pooler, RoBERTa's classification head and sentence-transformers' CLS pooling read
``hidden_states[:, 0]``: under left padding that is a pad token, not the row's [CLS], and
the row gives another number than alone (sentence-transformers fixed the same fault in its
own pooling). pyattr finds each row's first real token from the attention mask: in its
own targets (:class:`pyattr.targets.Cosine`), and in the model's read-out modules, whose
input is re-indexed for the pass so that position 0 holds each row's first real token.
A model whose own ``forward`` reads position 0 outside a module (DistilBERT's and
ModernBERT's sequence classifiers) cannot be reached that way: a left-padded batch is
refused there.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from typing import List, Optional

import torch
from torch import nn

_READS_FIRST = re.compile(r"\[\s*:\s*,\s*0\s*[\],]")


def first_real(mask: Optional[torch.Tensor], batch: int, device) -> torch.Tensor:
    """Index (batch,) of each row's first real token (0 without a mask)."""
    if mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    return mask.to(torch.long).argmax(1).to(device)


def left_padded(mask: Optional[torch.Tensor]) -> bool:
    return mask is not None and not bool(mask[:, 0].bool().all())


def _source(fn) -> str:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _reads_first(module: nn.Module) -> bool:
    return bool(_READS_FIRST.search(_source(type(module).forward)))


def readers(model: nn.Module) -> List[nn.Module]:
    """Modules that read position 0 of their first input: poolers and classification
    heads (``*Pooler``, ``*ClassificationHead``) whose forward indexes ``[:, 0]``."""
    return [m for m in model.modules() if m is not model
            and type(m).__name__.endswith(("Pooler", "ClassificationHead")) and _reads_first(m)]


def check_model_forward(model: nn.Module, mask: Optional[torch.Tensor], caller: str) -> None:
    """A model whose own forward reads position 0 refuses left-padded rows (ValueError)."""
    if not left_padded(mask):
        return
    inner = getattr(model, "_orig_mod", model)
    if _reads_first(inner) and not type(inner).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        row = int((~mask[:, 0].bool()).nonzero()[0, 0])
        raise ValueError(
            f"{caller}(): attention_mask pads row {row} on the left, and {type(inner).__name__}.forward reads "
            "position 0 ([CLS]) of every row itself, which is a pad token there, so the row would not give what "
            "it gives alone. Pad on the right (the default of BERT-style tokenizers: tokenizer.padding_side = 'right')"
        )


@contextlib.contextmanager
def first_real_token(model: nn.Module, mask: Optional[torch.Tensor]):
    """During the block, each read-out module (:func:`readers`) sees at position 0 of its
    input each row's first real token; nothing is installed without left padding."""
    mods = readers(model) if left_padded(mask) else []
    if not mods:
        yield
        return

    def pre(mod, args, kwargs):
        h = args[0] if args else kwargs.get("hidden_states", kwargs.get("features"))
        if not isinstance(h, torch.Tensor) or h.dim() < 2 or h.shape[:2] != mask.shape:
            return None
        first = first_real(mask, h.shape[0], h.device)
        rows = torch.arange(h.shape[0], device=h.device)
        # the whole first column swapped for the first real token's states, the rest as is
        new = torch.cat([h[rows, first].unsqueeze(1), h[:, 1:]], 1)
        if args:
            return (new, *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else "features"
        return args, {**kwargs, key: new}

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in mods]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
