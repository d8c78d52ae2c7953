"""The computational graph that edge attribution and circuit evaluation work on (EAP's graph,
Syed et al. 2023, "Attribution patching outperforms automated circuit discovery"; Hanna et
al. 2024, EAP-IG), and the forward that gives every edge a copy of its own.

Upstream nodes write into the residual stream: ``input`` (the residual stream entering the
first block), each head ``a{l}.h{h}`` (its slice of the output projection's input mapped
through that projection, the bias left out: the same in every run) and each MLP ``m{l}``
(the MLP block's output). Downstream inputs read it: each head's query, key and value input
``a{l}.h{h}<q>`` / ``<k>`` / ``<v>`` (with grouped-query attention one key and one value
input per key-value head), each MLP's input ``m{l}`` and the ``logits``. An edge joins an
upstream node to a downstream input that reads the residual stream after it was written.

In a pre-norm decoder every downstream input is the sum of the upstream outputs before it
(plus the output projections' biases), normalised by the norm in front of it. The *split
forward* gives each downstream input its own copy of that sum: the query of head h is
computed from ``norm(x_d)`` with ``x_d`` the residual stream plus ``delta_d``, and only head
h's slice of the projection output is taken from that copy. With ``delta_d`` a zero leaf the
forward is the model's own and the gradient at ``delta_d`` is ∂metric/∂x_d for every
downstream input at once; with ``delta_d = Σ_{u ∉ circuit} (a_u(corrupt) − a_u(this run))``
it is the run of a circuit with every edge outside it patched to the corrupt input (as
EAP-IG's ``evaluate_graph`` defines it).

What the model computes is observed, not assumed: the first clean forward checks that each
attention norm reads the block's input, each MLP norm the block's input plus the heads'
contributions, each block's output that plus the MLP output, the final norm the last
block's output, and that the projections read their norm's output. A model whose residual
stream is not such a sum (a norm after the attention output, a parallel block) is refused.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

import pyattr.architectures as A


@dataclass(frozen=True)
class Layout:
    """The modules the graph reads, per layer."""

    blocks: List[nn.Module]
    attn: List[nn.Module]
    attn_norm: List[nn.Module]
    proj: List[Tuple[nn.Module, ...]]       # (q, k, v) modules, or (fused,) with q | k | v widths
    o_proj: List[nn.Module]
    mlp_norm: List[nn.Module]
    mlp: List[nn.Module]
    final_norm: nn.Module
    heads: int
    kv_heads: int
    head_dim: int


def layout(model: nn.Module) -> Layout:
    """The graph's modules from the architecture table.

    Raises:
        ValueError: an unmapped architecture, or one whose attention projection form or
            norms the edge graph does not read (named with the reason).
    """
    arch = A.arch_of(model, False)
    mt = A.model_type(model)
    if arch is None:
        raise ValueError(f"model: edge attribution needs a mapped architecture, and {type(model).__name__} "
                         f"(model_type {mt!r}) has none")
    kind = arch.attention[0]
    if kind not in ("separate", "concat", "split") or arch.heads is None or len(arch.layer_norms) != 2 \
            or not arch.outer_norms or arch.vision:
        raise ValueError(f"model: edge attribution reads a pre-norm decoder with one norm before the attention "
                         f"and one before the MLP; {mt!r} has attention form {kind!r} and block norms "
                         f"{list(arch.layer_norms)} (post-norm, sandwich-norm and per-head fused forms are not "
                         "supported)")
    blocks_paths = A.layer_paths(model, arch)
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    get = model.get_submodule
    attn_path = arch.heads.rsplit(".", 1)[0]
    out = Layout([], [], [], [], [], [], [], None, heads, kv, hd)  # type: ignore[arg-type]
    for b in blocks_paths:
        out.blocks.append(get(b))
        out.attn.append(get(f"{b}.{attn_path}"))
        out.attn_norm.append(get(f"{b}.{arch.layer_norms[0]}"))
        out.mlp_norm.append(get(f"{b}.{arch.layer_norms[1]}"))
        out.proj.append(tuple(get(f"{b}.{p}") for p in arch.attention[1:]))
        out.o_proj.append(get(f"{b}.{arch.heads}"))
        out.mlp.append(get(f"{b}.{arch.mlp_out}"))
    object.__setattr__(out, "final_norm", get(A.join(A.base_prefix(model), arch.outer_norms[-1])))
    check_hooks(model, out)
    return out


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks")


def check_hooks(model: nn.Module, lay: Layout) -> None:
    """Refuse hooks that the edge graph's forwards would skip: each downstream input's copy
    is normed and projected by calling the attention norm's and the projections' ``forward``
    directly (and each head's contribution by the output projection's), so a hook of the
    user's on those modules (or a global module hook) would act in the model's run and not
    in the copies, and every number would be silently wrong. pyattr's own hooks (its rule
    scopes' checks) are left alone."""
    import torch.nn.modules.module as M

    def foreign(table) -> bool:
        return any(not str(getattr(fn, "__module__", "") or "").startswith("pyattr.") for fn in table.values())

    for name in ("_global_forward_pre_hooks", "_global_forward_hooks"):
        if foreign(getattr(M, name, {})):
            raise ValueError("model: a global module forward hook is registered (torch.nn.modules.module."
                             "register_module_forward_hook); the edge graph calls the attention norms' and projections' "
                             "forward directly, which would skip it: remove it for the call")
    names = {id(m): n for n, m in model.named_modules()}
    for l in range(len(lay.blocks)):
        for mod in (lay.attn_norm[l], *lay.proj[l], lay.o_proj[l]):
            if any(foreign(getattr(mod, t, {})) for t in _HOOK_TABLES):
                raise ValueError(
                    f"model: {names.get(id(mod), type(mod).__name__)!r} has a forward hook; the edge graph norms and "
                    "projects each downstream input's own copy of the residual stream by calling this module's forward "
                    "directly, which skips the hook, so the numbers would not be the hooked model's. Remove the hook "
                    "for the call (or patch nodes with activation_patching, which runs the model as it is)")


