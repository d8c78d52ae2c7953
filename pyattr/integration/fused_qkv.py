"""``generic=True`` on attention whose q/k/v projections are not separate modules: which
output columns of each projection are queries and keys, values, or neither — observed.

A model without a rule map may compute queries, keys and values with one fused projection
and split its output in a layout of its own (q | k | v, per head, per key-value group,
CodeGen's q | v | k per model-parallel chunk), or through low-rank chains (multi-head latent
attention: ``kv_a_proj`` → norm → ``kv_b_proj`` gives k and v, ``kv_a_proj`` also the
rotary key part). Rather than guess layouts from names, pyattr observes them on the
attention module itself: its call is captured once on the plan check's probe input and
replayed in float64 on a copy; each block of a projection's output columns (the greatest
common divisor of the module's head and rank sizes, else one column) is moved by +δ and
−δ, and the block is

- a **value** block where the attention output is linear in it (second difference
  ``f(+δ) + f(−δ) − 2 f(0)`` zero to 1e-7 of the first): the pattern does not depend on it;
- **pass-through** where it changes the input of another projection of the module (the
  low-rank chains' first step): the rules apply where that projection's columns are read;
- a **query or key** block otherwise: it moves the pattern through the softmax.

The output projection (the one whose output the module returns, else the last of several
to run, of the output's width) is left alone. The
AH-rule then scales the value columns' gradient by 1 and the query and key columns' by 0
(AttnLRP: ½ and ¼), pass-through columns keep theirs; a column wrongly taken as a query or
key would cut relevance, which the plan check measures and refuses.
"""

from __future__ import annotations

import copy
import math
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from pyattr.integration.plan_check import probe_inputs

#: relative size of the second difference below which a column block counts as linear
LINEAR_TOL = 1e-7
QK, VALUE, THROUGH = 0, 1, 2

_SEEN: "weakref.WeakKeyDictionary[nn.Module, Dict[tuple, object]]" = weakref.WeakKeyDictionary()


class _Captured(Exception):
    pass


def _to64(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_to64(v) for v in value)
    if isinstance(value, list):
        return [_to64(v) for v in value]
    if isinstance(value, dict):
        return {k: _to64(v) for k, v in value.items()}
    return value


def _first(out) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _takes_cache(model: nn.Module) -> bool:
    import inspect

    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _call_of(model: nn.Module, attn: nn.Module):
    """``(args, kwargs)`` of ``attn``'s first call in a probe forward of ``model``."""
    seen = []

    def pre(mod, args, kwargs):
        seen.append((args, kwargs))
        raise _Captured()

    handle = attn.register_forward_pre_hook(pre, with_kwargs=True)
    was = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            model(**probe_inputs(model), **({"use_cache": False} if _takes_cache(model) else {}))
    except _Captured:
        pass
    finally:
        handle.remove()
        for m, t in was.items():
            m.training = t
    return seen[0] if seen else None


_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def _bare_copy(attn: nn.Module) -> nn.Module:
    """A deep copy of ``attn`` without the hooks its modules carry (a user's hook must not
    run, or record, during the replay): they are set aside on the original while copying."""
    import collections

    kept = []
    for m in attn.modules():
        for h in _HOOKS:
            d = getattr(m, h, None)
            if isinstance(d, dict) and d:
                kept.append((m, h, d))
                setattr(m, h, collections.OrderedDict())
    try:
        return copy.deepcopy(attn)
    finally:
        for m, h, d in kept:
            setattr(m, h, d)


def projections(attn: nn.Module) -> List[str]:
    """The direct children of ``attn`` that project (a 2-D weight: ``nn.Linear``, GPT-2's Conv1D)."""
    return [n for n, c in attn.named_children()
            if isinstance(getattr(c, "weight", None), torch.Tensor) and c.weight.dim() == 2]


