"""``use_relevance_rules``: install rules on a model instance for the length of a scope."""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import re
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional

import torch
from torch import nn

from pyattr.activations import Activation, _kind_of_module, forward_fn
from pyattr.integration import architectures as A
from pyattr.integration.config import RelevanceRuleCoverage, RelevanceRules
from pyattr.integration.errors import RelevanceRuleConflictError, RelevanceRuleUnsupportedError
from pyattr.integration.patching import (
    acquire,
    has_hooks,
    per_column_scale,
    recomputing,
    release,
    snapshot,
    state_of,
)
from pyattr.ops.gated import gated_activation
from pyattr.ops.layer_norm import layer_norm
from pyattr.ops.rms_norm import rms_norm
from pyattr.rules.identity import apply_identity_rule
from pyattr.integration.attention import exactly as attention_exactly
from pyattr.integration.attention import frozen_attention
from pyattr.integration.attention import is_frozen as attention_is_frozen
from pyattr.rules.scale import scale_gradient
from pyattr.integration.wrappers import unwrap


@dataclass
class _Step:
    module: nn.Module
    path: str
    kind: str
    value: Any
    make_forward: Callable
    check_output: bool


# --- forward factories --------------------------------------------------------------------

def _bypass_message(path: str, act: str = "act_fn") -> str:
    return (
        f"{path + '.' + act!r} has hooks, but the gated-activation rule computes act(gate)·up "
        "in one op and would bypass them; remove the hooks or switch off activation and "
        "multiplicative_gate"
    )


def _norm_eps(module: nn.Module, path: str) -> float:
    for name in ("variance_epsilon", "eps"):
        eps = getattr(module, name, None)
        if isinstance(eps, (int, float)) and not isinstance(eps, bool):
            return float(eps)
    raise RelevanceRuleUnsupportedError(f"{path!r}: norm module has no numeric eps / variance_epsilon")


def _rms_forward(offset: float, eps: float):
    def make(module, state):
        native = state.native

        def forward(x):
            return rms_norm(x, module.weight, eps, offset, _native=native)

        return forward

    return make


def _layer_norm_forward(eps: float):
    def make(module, state):
        native = state.native

        def forward(x):
            return layer_norm(x, module.weight, module.bias, eps, _native=native)

        return forward

    return make


def _activation_forward(kind: str):
    def make(module, state):
        # in-place modules (nn.ReLU(inplace=True)) run out of place, as the saved input
        # must survive; otherwise the module's own forward, without its __call__
        inplace = kind != "custom" and getattr(module, "inplace", False)
        act = Activation(kind, forward_fn(module, kind) if inplace else state.native)

        def forward(x):
            return apply_identity_rule(x, act)

        return forward

    return make


_GATED_NAMES = ("gate_proj", "up_proj", "down_proj", "act_fn")


def _gated_forward(kind: str, path: str, names=_GATED_NAMES):
    """``down(act(gate(x)) * up(x))`` through the fused gated op; ``names`` are the MLP's
    (gate, up, down, act) attributes."""
    def make(mlp, state):
        gate, up, down, act_mod = (getattr(mlp, n) for n in names)
        # The module's own forward (bit-identical values) without its __call__: the
        # activation's hooks would be bypassed, which is checked at install and at each call.
        act = Activation(kind, forward_fn(act_mod, kind) if kind != "custom" else act_mod.forward)

        def forward(x):
            if has_hooks(act_mod):
                raise RelevanceRuleConflictError(_bypass_message(path, names[3]))
            h = gated_activation(
                gate(x), up(x), act, identity=state.active("activation"), half=state.active("multiplicative_gate")
            )
            return down(h)

        return forward

    return make


FusedGatedForm = A.FusedGatedForm  # the forms live in the architecture table


def _gated_fused_forward(kind: str, path: str, form: FusedGatedForm):
    """``down(drop(act(a)·b))`` with ``a, b = proj(x).chunk(2)`` through the fused op.
    The product is commutative in floating point (Phi-3 writes ``b * act(a)``), so the
    values are bit-identical."""
    def make(mlp, state):
        act_mod = getattr(mlp, form.act)
        act = Activation(kind, forward_fn(act_mod, kind) if kind != "custom" else act_mod.forward)
        proj, down = getattr(mlp, form.proj), getattr(mlp, form.down)
        drop = getattr(mlp, form.drop) if form.drop else None

        def forward(x):
            if has_hooks(act_mod):
                raise RelevanceRuleConflictError(_bypass_message(path, form.act))
            a, b = proj(x).chunk(2, dim=-1)
            h = gated_activation(a, b, act, identity=state.active("activation"), half=state.active("multiplicative_gate"))
            return down(h if drop is None else drop(h))

        return forward

    return make


