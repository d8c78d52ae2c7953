"""Gradient checkpointing inside a rule scope: a checkpointed block recomputes its forward
in the backward, and must do so with the rules its forward ran with."""

from __future__ import annotations

import contextlib
from typing import Callable

from torch import nn

from pyattr._function import first_order, first_order_saves
from pyattr.integration.attention import exactly as attention_exactly
from pyattr.integration.attention import attention_mode
from pyattr.integration.install import (
    recomputing,
    snapshot,
)

CHECKPOINT_INNER = "_pyattr_checkpoint_inner"


_SCOPES = "_pyattr_checkpoint_scopes"


def _block_of(run_function, owner: nn.Module) -> nn.Module:
    """The module a checkpointed function runs: ``partial(layer.__call__)`` or
    ``block.__call__`` in Hugging Face's models, else the module that checkpoints."""
    fn = getattr(run_function, "func", run_function)
    mod = getattr(fn, "__self__", None)
    return mod if isinstance(mod, nn.Module) else owner


def bind_checkpoint(fn: Callable, owner: nn.Module) -> Callable:
    def checkpointed(run_function, *args, **kwargs):
        mods = list(_block_of(run_function, owner).modules())
        snap = snapshot(mods)  # the rules of this forward, whatever holds them
        modes = {id(m): attention_mode(m) for m in mods}
        lean = first_order()  # what the forward's norms saved, which the recomputation must match
        first = [True]

        def run(*a, **k):
            if first[0]:
                return run_function(*a, **k)
            with recomputing(mods, snap), attention_exactly(mods, modes), first_order_saves(lean):
                return run_function(*a, **k)

        try:
            return fn(run, *args, **kwargs)
        finally:
            first[0] = False

    setattr(checkpointed, CHECKPOINT_INNER, fn)
    return checkpointed


def wrap_checkpoint_functions(model: nn.Module) -> None:
    for mod in model.modules():
        fn = mod.__dict__.get("_gradient_checkpointing_func")
        if callable(fn) and not hasattr(fn, CHECKPOINT_INNER):
            mod.__dict__["_gradient_checkpointing_func"] = bind_checkpoint(fn, mod)


@contextlib.contextmanager
def checkpoints_bound(model: nn.Module):
    """Activation-checkpoint recomputations run with the rules of their forward.

    Hugging Face gradient checkpointing (``model.gradient_checkpointing_enable()``) runs
    a block's forward again during the backward. Without care, a backward that starts
    after the scope ended would recompute the block without the rules (a mixture of rule
    and plain gradients when reentrant; a ``CheckpointError`` when not), and one run in
    another scope would recompute with that scope's rules. While any scope is open on
    the model, each block's ``_gradient_checkpointing_func`` (also one set by
    ``gradient_checkpointing_enable()`` inside the scope) is wrapped so that it records
    the rules active at the forward and reinstalls exactly those for the recomputation.
    A block checkpointed outside every scope recomputes without rules even inside one
    (see ``patching._unbound_recomputation``).
    """
    count = model.__dict__.get(_SCOPES, 0)
    model.__dict__[_SCOPES] = count + 1
    wrap_checkpoint_functions(model)
    hook = model.register_forward_pre_hook(lambda mod, args: wrap_checkpoint_functions(model))
    try:
        yield
    finally:
        hook.remove()
        model.__dict__[_SCOPES] -= 1
        if model.__dict__[_SCOPES] == 0:
            del model.__dict__[_SCOPES]
            for mod in model.modules():
                fn = mod.__dict__.get("_gradient_checkpointing_func")
                if hasattr(fn, CHECKPOINT_INNER):
                    mod.__dict__["_gradient_checkpointing_func"] = getattr(fn, CHECKPOINT_INNER)