def _block(attn: nn.Module, widths: List[int]) -> int:
    """The column block: the greatest common divisor of the module's (and its config's)
    head and rank sizes that divides every projection's width, else 1."""
    sizes = []
    cfg = getattr(attn, "config", None)
    hidden = next((getattr(cfg, k) for k in ("hidden_size", "n_embd", "d_model") if isinstance(getattr(cfg, k, None), int)),
                  None)
    heads = next((getattr(o, k) for o in (attn, cfg) for k in ("num_heads", "n_head", "num_attention_heads")
                  if isinstance(getattr(o, k, None), int) and getattr(o, k) > 0), None)
    if hidden and heads and hidden % heads == 0:
        sizes.append(hidden // heads)  # the head width, where the module names no head_dim (OpenAI GPT)
    for obj in (attn, cfg):
        for k, v in vars(obj).items() if obj is not None else ():
            if isinstance(v, int) and not isinstance(v, bool) and v > 1 and k.endswith(
                    ("head_dim", "head_size", "rank", "attention_head_size")):
                sizes.append(v)
    size = 0
    for v in sizes:
        size = math.gcd(size, v)
    return size if size > 1 and all(w % size == 0 for w in widths) else 1


def column_roles(model: nn.Module, attn: nn.Module, names: Optional[List[str]] = None
                 ) -> Tuple[Optional[Dict[str, torch.Tensor]], str]:
    """``({projection name: LongTensor of roles per output column}, "")`` for ``names`` (by
    default every projection but the output one), roles :data:`QK`, :data:`VALUE`,
    :data:`THROUGH`; or ``(None, reason)``. Kept per model and attention class: every
    attention module of one class splits its projections alike."""
    key = (type(attn), tuple(names or ()))
    cache = _SEEN.setdefault(model, {})
    if key not in cache:
        try:
            cache[key] = _observe(model, attn, names)
        except Exception as e:  # noqa: BLE001 - a module that cannot be replayed alone
            cache[key] = None, f"its call could not be replayed in float64 ({type(e).__name__}: {e})"
    return cache[key]


def _observe(model: nn.Module, attn: nn.Module, names: Optional[List[str]]):
    call = _call_of(model, attn)
    if call is None:
        return None, "the attention module did not run in the probe forward"
    args, kwargs = _to64(call[0]), _to64(call[1])
    twin = _bare_copy(attn).to(torch.float64).eval()
    every = projections(twin)
    state: Dict[str, object] = {"shift": None}
    outs: Dict[str, torch.Tensor] = {}
    ins: Dict[str, torch.Tensor] = {}
    order: List[str] = []

    def hook(name):
        def fn(mod, a, out):
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"{name!r} returns a {type(out).__name__}, not a tensor")
            ins[name] = a[0].detach().clone() if a and isinstance(a[0], torch.Tensor) else None
            order.append(name)
            shift = state["shift"]
            if shift is not None and shift[0] == name:
                out = out.clone()
                out[..., shift[1]] += shift[2]
            outs[name] = out.detach()
            return out
        return fn

    handles = [getattr(twin, n).register_forward_hook(hook(n)) for n in every]
    try:
        with torch.no_grad():
            def run():
                ins.clear()
                y = _first(twin(*args, **kwargs))
                if y is None:
                    raise TypeError("the attention module returns no tensor")
                return y, dict(ins)

            order.clear()
            base, base_in = run()
            # the output projection: the one whose output the module returns, else the last of
            # several to run, of the output's width (Bloom adds the residual inside its
            # attention; DeBERTa's has its in_proj only, the output projection comes after it)
            last = order[-1] if len(order) > 1 and outs[order[-1]].shape[-1] == base.shape[-1] else None
            output = next((n for n in every if outs.get(n) is not None and outs[n].shape == base.shape
                           and torch.equal(outs[n], base)), last)
            todo = [n for n in (names or every) if n != output and n in outs]
            if not todo:
                return None, "no projection of the module ran besides its output projection"
            size = _block(attn, [outs[n].shape[-1] for n in todo])
            g = torch.Generator().manual_seed(0)
            roles: Dict[str, torch.Tensor] = {}
            for n in todo:
                width, scale = outs[n].shape[-1], max(float(outs[n].std()), 1e-3)
                r = torch.full((width,), QK, dtype=torch.long)
                for start in range(0, width, size):
                    cols = slice(start, start + size)
                    delta = torch.randn(size, generator=g, dtype=torch.float64) * scale
                    state["shift"] = (n, cols, delta)
                    up, up_in = run()
                    state["shift"] = (n, cols, -delta)
                    down, _ = run()
                    state["shift"] = None
                    first = float((up - base).abs().max())
                    second = float((up + down - 2 * base).abs().max())
                    fed = any(m not in (n, output) and base_in.get(m) is not None and up_in.get(m) is not None
                              and not torch.equal(base_in[m], up_in[m]) for m in every)
                    r[cols] = THROUGH if fed else VALUE if first > 0 and second <= LINEAR_TOL * first else QK
                roles[n] = r
    finally:
        for h in handles:
            h.remove()
    if not any(bool((r == QK).any()) for r in roles.values()):
        return None, "no column of its projections moves the attention pattern (no query or key found)"
    if not any(bool((r == VALUE).any()) for r in roles.values()):
        return None, "no column of its projections enters the attention output linearly (no value found)"
    return roles, ""


def value_columns(model: nn.Module, attn: nn.Module, proj: str) -> Tuple[Optional[torch.Tensor], str]:
    """``(mask, "")``: a bool tensor over a fused q|k|v projection's output columns, True at
    the value columns (:func:`column_roles`), or ``(None, reason)``."""
    roles, why = column_roles(model, attn, [proj])
    if roles is None:
        return None, why
    r = roles.get(proj)
    if r is None or bool((r == THROUGH).any()):
        return None, f"{proj!r} feeds another projection of the module: not a fused q|k|v projection"
    return r == VALUE, ""


def role_pattern(scales, roles: torch.Tensor):
    """The per-column gradient scale: ``scales[2]`` on the value columns, ``scales[0]`` (the
    queries' and keys' share, equal under both attention rules) on the query and key
    columns, 1 on pass-through columns (``roles``: a bool mask of values, or roles)."""
    assert scales[0] == scales[1]
    if roles.dtype == torch.bool:
        roles = torch.where(roles, VALUE, QK)
    table = torch.tensor([scales[0], scales[2], 1.0], dtype=torch.float32)
    out = table[roles]

    def pattern(n: int) -> torch.Tensor:
        if n != out.numel():
            from pyattr.integration.errors import RelevanceRuleUnsupportedError

            raise RelevanceRuleUnsupportedError(
                f"projection of width {n} inside attention, observed with width {out.numel()}")
        return out

    return pattern
