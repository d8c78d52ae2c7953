"""Activation checkpointing inside a rule scope: a checkpointed block recomputes its forward
in the backward, and must do so with the rules its forward ran with.

Two ways in: Hugging Face's ``_gradient_checkpointing_func`` on each block (wrapped per model
while a scope is open on it, :func:`checkpoints_bound`), and every other call of
``torch.utils.checkpoint.checkpoint`` (a user's own, ``checkpoint_wrapper``, accelerate's and
FSDP's activation checkpointing): torch's two implementations are bound where they take the
function they will run again (:func:`bind_torch_checkpoint`)."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Dict, Iterable, List

from torch import nn

from pyattr._function import first_order, first_order_saves
from pyattr.integration.attention import exactly as attention_exactly
from pyattr.integration.attention import attention_mode
from pyattr.integration.install import (
    hold,
    recomputing,
    snapshot,
    state_of,
    unhold,
)

CHECKPOINT_INNER = "_pyattr_checkpoint_inner"
#: set on a function a recomputation runs with its forward's rules (never bound twice)
_BOUND = "_pyattr_checkpoint_bound"

_SCOPES = "_pyattr_checkpoint_scopes"
#: models with a rule scope open now, and the threads that opened them (thread -> scopes): a
#: checkpoint records the rules of the models its own thread has scopes on (another thread's
#: model is refused in this thread's forwards anyway, and must not be swapped under it)
_SCOPED: "weakref.WeakKeyDictionary[nn.Module, Dict[threading.Thread, int]]" = weakref.WeakKeyDictionary()
#: per thread, the modules of the recomputations running now: a checkpoint started inside one
#: (a checkpointed block inside a checkpointed model) records their rules, scope or none
_RECOMPUTING = threading.local()


def _block_of(run_function, owner: nn.Module) -> nn.Module:
    """The module a checkpointed function runs: ``partial(layer.__call__)`` or
    ``block.__call__`` in Hugging Face's models, else the module that checkpoints."""
    fn = getattr(run_function, "func", run_function)
    mod = getattr(fn, "__self__", None)
    return mod if isinstance(mod, nn.Module) else owner


def _scoped_modules() -> List[nn.Module]:
    """Every module of every model this thread has a scope open on, and of the recomputations
    this thread runs now."""
    me = threading.current_thread()
    found = {}
    for model, threads in list(_SCOPED.items()):
        if threads.get(me):
            for m in model.modules():
                found[id(m)] = m
    for mods in getattr(_RECOMPUTING, "stack", ()):
        for m in mods:
            found[id(m)] = m
    return list(found.values())


def _binds() -> bool:
    """Whether a checkpoint started now records rules: this thread has a scope open, or runs
    a recomputation."""
    me = threading.current_thread()
    return bool(getattr(_RECOMPUTING, "stack", None)) or any(t.get(me) for t in list(_SCOPED.values()))


def _rules(m: nn.Module):
    st = state_of(m)
    return (dict(st.values) if st is not None and st.counts else {}), attention_mode(m)


def bound_run(run_function: Callable, modules: Callable[[], Iterable[nn.Module]], forward_calls: int) -> Callable:
    """``run_function`` for a checkpoint: its first ``forward_calls`` calls (the forward) run as
    they are; every later one (a recomputation, during the backward) runs with exactly the rules
    and attention cores ``modules()`` held when this was called, whatever holds them then (the
    same scope, another one, none). ``modules`` is asked again at the recomputation, so a model
    a scope opened on in between is covered (its modules then run as they did: without rules)."""
    if getattr(run_function, _BOUND, False):
        return run_function
    mods = list(modules())
    rules = {id(m): _rules(m) for m in mods}
    snap = snapshot(mods)  # the rules of this forward, whatever holds them
    modes = {id(m): rules[id(m)][1] for m in mods}
    lean = first_order()  # what the forward's norms saved, which the recomputation must match
    calls = [0]

    def run(*a, **k):
        if calls[0] < forward_calls:
            calls[0] += 1
            return run_function(*a, **k)
        now = {id(m): m for m in mods}
        now.update((id(m), m) for m in modules())
        # only the modules whose rules changed since are swapped (none, for a backward inside
        # the scope of the forward); recomputing() still marks the recomputation as bound
        changed = [m for i, m in now.items() if _rules(m) != rules.get(i, ({}, None))]
        ids = {id(m) for m in changed}
        stack = _RECOMPUTING.__dict__.setdefault("stack", [])
        stack.append(mods)
        try:
            with recomputing(changed, [e for e in snap if id(e[0]) in ids]), \
                    attention_exactly(changed, modes), first_order_saves(lean):
                return run_function(*a, **k)
        finally:
            stack.pop()

    setattr(run, _BOUND, True)
    return run


def bind_checkpoint(fn: Callable, owner: nn.Module) -> Callable:
    def checkpointed(run_function, *args, **kwargs):
        mods = list(_block_of(run_function, owner).modules())
        return fn(bound_run(run_function, lambda: mods, 1), *args, **kwargs)

    setattr(checkpointed, CHECKPOINT_INNER, fn)
    return checkpointed


_torch_bound = [False]
#: the non-reentrant implementation's entry, by torch version (the function comes first in each)
_NON_REENTRANT = ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")


def bind_torch_checkpoint() -> bool:
    """Bind ``torch.utils.checkpoint.checkpoint`` however it was imported: torch's reentrant
    implementation (``CheckpointFunction``, whose forward runs the function once) and its
    non-reentrant one (the generator that keeps the function only for the recomputation) take
    their function through :func:`bound_run` where the calling thread has a scope open or runs
    a recomputation (elsewhere the function as it is: a recomputation of a forward that ran
    without rules runs without them). Done once per process; False where this torch has
    neither entry by these names (its checkpoints then recompute without rules, as before)."""
    if _torch_bound[0]:
        return True
    import torch.utils.checkpoint as tuc

    cls = getattr(tuc, "CheckpointFunction", None)
    forward = getattr(cls, "forward", None)
    gens = [(name, getattr(tuc, name)) for name in _NON_REENTRANT if callable(getattr(tuc, name, None))]
    if not callable(forward) or not gens:
        return False

    def reentrant_forward(ctx, run_function, *args):
        if _binds():
            run_function = bound_run(run_function, _scoped_modules, 1)
        return forward(ctx, run_function, *args)

    def non_reentrant(gen):
        def entry(fn, *args, **kwargs):
            if _binds():
                fn = bound_run(fn, _scoped_modules, 0)
            return gen(fn, *args, **kwargs)

        return entry

    cls.forward = staticmethod(reentrant_forward)
    for name, gen in gens:
        setattr(tuc, name, non_reentrant(gen))
    _torch_bound[0] = True
    return True


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
    bind_torch_checkpoint()
    me = hold(_SCOPED.setdefault(model, {}))
    wrap_checkpoint_functions(model)
    hook = model.register_forward_pre_hook(lambda mod, args: wrap_checkpoint_functions(model))
    try:
        yield
    finally:
        hook.remove()
        model.__dict__[_SCOPES] -= 1
        unhold(_SCOPED.get(model, {}), me)
        if not _SCOPED.get(model):
            _SCOPED.pop(model, None)
        if model.__dict__[_SCOPES] == 0:
            del model.__dict__[_SCOPES]
            for mod in model.modules():
                fn = mod.__dict__.get("_gradient_checkpointing_func")
                if hasattr(fn, CHECKPOINT_INNER):
                    mod.__dict__["_gradient_checkpointing_func"] = getattr(fn, CHECKPOINT_INNER)
