"""The target protocol: what a forward gives a target to read, the base class, token ids
in any integer form, and each row's positions counted along the attention mask."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch


@dataclass
class Forward:
    """What a target can read from one forward pass."""

    output: Any                        # the model's return value
    input_ids: torch.Tensor            # (batch, seq)
    attention_mask: Optional[torch.Tensor]
    modules: dict                      # path -> first tensor of the module's (last) output
    kept: Optional[torch.Tensor] = None  # positions the logits were computed at (logits_to_keep)


class Target:
    """Base class of the target objects. Subclasses define :meth:`value`."""

    #: module paths whose outputs the target reads (recorded during the forward)
    paths: Tuple[str, ...] = ()

    def value(self, fwd: Forward) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(Tensor[batch] or Tensor[], token ids Tensor[batch] or None)``."""
        raise NotImplementedError

    def fixed(self, token_ids: Optional[torch.Tensor]) -> "Target":
        """The same target with its token ids fixed (for ``None`` = top-1): baselines and
        integration steps must explain the token chosen at the real input."""
        return self

    def rows(self, index: torch.Tensor, batch: int) -> "Target":
        """The target for the rows ``index`` (LongTensor) of a batch of ``batch`` rows, for
        passes that run a subset or a repetition of the rows (chunks, integration steps)."""
        return self


def is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def real_positions(position: int, mask: torch.Tensor, name: str) -> torch.Tensor:
    """Index (batch,) of each row's ``position``-th real token under ``mask`` (negative:
    counted back from the row's last real token, ``-1`` the last).

    Raises:
        ValueError: a row has too few real tokens (``name`` starts the message).
    """
    m = mask.to(torch.long)
    lengths = m.sum(1)
    k = position + lengths if position < 0 else torch.full_like(lengths, position)
    short = (k < 0) | (k >= lengths)
    if bool(short.any()):
        row = int(short.nonzero()[0, 0])
        raise ValueError(
            f"{name} {position} is outside row {row}, which has {int(lengths[row])} real tokens (attention_mask); "
            "positions count each row's real tokens, as in the row alone (p ≥ 0 from the first, -1 the last)"
        )
    return ((m.cumsum(1) == (k + 1).unsqueeze(1)) & m.bool()).to(torch.long).argmax(1)


def check_position(position) -> int:
    """A position: ``p ≥ 0`` each row's ``p``-th real token, ``p < 0`` counted back from its
    last real token (``-1`` the last)."""
    if not is_int(position):
        raise ValueError(f"target: position must be an int (≥ 0 from each row's first real token, < 0 counted "
                         f"back from its last, -1 the last); got {position!r}")
    return int(position)


def token_ids(target, batch: int, name: str = "target") -> torch.Tensor:
    """Token ids in any integer form → ``LongTensor[batch]`` (on the CPU).

    Accepted: an int or NumPy integer, a 0-d integer tensor or array (one id for every
    row); a list / tuple, 1-d integer tensor or array with one id per row; a ``(batch, 1)``
    tensor, array or nested list.
    """
    if is_int(target):
        if not -(2**63) <= int(target) < 2**63:
            raise ValueError(f"{name}: token id {int(target)} is out of range for a token id")
        return torch.full((batch,), int(target), dtype=torch.long)
    if isinstance(target, torch.Tensor):
        t = target.detach()
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise TypeError(f"{name}: token ids must be an integer tensor, got dtype {t.dtype}")
        t = t.to("cpu", torch.long)
    elif type(target).__module__ == "numpy" and hasattr(target, "dtype") and hasattr(target, "shape"):
        if target.dtype.kind not in "iu":
            raise TypeError(f"{name}: token ids must be an integer array, got dtype {target.dtype}")
        for v in (target.min(initial=0), target.max(initial=0)):
            if not -(2**63) <= int(v) < 2**63:
                raise ValueError(f"{name}: token id {int(v)} is out of range for a token id")
        t = torch.as_tensor(target.astype("int64"))
    elif isinstance(target, (list, tuple)):
        flat = [v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v for v in target]
        bad = [v for v in flat if not is_int(v) and not (isinstance(v, torch.Tensor) and v.numel() == 1)]
        if bad or any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.dtype == torch.bool) for v in flat):
            raise TypeError(f"{name}: token ids must be integers, got {target!r}")
        for v in flat:
            if not -(2**63) <= int(v) < 2**63:
                raise ValueError(f"{name}: token id {int(v)} is out of range for a token id")
        t = torch.tensor([int(v) for v in flat], dtype=torch.long)
    else:
        raise TypeError(f"{name}: token ids must be integers, got {type(target).__name__}")
    if t.dim() == 0:
        return t.expand(batch).clone()
    if t.dim() == 2 and t.shape[1] == 1:
        t = t[:, 0]
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(
            f"{name}: expected one token id per batch row, shape ({batch},) or ({batch}, 1), got shape {tuple(t.shape)}"
        )
    return t


def first_real(mask: Optional[torch.Tensor], batch: int, device) -> torch.Tensor:
    """Index (batch,) of each row's first real token (0 without a mask)."""
    if mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    return mask.to(torch.long).argmax(1).to(device)
