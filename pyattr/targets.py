"""What an attribution explains: one target vocabulary for every method.

A target turns a forward pass into the explained value, one per batch row
(``Tensor[batch]``): tdhook's ``init_attr_targets``, Captum's ``target`` and neuron
selector. Every method (:func:`pyattr.relevance`, :func:`pyattr.layer_relevance`,
:func:`pyattr.integrated_gradients`) accepts:

- ``Logit(token_id, position=-1)``: a next-token logit; ``LogitDiff(a, b)``: ``logit[a] − logit[b]``;
- ``ModuleOutput(path, select=None)``: a module's output (a neuron with ``select``);
- ``Cosine(reference)``: the cosine similarity of the mean-pooled sentence embedding with a
  fixed reference embedding (sentence-transformers models);
- ``None`` (the top-1 next token at each row's last real position), a token id, one id
  per row (list / 1-d tensor / ``(batch, 1)``), or any callable ``f(output) → Tensor[batch]``
  or ``Tensor[]``;
- k targets per row: a ``LongTensor[batch, k]`` or a list of k target objects.

Positions count each row's real tokens under the attention mask, so a padded row explains
the token the row alone explains: ``-1`` is each row's last real token, ``p ≥ 0`` each
row's ``p``-th real token (the absolute position ``p`` for unpadded and right-padded rows).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch

__all__ = ["Cosine", "Logit", "LogitDiff", "ModuleOutput", "Target"]


@dataclass
class _Forward:
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

    def value(self, fwd: _Forward) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
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


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _logits(output) -> torch.Tensor:
    """The model's logits: next-token (batch, seq, vocab) or one per class (batch, classes)."""
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, torch.Tensor):
        logits = output
    if logits is None or logits.dim() not in (2, 3):
        raise ValueError(
            "target: a token or class id needs a model that returns logits of shape (batch, seq, vocab) "
            "or (batch, classes); for other outputs pass ModuleOutput(...) or a callable target"
        )
    return logits


def _class_logits(logits: torch.Tensor, position: int) -> bool:
    """Classification logits (batch, classes) have no position: only the default -1."""
    if logits.dim() != 2:
        return False
    if position != -1:
        raise ValueError(
            f"target: position {position} given, but the model returns one logit per class (batch, classes), "
            "which has no positions; leave position at -1"
        )
    return True


def _positions(position: int, fwd: _Forward) -> torch.Tensor:
    """Per row, the index along the sequence of ``position``: ``-1`` each row's last real
    token, ``p ≥ 0`` each row's ``p``-th real token (counted along the attention mask from
    0), so a padded row reads the token the row alone reads at ``p``."""
    ids, mask = fwd.input_ids, fwd.attention_mask
    batch, seq = ids.shape
    if mask is None:
        if position == -1:
            return torch.full((batch,), seq - 1, dtype=torch.long, device=ids.device)
        if not 0 <= position < seq:
            raise ValueError(
                f"target: position {position} is outside the sequence of length {seq} (use -1 for the last real token)")
        return torch.full((batch,), position, dtype=torch.long, device=ids.device)
    return real_positions(position, mask, "target: position").to(ids.device)


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


def _check_position(position) -> int:
    if not _is_int(position) or int(position) < -1:
        raise ValueError(f"target: position must be an int ≥ 0, or -1 for each row's last real token; got {position!r}")
    return int(position)


def token_ids(target, batch: int, name: str = "target") -> torch.Tensor:
    """Token ids in any integer form → ``LongTensor[batch]`` (on the CPU).

    Accepted: an int or NumPy integer, a 0-d integer tensor or array (one id for every
    row); a list / tuple, 1-d integer tensor or array with one id per row; a ``(batch, 1)``
    tensor, array or nested list.
    """
    if _is_int(target):
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
        bad = [v for v in flat if not _is_int(v) and not (isinstance(v, torch.Tensor) and v.numel() == 1)]
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


def _kept_index(logits, pos, fwd: _Forward):
    """Index along the logits' sequence dimension of absolute positions ``pos``."""
    kept = fwd.kept
    if kept is not None and logits.shape[1] == kept.numel():
        return torch.searchsorted(kept.to(pos.device), pos)
    return pos


