"""Everything a method accepts as ``target`` turned into target objects (ids, lists, tensors,
callables, k targets per row), and the module paths they read."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from pyattr.targets.base import Target, is_int, token_ids
from pyattr.targets.logits import Logit


class _Callable(Target):
    def __init__(self, fn, per_row: bool = False):
        self.fn = fn
        self.per_row = per_row  # the rows are copies or subsets of the call's (levels, path points, patched runs)

    def __repr__(self):
        return f"{getattr(self.fn, '__name__', 'callable')}(output)"

    def rows(self, index, batch):
        return _Callable(self.fn, per_row=True)

    def value(self, fwd):
        t = self.fn(fwd.output)
        batch = fwd.input_ids.shape[0]
        if not isinstance(t, torch.Tensor) or t.dim() > 1 or (t.dim() == 1 and t.shape[0] != batch):
            raise ValueError("target: the callable must return a scalar tensor or one value per batch row")
        if self.per_row and t.dim() == 0 and batch > 1:
            # one value for a forward of several copies would be given to every copy
            raise ValueError("target: the callable returned one value for a forward of several rows; this method "
                             "runs copies of the rows (perturbed levels, path points, patched runs) in one forward, "
                             "so return one value per row (Tensor[batch], e.g. out.logits[:, -1, token_id])")
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
        raise TypeError(f"target must be None, a token id, a list of ids, a word (with tokenizer=), a target object or a "
                        f"callable, got {type(target).__name__}")
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
    if not (is_int(target) or isinstance(target, (Sequence, torch.Tensor)) or type(target).__module__ == "numpy"):
        raise TypeError(f"target must be None, a token id, a list of ids, a word (with tokenizer=), a target object or a "
                        f"callable, got {type(target).__name__}")
    token_ids(target, batch)  # raise now, before any forward pass
    return [Logit(target)], False


def module_paths(targets: Sequence[Target]) -> List[str]:
    out: List[str] = []
    for t in targets:
        out.extend(p for p in t.paths if p not in out)
    return out
