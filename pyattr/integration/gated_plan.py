"""The mounts of a gated MLP (``down(act(gate(x)) · up(x))``): separate projections (Llama),
one fused projection (Phi-3's ``gate_up_proj``, ModernBERT's GeGLU ``Wi``), or found by the
form of its forward under any names (``generic=True``).

With the Identity- or Half-rule on, the MLP runs through the fused
:func:`~pyattr.ops.gated.gated_activation` op with those rules. With both off and another
rule on, the same op runs with the ordinary gradient (:data:`GATED_MEMORY`): it saves
``gate`` and ``up`` where the native graph also keeps ``act(gate)``; not a rule, so the
coverage does not list it, and it is placed only where it can run as the module's own
forward would (the plain form, a known activation, nothing hooking it).
"""

from __future__ import annotations

from typing import Callable, List

from torch import nn

from pyattr._module_forward import forward_name
from pyattr.activations import _kind_of_module
from pyattr.architectures.forms import plain_fused_gated_forward, plain_gated_forward
from pyattr.integration.errors import RelevanceRuleConflictError, RelevanceRuleUnsupportedError
from pyattr.integration.forwards import (
    FusedGatedForm,
    Step,
    bypass_message,
    gated_forward,
    gated_fused_forward,
    verify_rebuilt,
)
from pyattr.integration.gated_memory import GATED_MEMORY, global_hooks, lenient
from pyattr.integration.install import has_hooks

GATED_KINDS = ("activation", "multiplicative_gate")


def wanted_kinds(pl) -> List[str]:
    """The gated rule kinds ``pl``'s rules ask for."""
    return [k for k in GATED_KINDS if getattr(pl.rules, k)]


def gated_kinds(pl, path: str, mod: nn.Module) -> List[str]:
    """The gated rule kinds ``pl``'s rules ask for; the others are recorded as off."""
    wanted = wanted_kinds(pl)
    for k in GATED_KINDS:
        if k not in wanted:
            pl.off(k, path, mod, f"{k} rule off")
    return wanted


def plan_gated(pl, path: str) -> None:
    """A gated MLP with ``gate_proj``, ``up_proj``, ``down_proj`` and ``act_fn``."""
    mlp = pl.need(path)
    for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
        if not isinstance(getattr(mlp, name, None), nn.Module):
            raise RelevanceRuleUnsupportedError(
                f"{path!r}: a gated MLP needs gate_proj, up_proj, down_proj and act_fn modules; "
                f"{name} is missing"
            )
    kind = _kind_of_module(mlp.act_fn) or "custom"
    pl.mounted.add(id(mlp.act_fn))
    pl.observed.add(id(mlp.act_fn))
    wanted = wanted_kinds(pl)  # before recording the others as off: a generic model may skip it whole
    plain = plain_gated_forward(mlp)
    if wanted and not plain:
        msg = (
            f"{path!r}: {forward_name(mlp)} is not the plain "
            "down_proj(act_fn(gate_proj(x)) * up_proj(x)); the gated rule would change its forward"
        )
        if pl.generic:
            for k in wanted:
                pl.cov._skip(path, msg)
            return
        raise RelevanceRuleUnsupportedError(msg)
    gated_kinds(pl, path, mlp)
    _mount(pl, path, mlp, mlp.act_fn, kind, wanted, plain, gated_forward(kind, path), "act_fn")


def plan_gated_fused(pl, path: str, form: FusedGatedForm) -> None:
    """An MLP with one projection for gate and up (Phi-3's gate_up_proj, ModernBERT's
    GeGLU Wi), ``a, b = proj(x).chunk(2)``."""
    mlp = pl.need(path)
    for name in (form.proj, form.act, form.down) + ((form.drop,) if form.drop else ()):
        if not isinstance(getattr(mlp, name, None), nn.Module):
            raise RelevanceRuleUnsupportedError(
                f"{path!r}: a fused gated MLP needs {form.proj}, {form.act} and {form.down} modules; "
                f"{name} is missing"
            )
    act = getattr(mlp, form.act)
    kind = _kind_of_module(act) or "custom"
    pl.mounted.add(id(act))
    pl.observed.add(id(act))
    wanted = gated_kinds(pl, path, mlp)
    plain = plain_fused_gated_forward(mlp, form)
    if wanted and not plain:
        raise RelevanceRuleUnsupportedError(
            f"{path!r}: {forward_name(mlp)} is not the plain a, b = {form.proj}(x).chunk(2); "
            f"{form.down}(act(a) * b); the gated rule would change its forward"
        )
    _mount(pl, path, mlp, act, kind, wanted, plain, gated_fused_forward(kind, path, form), form.act)


def plan_gated_named(pl, path: str, names) -> None:
    """A gated MLP found by the form of its forward, under any attribute names
    ``(gate, up, down, act)``."""
    mlp = pl.need(path)
    act = getattr(mlp, names[3])
    kind = _kind_of_module(act) or "custom"
    pl.mounted.add(id(act))
    wanted = gated_kinds(pl, path, mlp)
    _mount(pl, path, mlp, act, kind, wanted, True, gated_forward(kind, path, names), names[3])


def _mount(pl, path: str, mlp: nn.Module, act: nn.Module, kind: str, wanted: List[str], plain: bool,
           make: Callable, act_name: str) -> None:
    """The gated rules ``wanted`` on ``mlp`` through ``make``; with none wanted, the
    :data:`GATED_MEMORY` mount where some other rule is on and the MLP has the plain form,
    a known activation and no hook on it (at run time a hook added later hands the call back
    to the module's own forward)."""
    if wanted:
        if has_hooks(act):
            raise RelevanceRuleConflictError(bypass_message(path, act_name))
        for k in wanted:
            pl.add(k, path, mlp, True, make, check_output=True, rebuilt=True)
        return
    if pl.rules.any() and plain and kind != "custom" and not has_hooks(act) and not global_hooks():
        check = lenient(verify_rebuilt(path, (GATED_MEMORY, "True", getattr(make, "__qualname__", ""))))
        pl.steps.append(Step(mlp, path, GATED_MEMORY, True, make, False, check))