def logit_positions(targets: Sequence["Target"], input_ids: torch.Tensor, attention_mask) -> Optional[torch.Tensor]:
    """The positions whose logits the targets read (sorted, unique), when every target is
    a :class:`Logit` / :class:`LogitDiff`; None otherwise. Passed to the model as
    ``logits_to_keep``, the language-model head then runs at these positions only instead
    of at every position (the head's matmul over a large vocabulary dominates a relevance
    pass on long inputs, and its backward for k targets even more)."""
    if not targets or not all(isinstance(t, (Logit, LogitDiff)) for t in targets):
        return None
    fwd = _Forward(None, input_ids, attention_mask, {})
    pos = torch.cat([_positions(t.position, fwd) for t in targets])
    return torch.unique(pos)


def _gather_logit(logits, pos, tid, name="target"):
    vocab = logits.shape[-1]
    tid = tid.to(logits.device)
    if bool(((tid < 0) | (tid >= vocab)).any()):
        raise ValueError(f"{name}: token ids must be in [0, {vocab}), got {tid.tolist()}")
    rows = torch.arange(logits.shape[0], device=logits.device)
    return logits[rows, pos.to(logits.device), tid]


def _gather_class(logits, cid):
    classes = logits.shape[-1]
    cid = cid.to(logits.device)
    if bool(((cid < 0) | (cid >= classes)).any()):
        raise ValueError(f"target: class ids must be in [0, {classes}), got {cid.tolist()}")
    return logits[torch.arange(logits.shape[0], device=logits.device), cid]


class Logit(Target):
    """The logit of ``token_id`` at ``position``: ``output.logits[row, position, token_id]``;
    for a classifier's logits (batch, classes), the class logit ``output.logits[row, token_id]``.

    Args:
        token_id: an int (every row), one id per row (list / 1-d tensor), or ``None`` for
            the top-1 token at that position (chosen at the real input and kept fixed for
            baselines and integration steps).
        position (int): ``-1`` (default) each row's last real token under the attention
            mask; ``p ≥ 0`` each row's ``p``-th real token (position ``p`` of the row
            alone; a row with ``p`` or fewer real tokens raises ValueError).
    """

    def __init__(self, token_id=None, position: int = -1):
        self.token_id = token_id
        self.position = _check_position(position)

    def __repr__(self):
        return f"Logit({self.token_id!r}, position={self.position})"

    def value(self, fwd):
        logits = _logits(fwd.output)
        rows = torch.arange(logits.shape[0], device=logits.device)
        if _class_logits(logits, self.position):
            tid = logits.detach().argmax(-1) if self.token_id is None else token_ids(self.token_id, logits.shape[0])
            return _gather_class(logits, tid), tid.to(logits.device)
        pos = _kept_index(logits, _positions(self.position, fwd), fwd)
        if self.token_id is None:
            tid = logits[rows, pos.to(logits.device)].detach().argmax(-1)
        else:
            tid = token_ids(self.token_id, logits.shape[0])
        return _gather_logit(logits, pos, tid), tid.to(logits.device)

    def fixed(self, token_ids):
        return self if self.token_id is not None or token_ids is None else Logit(token_ids, self.position)

    def rows(self, index, batch):
        if self.token_id is None or _is_int(self.token_id):
            return self
        return Logit(token_ids(self.token_id, batch)[index.cpu()], self.position)


