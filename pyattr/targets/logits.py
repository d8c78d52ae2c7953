"""Logit targets: a token's (or a class's) logit and logit differences, at each row's own
positions; the positions the language-model head must run at."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from pyattr.targets.base import (
    Forward,
    Target,
    check_position,
    is_int,
    real_positions,
    token_ids,
)


def _logits(output) -> torch.Tensor:
    """The model's logits: next-token (batch, seq, vocab) or one per class (batch, classes)."""
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, torch.Tensor):
        logits = output
    if logits is None or logits.dim() not in (2, 3):
        encoder = ""
        if getattr(output, "last_hidden_state", None) is not None:  # a sentence encoder, say
            encoder = ("; this model returns hidden states (an encoder): pyattr.sentence_similarity(model, text_a, "
                       "text_b) explains a sentence pair's cosine similarity, target=pyattr.targets.Cosine(reference) "
                       "one sentence against a fixed embedding (a query)")
        raise ValueError(
            "target: a token or class id needs a model that returns logits of shape (batch, seq, vocab) "
            "or (batch, classes); for other outputs pass ModuleOutput(...) or a callable target" + encoder
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


def _positions(position: int, fwd: Forward) -> torch.Tensor:
    """Per row, the index along the sequence of ``position``: ``-1`` each row's last real
    token, ``p ≥ 0`` each row's ``p``-th real token (counted along the attention mask from
    0), so a padded row reads the token the row alone reads at ``p``."""
    ids, mask = fwd.input_ids, fwd.attention_mask
    batch, seq = ids.shape
    if mask is None:
        if not -seq <= position < seq:
            raise ValueError(
                f"target: position {position} is outside the sequence of length {seq} (use -1 for the last real token)")
        return torch.full((batch,), position % seq, dtype=torch.long, device=ids.device)
    return real_positions(position, mask, "target: position").to(ids.device)


def _kept_index(logits, pos, fwd: Forward):
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
    if not targets or not all(isinstance(t, (Logit, LogitDiff, LogProb)) for t in targets):
        return None
    fwd = Forward(None, input_ids, attention_mask, {})
    pos = torch.cat([_positions(t.position, fwd) for t in targets])
    return torch.unique(pos)


def _in_vocab(tid: torch.Tensor, vocab: int, name: str) -> torch.Tensor:
    """``tid`` where every id is one of the ``vocab`` logits (a negative id would index from
    the end, silently another token)."""
    if bool(((tid < 0) | (tid >= vocab)).any()):
        raise ValueError(f"{name}: token ids must be in [0, {vocab}), got {tid.tolist()}")
    return tid


def _gather_logit(logits, pos, tid, name="target"):
    tid = _in_vocab(tid.to(logits.device), logits.shape[-1], name)
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
            mask, ``-2`` the one before it, and so on; ``p ≥ 0`` each row's ``p``-th real
            token (position ``p`` of the row alone). A row with too few real tokens raises
            ValueError.
    """

    def __init__(self, token_id=None, position: int = -1):
        self.token_id = token_id
        self.position = check_position(position)

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
        if self.token_id is None or is_int(self.token_id):
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
        self.position = check_position(position)

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


class LogProb(Target):
    """The log-probability of ``token_id`` at ``position``: ``log_softmax(logits)[token_id]``
    (``prob=True``: the probability itself). With ``contrast`` (a token id, or one per row),
    the difference to that token's log-probability (probability): inseq's contrastive
    target. ``token_id`` and ``position`` as in :class:`Logit` (``token_id`` required)."""

    def __init__(self, token_id, position: int = -1, contrast=None, prob: bool = False):
        if token_id is None:
            raise ValueError("target: LogProb needs a token id")
        self.token_id, self.contrast, self.prob = token_id, contrast, bool(prob)
        self.position = check_position(position)

    def __repr__(self):
        name = "Prob" if self.prob else "LogProb"
        return f"{name}({self.token_id!r}, position={self.position}, contrast={self.contrast!r})"

    def value(self, fwd):
        logits = _logits(fwd.output)
        if logits.dim() != 3:
            raise ValueError("target: LogProb reads next-token logits of shape (batch, seq, vocab)")
        pos = _kept_index(logits, _positions(self.position, fwd), fwd)
        rows = torch.arange(logits.shape[0], device=logits.device)
        # float32 at least, float64 for a float64 model (a float64 oracle compares to 1e-10)
        picked = logits[rows, pos.to(logits.device)]
        lp = torch.log_softmax(picked.to(torch.promote_types(picked.dtype, torch.float32)), dim=-1)
        out = lp.exp() if self.prob else lp
        tid = _in_vocab(token_ids(self.token_id, logits.shape[0]).to(logits.device), out.shape[-1], "target")
        v = out[rows, tid]
        if self.contrast is not None:
            cid = token_ids(self.contrast, logits.shape[0], "contrast").to(logits.device)
            v = v - out[rows, _in_vocab(cid, out.shape[-1], "contrast")]
        return v.to(logits.dtype), tid

    def rows(self, index, batch):
        pick = lambda v: v if v is None or is_int(v) else token_ids(v, batch)[index.cpu()]  # noqa: E731
        return LogProb(pick(self.token_id), self.position, pick(self.contrast), self.prob)
