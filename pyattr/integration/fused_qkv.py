"""``generic=True`` on a fused q|k|v projection: which output columns are values, observed.

A model without a rule map may compute queries, keys and values with one projection and
split its output in a layout of its own (q | k | v, per head, per key-value group, or
CodeGen's q | v | k per model-parallel chunk). Rather than guess the layout from names,
pyattr observes it on the attention module itself: the module's call is captured once on
the plan check's probe input, replayed in float64 on a copy of the module, and each block
of the projection's output columns (a head's width where the module says it, else one
column) is moved by +δ and −δ. The attention output is linear in a value column (the
pattern does not depend on it), so its second difference ``f(+δ) + f(−δ) − 2 f(0)`` is zero
to rounding; a query or key column moves the pattern through the softmax, which it is not.
The AH-rule then scales the value columns' gradient by 1 and the others' by 0 (AttnLRP:
½ and ¼), as the mapped fused layouts do; a column wrongly taken as a query or key would
cut relevance, which the plan check measures and refuses.
"""

from __future__ import annotations

import copy
import weakref
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from pyattr.integration.plan_check import probe_inputs

#: relative size of the second difference below which a column block counts as linear
LINEAR_TOL = 1e-7

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


def _call_of(model: nn.Module, attn: nn.Module):
    """``(args, kwargs)`` of ``attn``'s first call in a probe forward of ``model``."""
    seen = []

    def pre(mod, args, kwargs):
        seen.append((args, kwargs))
        raise _Captured()

    handle = attn.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**probe_inputs(model), **({"use_cache": False} if _takes_cache(model) else {}))
    except _Captured:
        pass
    finally:
        handle.remove()
    return seen[0] if seen else None


def _takes_cache(model: nn.Module) -> bool:
    import inspect

    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def value_columns(model: nn.Module, attn: nn.Module, proj: str) -> Tuple[Optional[torch.Tensor], str]:
    """``(mask, "")``: a bool tensor over the fused projection's output columns, True at the
    value columns (observed as above), or ``(None, reason)``. Kept per model and attention
    class: every attention module of one class splits its projection alike."""
    key = (type(attn), proj)
    cache = _SEEN.setdefault(model, {})
    if key in cache:
        return cache[key]
    cache[key] = found = _observe(model, attn, proj)
    return found


def _observe(model: nn.Module, attn: nn.Module, proj: str) -> Tuple[Optional[torch.Tensor], str]:
    was = {m: m.training for m in model.modules()}
    model.eval()
    try:
        call = _call_of(model, attn)
    except Exception as e:  # noqa: BLE001 - the probe forward of a model pyattr does not know
        return None, f"the probe forward failed ({type(e).__name__}: {e})"
    finally:
        for m, t in was.items():
            m.training = t
    if call is None:
        return None, "the attention module did not run in the probe forward"
    args, kwargs = _to64(call[0]), _to64(call[1])
    twin = copy.deepcopy(attn).to(torch.float64).eval()
    fused = getattr(twin, proj)
    shift: Dict[str, object] = {}

    def hook(mod, a, out):
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{proj!r} returns a {type(out).__name__}, not a tensor")
        shift["width"] = out.shape[-1]
        shift["scale"] = float(out.std())
        if "delta" in shift:
            out = out.clone()
            out[..., shift["cols"]] += shift["delta"]
        return out

    handle = fused.register_forward_hook(hook)
    try:
        with torch.no_grad():
            def run():
                y = _first(twin(*args, **kwargs))
                if y is None:
                    raise TypeError("the attention module returns no tensor")
                return y

            base = run()
            n = int(shift["width"])
            size = next((int(getattr(attn, a)) for a in ("head_dim", "head_size", "attention_head_size")
                         if isinstance(getattr(attn, a, None), int) and n % int(getattr(attn, a)) == 0), 1)
            g = torch.Generator().manual_seed(0)
            mask = torch.zeros(n, dtype=torch.bool)
            for start in range(0, n, size):
                cols = slice(start, start + size)
                delta = torch.randn(size, generator=g, dtype=torch.float64) * max(shift["scale"], 1e-3)
                shift.update(cols=cols, delta=delta)
                up = run()
                shift["delta"] = -delta
                down = run()
                shift.pop("delta")
                first = float((up - base).abs().max())
                second = float((up + down - 2 * base).abs().max())
                mask[cols] = first > 0 and second <= LINEAR_TOL * first
    except Exception as e:  # noqa: BLE001 - a module that cannot be replayed alone
        return None, f"its call could not be replayed in float64 ({type(e).__name__}: {e})"
    finally:
        handle.remove()
    if not mask.any() or mask.all():
        return None, (f"no column of its output enters the attention output linearly" if not mask.any()
                      else "every column enters the attention output linearly (no query or key among them)")
    return mask, ""


def role_pattern(scales, values: torch.Tensor):
    """The per-column gradient scale: ``scales[2]`` on the value columns, ``scales[0]`` (the
    queries' and keys' share, equal under both attention rules) on the others."""
    assert scales[0] == scales[1]
    out = torch.where(values, torch.tensor(scales[2]), torch.tensor(scales[0])).to(torch.float32)

    def pattern(n: int) -> torch.Tensor:
        if n != out.numel():
            from pyattr.integration.errors import RelevanceRuleUnsupportedError

            raise RelevanceRuleUnsupportedError(
                f"fused q/k/v projection of width {n}, observed with width {out.numel()}")
        return out

    return pattern
