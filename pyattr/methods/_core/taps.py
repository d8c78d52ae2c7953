"""Reading and replacing a module's tensors during a forward: the one ``first_tensor``, the
one ``resolve_module``, and forward hooks that an activation checkpoint replays."""

from __future__ import annotations

import contextlib
import difflib
import weakref
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import torch
from torch import nn

import pyattr.architectures as A
from pyattr.integration.forwards import TAPPED
from pyattr.integration.install import _in_backward, state_of


def first_tensor(value):
    """The first tensor of a module's output or argument (tuples, lists, ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    return None


def _replace_first(value, new):
    if isinstance(value, torch.Tensor):
        return new
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        done, out = False, []
        for v in value:
            if not done and isinstance(v, torch.Tensor):
                out.append(new)
                done = True
            else:
                out.append(v)
        return tuple(out)
    if isinstance(value, Mapping) and hasattr(value, "__setitem__"):
        key = next(k for k, v in value.items() if isinstance(v, torch.Tensor))
        value[key] = new
        return value
    raise TypeError(f"cannot replace the first tensor of a {type(value).__name__}")


ARG_KEYS = ("hidden_states", "input", "x", "inputs_embeds")

# entry modules whose input holds streams appended after the tokens' (ProphetNet's decoder
# runs ``ngram`` predicting streams, each as long as the input, whose inputs hold no token):
# module -> the number of streams, the tokens' first. A tap on such an input sees the
# tokens' stream only; the rest passes through unchanged (constants of the parameters)
_STREAMS: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
# while :func:`stream_tails` is open: the appended streams of each tapped call, as leaves
_TAILS: List[List[torch.Tensor]] = []


def mark_entry_streams(model: nn.Module, arch, mod: nn.Module) -> None:
    """An entry ``mod`` whose input appends streams after the tokens' (``Arch.streams``:
    ProphetNet's n-gram predicting streams) is marked, so that every tap there sees the
    tokens' stream."""
    if arch.streams is None:
        return
    count = getattr(getattr(model, "config", None), arch.streams, None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"inputs: {type(model).__name__}'s config.{arch.streams} (the streams its entry appends) "
                         f"must be an int ≥ 0, got {count!r}")
    _STREAMS[mod] = 1 + count


@contextlib.contextmanager
def stream_tails() -> Iterator[List[torch.Tensor]]:
    """Collect the appended streams of the tapped entries (leaves, (batch, (n − 1)·seq,
    hidden)) in the order the forward taps them, so that their relevance can be read."""
    got: List[torch.Tensor] = []
    _TAILS.append(got)
    try:
        yield got
    finally:
        _TAILS.remove(got)