@dataclass(frozen=True)
class Graph:
    """Names and order of the nodes; ``valid[u, d]``: upstream u is written before d reads."""

    upstream: List[str]
    downstream: List[str]
    valid: torch.Tensor            # BoolTensor[U, D]
    attn_inputs: List[List[int]]   # per layer, its downstream indices: q heads, k heads, v heads
    mlp_input: List[int]           # per layer, the MLP's downstream index
    logits: int
    head_nodes: List[List[int]]    # per layer, the upstream index of each head
    mlp_node: List[int]            # per layer, the MLP's upstream index

    @property
    def edges(self) -> List[Tuple[int, int]]:
        return [tuple(x) for x in self.valid.nonzero().tolist()]

    def edge_names(self) -> List[str]:
        return [f"{self.upstream[u]}->{self.downstream[d]}" for u, d in self.edges]


def build_graph(lay: Layout) -> Graph:
    up, down, stage_u, stage_d = ["input"], [], [(-1, 1)], []
    attn_inputs, mlp_input, head_nodes, mlp_node = [], [], [], []
    for l in range(len(lay.blocks)):
        idx = []
        for kind, n in (("q", lay.heads), ("k", lay.kv_heads), ("v", lay.kv_heads)):
            for h in range(n):
                idx.append(len(down))
                down.append(f"a{l}.h{h}<{kind}>")
                stage_d.append((l, 0))
        attn_inputs.append(idx)
        head_nodes.append(list(range(len(up), len(up) + lay.heads)))
        for h in range(lay.heads):
            up.append(f"a{l}.h{h}")
            stage_u.append((l, 0))
        mlp_input.append(len(down))
        down.append(f"m{l}")
        stage_d.append((l, 1))
        mlp_node.append(len(up))
        up.append(f"m{l}")
        stage_u.append((l, 1))
    logits = len(down)
    down.append("logits")
    stage_d.append((len(lay.blocks), 0))
    valid = torch.tensor([[su < sd for sd in stage_d] for su in stage_u], dtype=torch.bool)
    return Graph(up, down, valid, attn_inputs, mlp_input, logits, head_nodes, mlp_node)


