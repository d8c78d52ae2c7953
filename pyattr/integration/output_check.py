"""Whether a forward hook's replacement of a rule module's output still takes the rule's
gradient.

A rule module's backward lives in its output's autograd node. A hook that returns a new
output is harmless where the gradient reaching the module's inputs through the new value
still passes that node: a copy or any function of the output (Captum's layer methods return
``output.clone()``), or a new leaf (an interpolated activation, Captum's layer integrated
gradients: nothing upstream gets a gradient through it, so there is no rule to miss). It
bypasses the rule where the new value reaches the module's inputs by another path (the
output recomputed from the input with plain operations), which the graph walk below finds.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

#: autograd nodes walked before a replacement is refused as undecided (fail closed)
WALK_LIMIT = 5000


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _input_nodes(inputs: Iterable[torch.Tensor]) -> set:
    """The autograd nodes gradient flows to from the module's inputs: their grad_fn, or the
    accumulator of an input leaf that requires grad."""
    nodes = set()
    for t in inputs:
        if not t.requires_grad:
            continue
        node = t.grad_fn
        if node is None:
            node = t.view_as(t).grad_fn.next_functions[0][0]  # the leaf's AccumulateGrad
        nodes.add(node)
    return nodes


class Output:
    """What the check keeps of a rule module's output: per tensor its ``id`` and its autograd
    node (the tensor itself may be gone by the time the hooks run: a hook that returns a new
    value drops the last reference to it), per other value the value."""

    __slots__ = ("tensor", "items")

    def __init__(self, out):
        self.tensor = isinstance(out, torch.Tensor)
        self.items = [_item(out)] if self.tensor else (
            [_item(v) for v in out] if isinstance(out, (tuple, list)) else None)


def _item(v):
    return (True, id(v), v.grad_fn) if isinstance(v, torch.Tensor) else (False, id(v), None)


def _reaches_inputs(new: torch.Tensor, stop, inputs: set) -> Optional[bool]:
    """Whether ``new``'s graph reaches an input node without passing the node ``stop``;
    None: more than :data:`WALK_LIMIT` nodes."""
    seen, todo = set(), [new.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen or node is stop:
            continue
        if node in inputs:
            return True
        seen.add(node)
        if len(seen) > WALK_LIMIT:
            return None
        todo.extend(n for n, _ in node.next_functions)
    return False


def takes_rule_gradient(new, old: Output, args, kwargs) -> bool:
    """Whether the replacement ``new`` of the output ``old`` (the module called with ``args``
    and ``kwargs``) leaves the rule's backward on every path to the inputs: the same
    structure, each tensor the same object, one that records no gradient, or one whose
    graph meets the inputs only through the old output's node."""
    if not torch.is_grad_enabled():
        return True  # nothing is recorded: no backward to miss the rule
    if old.items is None or isinstance(new, torch.Tensor) != old.tensor:
        return False
    news = [new] if old.tensor else (list(new) if isinstance(new, (tuple, list)) else None)
    if news is None or len(news) != len(old.items):
        return False
    inputs = None
    for n, (was_tensor, ident, node) in zip(news, old.items):
        if id(n) == ident:
            continue
        if not was_tensor or not isinstance(n, torch.Tensor):
            return False
        if not n.requires_grad or n.grad_fn is None:
            continue  # a constant or a new leaf: no gradient reaches the module through it
        if node is None:
            return False
        if inputs is None:
            inputs = _input_nodes(_tensors(args) + _tensors(kwargs))
        if _reaches_inputs(n, node, inputs) is not False:
            return False
    return True
