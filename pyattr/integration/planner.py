"""The planner: which rule mounts on which module of a mapped architecture (by position in
the architecture table, never by class), checked before anything is installed."""

from __future__ import annotations

import inspect
import weakref
from typing import List, Optional

import torch
from torch import nn

import pyattr.architectures as A
from pyattr._module_forward import class_body as _class_body, forward_name, forward_of
from pyattr.activations import Activation, _kind_of_module, forward_fn
from pyattr.architectures.forms import (
    classify_norm,
    replaced_on_instance,
    plain_gelu_head,
)
from pyattr.config import RelevanceRuleCoverage, RelevanceRules
from pyattr.integration.errors import (
    RelevanceRuleUnsupportedError,
)
from pyattr.integration.forwards import (
    ATTN_SCALES,
    Step,
    activation_forward,
    concat_pattern,
    fused_projection_forward,
    head_forward,
    layer_norm_forward,
    norm_eps,
    per_head_pattern,
    projection_forward,
    rms_forward,
    router_forward,
    split_pattern,
    verify_rebuilt,
)
from pyattr.integration.gated_plan import plan_gated, plan_gated_fused, plan_gated_named
from pyattr.integration.install import state_of
from pyattr.integration.moe_checks import check_moe_block
from pyattr.integration.moe_plan import plan_experts, plan_gates


#: norms observed to compute the formula their rule assumes: module -> (forward, (kind, offset))
_NORM_VERDICTS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


