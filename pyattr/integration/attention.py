"""Frozen attention in Hugging Face models: the attention core of the modules a scope puts
under the AH-rule runs as :class:`pyattr.ops.attention.FrozenAttentionFunction`.

The seam is the call every supported architecture makes,
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)``:
while a scope is open, the ``"sdpa"`` entry of that registry and the modeling file's
``eager_attention_forward`` are wrapped. The wrapper hands every call through unchanged
except those of a registered attention module with gradient recording on; those run the
same native call as the forward of the frozen function, whose backward is ``dV = Pᵀ·dO``.

Correctness never depends on the wrapper being reached: the scope already detaches q and k
(or scales their gradient by 0), so a call that goes native (flash or flex attention, a
model with its own attention registry, dropout, sinks, a position bias) gives the same
gradient, only with the native backward's extra work.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch
from torch import nn

from pyattr._function import refuse_forward_mode
from pyattr.integration.errors import RelevanceRuleConflictError
from pyattr.integration.install import ONE_THREAD, _in_backward, _unbound_recomputation, hold, unhold
from pyattr.ops.attention import AttnLRPAttentionFunction, FrozenAttentionFunction, held_pattern_output
from pyattr.ops.sdpa_rows import sparse_rows_sdpa

_REGISTERED: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
# attention modules under AttnLRP whose eager core runs AttnLRPAttentionFunction
_RECOMPUTED: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
# registered modules set aside while a checkpointed block recomputes with other rules
_SUSPENDED: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
_SUSPENDED_ATTNLRP: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
# the threads whose scopes registered a module (thread -> registrations; the object: idents are reused): a module is
# shared by every thread, its attention rule is not
_THREADS: "weakref.WeakKeyDictionary[nn.Module, Dict[threading.Thread, int]]" = weakref.WeakKeyDictionary()
# (holder id, name) -> [holder, name, original, had_local, count]
_PATCHES: Dict[Tuple[int, str], list] = {}
# keyword arguments that change the attention's math beyond q, k, v, mask, scale, softcap
_UNHANDLED = ("s_aux", "sinks", "position_bias", "head_mask", "alibi", "attention_bias")

_bypass = False  # tests: run the native backward for comparison


@contextlib.contextmanager
def native_attention_backward() -> Iterator[None]:
    """Inside the block, registered modules run the native attention backward (for
    comparisons: the gradient is the same, only the work differs)."""
    global _bypass
    old, _bypass = _bypass, True
    try:
        yield
    finally:
        _bypass = old


def _spec(kind: str, module: nn.Module, query, key, mask, kwargs) -> Optional[tuple]:
    """``(scaling, softcap, causal, key, mask)`` of a call the frozen function can run, else None."""
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor) or query.dim() != 4 or key.dim() != 4:
        return None
    if mask is not None and not isinstance(mask, torch.Tensor):
        return None  # e.g. flex attention's BlockMask
    dropout = kwargs.get("dropout", 0.0)
    if not isinstance(dropout, (int, float)) or dropout != 0:
        return None
    if any(kwargs.get(name) is not None for name in _UNHANDLED):
        return None
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if not isinstance(scaling, (int, float)):
        return None
    softcap = kwargs.get("softcap")
    causal = False
    if kind == "sdpa":
        if softcap is not None:
            return None  # the native call raises for it
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        if not isinstance(is_causal, bool):
            return None
        causal = query.shape[2] > 1 and mask is None and is_causal
        if causal and key.shape[2] > query.shape[2]:
            key = key[:, :, : query.shape[2]]  # as the native sdpa call does
    elif softcap is not None and not isinstance(softcap, (int, float)):
        return None
    if query.shape[1] % key.shape[1] or query.shape[-1] != key.shape[-1]:
        return None
    return float(scaling), (None if softcap is None else float(softcap)), causal, key, mask


def _wrap(original, kind: str):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        frozen = is_frozen(module)
        if (frozen or is_attnlrp(module)) and torch.is_grad_enabled() and _other_thread(module):
            raise RelevanceRuleConflictError(
                f"the attention of {type(module).__name__} runs in a thread that opened no use_relevance_rules scope "
                f"on it, while a scope in another thread holds its attention rule; its gradient would silently "
                f"carry that rule. {ONE_THREAD}")
        # under AttnLRP only the eager core is replaced: its native backward keeps every
        # layer's (batch, heads, q_len, kv_len) pattern, sdpa's already recomputes blockwise
        recomputed = not frozen and kind == "eager" and is_attnlrp(module)
        if (kind == "sdpa" and not frozen and not args and not _bypass and torch.is_grad_enabled()
                and is_attnlrp(module) and not _unbound_recomputation() and not torch.compiler.is_compiling()):
            # sdpa's own backward, minus the query rows without gradient (a target at one
            # position leaves all but one row of the last block's dO at 0)
            with sparse_rows_sdpa():
                return original(module, query, key, value, attention_mask, **kwargs)
        if (args or _bypass or not (frozen or recomputed) or not torch.is_grad_enabled() or _unbound_recomputation()
                or not isinstance(value, torch.Tensor)):
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        if frozen and not value.requires_grad:
            return original(module, query, key, value, attention_mask, **kwargs)
        spec = _spec(kind, module, query, key, attention_mask, kwargs)
        if spec is None or (recomputed and (not isinstance(value, torch.Tensor) or value.dim() != 4
                                            or value.shape[:3] != key.shape[:3])):
            return original(module, query, key, value, attention_mask, **kwargs)
        scaling, softcap, causal, k_used, mask = spec

        def native():
            return original(module, query, key, value, attention_mask, **kwargs)

        mask = None if mask is None else mask.detach()
        if torch._C._are_functorch_transforms_active():
            # torch.func's transforms take Functions in setup_context form only: the same rules
            # in autograd ops (AttnLRP's core gradient is the plain one; the AH-rule's is P·v's
            # with the pattern a constant)
            refuse_forward_mode()
            out, weights = native()
            if frozen:
                out = held_pattern_output(out, query.detach(), k_used.detach(), value, mask, scaling, softcap, causal)
            return out, weights
        if frozen:
            out, weights = FrozenAttentionFunction.apply(
                value, query.detach(), k_used.detach(), mask, scaling, softcap, causal, native)
        else:
            out, weights = AttnLRPAttentionFunction.apply(
                query, key, value, mask, scaling, softcap, causal, k_used.shape[2], native)
        return out, (None if weights.numel() == 0 and weights.dim() == 1 else weights)

    attention.__wrapped__ = original
    attention._pyattr_frozen = True
    return attention


_PATCH_LOCK = threading.Lock()  # scopes opened and closed by several threads share _PATCHES


def _patch(holder, name: str, kind: str, mapping: bool) -> None:
    with _PATCH_LOCK:
        _patch_locked(holder, name, kind, mapping)


def _unpatch(holder, name: str, mapping: bool) -> None:
    with _PATCH_LOCK:
        _unpatch_locked(holder, name, mapping)


def _patch_locked(holder, name: str, kind: str, mapping: bool) -> None:
    key = (id(holder), name)
    entry = _PATCHES.get(key)
    if entry is not None:
        entry[4] += 1
        return
    if mapping:
        had_local = name in holder._local_mapping
        original = holder[name]
        holder[name] = _wrap(original, kind)
    else:
        had_local = True
        original = getattr(holder, name)
        setattr(holder, name, _wrap(original, kind))
    _PATCHES[key] = [holder, name, original, had_local, 1]


def _unpatch_locked(holder, name: str, mapping: bool) -> None:
    key = (id(holder), name)
    entry = _PATCHES[key]
    entry[4] -= 1
    if entry[4]:
        return
    del _PATCHES[key]
    _, _, original, had_local, _ = entry
    if mapping:
        if had_local:
            holder._local_mapping[name] = original
        else:
            holder._local_mapping.pop(name, None)
    else:
        setattr(holder, name, original)


def _seams(module: nn.Module):
    """``(holder, name, kind, is_mapping)`` of the attention functions ``module``'s modeling file calls."""
    src = sys.modules.get(type(module).__module__)
    out = []
    if src is None:
        return out
    if callable(getattr(src, "eager_attention_forward", None)):
        out.append((src, "eager_attention_forward", "eager", False))
    iface = getattr(src, "ALL_ATTENTION_FUNCTIONS", None)
    if iface is not None and hasattr(iface, "_local_mapping") and "sdpa" in iface:
        out.append((iface, "sdpa", "sdpa", True))
    return out


