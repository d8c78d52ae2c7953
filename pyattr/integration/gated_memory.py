"""The gated MLP's memory mount (:data:`GATED_MEMORY`) and what every gated MLP forward pyattr
rebuilds checks at each call.

With both gated rules off and another rule on (the LN-rule alone, or attention rules alone),
a gated MLP runs ``act(gate)·up`` through the fused gated op with the ordinary gradient: it
saves ``gate`` and ``up`` for the backward, where the native graph also keeps ``act(gate)``,
a third intermediate-wide tensor per MLP (on a 1B Llama a quarter of what a LN-rule-only
pass keeps). It is not a rule: the coverage does not list it, and wherever it could not run
as the module's own forward would, the module's own forward runs (:func:`native_instead`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

import torch
from torch import nn

from pyattr._module_forward import forward_of, global_hooks, nnsight_controller
from pyattr.integration.errors import RelevanceRuleConflictError, RelevanceRuleUnsupportedError
from pyattr.integration.install import GATED_MEMORY, has_hooks

__all__ = ["GATED_MEMORY", "MLPParts", "global_hooks", "lenient", "native_instead"]


@dataclass
class MLPParts:
    """The submodules a rebuilt gated forward calls, as the scope found them (``parts``: name →
    module), and its activation's forward then: a module put in their place, or a forward set
    on the activation, inside the scope would otherwise not run (or run with the old one's
    derivative)."""

    mlp: nn.Module
    parts: Dict[str, nn.Module]
    act: str
    act_forward: Callable = None
    nnsight: bool = False

    def __post_init__(self):
        self.act_forward = forward_of(self.parts[self.act])
        # nnsight's controller runs the body its trace sets: its forward is not compared
        self.nnsight = nnsight_controller(self.parts[self.act]) is not None

    def changed(self) -> str:
        """The first submodule replaced (or activation whose forward was) since, else ''."""
        for name, mod in self.parts.items():
            if getattr(self.mlp, name, None) is not mod:
                return name
        act = self.parts[self.act]
        if self.nnsight or nnsight_controller(act) is not None:
            return ""
        return "" if forward_of(act) == self.act_forward else self.act + ".forward"


def native_instead(state, held: MLPParts, ruled: bool) -> bool:
    """Whether a gated MLP's rebuilt forward hands this call to the module's own forward.

    With a gated rule active (``ruled``) never: a submodule replaced inside the scope, or a
    rebuilt forward found differing (:func:`lenient`), raises.
    Under the :data:`GATED_MEMORY` mount alone, whenever the fused op could not run as the
    module's own forward: a hook on the activation or on every module (a user's, a method's
    tap of the neurons) must see its call; a replaced submodule or activation forward must
    run; and a call whose first-call check was put off (under ``torch.func`` transforms and
    global hooks, :func:`lenient`) runs the module's own."""
    changed = held.changed()
    if ruled:
        if state.mismatch is not None:
            raise state.mismatch
        if changed and not changed.endswith(".forward"):  # a forward nnsight's trace sets reads as changed too
            raise RelevanceRuleConflictError(
                f"{state.path!r}: {changed} was replaced while a use_relevance_rules scope carrying its gated rules "
                "was open, and the rule forward would run the one it found; replace it before opening the scope "
                "(pyattr then reads the module it runs), or after it closes")
        return False
    return bool(changed or state.mismatch is not None or state.deferred
                or has_hooks(held.parts[held.act]) or global_hooks())


def lenient(verify: Callable) -> Callable:
    """The first-call check (:func:`~pyattr.integration.forwards.verify_rebuilt`) of a
    :data:`GATED_MEMORY` mount: a rebuilt forward that differs from the module's own is
    recorded on the state (the module's own forward then runs) rather than refused, since no
    rule asked for it; a gated rule active on the module then or later raises it. Deferred
    (the module's own forward runs meanwhile) under ``torch.func`` transforms, which take no
    saved-tensor hooks, and while global hooks would see its two-row calls."""
    def check(module, state, fwd, args, kwargs) -> bool:
        ruled = state.active("activation") or state.active("multiplicative_gate")
        state.deferred = not ruled and (torch._C._are_functorch_transforms_active() or global_hooks())
        if state.deferred:
            return False
        try:
            return verify(module, state, fwd, args, kwargs)
        except RelevanceRuleUnsupportedError as e:
            if ruled:
                raise
            state.mismatch = e
            return True

    return check
