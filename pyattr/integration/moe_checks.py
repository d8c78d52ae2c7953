"""The mixture-of-experts forms the planner's routing and gated rules are placed for: the
sparse block's forward must be the library's own, the experts transformers' dispatcher
over a plain concatenated gate | up layout."""

from __future__ import annotations

import importlib

from torch import nn

import pyattr.architectures as A
from pyattr._module_forward import forward_name, forward_of
from pyattr.architectures.forms import flat_body
from pyattr.integration.errors import RelevanceRuleConflictError, RelevanceRuleUnsupportedError
from pyattr.integration.forwards import bypass_message, is_experts_dispatcher
from pyattr.integration.install import has_hooks


def check_moe_block(model_type: str, path: str, block: nn.Module) -> None:
    """The sparse block's forward must be the library's own (the router's second output
    scales the experts' outputs; the shared expert behind a sigmoid gate), body for
    body: a block that recomputes its weights from the router logits would bypass the
    routing rule."""
    arch = A.ARCHITECTURES.get(model_type)
    own = arch.moe_block if arch is not None else None
    ref = None
    if own is not None:
        try:
            ref = getattr(importlib.import_module(own[0]), own[1])
        except (ImportError, AttributeError):
            ref = None
    body = flat_body(forward_of(block))
    if ref is None or body is None or body != flat_body(ref.forward):
        raise RelevanceRuleUnsupportedError(
            f"{path!r}: {forward_name(block)} is not the {own[1] if own else 'library'} forward the "
            "routing and gated rules are placed for; they would not apply where it computes its routing"
        )

def check_experts(path: str, experts: nn.Module) -> None:
    """The experts' layout and dispatcher the gated rules' fused op is placed for."""
    impl = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # pragma: no cover - transformers without the experts interface
        _default_apply_gate = None
    checks = [
        (impl not in (None, "eager"), f"experts_implementation {impl!r}: the eager one computes act(gate)·up "
         "inline, where no rule can reach it; load the model with experts_implementation=\"grouped_mm\" (or \"batched_mm\")"),
        (getattr(experts, "has_gate", False) is True and getattr(experts, "is_concatenated", False) is True
         and not getattr(experts, "has_bias", False) and not getattr(experts, "has_post_expert_norm", False),
         "experts without the plain concatenated gate | up layout (gated, no bias, no post-expert norm)"),
        (_default_apply_gate is not None and getattr(type(experts), "_apply_gate", None) is _default_apply_gate,
         f"{type(experts).__name__} has its own _apply_gate, not act(gate)·up"),
        (isinstance(getattr(experts, "act_fn", None), nn.Module), "experts without an act_fn module"),
        (is_experts_dispatcher(forward_of(experts)),
         f"{forward_name(experts)} is its own, not transformers' experts dispatcher that calls "
         "_apply_gate"),
    ]
    for ok, why in checks:
        if not ok:
            raise RelevanceRuleUnsupportedError(f"{path!r}: {why}; the gated rules cannot be placed")
    if has_hooks(experts.act_fn):
        raise RelevanceRuleConflictError(bypass_message(path))
