"""The patching nodes of an architecture (the table's roles, or with ``generic=True`` those
structural discovery finds), per block: residual stream, attention and MLP outputs, heads,
neurons."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

from torch import nn

import pyattr.architectures as A
from pyattr.architectures.paths import no_neurons

NODES = ("residual", "attention", "heads", "mlp", "neurons")


@dataclass(frozen=True)
class Site:
    node: str
    layer: int
    path: str
    module: nn.Module
    where: str              # "input" | "output" of the module
    heads: int = 0          # "heads": the number of heads the width splits into


def check_nodes(nodes) -> List[str]:
    if isinstance(nodes, str):
        nodes = [nodes]
    if not isinstance(nodes, (list, tuple)) or not nodes:
        raise ValueError(f"nodes must be one of {NODES} or a non-empty list of them, got {nodes!r}")
    out = []
    for n in nodes:
        if n not in NODES:
            raise ValueError(f"nodes: unknown node type {n!r}; expected one of {NODES}")
        if n not in out:
            out.append(n)
    return out


def _n_heads(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "num_attention_heads", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"nodes: 'heads' needs config.num_attention_heads, and {type(model).__name__} has none")
    return n


_ROLES = {"residual": "layers", "attention": "attention_out", "heads": "heads", "mlp": "mlp_out", "neurons": "neurons"}


def node_sites(model: nn.Module, nodes: Sequence[str], generic: bool = False) -> Dict[str, List[Site]]:
    """Node type → its module in each block (in layer order), by the roles of the table's
    entry, or with ``generic`` of the entry structural discovery reads off an unmapped
    model (a node whose role it could not find is refused with the reason)."""
    mt = A.model_type(model)
    arch = A.arch_of(model, generic)
    if arch is None or (arch.heads is None and not arch.refusals):
        supported = sorted(k for k, a in A.ARCHITECTURES.items() if a.heads is not None)
        raise ValueError(
            f"nodes: patching needs a mapped architecture to find the nodes, and {type(model).__name__} "
            f"(model_type {mt!r}) has none; supported: {', '.join(supported)}; or pass generic=True to read "
            "the nodes off the module graph"
        )
    for node in ["residual"] + list(nodes):
        A.require(arch, _ROLES[node], model, f"nodes: {node!r}")
    blocks = A.layer_paths(model, arch)
    if arch.neurons is None and "neurons" in nodes:
        raise no_neurons(model, "nodes")
    neurons, neurons_where = arch.neurons or (None, None)
    rel = {"attention": (arch.attention_out, "output"), "mlp": (arch.mlp_out, "output"),
           "neurons": (neurons, neurons_where), "heads": (arch.heads, "input")}
    out: Dict[str, List[Site]] = {}
    for node in nodes:
        sites = []
        for i, b in enumerate(blocks):
            path, where = (b, "input") if node == "residual" else (f"{b}.{rel[node][0]}", rel[node][1])
            heads = _n_heads(model) if node == "heads" else 0
            sites.append(Site(node, i, path, model.get_submodule(path), where, heads))
        out[node] = sites
    return out


def width_slice(site: Site, width: int, unit: int) -> slice:
    """The columns of unit ``unit`` of a site's width (a head's slice, a neuron; -1: all)."""
    if unit < 0:
        return slice(None)
    if site.node == "heads":
        d = width // site.heads
        return slice(unit * d, (unit + 1) * d)
    return slice(unit, unit + 1)