class LogitDiff(Target):
    """``logit[a] − logit[b]`` at ``position`` (the IOI-style logit difference).

    ``a`` and ``b`` are token ids (an int, or one per row); ``position`` as in :class:`Logit`.
    ``target_ids`` of the result are ``a``.
    """

    def __init__(self, a, b, position: int = -1):
        if a is None or b is None:
            raise ValueError("target: LogitDiff needs two token ids a and b")
        self.a, self.b = a, b
        self.position = _check_position(position)

    def __repr__(self):
        return f"LogitDiff({self.a!r}, {self.b!r}, position={self.position})"

    def value(self, fwd):
        logits = _logits(fwd.output)
        ta = token_ids(self.a, logits.shape[0], "target (LogitDiff a)")
        tb = token_ids(self.b, logits.shape[0], "target (LogitDiff b)")
        if _class_logits(logits, self.position):
            return _gather_class(logits, ta) - _gather_class(logits, tb), ta.to(logits.device)
        pos = _kept_index(logits, _positions(self.position, fwd), fwd)
        return _gather_logit(logits, pos, ta) - _gather_logit(logits, pos, tb), ta.to(logits.device)

    def rows(self, index, batch):
        ia = token_ids(self.a, batch, "target (LogitDiff a)")[index.cpu()]
        ib = token_ids(self.b, batch, "target (LogitDiff b)")[index.cpu()]
        return LogitDiff(ia, ib, self.position)


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
        if not (select is None or callable(select) or _is_int(select) or (
            isinstance(select, tuple) and all(_is_int(s) or isinstance(s, slice) for s in select)
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
            idx = (self.select,) if _is_int(self.select) else self.select
            if len(idx) > out.dim() - 1:
                raise ValueError(
                    f"target: select {self.select!r} indexes {len(idx)} dimensions after the batch, but "
                    f"{self.path!r} outputs shape {tuple(out.shape)}"
                )
            mask = fwd.attention_mask
            by_row = mask is not None and out.dim() >= 2 and tuple(out.shape[:2]) == tuple(mask.shape) \
                and not bool(mask.bool().all())
            try:
                if by_row and _is_int(idx[0]):
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
            first = torch.zeros(h.shape[0], dtype=torch.long, device=h.device) if m is None else \
                m.to(device=h.device, dtype=torch.long).argmax(1)
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


class _Callable(Target):
    def __init__(self, fn):
        self.fn = fn

    def __repr__(self):
        return f"{getattr(self.fn, '__name__', 'callable')}(output)"

    def value(self, fwd):
        t = self.fn(fwd.output)
        batch = fwd.input_ids.shape[0]
        if not isinstance(t, torch.Tensor) or t.dim() > 1 or (t.dim() == 1 and t.shape[0] != batch):
            raise ValueError("target: the callable must return a scalar tensor or one value per batch row")
        if not t.is_floating_point():
            raise TypeError(
                f"target: the callable returned a {t.dtype} tensor; it must return a floating value "
                "computed from the output (e.g. out.logits[:, -1, token_id]), not ids or a comparison"
            )
        if torch.is_grad_enabled() and not t.requires_grad:
            raise ValueError(
                "target: the callable's value does not depend on the model output through "
                "differentiable operations (detached, .item(), argmax, …), so every attribution would be 0"
            )
        return t, None


def normalize(target, batch: int) -> Tuple[List[Target], bool]:
    """``(targets, several)``: the target objects and whether the call explains k of them
    (results gain a leading k dimension)."""
    if isinstance(target, Target):
        return [target], False
    if target is None:
        return [Logit(None)], False
    if isinstance(target, (bool, str, bytes, float)):
        raise TypeError(f"target must be None, a token id, a list of ids, a target object or a callable, got {type(target).__name__}")
    if isinstance(target, (list, tuple)) and target and all(isinstance(t, Target) or (callable(t) and not isinstance(t, torch.Tensor)) for t in target):
        return [t if isinstance(t, Target) else _Callable(t) for t in target], True
    if isinstance(target, (list, tuple)) and any(isinstance(t, Target) for t in target):
        raise TypeError("target: a list of targets must hold only target objects or callables")
    if callable(target) and not isinstance(target, torch.Tensor):
        return [_Callable(target)], False
    if isinstance(target, torch.Tensor) and target.dim() == 2 and target.shape[1] > 1:
        token_ids(target[:, 0], batch)  # dtype and batch size
        t = target.detach().to("cpu", torch.long)
        return [Logit(t[:, j].clone()) for j in range(t.shape[1])], True
    if isinstance(target, (list, tuple)) and target and all(isinstance(r, (list, tuple)) and len(r) > 1 for r in target):
        return normalize(torch.tensor(target), batch)
    if type(target).__module__ == "numpy" and getattr(target, "ndim", 0) == 2 and target.shape[1] > 1:
        return normalize(torch.as_tensor(target), batch)
    if not (_is_int(target) or isinstance(target, (Sequence, torch.Tensor)) or type(target).__module__ == "numpy"):
        raise TypeError(f"target must be None, a token id, a list of ids, a target object or a callable, got {type(target).__name__}")
    token_ids(target, batch)  # raise now, before any forward pass
    return [Logit(target)], False


def module_paths(targets: Sequence[Target]) -> List[str]:
    out: List[str] = []
    for t in targets:
        out.extend(p for p in t.paths if p not in out)
    return out
