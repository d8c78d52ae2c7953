"""Targets read from module outputs: a module's output or a neuron of it, and the cosine
similarity of a pooled sentence embedding."""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch

from pyattr.targets.base import Target, first_real, is_int, real_positions

Selector = Union[None, int, Tuple[Union[int, slice], ...], Callable]


def _mask_padding(out: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``out`` with 0 at padded positions, when it is laid out ``(batch, seq, …)`` like the
    mask: the hidden states a pad token produces are not part of the row alone."""
    if mask is None or out.dim() < 2 or tuple(out.shape[:2]) != tuple(mask.shape):
        return out
    keep = mask.to(device=out.device, dtype=torch.bool)
    if bool(keep.all()):
        return out
    keep = keep.view(*keep.shape, *([1] * (out.dim() - 2)))
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


class ModuleOutput(Target):
    """A module's output, or a neuron of it: tdhook's target modules, Captum's neuron selector.

    Args:
        path (str): dotted module path (``model.named_modules()``); the first tensor of
            its output is read (Hugging Face decoder layers return tuples). If the module
            runs several times in one forward, the last call is explained.
        select: ``None`` (the whole output), an int ``i`` (``out[:, i]``, Captum's
            convention: the index after the batch dimension), a tuple of ints and slices
            (``out[:, *select]``), or a callable ``f(out) → Tensor``. What it selects is
            summed per row, so the target is ``Tensor[batch]``. A neuron ``j`` of the hidden
            size at position ``p``: ``select=(p, j)``; at every position: ``(slice(None), j)``.

    Padding: where the output is laid out ``(batch, seq, …)`` like the attention mask, the
    selector sees 0 at the positions the mask marks as padding, so ``select=None`` and
    sums over all positions explain what the row alone gives, and pad tokens get no
    relevance. An int position selected directly (``select=p`` or ``(p, …)``) is each
    row's ``p``-th real token (negative: counted back from its last real token), as in
    the row alone; a row too short raises ValueError, and so does a slice over positions
    other than ``slice(None)`` in a padded batch (it would mean other tokens than in each
    row alone). A callable ``select`` sees the zeros at padding: make it padding-aware
    (a mean over positions of a padded row is not the row's mean).
    """

    def __init__(self, path: str, select: Selector = None):
        if not isinstance(path, str) or not path:
            raise TypeError(f"target: ModuleOutput needs a dotted module path, got {path!r}")
        if not (select is None or callable(select) or is_int(select) or (
            isinstance(select, tuple) and all(is_int(s) or isinstance(s, slice) for s in select)
        )):
            raise TypeError(f"target: ModuleOutput select must be None, an int, a tuple of ints/slices or a callable, got {select!r}")
        self.path, self.select = path, select
        self.paths = (path,)

    def __repr__(self):
        return f"ModuleOutput({self.path!r}, select={self.select!r})"

    def value(self, fwd):
        out = fwd.modules.get(self.path)
        if out is None:
            raise ValueError(f"target: module {self.path!r} did not run during the forward pass")
        out = _mask_padding(out, fwd.attention_mask)
        if callable(self.select):
            sel = self.select(out)
            if not isinstance(sel, torch.Tensor):
                raise TypeError(f"target: ModuleOutput select callable must return a tensor, got {type(sel).__name__}")
        elif self.select is None:
            sel = out
        else:
            idx = (self.select,) if is_int(self.select) else self.select
            if len(idx) > out.dim() - 1:
                raise ValueError(
                    f"target: select {self.select!r} indexes {len(idx)} dimensions after the batch, but "
                    f"{self.path!r} outputs shape {tuple(out.shape)}"
                )
            mask = fwd.attention_mask
            by_row = mask is not None and out.dim() >= 2 and tuple(out.shape[:2]) == tuple(mask.shape) \
                and not bool(mask.bool().all())
            try:
                if by_row and is_int(idx[0]):
                    # the p-th real token of each row, as the row alone has it at p
                    pos = real_positions(int(idx[0]), mask, f"target: ModuleOutput({self.path!r}) select position")
                    rows = torch.arange(out.shape[0], device=out.device)
                    sel = out[rows, pos.to(out.device)][(slice(None), *idx[1:])]
                else:
                    if by_row and isinstance(idx[0], slice) and idx[0] != slice(None):
                        raise ValueError(
                            f"target: ModuleOutput({self.path!r}) select {self.select!r} slices the positions of a "
                            "padded batch, where a slice means other tokens in rows of other lengths than in each "
                            "row alone; select one position by an int (counted per row), all positions, or pass "
                            "unpadded rows"
                        )
                    sel = out[(slice(None), *idx)]
            except IndexError as e:
                raise ValueError(f"target: select {self.select!r} is out of range for {self.path!r} output {tuple(out.shape)}: {e}") from None
        if sel.dim() == 0:
            return sel, None
        if sel.shape[0] != fwd.input_ids.shape[0]:
            raise ValueError(f"target: ModuleOutput({self.path!r}) selection must keep the batch dimension first, got shape {tuple(sel.shape)}")
        return sel.reshape(sel.shape[0], -1).sum(1), None


class Cosine(Target):
    """Cosine similarity of each row's pooled sentence embedding with a fixed reference
    embedding: the sentence-transformers metric (all-MiniLM-L6-v2 mean-pools its last
    hidden state over the real tokens).

    Args:
        reference (Tensor[hidden] or Tensor[batch, hidden]): the embedding to compare with
            (one for every row, or one per row); a constant (detached).
        pooling (str): ``"mean"`` over the real tokens (attention mask; default) or
            ``"cls"`` (each row's first real token under the attention mask: position 0
            unless the row is left-padded).
        constant_norm (bool): the pooled embedding's norm is a constant in the backward
            (the LN-rule of AttnLRP, ICML 2024, Prop. 3.3, applied to the metric's own
            normalisation, as ``pyattr explain`` does); the forward is unchanged. With
            it the metric is linear in the pooled embedding along the backward. Default False.

    Reads the first tensor of the model output (``last_hidden_state``).
    """

    def __init__(self, reference: torch.Tensor, pooling: str = "mean", constant_norm: bool = False):
        if not isinstance(reference, torch.Tensor) or not reference.is_floating_point() or reference.dim() not in (1, 2):
            raise TypeError("target: Cosine reference must be a floating tensor of shape (hidden,) or (batch, hidden)")
        if not bool(torch.isfinite(reference).all()) or not bool((reference.norm(dim=-1) > 0).all()):
            raise ValueError("target: Cosine reference must be finite and nonzero")
        if pooling not in ("mean", "cls"):
            raise ValueError(f"target: Cosine pooling must be 'mean' or 'cls', got {pooling!r}")
        if not isinstance(constant_norm, bool):
            raise TypeError(f"target: Cosine constant_norm must be a bool, got {constant_norm!r}")
        self.reference = reference.detach()
        self.pooling, self.constant_norm = pooling, constant_norm

    def __repr__(self):
        return f"Cosine(reference {tuple(self.reference.shape)}, pooling={self.pooling!r}, constant_norm={self.constant_norm})"

    def value(self, fwd):
        h = getattr(fwd.output, "last_hidden_state", None)
        if h is None:
            h = fwd.output if isinstance(fwd.output, torch.Tensor) else fwd.output[0]
        if h.dim() != 3:
            raise ValueError(f"target: Cosine needs hidden states of shape (batch, seq, hidden), got {tuple(h.shape)}")
        ref = self.reference.to(device=h.device, dtype=h.dtype)
        if ref.shape[-1] != h.shape[-1] or (ref.dim() == 2 and ref.shape[0] != h.shape[0]):
            raise ValueError(
                f"target: Cosine reference of shape {tuple(ref.shape)} does not match hidden states {tuple(h.shape)}"
            )
        if self.pooling == "cls":
            # each row's first real token: under left padding position 0 is a pad token
            m = fwd.attention_mask
            first = first_real(m, h.shape[0], h.device)
            pooled = h[torch.arange(h.shape[0], device=h.device), first]
        else:
            m = fwd.attention_mask
            m = torch.ones(h.shape[:2], dtype=h.dtype, device=h.device) if m is None else m.to(h.device, h.dtype)
            pooled = (h * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True)
        norm = pooled.norm(dim=-1, keepdim=True)
        if self.constant_norm:
            from pyattr.rules import ln_rule

            unit = ln_rule(pooled, norm)
        else:
            unit = pooled / norm
        return (unit * ref).sum(-1) / ref.norm(dim=-1), None

    def rows(self, index, batch):
        if self.reference.dim() == 1:
            return self
        if self.reference.shape[0] != batch:
            raise ValueError(f"target: Cosine reference has {self.reference.shape[0]} rows for a batch of {batch}")
        return Cosine(self.reference[index.to(self.reference.device)], self.pooling, self.constant_norm)