def _other_thread(module: nn.Module) -> bool:
    """Whether only other threads' scopes registered ``module`` (a recomputation during a
    backward, on whatever thread the backward runs, runs what its forward ran)."""
    if torch.compiler.is_compiling():  # the thread is not traced: compiled code runs in its caller's
        return False
    held = _THREADS.get(module)
    return bool(held) and threading.current_thread() not in held and not _in_backward()


def is_frozen(module: nn.Module) -> bool:
    return _REGISTERED.get(module, 0) > 0 and not _SUSPENDED.get(module, 0)


def is_attnlrp(module: nn.Module) -> bool:
    return _RECOMPUTED.get(module, 0) > 0 and not _SUSPENDED_ATTNLRP.get(module, 0)


def attention_mode(module: nn.Module) -> Optional[str]:
    """``"frozen"``, ``"attnlrp"`` or None: the core ``module``'s attention runs now (the
    frozen one wins where nested scopes registered both)."""
    return "frozen" if is_frozen(module) else "attnlrp" if is_attnlrp(module) else None


@contextlib.contextmanager
def exactly(modules: Iterable[nn.Module], modes: Dict[int, Optional[str]]) -> Iterator[None]:
    """For an activation-checkpoint recomputation: each of ``modules`` runs the attention
    core it ran during the block's forward (``modes``: ``id(module)`` → its
    :func:`attention_mode` then), whatever scope is open now, so the recomputation records
    the same graph as the forward did."""
    modules = list(modules)
    want = {id(m): modes.get(id(m)) for m in modules}
    add_frozen = [m for m in modules if want[id(m)] == "frozen" and not is_frozen(m)]
    add_attnlrp = [m for m in modules if want[id(m)] == "attnlrp" and not is_attnlrp(m)]
    drop = [(m, _SUSPENDED) for m in modules if want[id(m)] != "frozen" and is_frozen(m)]
    drop += [(m, _SUSPENDED_ATTNLRP) for m in modules if want[id(m)] is None and is_attnlrp(m)]
    for m, reg in drop:
        reg[m] = reg.get(m, 0) + 1
    try:
        with frozen_attention(add_frozen), attnlrp_attention(add_attnlrp):
            yield
    finally:
        for m, reg in drop:
            n = reg.get(m, 0) - 1
            if n > 0:
                reg[m] = n
            else:
                reg.pop(m, None)