def _is_experts_dispatcher(fn) -> bool:
    """``fn`` is transformers' ``use_experts_implementation`` forward (it dispatches to the
    configured implementation, which calls ``self._apply_gate``), not a forward of its own."""
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.replace("\\", "/").endswith("transformers/integrations/moe.py")


def _router_forward():
    """The router's (logits, routing weights, expert indices) with the weights detached:
    the frozen routing rule (the selected experts and the forward are unchanged)."""
    def make(router, state):
        native = state.native

        def forward(*args, **kwargs):
            logits, weights, index = native(*args, **kwargs)
            return logits, weights.detach(), index

        return forward

    return make


def _experts_forward(kind: str):
    """The experts' own (dispatched) forward, with their gate ``act(gate)·up`` computed by
    the fused gated_activation op: every non-eager experts implementation of transformers
    calls ``self._apply_gate(gate_up)``, so an instance attribute set for the call takes
    its place. The product is commutative, so the values are bit-identical."""
    def make(experts, state):
        native = state.native
        act = Activation(kind, forward_fn(experts.act_fn, kind) if kind != "custom" else experts.act_fn.forward)

        def apply_gate(gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return gated_activation(gate, up, act, identity=state.active("activation"),
                                    half=state.active("multiplicative_gate"))

        def forward(*args, **kwargs):
            experts.__dict__["_apply_gate"] = apply_gate
            try:
                return native(*args, **kwargs)
            finally:
                experts.__dict__.pop("_apply_gate", None)

        return forward

    return make


def _head_forward(act: Activation):
    """RoBERTa's masked-LM head, ``decoder(layer_norm(gelu(dense(x))))``, with the
    Identity-rule on the gelu it calls as a function (the LayerNorm is mounted itself)."""
    def make(head, state):
        def forward(features, **kwargs):
            x = head.dense(features)
            x = apply_identity_rule(x, act)
            x = head.layer_norm(x)
            return head.decoder(x)

        return forward

    return make


def _projection_forward(scale: float):
    def make(module, state):
        native = state.native

        def forward(*args, **kwargs):
            out = native(*args, **kwargs)
            if scale == 0.0:
                return out.detach()
            return scale_gradient(out, scale)

        return forward

    return make


def _fused_projection_forward(pattern: Callable[[int], torch.Tensor]):
    def make(module, state):
        native = state.native
        cache: dict = {}

        def forward(*args, **kwargs):
            out = native(*args, **kwargs)
            return scale_gradient(out, per_column_scale(out, pattern, cache))

        return forward

    return make


_ATTN_SCALES = {"frozen": (0.0, 0.0, 1.0), "attnlrp": (0.25, 0.25, 0.5)}


def _concat_pattern(scales):
    def pattern(n: int) -> torch.Tensor:
        if n % 3:
            raise RelevanceRuleUnsupportedError(f"fused q/k/v projection of width {n} is not divisible by 3")
        return torch.tensor(scales, dtype=torch.float32).repeat_interleave(n // 3)

    return pattern


def _split_pattern(scales, widths):
    """q | k | v of the given widths (GQA: k and v narrower than q)."""
    def pattern(n: int) -> torch.Tensor:
        if n != sum(widths):
            raise RelevanceRuleUnsupportedError(
                f"fused q/k/v projection of width {n}, expected q {widths[0]} + k {widths[1]} + v {widths[2]}"
            )
        return torch.cat([torch.full((w,), s, dtype=torch.float32) for s, w in zip(scales, widths)])

    return pattern


def _per_head_pattern(scales, head_size: int):
    def pattern(n: int) -> torch.Tensor:
        if n % (3 * head_size):
            raise RelevanceRuleUnsupportedError(
                f"fused q/k/v projection of width {n} is not a multiple of 3 × head_size {head_size}"
            )
        one = torch.tensor(scales, dtype=torch.float32).repeat_interleave(head_size)
        return one.repeat(n // (3 * head_size))

    return pattern


# --- planning -----------------------------------------------------------------------------

# The forms a rule forward re-implements, matched against the WHOLE body of the module's
# forward (statements joined by ";", whitespace removed): one extra statement or factor
# anywhere, and the module keeps its own forward (or the scope refuses).
_GATED_CALL = r"self\.{down}\(self\.{act}\(self\.{gate}\((?P<x>\w+)\)\)\*self\.{up}\((?P=x)\)\)"
_GATED_BODY = "return{call}"  # "v = call; return v" is folded into this first (_body_matches)
_GATED_FORM = re.compile(_GATED_BODY.format(call=_GATED_CALL.format(
    down="down_proj", act="act_fn", gate="gate_proj", up="up_proj")))
_GENERIC_GATED_FORM = re.compile(_GATED_BODY.format(call=_GATED_CALL.format(
    down="(?P<down>\\w+)", act="(?P<act>\\w+)", gate="(?P<gate>\\w+)", up="(?P<up>\\w+)")))
_HEAD_FORM = re.compile(r"x=self\.dense\(features\);x=gelu\(x\);x=self\.layer_norm\(x\);x=self\.decoder\(x\);returnx")


def _flat_body(fn) -> Optional[str]:
    """The body of a function, docstring dropped, statements joined by ";" and all
    whitespace removed (None if the source is unknown)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    func = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if func is None:
        return None
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return ";".join(re.sub(r"\s+", "", ast.unparse(st)) for st in body)


def _body_matches(fn, form) -> Optional["re.Match"]:
    body = _flat_body(fn)
    if body is None:
        return None
    one = re.fullmatch(r"(\w+)=([^;]+);return\1", body)  # v = expr; return v  ->  return expr
    return re.fullmatch(form, "return" + one[2] if one else body)


def plain_fused_gated_forward(mlp: nn.Module, form: FusedGatedForm) -> bool:
    """True when the MLP's forward is exactly ``form``'s."""
    return _body_matches(type(mlp).forward, form.pattern) is not None


def plain_gelu_head(head: nn.Module) -> bool:
    """True when the head's forward is exactly ``decoder(layer_norm(gelu(dense(x))))``."""
    return _body_matches(type(head).forward, _HEAD_FORM) is not None


def plain_gated_forward(mlp: nn.Module) -> bool:
    """True when the MLP's forward is exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``:
    the form the gated rule re-implements (no extra norm, multiplier or dropout)."""
    return _body_matches(type(mlp).forward, _GATED_FORM) is not None


class _Planner:
    def __init__(self, model: nn.Module, rules: RelevanceRules, model_type: str):
        self.model = model
        self.rules = rules
        self.cov = RelevanceRuleCoverage(model_type=model_type)
        self.steps: List[_Step] = []
        self.mounted: set = set()
        self.generic = model_type == "generic"
        # attention modules under the AH-rule: their core runs the dV-only backward
        self.frozen_attention: List[nn.Module] = []

    def need(self, path: str) -> nn.Module:
        mod = A.get_submodule(self.model, path)
        if not isinstance(mod, nn.Module):
            raise RelevanceRuleUnsupportedError(
                f"{self.cov.model_type}: expected a module at {path!r}, found {type(mod).__name__}"
            )
        return mod

    def off(self, kind: str, path: str, module: nn.Module, reason: str) -> None:
        """A mount whose rule this scope leaves off; an enclosing scope may still hold it."""
        st = state_of(module)
        if st is not None and st.active(kind):
            self.cov._inherit(path, kind)
        else:
            self.cov._skip(path, reason)

    def add(self, kind, path, module, value, make, check_output=True):
        self.steps.append(_Step(module, path, kind, value, make, check_output))
        self.cov._add(kind, path)
        self.mounted.add(id(module))

    def norm(self, path: str, norm: str, offset: float) -> None:
        mod = self.need(path)
        if isinstance(mod, nn.Identity):  # ModernBERT's first layer: no norm in that place
            self.mounted.add(id(mod))
            self.cov._skip(path, "nn.Identity: no norm here")
            return
        if norm == "layer_norm":
            if not isinstance(mod, nn.LayerNorm) or len(mod.normalized_shape) != 1:
                raise RelevanceRuleUnsupportedError(
                    f"{path!r}: the LN-rule needs an nn.LayerNorm over the last dimension, "
                    f"found {type(mod).__name__}"
                )
            make = _layer_norm_forward(float(mod.eps))
        else:
            w = getattr(mod, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 1:
                raise RelevanceRuleUnsupportedError(f"{path!r}: RMSNorm without a 1-D weight")
            make = _rms_forward(offset, _norm_eps(mod, path))
        self.mounted.add(id(mod))
        if self.rules.normalization:
            self.add("normalization", path, mod, (norm, offset), make)
        else:
            self.off("normalization", path, mod, "normalization rule off")

    def gated_mlp(self, path: str) -> None:
        mlp = self.need(path)
        for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
            if not isinstance(getattr(mlp, name, None), nn.Module):
                raise RelevanceRuleUnsupportedError(
                    f"{path!r}: a gated MLP needs gate_proj, up_proj, down_proj and act_fn modules; "
                    f"{name} is missing"
                )
        kind = _kind_of_module(mlp.act_fn) or "custom"
        self.mounted.add(id(mlp.act_fn))
        wanted = [k for k in ("activation", "multiplicative_gate") if getattr(self.rules, k)]
        if wanted and not plain_gated_forward(mlp):
            msg = (
                f"{path!r}: {type(mlp).__name__}.forward is not the plain "
                "down_proj(act_fn(gate_proj(x)) * up_proj(x)); the gated rule would change its forward"
            )
            if self.generic:
                for k in wanted:
                    self.cov._skip(path, msg)
                return
            raise RelevanceRuleUnsupportedError(msg)
        for k in ("activation", "multiplicative_gate"):
            if k not in wanted:
                self.off(k, path, mlp, f"{k} rule off")
        if not wanted:
            return
        if has_hooks(mlp.act_fn):
            raise RelevanceRuleConflictError(_bypass_message(path))
        for k in wanted:
            self.add(k, path, mlp, True, _gated_forward(kind, path), check_output=False)

    def gated_fused_mlp(self, path: str, form: FusedGatedForm) -> None:
        """An MLP with one projection for gate and up (Phi-3's gate_up_proj, ModernBERT's
        GeGLU Wi): the Identity- and Half-rules through the fused gated_activation op, as
        for a gated MLP with separate projections."""
        mlp = self.need(path)
        for name in (form.proj, form.act, form.down) + ((form.drop,) if form.drop else ()):
            if not isinstance(getattr(mlp, name, None), nn.Module):
                raise RelevanceRuleUnsupportedError(
                    f"{path!r}: a fused gated MLP needs {form.proj}, {form.act} and {form.down} modules; "
                    f"{name} is missing"
                )
        act = getattr(mlp, form.act)
        kind = _kind_of_module(act) or "custom"
        self.mounted.add(id(act))
        wanted = self.gated_kinds(path, mlp)
        if not wanted:
            return
        if not plain_fused_gated_forward(mlp, form):
            raise RelevanceRuleUnsupportedError(
                f"{path!r}: {type(mlp).__name__}.forward is not the plain a, b = {form.proj}(x).chunk(2); "
                f"{form.down}(act(a) * b); the gated rule would change its forward"
            )
        if has_hooks(act):
            raise RelevanceRuleConflictError(_bypass_message(path, form.act))
        for k in wanted:
            self.add(k, path, mlp, True, _gated_fused_forward(kind, path, form), check_output=False)

    def moe(self, path: str) -> None:
        """A sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE): the routing
        rule on the router (and the shared-expert gate), the Identity- and Half-rules on
        the experts' gate through the fused op, the gated MLP rules on a shared expert.
        A layer of the model without experts is a plain gated MLP."""
        block = self.need(path)
        experts, router = getattr(block, "experts", None), getattr(block, "gate", None)
        if not isinstance(experts, nn.Module):
            self.gated_mlp(path)
            return
        if not isinstance(router, nn.Module):
            raise RelevanceRuleUnsupportedError(f"{path!r}: a mixture-of-experts block needs a gate (router) module")
        if self.rules.any():
            self._check_block(path, block)
        gates = [(A.join(path, "gate"), router, _router_forward())]
        shared_gate = getattr(block, "shared_expert_gate", None)
        if isinstance(shared_gate, nn.Module):
            gates.append((A.join(path, "shared_expert_gate"), shared_gate, _projection_forward(0.0)))
        for p, mod, make in gates:
            self.mounted.add(id(mod))
            if self.rules.routing:
                self.add("routing", p, mod, self.rules.routing, make)
            else:
                self.off("routing", p, mod, "routing rule off")
        epath = A.join(path, "experts")
        wanted = self.gated_kinds(epath, experts)
        if wanted:
            self._check_experts(epath, experts)
            kind = _kind_of_module(experts.act_fn) or "custom"
            self.mounted.add(id(experts.act_fn))
            for k in wanted:
                self.add(k, epath, experts, True, _experts_forward(kind), check_output=False)
        if isinstance(getattr(block, "shared_expert", None), nn.Module):
            self.gated_mlp(A.join(path, "shared_expert"))

    def _check_block(self, path: str, block: nn.Module) -> None:
        """The sparse block's forward must be the library's own (the router's second output
        scales the experts' outputs; the shared expert behind a sigmoid gate), body for
        body: a block that recomputes its weights from the router logits would bypass the
        routing rule."""
        arch = A.ARCHITECTURES.get(self.cov.model_type)
        own = arch.moe_block if arch is not None else None
        ref = None
        if own is not None:
            try:
                ref = getattr(importlib.import_module(own[0]), own[1])
            except (ImportError, AttributeError):
                ref = None
        body = _flat_body(type(block).forward)
        if ref is None or body is None or body != _flat_body(ref.forward):
            raise RelevanceRuleUnsupportedError(
                f"{path!r}: {type(block).__name__}.forward is not the {own[1] if own else 'library'} forward the "
                "routing and gated rules are placed for; they would not apply where it computes its routing"
            )

    def _check_experts(self, path: str, experts: nn.Module) -> None:
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
            (_is_experts_dispatcher(type(experts).forward),
             f"{type(experts).__name__}.forward is its own, not transformers' experts dispatcher that calls "
             "_apply_gate"),
        ]
        for ok, why in checks:
            if not ok:
                raise RelevanceRuleUnsupportedError(f"{path!r}: {why}; the gated rules cannot be placed")
        if has_hooks(experts.act_fn):
            raise RelevanceRuleConflictError(_bypass_message(path))

    def gated_kinds(self, path: str, mod: nn.Module) -> List[str]:
        """The gated rule kinds these rules ask for; the others are recorded as off."""
        wanted = [k for k in ("activation", "multiplicative_gate") if getattr(self.rules, k)]
        for k in ("activation", "multiplicative_gate"):
            if k not in wanted:
                self.off(k, path, mod, f"{k} rule off")
        return wanted

    def generic_gated_mlp(self, path: str, names) -> None:
        """A gated MLP found by the form of its forward, under any attribute names."""
        gate, up, down, act_name = names
        mlp = self.need(path)
        act = getattr(mlp, act_name)
        kind = _kind_of_module(act) or "custom"
        wanted = self.gated_kinds(path, mlp)
        if not wanted:
            return
        if has_hooks(act):
            raise RelevanceRuleConflictError(_bypass_message(path, act_name))
        for k in wanted:
            self.add(k, path, mlp, True, _gated_forward(kind, path, names), check_output=False)

    def structural_norm(self, path, mod, kind, weight_spec, eps, make_forward) -> None:
        self.mounted.add(id(mod))
        if self.rules.normalization:
            self.add("normalization", path, mod, ("structural", kind), make_forward(kind, weight_spec, eps))
        else:
            self.off("normalization", path, mod, "normalization rule off")

    def head_forward(self, path: str) -> None:
        head = A.get_submodule(self.model, path)
        if not isinstance(head, nn.Module):
            return  # the model without its head
        if not self.rules.activation:
            self.off("activation", path, head, "activation rule off")
            return
        gelu = getattr(inspect.getmodule(type(head)), "gelu", None)
        kind = _kind_of_module(gelu) if isinstance(gelu, nn.Module) else None
        if kind is None or not plain_gelu_head(head):
            raise RelevanceRuleUnsupportedError(
                f"{path!r}: {type(head).__name__}.forward is not the plain decoder(layer_norm(gelu(dense(x)))); "
                "the Identity-rule cannot be placed on its activation"
            )
        self.add("activation", path, head, kind, _head_forward(Activation(kind, forward_fn(gelu, kind))))

    def activation(self, path: str, mlp_path: Optional[str]) -> None:
        mod = self.need(path)
        kind = _kind_of_module(mod) or "custom"
        self.mounted.add(id(mod))
        if self.rules.activation:
            self.add("activation", path, mod, kind, _activation_forward(kind))
        else:
            self.off("activation", path, mod, "activation rule off")
        if self.rules.multiplicative_gate and mlp_path is not None:
            self.cov._skip(mlp_path, "no multiplicative gate in this MLP")

    def attention(self, layer: str, spec) -> None:
        mode = self.rules.attention
        layout = spec[0]
        if layout == "separate":
            paths = [A.join(layer, p) for p in spec[1:]]
            mods = [self.need(p) for p in paths]
            if not mode:
                for p, m in zip(paths, mods):
                    self.off("attention", p, m, "attention rule off")
                return
            for role, p, m, s in zip("qkv", paths, mods, _ATTN_SCALES[mode]):
                if s == 1.0:
                    self.cov._skip(p, "value path stays native under the AH-rule")
                    continue
                self.add("attention", p, m, (mode, role), _projection_forward(s))
            self.freeze(paths[0])
            return
        path = A.join(layer, spec[1])
        mod = self.need(path)
        if not mode:
            self.off("attention", path, mod, "attention rule off")
            return
        if layout == "concat":
            pattern = _concat_pattern(_ATTN_SCALES[mode])
        elif layout == "split":
            parent = self.need(path.rsplit(".", 1)[0])
            cfg = getattr(parent, "config", None)
            head_dim = getattr(parent, "head_dim", None)
            heads = getattr(cfg, "num_attention_heads", None)
            kv = getattr(cfg, "num_key_value_heads", None) or heads
            if not all(isinstance(v, int) for v in (head_dim, heads, kv)):
                raise RelevanceRuleUnsupportedError(f"{path!r}: cannot find the q/k/v head counts and head_dim")
            pattern = _split_pattern(_ATTN_SCALES[mode], (heads * head_dim, kv * head_dim, kv * head_dim))
        else:
            parent = self.need(path.rsplit(".", 1)[0])
            head_size = getattr(parent, "head_size", None)
            if not isinstance(head_size, int):
                raise RelevanceRuleUnsupportedError(f"{path!r}: cannot find the attention head size")
            pattern = _per_head_pattern(_ATTN_SCALES[mode], head_size)
        self.add("attention", path, mod, (mode, "qkv"), _fused_projection_forward(pattern))
        self.freeze(path)

    def freeze(self, projection: str) -> None:
        """Under the AH-rule, the attention module owning ``projection`` runs its core with
        the dV-only backward (integration/attention.py)."""
        if self.rules.attention == "frozen" and "." in projection:
            parent = A.get_submodule(self.model, projection.rsplit(".", 1)[0])
            if isinstance(parent, nn.Module):
                self.frozen_attention.append(parent)

    def qk_norms(self, paths, norm: str, offset: float) -> None:
        """Per-head q/k norms (Qwen3): the LN-rule under AttnLRP with ``normalization`` on,
        as the AttnLRP reference treats every norm; native otherwise (under the AH-rule no
        gradient reaches q or k, so a rule there would change nothing)."""
        for path in paths:
            mod = A.get_submodule(self.model, path)
            if not isinstance(mod, nn.Module):
                continue
            self.mounted.add(id(mod))
            if self.rules.attention != "attnlrp":
                why = "AH-rule: no gradient reaches q/k" if self.rules.attention else "attention rule off"
                self.cov._skip(path, f"q/k norm left native ({why}; the LN-rule applies here under attnlrp)")
                continue
            if not self.rules.normalization:
                self.off("normalization", path, mod, "normalization rule off")
                continue
            w = getattr(mod, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 1:
                raise RelevanceRuleUnsupportedError(f"{path!r}: q/k RMSNorm without a 1-D weight")
            self.add("normalization", path, mod, (norm, offset), _rms_forward(offset, _norm_eps(mod, path)))

    def skip_lookalikes(self) -> None:
        for name, mod in self.model.named_modules():
            if id(mod) in self.mounted:
                continue
            cls = type(mod).__name__
            if isinstance(mod, nn.LayerNorm) or cls.endswith("RMSNorm"):
                self.cov._skip(name, "not a residual-stream norm")


def _plan_known(model: nn.Module, rules: RelevanceRules, model_type: str) -> _Planner:
    arch = A.ARCHITECTURES[model_type]
    pl = _Planner(model, rules, model_type)
    prefix = A.base_prefix(model)
    layers = A.layer_paths(model, arch)
    if not layers:
        raise RelevanceRuleUnsupportedError(
            f"{model_type}: expected a ModuleList of blocks at {A.join(prefix, arch.layers)!r}"
        )
    for p in arch.outer_norms:
        if p.startswith("embeddings"):
            pl.norm(A.join(prefix, p), arch.norm, arch.offset)
    for layer in layers:
        cross = A.get_submodule(model, A.join(layer, "crossattention"))
        if rules.any() and isinstance(cross, nn.Module):
            # a decoder block with cross-attention has a third sublayer (its own LayerNorm on
            # the residual stream, q from the decoder, k/v from the encoder) that no rule
            # map covers: relevance would be lost there without a word
            raise RelevanceRuleUnsupportedError(
                f"{model_type}: {A.join(layer, 'crossattention')!r} ({type(cross).__name__}) is cross-attention, "
                "which the rule map does not cover (its LayerNorm and its q/k paths would carry no rule); "
                "use the model without add_cross_attention, or RelevanceRules() for plain gradients"
            )
        for p in arch.layer_norms:
            pl.norm(A.join(layer, p), arch.norm, arch.offset)
        pl.attention(layer, arch.attention)
        pl.qk_norms([A.join(layer, p) for p in arch.qk_norms], arch.norm, arch.offset)
        kind, p = arch.mlp
        if kind == "gated":
            pl.gated_mlp(A.join(layer, p))
        elif kind == "gated_fused":
            pl.gated_fused_mlp(A.join(layer, p), arch.fused_mlp)
        elif kind == "moe":
            pl.moe(A.join(layer, p))
        else:
            pl.activation(A.join(layer, p), A.join(layer, p.rsplit(".", 1)[0]))
    for p in arch.outer_norms:
        if not p.startswith("embeddings"):
            pl.norm(A.join(prefix, p), arch.norm, arch.offset)
    # a head's transform sits between the last block and the logits: without its rules
    # the relevance reaching the target would be lost there (BERT's masked-LM head)
    for p in arch.head_acts:
        if isinstance(A.get_submodule(model, p), nn.Module):
            pl.activation(p, p.rsplit(".", 1)[0])
    for p in arch.head_norms:
        if isinstance(A.get_submodule(model, p), nn.Module):
            pl.norm(p, arch.norm, arch.offset)
    if arch.head_forward:
        pl.head_forward(arch.head_forward)
    for p in arch.base_acts:  # the pooler's tanh: the Identity-rule in its general form act(x)/x
        path = A.join(prefix, p)
        if isinstance(A.get_submodule(model, path), nn.Module):
            pl.activation(path, None)
    for p, cls in arch.unruled_heads:
        mod = A.get_submodule(model, p)
        if isinstance(mod, nn.Module) and type(mod).__name__ == cls:
            pl.mounted.add(id(mod))
            pl.cov._skip(p, f"{cls} applies its activation as a function (torch.tanh) that no rule reaches: "
                            "relevance is not conserved through this head")
    pl.skip_lookalikes()
    return pl


def model_type_of(model: nn.Module) -> Optional[str]:
    return A.model_type(model)


def plan(model: nn.Module, rules: RelevanceRules, generic: bool = False) -> _Planner:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(rules, RelevanceRules):
        raise TypeError(f"rules must be a RelevanceRules, got {type(rules).__name__}")
    mt = model_type_of(model)
    if mt in A.ARCHITECTURES:
        return _plan_known(model, rules, mt)
    if generic:
        from pyattr.integration.generic import plan_generic  # it builds on this module's planner

        return plan_generic(model, rules)
    if not rules.any():
        # every rule off: nothing to install, so any architecture works (plain gradients)
        return _Planner(model, rules, mt)
    raise RelevanceRuleUnsupportedError(
        f"model type {mt!r} ({type(model).__name__}) has no rule map; supported: "
        f"{sorted(A.ARCHITECTURES)}. Pass generic=True for structural installation."
    )


@contextlib.contextmanager
def use_relevance_rules(
    model: nn.Module, rules: Optional[RelevanceRules] = None, *, generic: bool = False
) -> Iterator[RelevanceRuleCoverage]:
    """Install relevance rules on ``model``'s module instances for the ``with`` block.

    Args:
        model (nn.Module): a Hugging Face model (Llama, Mistral, Qwen2, Qwen3, Gemma,
            Gemma2, Gemma 3 text, OLMo 2, Phi-3, GPT-2, GPT-NeoX/Pythia, BERT, RoBERTa,
            DistilBERT), with or without its head; also placed by accelerate, or wrapped in
            DataParallel / DDP.
        rules (RelevanceRules, optional): which rules. ``RelevanceRules()`` is every rule off
            (TransformerLens' defaults: ``RelevanceRules(normalization=True)`` is the
            LN-rule alone). Default (``None``): ``RelevanceRules.all()``, the four rules
            with the AH-rule.
        generic (bool): for an architecture without a rule map, install the rules
            structurally (:func:`pyattr.integration.generic.plan_generic`) instead of raising. Default: False.

    Yields:
        RelevanceRuleCoverage: installed and skipped dotted paths.

    Forwards stay bit-identical to the model's own. Patches are per instance, refcounted
    per (module, rule kind) across nested scopes, and removed on exit, exceptions included.
    With Hugging Face gradient checkpointing, a recomputed block runs with exactly the
    rules its forward ran with, whenever and in whatever scope the backward runs (see
    :func:`_checkpoints_bound`).

    Raises:
        RelevanceRuleUnsupportedError: unknown model type (without ``generic``), or a
            mount that is not of the expected form; raised before anything is patched.
        RelevanceRuleConflictError: a nested scope asks for another attention mode on the
            same module; a hook sits on an activation the gated rule bypasses; at run
            time, a forward hook replaces the output of a rule-carrying module.
    """
    model = unwrap(model)
    rules = RelevanceRules.all() if rules is None else rules
    pl = plan(model, rules, generic)
    # probe the backends (load the extension, register its ops) now, not first inside a
    # graph torch.compile traces, where the one-time registration cannot run
    from pyattr.backends import available_backends

    available_backends()
    done: List[_Step] = []
    try:
        for st in pl.steps:
            acquire(st.module, st.path, st.kind, st.value, st.make_forward, st.check_output)
            done.append(st)
        with _checkpoints_bound(model), frozen_attention(pl.frozen_attention):
            yield pl.cov
    finally:
        for st in reversed(done):
            release(st.module, st.kind)


# --- activation checkpointing -------------------------------------------------------------

CHECKPOINT_INNER = "_pyattr_checkpoint_inner"
_SCOPES = "_pyattr_checkpoint_scopes"


def _block_of(run_function, owner: nn.Module) -> nn.Module:
    """The module a checkpointed function runs: ``partial(layer.__call__)`` or
    ``block.__call__`` in Hugging Face's models, else the module that checkpoints."""
    fn = getattr(run_function, "func", run_function)
    mod = getattr(fn, "__self__", None)
    return mod if isinstance(mod, nn.Module) else owner


def bind_checkpoint(fn: Callable, owner: nn.Module) -> Callable:
    def checkpointed(run_function, *args, **kwargs):
        mods = list(_block_of(run_function, owner).modules())
        snap = snapshot(mods)  # the rules of this forward, whatever holds them
        frozen = [m for m in mods if attention_is_frozen(m)]
        first = [True]

        def run(*a, **k):
            if first[0]:
                return run_function(*a, **k)
            with recomputing(mods, snap), attention_exactly(mods, frozen):
                return run_function(*a, **k)

        try:
            return fn(run, *args, **kwargs)
        finally:
            first[0] = False

    setattr(checkpointed, CHECKPOINT_INNER, fn)
    return checkpointed


def _wrap_checkpoint_functions(model: nn.Module) -> None:
    for mod in model.modules():
        fn = mod.__dict__.get("_gradient_checkpointing_func")
        if callable(fn) and not hasattr(fn, CHECKPOINT_INNER):
            mod.__dict__["_gradient_checkpointing_func"] = bind_checkpoint(fn, mod)


@contextlib.contextmanager
def _checkpoints_bound(model: nn.Module):
    """Activation-checkpoint recomputations run with the rules of their forward.

    Hugging Face gradient checkpointing (``model.gradient_checkpointing_enable()``) runs
    a block's forward again during the backward. Without care, a backward that starts
    after the scope ended would recompute the block without the rules (a mixture of rule
    and plain gradients when reentrant; a ``CheckpointError`` when not), and one run in
    another scope would recompute with that scope's rules. While any scope is open on
    the model, each block's ``_gradient_checkpointing_func`` (also one set by
    ``gradient_checkpointing_enable()`` inside the scope) is wrapped so that it records
    the rules active at the forward and reinstalls exactly those for the recomputation.
    A block checkpointed outside every scope recomputes without rules even inside one
    (see ``patching._unbound_recomputation``).
    """
    count = model.__dict__.get(_SCOPES, 0)
    model.__dict__[_SCOPES] = count + 1
    _wrap_checkpoint_functions(model)
    hook = model.register_forward_pre_hook(lambda mod, args: _wrap_checkpoint_functions(model))
    try:
        yield
    finally:
        hook.remove()
        model.__dict__[_SCOPES] -= 1
        if model.__dict__[_SCOPES] == 0:
            del model.__dict__[_SCOPES]
            for mod in model.modules():
                fn = mod.__dict__.get("_gradient_checkpointing_func")
                if hasattr(fn, CHECKPOINT_INNER):
                    mod.__dict__["_gradient_checkpointing_func"] = getattr(fn, CHECKPOINT_INNER)
