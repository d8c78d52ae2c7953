"""The plan of an encoder–decoder model (:mod:`pyattr.architectures.seq2seq`): each stack's
blocks as a decoder-only model's, the decoder blocks' cross-attention under the attention
rule, and a refusal of any norm or activation module the map left without its rule."""

from __future__ import annotations

import dataclasses

from torch import nn

import pyattr.architectures as A
from pyattr.activations import _kind_of_module
from pyattr.architectures.seq2seq import SEQ2SEQ
from pyattr.config import RelevanceRules
from pyattr.integration.errors import RelevanceRuleUnsupportedError
from pyattr.integration.forwards import Step
from pyattr.integration.planner import Planner, plan_block


def plan_seq2seq(model: nn.Module, rules: RelevanceRules, model_type: str) -> Planner:
    spec = SEQ2SEQ[model_type]
    pl = Planner(model, rules, model_type)
    dec = A.one_stack(model, model_type)
    stacks = (spec.encoder, spec.decoder) if dec is None else (dec,)
    # with every rule off the mounts are still walked: each records the rule an enclosing
    # scope holds there (inherited), which a method asking for plain gradients refuses
    prefix = A.base_prefix(model)
    for arch in stacks:
        i = int(arch is spec.decoder)
        layers = A.layer_paths(model, arch)
        if not layers:
            raise RelevanceRuleUnsupportedError(
                f"{model_type}: expected a ModuleList of blocks at {A.join(prefix, arch.layers)!r}; use "
                "RelevanceRules() for plain gradients")
        for p in arch.outer_norms:
            pl.norm(A.join(prefix, p), arch.norm, arch.offset)
        for layer in layers:
            pl.mounted.add(id(A.get_submodule(model, layer)))
            block = _with_ff(model, layer, arch, spec, i)
            # an optional cross-attention the block was built without: its norms go with it
            crossed = i == 1 and spec.cross_attention is not None and \
                (not spec.cross_norms or A.get_submodule(model, A.join(layer, spec.cross_attention[1])) is not None)
            if i == 1 and not crossed:
                block = dataclasses.replace(block, layer_norms=tuple(p for p in block.layer_norms
                                                                     if p not in spec.cross_norms))
            plan_block(pl, layer, block)
            if crossed:
                pl.attention(layer, spec.cross_attention)
    for p in spec.off_path:
        _off_path(pl, A.join(prefix, p))
    head = A.classifier_head(model)
    if head is not None:
        # the classifier's head calls torch.tanh as a function after the base model returns:
        # the functional Identity-rule of the head region takes it (its modules are linear)
        pl.mounted.add(id(head[1]))
        pl.head_functional(head[0], f"{type(head[1]).__name__}: functions after the base model (torch.tanh)")
    cap = _softcap(model)
    lm = getattr(model, "get_output_embeddings", lambda: None)()
    if rules.any() and cap and isinstance(lm, nn.Module):
        # T5Gemma's logits are cap·tanh(logits/cap), computed in the model's own forward
        path = next(n for n, m in model.named_modules() if m is lm)
        pl.head_functional(path, f"final_logit_softcapping={cap}: cap·tanh(logits/cap) in the model's own forward")
    pl.skip_lookalikes()
    if rules.any():
        _refuse_unmounted(pl)
    if rules.activation or rules.multiplicative_gate:
        pl.refuse_unobserved_forwards()
    return pl


def _off_path(pl: Planner, path: str) -> None:
    """A module text inputs never run (a vision tower): no rule inside, so it refuses to
    run under the scope rather than pass relevance through it without its rules."""
    mod = A.get_submodule(pl.model, path)
    if not isinstance(mod, nn.Module):
        return
    reason = (f"{path!r} is not on the text path the {pl.cov.model_type} rule map covers (its norms and activations "
              "carry no rule); explain text inputs, or use RelevanceRules() for plain gradients")

    def make(module, state):
        def forward(*args, **kwargs):
            raise RelevanceRuleUnsupportedError(reason)
        return forward

    pl.steps.append(Step(mod, path, "off_path", None, make, False, None))
    pl.cov._skip(path, "not on the text path: refused if it runs")
    pl.mounted.update(id(m) for m in mod.modules())


def _softcap(model: nn.Module):
    """The final logit soft-capping the model's config (or its decoder's) asks for, else None."""
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "decoder", None)):
        cap = getattr(c, "final_logit_softcapping", None)
        if isinstance(cap, (int, float)) and cap:
            return cap
    return None


def _with_ff(model: nn.Module, layer: str, arch, spec, side: int):
    """T5's feed-forward as the instance has it: gated (v1.1, mT5, Flan-T5: ``wi_0``,
    ``wi_1``) or a plain activation MLP (v1.0), read off the module, not the config."""
    if spec.gated_ff is None:
        return arch
    path, names = spec.gated_ff[side], spec.gated_ff[2]
    ff = A.get_submodule(model, A.join(layer, path))
    if isinstance(getattr(ff, names[0], None), nn.Module):
        return dataclasses.replace(arch, mlp=("gated_named", path), gated_extra=names)
    return arch


def _refuse_unmounted(pl: Planner) -> None:
    """Fail closed: a norm or an activation module of the model that no mount of the map
    covers (a variant of the architecture with one more norm, an activation the forward
    calls where the map does not look) would carry no rule, and relevance would be lost or
    wrong there without a word."""
    for name, mod in pl.model.named_modules():
        if not name or id(mod) in pl.mounted:
            continue
        cls = type(mod).__name__
        if isinstance(mod, nn.LayerNorm) or cls.endswith(("RMSNorm", "LayerNorm")) or _kind_of_module(mod):
            raise RelevanceRuleUnsupportedError(
                f"{pl.cov.model_type}: {name!r} ({cls}) is a norm or activation the {pl.cov.model_type} rule map does "
                "not cover, so its rule would be missing; use RelevanceRules() for plain gradients")