@contextlib.contextmanager
def frozen_attention(modules: Iterable[nn.Module], registry=None) -> Iterator[None]:
    """Register ``modules`` (attention modules under the AH-rule) for the ``with`` block."""
    registry = _REGISTERED if registry is None else registry
    done = []
    me = threading.current_thread()
    try:
        for m in modules:
            if _other_thread(m):
                raise RelevanceRuleConflictError(
                    f"the attention of {type(m).__name__} carries an attention rule from a use_relevance_rules scope "
                    f"open in another thread; a scope here would run with it. {ONE_THREAD}")
            seams = _seams(m)
            for holder, name, kind, mapping in seams:
                _patch(holder, name, kind, mapping)
            registry[m] = registry.get(m, 0) + 1
            hold(_THREADS.setdefault(m, {}), me)
            done.append((m, seams))
        yield
    finally:
        for m, seams in reversed(done):
            n = registry.get(m, 0) - 1
            if n > 0:
                registry[m] = n
            else:
                registry.pop(m, None)
            unhold(_THREADS.get(m, {}), me)
            for holder, name, _, mapping in reversed(seams):
                _unpatch(holder, name, mapping)


def attnlrp_attention(modules: Iterable[nn.Module]):
    """Register ``modules`` (attention modules under AttnLRP) for the ``with`` block: their
    eager core runs :class:`AttnLRPAttentionFunction` (the same gradient, nothing quadratic
    saved)."""
    return frozen_attention(modules, _RECOMPUTED)
