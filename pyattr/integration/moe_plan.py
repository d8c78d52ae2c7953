"""The rules of a sparse mixture-of-experts block, shared by the mapped MoE models
(:meth:`pyattr.integration.planner.Planner.moe`) and ``generic=True``
(:func:`plan_generic_moe`).

- the routing rule (frozen routing): the router's routing weights are held constant, so
  relevance flows only through the selected experts, each scaled by its fixed weight
  (the selection and the forward are unchanged); a shared-expert gate likewise;
- the experts' ``act(gate)·up``: the Identity-rule on the activation and the Half-rule on
  the product, through the fused gated op that transformers' experts dispatcher calls.
"""

from __future__ import annotations

from typing import List, Optional, Set, Tuple

import torch
from torch import nn

import pyattr.architectures as A
from pyattr.activations import _kind_of_module
from pyattr.integration.errors import RelevanceRuleUnsupportedError
from pyattr.integration.forwards import experts_forward, projection_forward
from pyattr.integration.gated_plan import gated_kinds
from pyattr.integration.moe_checks import check_experts

#: the names transformers gives a sparse block's router
ROUTER_NAMES = ("gate", "router")


def plan_gates(pl, path: str, block: nn.Module, router: str, make) -> List[nn.Module]:
    """The block's router (``router``: its attribute name, ``make``: its rule forward) and
    its shared-expert gate, if any (held constant), under the routing rule (or recorded
    as off); returns the modules placed."""
    gates = [(A.join(path, router), getattr(block, router), make)]
    shared_gate = getattr(block, "shared_expert_gate", None)
    if isinstance(shared_gate, nn.Module):
        gates.append((A.join(path, "shared_expert_gate"), shared_gate, projection_forward(0.0)))
    for p, mod, make in gates:
        pl.mounted.add(id(mod))
        if pl.rules.routing:
            pl.add("routing", p, mod, pl.rules.routing, make)
        else:
            pl.off("routing", p, mod, "routing rule off")
    return [mod for _, mod, _ in gates]


def plan_experts(pl, epath: str, experts: nn.Module) -> None:
    """The gated rules on the experts' ``act(gate)·up`` (transformers' dispatcher form,
    checked by :func:`~pyattr.integration.moe_checks.check_experts`)."""
    wanted = gated_kinds(pl, epath, experts)
    if wanted:
        check_experts(epath, experts)
        kind = _kind_of_module(experts.act_fn) or "custom"
        pl.mounted.add(id(experts.act_fn))
        for k in wanted:
            pl.add(k, epath, experts, True, experts_forward(kind), check_output=False)


def frozen_router_forward():
    """The router's own forward with every floating output detached (logits, scores or
    weights, whatever its form returns; indices stay): the routing weights a block makes
    from them are then constants — the frozen routing rule for a router whose output
    form pyattr does not know. The generic plan check measures that the block conserves."""
    def make(router, state):
        native = state.native

        def forward(*args, **kwargs):
            out = native(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                return out.detach()
            if isinstance(out, tuple):
                return type(out)(o.detach() if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                                 for o in out)
            raise RelevanceRuleUnsupportedError(
                f"{type(router).__name__} returns a {type(out).__name__}, not tensors: the routing rule cannot hold "
                "its routing weights constant")

        return forward

    return make


def plan_generic_moe(pl, path: str, block: nn.Module) -> Tuple[Optional[str], Set[int]]:
    """``(None, ids of the modules it placed)`` when the block's router and experts have a
    form the rules can be placed on (a router module named ``gate`` or ``router``;
    experts in transformers' dispatcher form), else ``(reason, empty set)`` and nothing
    placed. A shared expert is left to the generic walk (a gated MLP); a shared-expert
    gate is held constant as in the mapped models."""
    experts = getattr(block, "experts", None)
    router_name = next((n for n in ROUTER_NAMES if isinstance(getattr(block, n, None), nn.Module)
                        and getattr(block, n) is not experts), None)
    if router_name is None:
        return f"no router module ({' or '.join(ROUTER_NAMES)})", set()
    epath = A.join(path, "experts")
    if pl.rules.activation or pl.rules.multiplicative_gate:
        try:
            check_experts(epath, experts)
        except RelevanceRuleUnsupportedError as e:
            return str(e), set()
    gates = plan_gates(pl, path, block, router_name, frozen_router_forward())
    plan_experts(pl, epath, experts)
    placed = {id(block)} | {id(m) for g in gates for m in g.modules()} | {id(m) for m in experts.modules()}
    pl.mounted |= placed
    return None, placed
