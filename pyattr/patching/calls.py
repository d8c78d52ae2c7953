"""A module's calls recorded in one forward and re-run on chosen rows: what AtP*'s pattern
recomputation (:mod:`pyattr.patching.atp_star`) and blockwise patching
(:mod:`pyattr.patching.blockwise`) do with attention modules and blocks."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

import pyattr.methods._core as core

_CACHE_KWARGS = ("past_key_value", "past_key_values", "layer_past", "cache")


def is_cache(name: str, value) -> bool:
    """A key/value cache argument: re-running the module must not append to it."""
    return name in _CACHE_KWARGS or any(c.__name__.endswith("Cache") for c in type(value).__mro__)


def first_input(args, kwargs) -> Optional[torch.Tensor]:
    """The call's first tensor argument (its hidden states)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for key in core.ARG_KEYS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    return None


def replace_input(args, kwargs, x, caller: str):
    """``(args, kwargs)`` with the first tensor argument replaced by ``x``."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return (*args[:i], x, *args[i + 1:]), kwargs
    for key in core.ARG_KEYS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return args, {**kwargs, key: x}
    raise RuntimeError(f"{caller}: the module's input tensor was not found")


def first_output(out):
    """A module's output tensor: the output itself or its tuple's first element (a block's
    hidden states, an MLP's output beside router logits)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise RuntimeError(f"method='blockwise': a block returned {type(out).__name__}, not a tensor or a tuple "
                       "starting with one")


def with_first_output(out, x: torch.Tensor):
    """``out`` with its output tensor (:func:`first_output`) replaced by ``x``."""
    if isinstance(out, torch.Tensor):
        return x
    return type(out)((x, *out[1:])) if isinstance(out, tuple) else [x, *out[1:]]


@contextlib.contextmanager
def hooks_around(module: nn.Module, pre, post) -> Iterator[None]:
    """While open, ``pre`` (a forward pre-hook with kwargs, after those registered earlier)
    and ``post`` (a forward hook with kwargs, before any other) on ``module``: what a cut of
    its input needs, the others seeing the input before and the output after it."""
    handles = [module.register_forward_pre_hook(pre, with_kwargs=True),
               module.register_forward_hook(post, with_kwargs=True, prepend=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def tensors(obj) -> Iterator[torch.Tensor]:
    """The tensors of a call argument (inside tuples and lists; not inside a cache)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)) and not is_cache("", obj):
        for o in obj:
            yield from tensors(o)


def select_rows(obj, idx: torch.Tensor, batch: int):
    """Per-row tensors of a recorded call (leading dimension ``batch``, dim ≥ 2) restricted to
    rows ``idx``; other values (positions, broadcast masks, flags) unchanged."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() >= 2 and obj.shape[0] == batch:
            return obj.detach()[idx.to(obj.device)]
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(select_rows(o, idx, batch) for o in obj)
    if isinstance(obj, list):
        return [select_rows(o, idx, batch) for o in obj]
    return obj


class RecordedCalls:
    """Per module: its call (args, kwargs), its input (first tensor, in the graph) and how
    often it ran; :meth:`output` keeps what a subclass needs of the output. ``prepend``: the
    recording pre-hook runs before any other (the input as the module receives it); ``copy``:
    the input is kept as a copy (a hook that changes it in place afterwards leaves it as
    received)."""

    caller = "patching"

    def __init__(self, modules: Sequence[nn.Module], prepend: bool = False, copy: bool = False):
        self.modules = list(modules)
        n = len(self.modules)
        self.prepend = prepend
        self.copy = copy
        self.calls: List[Optional[Tuple[tuple, dict]]] = [None] * n
        self.inputs: List[Optional[torch.Tensor]] = [None] * n
        self.count = [0] * n

    def output(self, i: int, out) -> None:
        """Keep what is needed of module ``i``'s output."""

    @contextlib.contextmanager
    def recording(self):
        handles = []
        for i, mod in enumerate(self.modules):
            def pre(m, args, kwargs, i=i):
                self.calls[i] = (args, kwargs)
                x = first_input(args, kwargs)
                self.inputs[i] = x.detach().clone() if self.copy and x is not None else x
                self.count[i] += 1

            def post(m, args, kwargs, out, i=i):
                self.output(i, out)

            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True, prepend=self.prepend))
            handles.append(mod.register_forward_hook(post, with_kwargs=True))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def rerun(self, i: int, idx: torch.Tensor, x: torch.Tensor, batch: int):
        """Module ``i`` on rows ``idx`` of its recorded call with input ``x``: its output."""
        args, kwargs = self.calls[i]
        args = select_rows(args, idx, batch)
        kwargs = {k: (None if is_cache(k, v) else select_rows(v, idx, batch)) for k, v in kwargs.items()}
        args, kwargs = replace_input(args, kwargs, x, self.caller)
        return self.modules[i](*args, **kwargs)
