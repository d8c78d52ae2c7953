"""Where relevance leaks: a per-module conservation audit of one forward and its backward.

Under LRP-family rules every rule-carrying computation conserves relevance: with the
rule's backward, Σ x·∂̃ over a module's inputs equals Σ y·∂̃ over its outputs, up to
what its biases take (Σ b·∂̃b) — the LN-rule (the normalising scale is a constant),
the Identity-rule (x·φ(x) = act(x)), the Half-rule (½uv + ½uv = uv), the AH-rule (the
pattern is a constant: y = A·V is linear in V), and linear maps. A nonlinearity that got
no rule breaks the balance where it is computed (RelP, arXiv 2508.21258, §3; AttnLRP,
ICML 2024, §3.1). The audit measures, for every module of the model, over its calls:

    gap = Σ relevance in + Σ bias relevance − Σ relevance out

and its **own gap**: the gap minus its submodules' gaps, i.e. what is lost in the
module's own forward code (a ``torch.tanh`` in a pooler, a norm computed inline). Gaps
add up along the graph, so the own gaps of all modules sum to the whole model's gap.

How it reads the relevance at a module boundary without disturbing the forward's values:
each floating tensor argument that carries gradient is replaced by a copy made for that
call alone (so its gradient is what this module sends back, not what every consumer of
the tensor does), and passed on as a second copy (so an in-place change inside the
module cannot alter the recorded one); each output of a module without a rule forward
likewise is recorded as a copy (what the module itself did with a tensor it returns, as
attention weights, is not relevance out) and handed downstream as a second copy; a rule
forward's output is recorded as it is (its output check wants that very tensor). Copies are bit-identical, so the forward's values are the model's own.
Biases (floating parameters whose name contains ``bias``) are made to require gradient
from the moment relevance enters (the entry), so that their share is measured, not
guessed; their flags are restored afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

from pyattr._repr import summary_repr
from pyattr.results import ResultViews
from pyattr.integration.install import state_of

# relative tolerance of an own gap to the relevance mass it is measured over, by dtype:
# float64 rounds at ~1e-16 per op, float32 at ~1e-7; 16-bit formats at ~1e-3 per op
_TOL = {torch.float64: 1e-7, torch.float32: 1e-4}
_TOL_16 = 3e-2


def tolerance(dtype: torch.dtype) -> float:
    """The relative own-gap tolerance the audit uses for a model in ``dtype``."""
    return _TOL.get(dtype, _TOL_16)


class _Call:
    __slots__ = ("path", "parent", "ins", "outs", "entry", "versions")

    def __init__(self, path: str, parent: Optional["_Call"]):
        self.path, self.parent = path, parent
        self.ins: List[torch.Tensor] = []
        self.outs: List[torch.Tensor] = []
        self.versions: List[int] = []
        self.entry = False


def _depends_on(entry: torch.Tensor, tensors: Sequence[torch.Tensor]) -> set:
    """The ids of the tensors in ``tensors`` whose autograd graph reaches the leaf ``entry``
    (memoised over the graph's nodes, iteratively: the graph may be deep)."""
    memo: Dict[object, bool] = {}

    def reaches(root) -> bool:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node is None or node in memo:
                continue
            if getattr(node, "variable", None) is entry:
                memo[node] = True
                continue
            kids = [n for n, _ in getattr(node, "next_functions", ()) if n is not None]
            if expanded:
                memo[node] = any(memo.get(k, False) for k in kids)
                continue
            stack.append((node, True))
            stack.extend((k, False) for k in kids if k not in memo)
        return memo.get(root, False)

    return {id(t) for t in tensors if t.grad_fn is not None and reaches(t.grad_fn)}


def _path_tensors(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad


def _swap(value, fn, depth: int = 0):
    """``value`` with every floating tensor that carries gradient replaced by ``fn(t)``
    (tuples, lists, dicts and ModelOutputs, a few levels deep)."""
    if _path_tensors(value):
        return fn(value)
    if depth > 3:
        return value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_swap(v, fn, depth + 1) for v in value)
    if isinstance(value, list):
        return [_swap(v, fn, depth + 1) for v in value]
    if isinstance(value, Mapping) and hasattr(value, "__setitem__"):
        for k in list(value.keys()):
            v = value[k]
            new = _swap(v, fn, depth + 1)
            if new is not v:
                value[k] = new
        return value
    return value


@dataclass
class ModuleGap:
    """One module's row of a :class:`RelevanceAudit` (relevance in units of the target)."""

    path: str
    cls: str
    calls: int
    relevance_in: float
    relevance_out: float
    bias_relevance: float
    gap: float  # relevance in + the biases inside it − relevance out
    own_gap: float  # the gap of its own forward code: gap minus its submodules' gaps
    scale: float
    leak: bool
    note: Optional[str] = None

    __repr__ = summary_repr


@dataclass
class RelevanceAudit(ResultViews):
    """A conservation audit (see :mod:`pyattr.integration.audit`).

    Attributes:
        modules (list[ModuleGap]): every module the relevance passed, in call order.
        target (float): the explained value (Σ grad_outputs · target).
        entry_relevance (float): Σ x·∂̃ at the entry (the embeddings' output or the first
            norm's input: where relevance methods read it).
        bias_relevance (float): Σ b·∂̃b over the biases after the entry.
        gap (float): entry relevance + bias relevance − target (0 when conserved): the
            sum of every module's own gap, with their sign (relevance in + bias − out).
        tolerance (float): the relative own-gap tolerance used (by the model's dtype).
    """

    modules: List[ModuleGap]
    target: float
    entry_relevance: float
    bias_relevance: float
    gap: float
    tolerance: float
    stale: List[str] = field(default_factory=list)

    @property
    def leaks(self) -> List[ModuleGap]:
        """The modules whose own forward code loses (or creates) relevance beyond the
        tolerance, largest |own gap| first."""
        return sorted((m for m in self.modules if m.leak), key=lambda m: -abs(m.own_gap))

    def to_pandas(self):
        """One row per module: path, class, calls, relevance in/out, bias, gap, own gap, leak."""
        import pandas as pd

        return pd.DataFrame([m.__dict__ for m in self.modules])

    def __repr__(self) -> str:
        lines = [f"RelevanceAudit(target={self.target:.6g}, entry_relevance={self.entry_relevance:.6g}, "
                 f"bias_relevance={self.bias_relevance:.6g}, gap={self.gap:.3g}, {len(self.modules)} modules, "
                 f"{len(self.leaks)} leaking)"]
        for m in self.leaks[:10]:
            lines.append(f"  {m.path or '<model>'} ({m.cls}): own gap {m.own_gap:.3g} of {m.scale:.3g}"
                         + (f" [{m.note}]" if m.note else ""))
        return "\n".join(lines)


def bypassed_activations(model: nn.Module) -> List[nn.Module]:
    """Activation modules (no parameters, no children, no rule of their own) of a module
    whose gated rule forward computes act(gate)·up in one fused op: hooks on them would be
    bypassed, which that rule refuses."""
    out = []
    for mod in model.modules():
        st = state_of(mod)
        if st is None or not any(k in st.counts for k in ("multiplicative_gate", "activation")):
            continue
        out.extend(c for c in mod.children() if state_of(c) is None and not list(c.children())
                   and not list(c.parameters()))
    return out


class ModuleAudit:
    """Hooks on every module of ``model`` for one forward; :meth:`finish` runs the
    backward and returns the :class:`RelevanceAudit`.

    ``absorbed``: module paths whose gap counts as their parent's own (the q/k projections
    whose gradient a rule scales: the pattern's share comes back in the attention core);
    ``exempt``: paths whose own gap a rule makes by design (attention under AttnLRP), with
    the note to show; ``unhooked``: modules a rule forward bypasses (a gated MLP's
    activation, computed inside the fused op), which must carry no hook. ``entered(t)`` must be called with the entry tensor (a leaf)."""

    def __init__(self, model: nn.Module, absorbed: Sequence[str] = (), exempt: Optional[Dict[str, str]] = None,
                 unhooked: Sequence[nn.Module] = ()):
        self.model = model
        self.unhooked = {id(m) for m in unhooked}
        self.absorbed = set(absorbed)
        self.exempt = dict(exempt or {})
        self.calls: List[_Call] = []
        self.stack: List[_Call] = []
        self.handles: list = []
        self.entry: Optional[torch.Tensor] = None
        self.flags: list = []
        self.names = {id(m): n for n, m in model.named_modules()}
        self.classes = {n: type(m).__name__ for n, m in model.named_modules()}
        # a bias held by several modules (a head's decoder.bias tied to predictions.bias)
        # belongs to the deepest holder: the module whose forward adds it
        holders: Dict[int, tuple] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            if "bias" in n.rsplit(".", 1)[-1] and p.is_floating_point():
                owner = n.rsplit(".", 1)[0] if "." in n else ""
                if id(p) not in holders or owner.count(".") > holders[id(p)][0].count("."):
                    holders[id(p)] = (owner, p)
        self.biases = list(holders.values())

    def __enter__(self) -> "ModuleAudit":
        for name, mod in self.model.named_modules():
            if id(mod) in self.unhooked:
                continue
            self.handles.append(mod.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(mod.register_forward_hook(self._post(name, mod), always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for p, flag in self.flags:
            p.requires_grad_(flag)
        self.flags.clear()

    def entered(self, t: torch.Tensor) -> None:
        """Relevance enters here: every module call now open counts ``t`` as an input;
        from now on biases carry gradient."""
        self.entry = t
        for c in self.stack:
            c.entry = True
        for _, p in self.biases:
            if not p.requires_grad:
                self.flags.append((p, False))
                p.requires_grad_(True)

    def _pre(self, name: str):
        def hook(mod, args, kwargs):
            call = _Call(name, self.stack[-1] if self.stack else None)
            self.calls.append(call)
            self.stack.append(call)

            def own(t):
                a = t.clone()
                call.ins.append(a)
                return a.clone()

            return _swap(args, own), _swap(kwargs, own)

        return hook

    def _post(self, name: str, mod: nn.Module):
        def hook(module, args, output):
            while self.stack and self.stack[-1].path != name:
                self.stack.pop()  # a call that raised and was caught inside its parent
            call = self.stack.pop() if self.stack else None
            if call is None:
                return None
            ruled = state_of(module) is not None  # its output check wants the very tensor it returned
            seen = set()

            def record(t):
                if ruled:  # the tensor itself (its rule forward's output is used by nothing inside)
                    if id(t) not in seen:
                        seen.add(id(t))
                        call.outs.append(t)
                        call.versions.append(t._version)
                    return t
                # a copy for the record (an output the module also used inside, as attention
                # weights, would count that use too), handed on as a second copy (so that an
                # in-place change downstream cannot alter the recorded one)
                c = t.clone()
                call.outs.append(c)
                call.versions.append(c._version)
                return c.clone()

            new = _swap(output, record)
            return None if ruled else new

        return hook

    def finish(self, value: torch.Tensor, grad_outputs: Optional[torch.Tensor] = None,
               extra_entries: Sequence[torch.Tensor] = ()) -> RelevanceAudit:
        """Backward from ``value`` (weighted by ``grad_outputs``) and the audit's rows.
        ``extra_entries``: leaves that enter with the entry (the streams ProphetNet appends
        after the tokens: inputs of the entry module whose relevance is the model's own
        share, not a leak)."""
        if self.entry is None:
            raise RuntimeError("audit: the entry was not reached during the forward")
        go = torch.ones_like(value) if grad_outputs is None else grad_outputs
        extra = [t for t in extra_entries if t.requires_grad]
        tensors, index = [self.entry, *extra], {id(t): i for i, t in enumerate([self.entry, *extra])}
        for c in self.calls:
            for t in c.ins + c.outs:
                if id(t) not in index and t.requires_grad:
                    index[id(t)] = len(tensors)
                    tensors.append(t)
        bias_at = {}
        for owner, p in self.biases:
            if p.requires_grad and id(p) not in index:
                index[id(p)] = len(tensors)
                bias_at.setdefault(owner, []).append(p)
                tensors.append(p)
        grads = torch.autograd.grad(value, tensors, go, allow_unused=True)
        # a tensor that does not depend on the entry (a relative position bias, or anything
        # computed from parameters alone, when the parameters are trainable) carries no
        # relevance: its share is a constant's, counted neither in nor out
        on_path = _depends_on(self.entry, tensors) | {id(p) for ps in bias_at.values() for p in ps}
        for t in extra:
            on_path |= _depends_on(t, tensors) | {id(t)}

        def rel(t) -> tuple:
            g = grads[index[id(t)]] if id(t) in index and (id(t) in on_path or t is self.entry) else None
            if g is None:
                return 0.0, 0.0
            r = t.detach().double() * g.double()
            return float(r.sum()), float(r.abs().sum())

        target = float((value.detach().double() * go.double()).sum())
        entry = sum(rel(t)[0] for t in [self.entry, *extra])
        rows: Dict[str, dict] = {}
        stale = []
        for c in self.calls:
            row = rows.setdefault(c.path, {"calls": 0, "in": 0.0, "out": 0.0, "mass": 0.0, "child": 0.0,
                                           "child_mass": 0.0})
            row["calls"] += 1
            for t in c.ins:
                s, m = rel(t)
                row["in"] += s
                row["mass"] += m
            if c.entry:
                for t in [self.entry, *extra]:
                    s, m = rel(t)
                    row["in"] += s
                    row["mass"] += m
            for t, v in zip(c.outs, c.versions):
                if t._version != v:
                    stale.append(c.path)
                s, m = rel(t)
                row["out"] += s
                row["mass"] += m
        bias_total = 0.0
        for owner, ps in bias_at.items():
            row = rows.get(owner)
            for p in ps:
                s, m = rel(p)
                bias_total += s
                if row is not None:
                    row["bias"] = row.get("bias", 0.0) + s
                    row["mass"] += m
        # own gap = (in − out) + own biases − Σ children's (in − out): a child's biases are
        # sources inside it, so its (in − out) is what the parent sees of it
        parent_of = {}
        for c in self.calls:
            if c.parent is not None and c.parent.path != c.path:
                parent_of.setdefault(c.path, c.parent.path)
        subtree = {p: r.get("bias", 0.0) for p, r in rows.items()}
        for path in sorted(parent_of, key=lambda p: -p.count(".")):
            subtree[parent_of[path]] = subtree.get(parent_of[path], 0.0) + subtree.get(path, 0.0)
        for path, r in rows.items():
            r["gap"] = r["in"] + subtree.get(path, 0.0) - r["out"]
        for path, parent in parent_of.items():
            if path in self.absorbed:
                continue
            rows[parent]["child"] += rows[path]["in"] - rows[path]["out"]
            rows[parent]["child_mass"] += rows[path]["mass"]
        tol = tolerance(next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32))
        floor = 1e-12 * max(abs(target), 1e-300)
        out = []
        for path, r in rows.items():
            if r["mass"] == 0.0 and r["child_mass"] == 0.0:
                continue  # not on the relevance's path
            own = r["in"] - r["out"] + r.get("bias", 0.0) - r["child"]
            scale = r["mass"] + r["child_mass"]
            note = self.exempt.get(path)
            leak = (path not in self.absorbed and note is None and math.isfinite(own)
                    and abs(own) > tol * scale + floor) or not math.isfinite(own)
            if path in self.absorbed:
                note = "a rule scales its gradient; counted in the attention module"
            out.append(ModuleGap(path, self.classes.get(path, "?"), r["calls"], r["in"], r["out"], r.get("bias", 0.0),
                                 r["gap"], own, scale, bool(leak), note))
        return RelevanceAudit(out, target, entry, bias_total, entry + bias_total - target, tol, sorted(set(stale)))
