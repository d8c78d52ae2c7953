"""Exact edge patching block by block (``edge_attribution(method="blockwise")``): every edge's
effect as :func:`pyattr.patching.edge_effects` defines it, computed from the clean run the way
:mod:`pyattr.patching.blockwise` computes node effects.

Patching edge ``u → d`` alone changes one downstream input: ``x_d`` becomes
``x_d + a_u(corrupt) − a_u(clean)`` (``u`` is written before ``d`` reads, and nothing else is
patched, so ``a_u`` is the clean run's). Every block before ``d``'s is the clean run's and is
not run again. ``d``'s own block is re-run on its recorded input with only that input changed:

- a query input of head ``h`` (a key or value input of key-value head ``g``): the attention
  norm is applied to the block's input plus the change, that copy projected, and only head
  ``h``'s (group ``g``'s) columns of the projection's output taken from it; every other
  column, the residual stream and the MLP read the clean values;
- the MLP input: the MLP norm reads the block's middle residual stream plus the change; the
  residual add does not;
- the logits: no block runs; the final norm reads the last block's output plus the change.

From there the block's output change goes through every later block and the output head as
in :func:`pyattr.patching.blockwise.downstream`, exactly. Edges of every pair are batched,
``batch_size`` rows (edge × pair) per run; edges into later layers (most of them: a layer's
inputs read every node before it) run the fewest blocks.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch

import pyattr.patching.blockwise as BW
import pyattr.patching.graph as G

#: rows (edge × pair) per block run
DEFAULT_BATCH = 1024


def stages(graph: G.Graph) -> Dict[int, int]:
    """Downstream input → the block that reads it (the logits: ``len(blocks)``)."""
    out = {}
    for l, ins in enumerate(graph.attn_inputs):
        for d in ins:
            out[d] = l
        out[graph.mlp_input[l]] = l
    out[graph.logits] = len(graph.attn_inputs)
    return out


def _columns(lay: G.Layout, graph: G.Graph, layer: int, ds: List[int], device) -> List[torch.Tensor]:
    """Per projection module of ``layer`` (q, k, v or the fused one): BoolTensor[rows, width],
    True on the columns of the head (key-value head) whose input row r's edge changes."""
    nq, nk, hd = lay.heads, lay.kv_heads, lay.head_dim
    where = {d: i for i, d in enumerate(graph.attn_inputs[layer])}   # q heads, then k heads, then v heads
    slot = torch.tensor([where.get(d, -1) for d in ds], device=device)   # -1: not an attention input
    col = torch.arange((nq + 2 * nk) * hd, device=device) // hd          # the q|k|v slot of each column
    full = slot[:, None] == col[None, :]                                 # (rows, (nq + 2 nk)·hd)
    if len(lay.proj[layer]) == 1:                                        # one fused projection
        return [full]
    return list(full.split([nq * hd, nk * hd, nk * hd], dim=1))


def _hidden(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


@contextlib.contextmanager
def edge_hooks(lay: G.Layout, graph: G.Graph, layer: int, ds: List[int], delta: torch.Tensor):
    """Hooks on block ``layer``'s norms and projections for rows whose edges end at ``ds``
    (one downstream input per row), each changed by ``delta[row]`` (rows, seq, hidden)."""
    mlp_d = graph.mlp_input[layer]
    is_mlp = torch.tensor([d == mlp_d for d in ds], device=delta.device)
    attn_delta = delta * (~is_mlp).to(delta.dtype)[:, None, None]
    mlp_delta = delta * is_mlp.to(delta.dtype)[:, None, None]
    masks = _columns(lay, graph, layer, ds, delta.device)
    state: Dict[str, torch.Tensor] = {}
    handles = []

    def attn_norm(mod, args, kwargs, out):
        x = _hidden(args, kwargs)
        state["normed"] = mod.forward(x + attn_delta.to(x.dtype))

    def proj(mask):
        def fn(mod, args, kwargs, out):
            y = mod.forward(state["normed"])
            return torch.where(mask[:, None, :], y, out)
        return fn

    def mlp_norm(mod, args, kwargs):
        x = _hidden(args, kwargs)
        new = x + mlp_delta.to(x.dtype)
        return ((new,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": new})

    if not bool(is_mlp.all()):
        handles.append(lay.attn_norm[layer].register_forward_hook(attn_norm, with_kwargs=True))
        for mod, mask in zip(lay.proj[layer], masks):
            if bool(mask.any()):
                handles.append(mod.register_forward_hook(proj(mask), with_kwargs=True))
    if bool(is_mlp.any()):
        handles.append(lay.mlp_norm[layer].register_forward_pre_hook(mlp_norm, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def effects(model, lay: G.Layout, graph: G.Graph, pair, fixed, acts_c: torch.Tensor, acts_x: torch.Tensor,
            calls: BW.BlockCalls, batch_size: int, clean_value: torch.Tensor) -> torch.Tensor:
    """Tensor[batch, edges] float64: each edge's exact patching effect per pair (module
    docstring), in the order of ``graph.edges``. ``acts_c`` / ``acts_x``: the upstream nodes'
    activations of the clean and the corrupt run (U, batch, seq, hidden)."""
    batch = pair.clean.input_ids.shape[0]
    edges = graph.edges
    stage = stages(graph)
    n_layers = len(lay.blocks)
    per = max(1, batch_size // batch)     # edges per run, every pair of each
    by_stage: Dict[int, List[int]] = {}
    for e, (_, d) in enumerate(edges):
        by_stage.setdefault(stage[d], []).append(e)
    out = torch.zeros((batch, len(edges)), dtype=torch.float64)
    refs: Dict[tuple, torch.Tensor] = {}
    dev = calls.x[0].device
    with torch.no_grad():
        for layer in sorted(by_stage):
            es = by_stage[layer]
            for lo in range(0, len(es), per):
                part = es[lo:lo + per]
                us = torch.tensor([edges[e][0] for e in part], device=acts_c.device)
                delta = (acts_x[us] - acts_c[us]).reshape(-1, *acts_c.shape[2:])     # (edges·batch, seq, hidden)
                idx = torch.arange(batch, device=dev).repeat(len(part))
                if layer == n_layers:     # into the logits: the last block's output changes
                    change = delta
                else:
                    # beside an unchanged copy of each row (its input to the MLP's norm changed by 0)
                    ext, ref = BW.with_references(idx)
                    ds = [edges[e][1] for e in part for _ in range(batch)]
                    ds += [graph.mlp_input[layer]] * (len(ext) - len(idx))
                    delta = torch.cat([delta, delta.new_zeros((len(ext) - len(idx), *delta.shape[1:]))])
                    with edge_hooks(lay, graph, layer, ds, delta):
                        y = calls.run(layer, ext, calls.x[layer].detach()[ext], batch, ref=ref)
                    change = y[:len(idx)] - y[ref]
                value = BW.downstream(model, pair, fixed, calls, idx, min(layer, n_layers - 1), change, batch, refs,
                                      clean_value)
                out[:, part] = value.reshape(len(part), batch).T
    return out