def _first(x):
    return x if isinstance(x, torch.Tensor) else x[0]


class SplitForward:
    """Hooks for one forward of the split graph (see the module docstring).

    mode ``"record"``: the model's own forward, recording every upstream activation
    (``acts[u]``: (rows, seq, hidden), detached); ``"grad"``: also a zero leaf per downstream
    input (``leaves``: (D, rows, seq, hidden) in one tensor), whose gradient is ∂metric/∂x_d;
    ``"patch"``: ``delta_d = Σ_u patched[row, u, d] (corrupt[u] − acts[u])`` with
    ``patched`` (rows, U, D) float (1: the edge is outside the circuit) and ``corrupt``
    (U, rows, seq, hidden).
    """

    def __init__(self, lay: Layout, graph: Graph, mode: str, corrupt: Optional[torch.Tensor] = None,
                 patched: Optional[torch.Tensor] = None, check: bool = False):
        self.lay, self.g, self.mode, self.check = lay, graph, mode, check
        self.corrupt, self.patched = corrupt, patched
        self.acts: List[Optional[torch.Tensor]] = [None] * len(graph.upstream)
        self.leaves: Optional[torch.Tensor] = None
        self.normed: Dict[int, torch.Tensor] = {}
        self.seen: Dict[str, torch.Tensor] = {}
        self.mismatch: List[str] = []

    # -- the additive change of each downstream input --------------------------------
    def _delta(self, ds: List[int], x: torch.Tensor) -> Optional[torch.Tensor]:
        """(len(ds), rows, seq, hidden) or None (no change)."""
        if self.mode == "grad":  # ds are consecutive: a slice, not a gather (whose backward scatters)
            if self.leaves is None:  # a downstream input read before the first block
                self.mismatch.append(f"{self.g.downstream[ds[0]]} is read before the first block")
                return None
            return self.leaves[ds[0]:ds[0] + len(ds)]
        if self.mode != "patch":
            return None
        m = self.patched[:, :, ds]                              # (rows, U, len(ds))
        if not bool(m.any()):
            return None
        us = [u for u in range(len(self.acts)) if self.acts[u] is not None and bool(m[:, u].any())]
        if not us:
            return None
        diff = torch.stack([self.corrupt[u].to(x) - self.acts[u].to(x) for u in us])   # (n, rows, seq, h)
        return torch.einsum("nrsh,rnd->drsh", diff, m[:, us].to(x))

    # -- hooks -------------------------------------------------------------------------
    def _entry(self, mod, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        self.acts[0] = x.detach()
        self.seen["block0"] = x.detach()
        if self.mode == "grad" and self.leaves is None:
            n = len(self.g.downstream)
            self.leaves = torch.zeros((n, *x.shape), dtype=x.dtype, device=x.device, requires_grad=True)

    def _block(self, l):
        def fn(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if self.check and l > 0:
                self._close(f"layer {l}'s input", x, self._sum(f"mid{l - 1}", [self.g.mlp_node[l - 1]]))
            self.seen[f"block{l}"] = x.detach()
        return fn

    def _attn_norm(self, l):
        def fn(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if self.check and not self._same(x, f"block{l}"):
                self.mismatch.append(f"layer {l}'s attention norm does not read the block's input")
            ds = self.g.attn_inputs[l]
            delta = self._delta(ds, x)
            if delta is not None:
                copies = x.unsqueeze(0) + delta
                normed = mod.forward(copies.reshape(-1, *x.shape[1:]))
                self.normed[l] = normed.reshape(len(ds), *x.shape[:-1], normed.shape[-1])
        return fn

    def _attn_norm_out(self, l):
        def fn(mod, args, kwargs, out):
            self.seen[f"attn_norm{l}"] = _first(out).detach()
        return fn

    def _proj(self, l, which):
        """Forward hook on a projection: each head's slice from its own copy."""
        lay, hd = self.lay, self.lay.head_dim

        def fn(mod, args, kwargs, out):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
            if self.check and not self._same(x, f"attn_norm{l}"):
                self.mismatch.append(f"layer {l}'s query/key/value projection does not read the attention norm")
            if l not in self.normed:
                return None
            copies = self.normed[l]
            nq, nk = lay.heads, lay.kv_heads
            if which == "fused":
                spans = [(0, nq, 0), (nq, nk, nq * hd), (nq + nk, nk, (nq + nk) * hd)]
            else:
                first = {"q": 0, "k": nq, "v": nq + nk}[which]
                spans = [(first, nq if which == "q" else nk, 0)]
            pieces = []
            plain = type(mod) is nn.Linear  # each head's rows of the weight alone: one projection's work
            for first, count, offset in spans:
                part = copies[first:first + count]                        # (count, rows, seq, hidden)
                if plain:
                    w = mod.weight[offset:offset + count * hd].reshape(count, hd, -1)
                    y = torch.einsum("crsi,cdi->crsd", part.to(w.dtype), w)
                    if mod.bias is not None:
                        y = y + mod.bias[offset:offset + count * hd].reshape(count, 1, 1, hd)
                    pieces += list(y.unbind(0))
                    continue
                # any other module (Conv1D, a quantized linear): the whole projection per copy
                y = mod.forward(part.reshape(-1, *copies.shape[2:]))
                y = y.reshape(count, *copies.shape[1:-1], y.shape[-1])
                for h in range(count):
                    pieces.append(y[h, ..., offset + h * hd: offset + (h + 1) * hd])
            return torch.cat(pieces, -1)
        return fn

    def _o_proj(self, l):
        lay = self.lay

        def fn(mod, args, kwargs):
            z = (args[0] if args else kwargs["input"]).detach()
            hd, n = lay.head_dim, lay.heads
            with torch.no_grad():
                zs = torch.zeros((n, *z.shape), dtype=z.dtype, device=z.device)
                for h in range(n):
                    zs[h, ..., h * hd:(h + 1) * hd] = z[..., h * hd:(h + 1) * hd]
                bias = mod.forward(torch.zeros_like(z[:1, :1]))
                contrib = mod.forward(zs.reshape(-1, *z.shape[1:])).reshape(n, *z.shape[:-1], -1) - bias
            for h, u in enumerate(self.g.head_nodes[l]):
                self.acts[u] = contrib[h]
            self.seen[f"bias{l}"] = bias.detach()
        return fn

    def _mlp_norm(self, l):
        def fn(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if self.check:
                want = self._sum(f"block{l}", self.g.head_nodes[l])
                bias = self.seen.get(f"bias{l}")
                self._close(f"layer {l}'s MLP norm input", x, None if want is None or bias is None else want + bias)
            self.seen[f"mid{l}"] = x.detach()
            delta = self._delta([self.g.mlp_input[l]], x)
            if delta is None:
                return None
            new = x + delta[0]
            return ((new,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": new})
        return fn

    def _mlp_norm_out(self, l):
        def fn(mod, args, kwargs, out):
            self.seen[f"mlp_norm{l}"] = _first(out).detach()
        return fn

    def _mlp_out(self, l):
        def fn(mod, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            if self.check and not self._same(x, f"mlp_norm{l}"):
                self.mismatch.append(f"layer {l}'s MLP does not read the MLP norm's output")
            self.acts[self.g.mlp_node[l]] = _first(out).detach()
        return fn

    def _final(self, mod, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        last = len(self.lay.blocks) - 1
        if self.check:
            self._close("the final norm's input", x, self._sum(f"mid{last}", [self.g.mlp_node[last]]))
        delta = self._delta([self.g.logits], x)
        if delta is None:
            return None
        new = x + delta[0]
        return ((new,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": new})

    def _same(self, x: torch.Tensor, key: str) -> bool:
        """``x`` is the tensor recorded under ``key`` earlier in this forward: equal values,
        a NaN where the recorded one has its NaN (transformers' eager attention leaves NaN
        at the query positions a left-padded row masks out entirely, and NaN equals
        nothing, itself included)."""
        seen = self.seen.get(key)
        if seen is None or seen.shape != x.shape:
            return False
        x = x.detach()
        return bool(((x == seen) | (x.isnan() & seen.isnan())).all())

    def _sum(self, key: str, upstream: List[int]) -> Optional[torch.Tensor]:
        """The tensor recorded under ``key`` plus the listed upstream outputs (None where one
        was not computed before: the model runs its modules in another order)."""
        parts = [self.seen.get(key)] + [self.acts[u] for u in upstream]
        if any(p is None for p in parts) or len({tuple(p.shape) for p in parts}) != 1:
            return None
        return sum(parts[1:], parts[0])

    def _close(self, what: str, got: torch.Tensor, want: Optional[torch.Tensor]) -> None:
        if want is None:
            self.mismatch.append(f"{what} is not the sum of the upstream outputs before it")
            return
        # structural mismatches are of the order of the values; rounding is of the dtype's order
        eps = torch.finfo(got.dtype).eps if got.is_floating_point() else 0.0
        got, want = got.detach().double(), want.detach().double()
        if got.shape != want.shape:
            self.mismatch.append(f"{what} is not the sum of the upstream outputs before it")
            return
        # NaN where both hold it (the masked-out rows of eager attention) is no difference;
        # a NaN on one side only is, and must not hide the others (max over NaN is NaN)
        both = got.isnan() & want.isnan()
        diff = (got - want).abs().masked_fill(both, 0.0)
        tol = max(1e-4, 16 * eps) * float(want.masked_fill(both, 0.0).abs().max().clamp(min=1.0))
        if bool(diff.isnan().any()) or float(diff.max()) > tol:
            self.mismatch.append(f"{what} is not the sum of the upstream outputs before it")

    @contextlib.contextmanager
    def hooks(self):
        lay = self.lay
        hs = [lay.blocks[0].register_forward_pre_hook(self._entry, with_kwargs=True)]
        for l in range(len(lay.blocks)):
            hs.append(lay.blocks[l].register_forward_pre_hook(self._block(l), with_kwargs=True))
            hs.append(lay.attn_norm[l].register_forward_pre_hook(self._attn_norm(l), with_kwargs=True))
            hs.append(lay.attn_norm[l].register_forward_hook(self._attn_norm_out(l), with_kwargs=True))
            if len(lay.proj[l]) == 1:
                hs.append(lay.proj[l][0].register_forward_hook(self._proj(l, "fused"), with_kwargs=True))
            else:
                for which, mod in zip("qkv", lay.proj[l]):
                    hs.append(mod.register_forward_hook(self._proj(l, which), with_kwargs=True))
            hs.append(lay.o_proj[l].register_forward_pre_hook(self._o_proj(l), with_kwargs=True))
            hs.append(lay.mlp_norm[l].register_forward_pre_hook(self._mlp_norm(l), with_kwargs=True))
            hs.append(lay.mlp_norm[l].register_forward_hook(self._mlp_norm_out(l), with_kwargs=True))
            hs.append(lay.mlp[l].register_forward_hook(self._mlp_out(l), with_kwargs=True))
        hs.append(lay.final_norm.register_forward_pre_hook(self._final, with_kwargs=True))
        try:
            yield self
        finally:
            for h in hs:
                h.remove()
