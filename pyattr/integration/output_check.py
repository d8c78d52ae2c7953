"""Whether a forward hook's replacement of a rule module's output still takes the rule's
gradient.

A rule module's backward lives in its output's autograd node. A hook that returns a new
output is harmless where the new value is a function of that output alone, with constants and
parameters (a copy, a scaled or steered copy: Captum's layer methods return
``output.clone()``), or a new leaf (an interpolated activation, Captum's layer integrated
gradients: nothing upstream gets a gradient through it, so there is no rule to miss). Every
other replacement is refused, fail closed: one whose graph reaches a node that existed before
the output (the module's input, what the input was made from, an earlier activation a hook
kept) could carry gradient to the model's inputs around the rule, as a norm recomputed from
the input would. Which nodes are new is read off autograd's own per-thread sequence numbers:
a node made after the output has a larger one.
"""

from __future__ import annotations

import torch
from torch import nn

#: autograd nodes walked before a replacement is refused as undecided (fail closed)
WALK_LIMIT = 5000


class Output:
    """What the check keeps of a rule module's output: per tensor its ``id`` and its autograd
    node (the tensor itself may be gone by the time the hooks run: a hook that returns a new
    value drops the last reference to it), per other value its ``id``."""

    __slots__ = ("tensor", "items")

    def __init__(self, out):
        self.tensor = isinstance(out, torch.Tensor)
        self.items = [_item(out)] if self.tensor else (
            [_item(v) for v in out] if isinstance(out, (tuple, list)) else None)


def _item(v):
    return (True, id(v), v.grad_fn) if isinstance(v, torch.Tensor) else (False, id(v), None)


def _of_output_only(new: torch.Tensor, stop) -> bool:
    """Whether ``new``'s graph, walked down to the output's node ``stop``, holds only nodes
    made after it and the accumulators of parameters."""
    after = stop._sequence_nr()
    seen, todo = set(), [new.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node is stop or node in seen:
            continue
        seen.add(node)
        if len(seen) > WALK_LIMIT:
            return False
        if type(node).__name__ == "AccumulateGrad":
            if not isinstance(getattr(node, "variable", None), nn.Parameter):
                return False  # a leaf the caller made: possibly the model's own input
            continue
        if node._sequence_nr() < after:
            return False  # made before the output: the input, or what it was made from
        todo.extend(n for n, _ in node.next_functions)
    return True


def takes_rule_gradient(new, old: Output) -> bool:
    """Whether the replacement ``new`` of the output ``old`` leaves the rule's backward on every
    path to the model's inputs: the same structure, each tensor the same object, one that
    records no gradient, or a function of the old output alone (:func:`_of_output_only`)."""
    if not torch.is_grad_enabled():
        return True  # nothing is recorded: no backward to miss the rule
    if old.items is None or isinstance(new, torch.Tensor) != old.tensor:
        return False
    news = [new] if old.tensor else (list(new) if isinstance(new, (tuple, list)) else None)
    if news is None or len(news) != len(old.items):
        return False
    for n, (was_tensor, ident, node) in zip(news, old.items):
        if id(n) == ident:
            continue
        if not was_tensor or not isinstance(n, torch.Tensor):
            return False
        if not n.requires_grad or n.grad_fn is None:
            continue  # a constant or a new leaf: no gradient reaches the module through it
        if node is None or not _of_output_only(n, node):
            return False
    return True