def streams_relevance(tails: List[torch.Tensor], grads, seq: int, dtype) -> Optional[torch.Tensor]:
    """Relevance (input × gradient, summed over hidden) of the appended streams of the last
    tapped call, ``(…, batch, streams, seq)`` in ``dtype``; None without streams. A stream no
    gradient reached holds 0."""
    if not tails:
        return None
    x, g = tails[-1].detach(), grads[-1]
    rel = (x.to(dtype) * (torch.zeros_like(x) if g is None else g).to(dtype)).sum(-1)
    return rel.reshape(*rel.shape[:-1], rel.shape[-1] // seq, seq)


def check_not_streams(entry: nn.Module, path: str, calls: List[torch.Tensor], seq: int, arg: str = "layers") -> None:
    """A module read per position inside a model whose ``entry`` appends streams (see
    ``_STREAMS``) holds every stream when its positions are the streams' total: ValueError,
    since its positions are not one per token."""
    n = _STREAMS.get(entry)
    if n is None or n == 1:
        return
    t = calls[0] if calls else None
    if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == n * seq:
        raise ValueError(f"{arg}: {path!r} holds {n} streams of {seq} positions (shape {tuple(t.shape)}: the tokens' "
                         f"stream and the {n - 1} the model appends, ProphetNet's predicting streams), not one position "
                         "per token; read the relevance of the tokens with pyattr.relevance (stream_relevance gives "
                         "the appended streams' share)")


def _on_tokens(module: nn.Module, fn):
    """``fn`` applied to the tokens' stream of a stream entry's input (see ``_STREAMS``)."""
    n = _STREAMS.get(module)
    if n is None:
        return fn

    def on_tokens(t):
        if t.dim() < 2 or t.shape[1] % n:
            raise ValueError(f"inputs: {type(module).__name__} expected {n} streams of equal length at the entry, got "
                             f"shape {tuple(t.shape)}")
        seq = t.shape[1] // n
        out = fn(t[:, :seq])
        if out is None:  # an observer: the input stays as it is
            return None
        tail = t[:, seq:]
        if _TAILS:  # only a tap that replaces the input makes the streams a leaf
            tail = tail.detach().requires_grad_(True)
            _TAILS[-1].append(tail)
        return torch.cat([out, tail], 1)

    return on_tokens


@contextlib.contextmanager
def tap(module: nn.Module, where: str, fn: Callable[[torch.Tensor], Optional[torch.Tensor]], once: bool = False):
    """Call ``fn(t)`` on the first tensor of ``module``'s input (``where="input"``) or
    output (``"output"``) at each call; a tensor it returns replaces ``t`` downstream.
    ``once``: only the first call.

    With ``once``, an activation-checkpoint recomputation during the backward, which calls
    the module again, gets back what the forward's calls got (the first call's tensor,
    ``fn`` not called again), so the recomputed block sees the replaced value too."""
    state = {"calls": 0, "first": None, "replays": 0}
    if where == "input":
        fn = _on_tokens(module, fn)

    def apply(t):
        if t is None:
            return None
        if once and state["calls"] and _in_backward():
            out = state["first"] if state["replays"] % state["calls"] == 0 else None
            state["replays"] += 1
            return out
        if once and state["calls"]:
            state["calls"] += 1
            return None
        out = fn(t)
        state["calls"] += 1
        if once:
            state["first"] = out
        return out

    if where == "input":

        def pre(mod, args, kwargs):
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    new = apply(a)
                    return None if new is None else ((*args[:i], new, *args[i + 1:]), kwargs)
            for key in ARG_KEYS:
                if isinstance(kwargs.get(key), torch.Tensor):
                    new = apply(kwargs[key])
                    return None if new is None else (args, {**kwargs, key: new})
            return None

        h = module.register_forward_pre_hook(pre, with_kwargs=True)
    else:

        def post(mod, args, out):
            new = apply(first_tensor(out))
            if new is None:
                return None
            replaced = _replace_first(out, new)
            rule = state_of(mod)
            if rule is not None and rule.expected_id() == id(out):
                # pyattr's own replacement of a rule module's output (a layer's interpolation,
                # a patched value): the method reads gradients at the new value, so the rule's
                # backward not reaching it is what it asks for; the scope's check lets it pass
                rule.replace_expected(replaced)
            return replaced

        h = module.register_forward_hook(post)
    module.__dict__[TAPPED] = module.__dict__.get(TAPPED, 0) + 1  # a rule that bypasses it says so
    try:
        yield state
    finally:
        h.remove()
        module.__dict__[TAPPED] -= 1
        if not module.__dict__[TAPPED]:
            del module.__dict__[TAPPED]


@contextlib.contextmanager
def taps(pairs: Sequence, fn_for) -> Iterator[None]:
    """Several :func:`tap` hooks at once: ``pairs`` of (module, where), ``fn_for(i)`` the hook body."""
    with contextlib.ExitStack() as stack:
        for i, (mod, where) in enumerate(pairs):
            stack.enter_context(tap(mod, where, fn_for(i)))
        yield


def resolve_module(model: nn.Module, path: str, arg: str, extra: Sequence[str] = ()) -> nn.Module:
    """``model.get_submodule(path)``, or a ValueError naming ``arg`` and the nearest paths
    (``extra``: other accepted names, such as shorthands, among the candidates)."""
    if not isinstance(path, str):
        raise TypeError(f"{arg}: module paths must be strings, got {type(path).__name__}")
    names = [n for n, _ in model.named_modules() if n] + list(extra)
    mod = A.get_submodule(model, path) if path else None
    if mod is None:
        near = difflib.get_close_matches(path, names, n=3, cutoff=0.5)
        hint = f"; nearest: {', '.join(near)}" if near else ""
        raise ValueError(f"{arg}: {type(model).__name__} has no module {path!r}{hint}")
    return mod


def record_modules(model: nn.Module, paths: Sequence[str], store: Dict[str, torch.Tensor]):
    """Forward hooks keeping each path's latest output (first tensor, in the graph)."""
    pairs = [(resolve_module(model, p, "target"), "output") for p in paths]

    def fn_for(i):
        def fn(t):
            store[paths[i]] = t
            return None

        return fn

    return taps(pairs, fn_for)


def rule_holds_output(module: nn.Module) -> bool:
    """``module`` carries the AH-rule's attention mount (a q or k projection, whose output the
    rule detaches): a value put in place of its output gets no gradient under the rule."""
    st = state_of(module)
    value = st.value("attention") if st is not None and st.active("attention") else None
    return isinstance(value, tuple) and value[0] == "frozen"