class Planner:
    def __init__(self, model: nn.Module, rules: RelevanceRules, model_type: str):
        self.model = model
        self.rules = rules
        self.cov = RelevanceRuleCoverage(model_type=model_type)
        self.steps: List[Step] = []
        self.mounted: set = set()
        self.generic = model_type == "generic"
        # attention modules under the AH-rule: their core runs the dV-only backward
        self.frozen_attention: List[nn.Module] = []
        self.attnlrp_attention: List[nn.Module] = []
        # modules left native on purpose (q/k norms under the AH-rule, a generic MoE block):
        # a generic scope's functional rules stay out of them too
        self.native: List[nn.Module] = []
        # a mapped model's forward applies a nonlinearity as a function after its base model
        # (pyattr.integration.functional.head_functional_rules)
        self.head_region = False
        # modules whose own forward, replaced on the instance or not, pyattr observes (a norm's
        # formula on probe rows, an activation's Identity-rule read off its own output)
        self.observed: set = set()

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

    def add(self, kind, path, module, value, make, check_output=True, rebuilt=False):
        """One rule mount; ``rebuilt``: the rule forward computes the module's output itself
        (bypassing its own forward), so it is checked against it on the first call."""
        self.steps.append(Step(module, path, kind, value, make, check_output,
                               verify_rebuilt(path, (kind, repr(value), getattr(make, "__qualname__", "")))
                               if rebuilt else None))
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
            make = layer_norm_forward(float(mod.eps))
        else:
            w = getattr(mod, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 1:
                raise RelevanceRuleUnsupportedError(f"{path!r}: RMSNorm without a 1-D weight")
            make = rms_forward(offset, norm_eps(mod, path))
        self.mounted.add(id(mod))
        if self.rules.normalization:
            self._check_norm(path, mod, norm, offset)
            self.observed.add(id(mod))
        if self.rules.normalization:
            self.add("normalization", path, mod, (norm, offset), make)
        else:
            self.off("normalization", path, mod, "normalization rule off")

    def _check_norm(self, path: str, mod: nn.Module, norm: str, offset: float) -> None:
        """A norm keeps its own forward (its values); the LN-rule's backward assumes the
        norm's formula with the module's own weight and eps, which the architecture's own
        norm class computes (its forward as written in its class body, or torch's
        ``nn.LayerNorm.forward``). Any other forward (one a kernel library or a user patched
        onto the class or the instance) is observed on probe rows
        (:func:`~pyattr.architectures.forms.classify_norm`) and must compute it. The
        verdict is kept per module and forward function."""
        fn = forward_of(mod)
        if fn is nn.LayerNorm.forward or _class_body(type(mod), fn):
            return
        kept = _NORM_VERDICTS.get(mod)
        if kept is not None and kept[0] is fn and kept[1] == (norm, offset):
            return
        found = classify_norm(mod, None)
        w = getattr(mod, "weight", None)
        ok = found is not None and found[0] == norm and (
            found[1][0] is w and found[1][1] == offset if isinstance(w, torch.Tensor) else True)
        if ok:
            _NORM_VERDICTS[mod] = (fn, (norm, offset))
        if not ok:
            raise RelevanceRuleUnsupportedError(
                f"{path!r}: {forward_name(mod)} does not compute the "
                f"{norm.replace('_', ' ')} with its weight{' + ' + str(offset) if offset else ''} and eps that the "
                "LN-rule's backward assumes (observed on probe rows); the rule would give it another gradient. "
                "Restore its forward, or switch normalization off")

    def moe(self, path: str) -> None:
        """A sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE): the routing
        rule on the router (and the shared-expert gate), the Identity- and Half-rules on
        the experts' gate through the fused op, the gated MLP rules on a shared expert.
        A layer of the model without experts is a plain gated MLP."""
        block = self.need(path)
        experts, router = getattr(block, "experts", None), getattr(block, "gate", None)
        if not isinstance(experts, nn.Module):
            plan_gated(self, path)
            return
        if not isinstance(router, nn.Module):
            raise RelevanceRuleUnsupportedError(f"{path!r}: a mixture-of-experts block needs a gate (router) module")
        if self.rules.any():
            check_moe_block(self.cov.model_type, path, block)
        plan_gates(self, path, block, "gate", router_forward())
        plan_experts(self, A.join(path, "experts"), experts)
        if isinstance(getattr(block, "shared_expert", None), nn.Module):
            plan_gated(self, A.join(path, "shared_expert"))

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
                f"{path!r}: {forward_name(head)} is not the plain decoder(layer_norm(gelu(dense(x)))); "
                "the Identity-rule cannot be placed on its activation"
            )
        self.add("activation", path, head, kind, head_forward(Activation(kind, forward_fn(gelu, kind))), rebuilt=True)

    def activation(self, path: str, mlp_path: Optional[str]) -> None:
        mod = self.need(path)
        kind = _kind_of_module(mod) or "custom"
        self.mounted.add(id(mod))
        self.observed.add(id(mod))
        if self.rules.activation:
            self.add("activation", path, mod, kind, activation_forward(kind))
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
            for role, p, m, s in zip("qkv", paths, mods, ATTN_SCALES[mode]):
                if s == 1.0:
                    self.cov._skip(p, "value path stays native under the AH-rule")
                    continue
                self.add("attention", p, m, (mode, role), projection_forward(s))
            self.freeze(paths[0])
            return
        path = A.join(layer, spec[1])
        mod = self.need(path)
        if not mode:
            self.off("attention", path, mod, "attention rule off")
            return
        if layout == "concat":
            pattern = concat_pattern(ATTN_SCALES[mode])
        elif layout == "split":
            parent = self.need(path.rsplit(".", 1)[0])
            cfg = getattr(parent, "config", None)
            head_dim = getattr(parent, "head_dim", None)
            heads = getattr(cfg, "num_attention_heads", None)
            kv = getattr(cfg, "num_key_value_heads", None) or heads
            if not all(isinstance(v, int) for v in (head_dim, heads, kv)):
                raise RelevanceRuleUnsupportedError(f"{path!r}: cannot find the q/k/v head counts and head_dim")
            pattern = split_pattern(ATTN_SCALES[mode], (heads * head_dim, kv * head_dim, kv * head_dim))
        else:
            parent = self.need(path.rsplit(".", 1)[0])
            head_size = getattr(parent, "head_size", None)
            if not isinstance(head_size, int):
                raise RelevanceRuleUnsupportedError(f"{path!r}: cannot find the attention head size")
            pattern = per_head_pattern(ATTN_SCALES[mode], head_size)
        self.add("attention", path, mod, (mode, "qkv"), fused_projection_forward(pattern))
        self.freeze(path)

    def freeze(self, projection: str) -> None:
        """Under the AH-rule, the attention module owning ``projection`` runs its core with
        the dV-only backward; under AttnLRP, its eager core with the blockwise full
        backward (integration/attention.py)."""
        if self.rules.attention in ("frozen", "attnlrp") and "." in projection:
            parent = A.get_submodule(self.model, projection.rsplit(".", 1)[0])
            if isinstance(parent, nn.Module):
                (self.frozen_attention if self.rules.attention == "frozen" else self.attnlrp_attention).append(parent)

    def score_bias(self, paths) -> None:
        """Projections of the hidden states added to the attention logits (ProphetNet's position
        bias): q·k's logit-path rule — none under the AH-rule, the ½ p·v leaves under AttnLRP."""
        for path in paths:
            mod, mode = self.need(path), self.rules.attention
            if mode:
                self.add("attention", path, mod, (mode, "score"), projection_forward(2 * ATTN_SCALES[mode][0]))
            else:
                self.off("attention", path, mod, "attention rule off")

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
                self.native.append(mod)
                why = "AH-rule: no gradient reaches q/k" if self.rules.attention else "attention rule off"
                self.cov._skip(path, f"q/k norm left native ({why}; the LN-rule applies here under attnlrp)")
                continue
            if not self.rules.normalization:
                self.off("normalization", path, mod, "normalization rule off")
                continue
            w = getattr(mod, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 1:
                raise RelevanceRuleUnsupportedError(f"{path!r}: q/k RMSNorm without a 1-D weight")
            self.add("normalization", path, mod, (norm, offset), rms_forward(offset, norm_eps(mod, path)))

    def head_functional(self, path: str, what: str) -> None:  # noqa: ARG002 - ``what`` names it for the reader
        """A nonlinearity the model's forward applies as a function after its base model
        returns (a classification head's ``torch.tanh``, Gemma 2's logit soft-capping): the
        functional rules (:mod:`pyattr.integration.functional`, the Identity-rule on
        ``torch.tanh``) run in that stretch of the forward, from the base model's output to
        the model's."""
        if not self.rules.activation:
            self.off("activation", path, A.get_submodule(self.model, path), "activation rule off")
            return
        self.head_region = True
        self.cov._add("activation", path)  # {what}: the functional Identity-rule in the head region

    def refuse_unobserved_forwards(self) -> None:
        """A mapped model's rule map assumes the architecture's own forwards: a module whose
        forward is replaced on the instance (an ablation, a steering or kernel library) and
        whose forward pyattr does not itself observe (a norm's formula, an activation's
        Identity-rule of what it computes) could hide a nonlinearity no rule reaches (a tanh
        in an ``o_proj``, an ``exp`` in the head): refused by name."""
        from pyattr._components import written_by_component
        from pyattr.integration.bridge import components

        wrappers = components(self.model)
        for name, mod in self.model.named_modules():
            if type(mod).__name__ == "OptimizedModule":  # torch.compile's wrapper: the module it compiles runs
                continue
            if written_by_component(mod, forward_of(mod), wrappers.get(id(mod))):
                continue  # a TransformerLens bridge's own forward: its hook points around the module's own calls
            if id(mod) not in self.observed and replaced_on_instance(mod):
                raise RelevanceRuleUnsupportedError(
                    f"{name!r}: {forward_name(mod)} is not the {self.cov.model_type} forward the rule map is written "
                    "for, and pyattr cannot show that what it computes is linear or carries its rule; restore the "
                    "module's own forward, or use RelevanceRules() for plain gradients")

    def skip_lookalikes(self) -> None:
        for name, mod in self.model.named_modules():
            if id(mod) in self.mounted:
                continue
            cls = type(mod).__name__
            if isinstance(mod, nn.LayerNorm) or cls.endswith("RMSNorm"):
                self.cov._skip(name, "not a residual-stream norm")


def plan_block(pl: Planner, layer: str, arch) -> None:
    """The rules of one block (``layer``, its dotted path) of a stack ``arch`` describes."""
    for p in arch.layer_norms:
        pl.norm(A.join(layer, p), arch.norm, arch.offset)
    pl.attention(layer, arch.attention)
    pl.score_bias([A.join(layer, p) for p in arch.score_bias])
    pl.qk_norms([A.join(layer, p) for p in arch.qk_norms], arch.norm, arch.offset)
    kind, p = arch.mlp
    if kind == "gated":
        plan_gated(pl, A.join(layer, p))
    elif kind == "gated_fused":
        plan_gated_fused(pl, A.join(layer, p), arch.fused_mlp)
    elif kind == "moe":
        pl.moe(A.join(layer, p))
    elif kind == "gated_named":
        plan_gated_named(pl, A.join(layer, p), arch.gated_extra)
    else:
        pl.activation(A.join(layer, p), A.join(layer, p.rsplit(".", 1)[0]))


def plan_known(model: nn.Module, rules: RelevanceRules, model_type: str) -> Planner:
    arch = A.ARCHITECTURES[model_type]
    pl = Planner(model, rules, model_type)
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
        plan_block(pl, layer, arch)
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
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if rules.any() and isinstance(cap, (int, float)) and cap and isinstance(head, nn.Module):
        # Gemma 2's logits are cap·tanh(logits/cap), computed in the model's own forward
        # after its base model: the functional Identity-rule of the head region takes it
        path = next(n for n, m in model.named_modules() if m is head)
        pl.head_functional(path, f"final_logit_softcapping={cap}: cap·tanh(logits/cap) in the model's own forward")
    for p, cls in arch.unruled_heads:
        mod = A.get_submodule(model, p)
        if isinstance(mod, nn.Module) and type(mod).__name__ == cls:
            pl.mounted.add(id(mod))
            pl.head_functional(p, f"{cls} applies its activation as a function (torch.tanh)")
    pl.skip_lookalikes()
    if rules.activation or rules.multiplicative_gate:  # a replaced forward may hide what these rules treat
        pl.refuse_unobserved_forwards()
    return pl

