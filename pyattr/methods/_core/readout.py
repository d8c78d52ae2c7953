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

from pyattr.targets.base import first_real

_READS_FIRST = re.compile(r"\[\s*:\s*,\s*0\s*[\],]")
# CLIP's text tower pools at the first end-of-sequence token, found in the ids
_READS_EOS = re.compile(r"eos_token_id[\s\S]*argmax|argmax[\s\S]*eos_token_id")
# decoder sequence classifiers read the last token that is not the pad token, found in the ids
_READS_LAST_NON_PAD = re.compile(r"last_non_pad_token|pad_token_id[\s\S]*argmax|argmax[\s\S]*pad_token_id")


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


def _model_level(model: nn.Module) -> List[nn.Module]:
    """The model and the models inside it (base model, towers): where poolers read a fixed
    position in their own ``forward`` rather than in a module (ALBERT, BigBird, CLIP's
    text tower, DistilBERT's and ModernBERT's classifiers)."""
    inner = getattr(model, "_orig_mod", model)
    return [inner] + [m for m in inner.modules() if m is not inner and (
        hasattr(m, "base_model_prefix") or type(m).__name__.endswith(("Model", "Transformer")))]


def check_model_forward(model: nn.Module, mask: Optional[torch.Tensor], caller: str) -> None:
    """A left-padded batch on a model whose own forward reads a fixed position (``[:, 0]``)
    or the first end-of-sequence token found in the ids: ValueError."""
    if not left_padded(mask):
        return
    row = int((~mask[:, 0].bool()).nonzero()[0, 0])
    for m in _model_level(model):
        name = type(m).__name__
        src = _source(type(m).forward)
        if _READS_FIRST.search(src) and not name.endswith(("ForCausalLM", "LMHeadModel")):
            raise ValueError(
                f"{caller}(): attention_mask pads row {row} on the left, and {name}.forward reads position 0 "
                "([CLS]) of every row itself, which is a pad token there, so the row would not give what it gives "
                "alone. Pad on the right (the default of BERT-style tokenizers: tokenizer.padding_side = 'right')"
            )
        if _READS_EOS.search(src):
            raise ValueError(
                f"{caller}(): attention_mask pads row {row} on the left, and {name}.forward pools at the first "
                "end-of-sequence token it finds in the ids, which under left padding can be a pad token, so the row "
                "would not give what it gives alone. Pad on the right (tokenizer.padding_side = 'right')"
            )


def check_pad_baseline(model: nn.Module, mask: Optional[torch.Tensor], caller: str) -> None:
    """``baseline="pad"`` on a left-padded batch of a model that reads the last non-pad
    token of the ids (decoder sequence classifiers): an all-pad baseline row has none, so
    the model reads position 0, a pad slot of the padded row but the first token of the
    row alone: ValueError."""
    if not left_padded(mask):
        return
    for m in _model_level(model):
        if _READS_LAST_NON_PAD.search(_source(type(m).forward)):
            row = int((~mask[:, 0].bool()).nonzero()[0, 0])
            raise ValueError(
                f"baseline: 'pad' on a batch that pads row {row} on the left, and {type(m).__name__}.forward reads the "
                "last token that is not the pad token: the all-pad baseline has none, so it would read position 0, a "
                "pad slot of the padded row but the first token of the row alone. Pad on the right, or pass "
                "baseline='zeros' or a tensor"
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
