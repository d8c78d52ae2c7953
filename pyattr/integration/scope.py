"""``use_relevance_rules``: install rules on a model instance for the length of a scope
(the plan, the install and undo, checkpoint binding), and ``plan``."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional

from torch import nn

import pyattr.architectures as A
from pyattr.integration.attention import attnlrp_attention, frozen_attention
from pyattr.integration.bridge import bridge_seams, check_plan as check_bridge, is_transformer_bridge, mount_names
from pyattr.integration.checkpoint import checkpoints_bound
from pyattr.config import RelevanceRuleCoverage, RelevanceRules, rules_from
from pyattr._validation import refuse_meta_model
from pyattr.integration.errors import RelevanceRuleConflictError, RelevanceRuleUnsupportedError
from pyattr.integration.forwards import Step
from pyattr.integration.install import (
    GATED_MEMORY,
    ScopeHook,
    acquire,
    holds_patch,
    release,
    state_of,
)
from pyattr.integration.functional import functional_rules, head_functional_rules
from pyattr.integration.plan_check import check, check_mode
from pyattr.integration.planner import Planner, plan_known
from pyattr.integration.quantized import quantized_input_gradients
from pyattr.integration.wrappers import mapped_inside, unwrap


def plan(model: nn.Module, rules: RelevanceRules, generic: bool = False) -> Planner:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(rules, RelevanceRules):
        raise TypeError(f"rules must be a RelevanceRules, got {type(rules).__name__}")
    mt = A.model_type(model)
    if mt in A.ARCHITECTURES:
        return plan_known(model, rules, mt)
    if mt in A.SEQ2SEQ:
        from pyattr.integration.planner_seq2seq import plan_seq2seq

        return plan_seq2seq(model, rules, mt)
    if generic:
        from pyattr.integration.generic import (
            plan_generic,  # it builds on this module's planner
        )

        return plan_generic(model, rules)
    if not rules.any():
        # every rule off: nothing to install, so any architecture works (plain gradients)
        return Planner(model, rules, mt)
    raise RelevanceRuleUnsupportedError(
        f"model type {mt!r} ({type(model).__name__}) has no rule map; supported: "
        f"{sorted(A.ARCHITECTURES)}, encoder–decoder {sorted(A.SEQ2SEQ)}. Pass generic=True for structural installation."
    )


@contextlib.contextmanager
def use_relevance_rules(
    model: nn.Module, rules: Optional[RelevanceRules] = None, *, generic: bool = False
) -> Iterator[RelevanceRuleCoverage]:
    """Install relevance rules on ``model``'s module instances for the ``with`` block.

    Args:
        model (nn.Module): a Hugging Face model (Llama, Mistral, Qwen2, Qwen3, Gemma,
            Gemma2, Gemma 3 text, OLMo 2, Phi-3, GPT-2, GPT-NeoX/Pythia, BERT, RoBERTa,
            DistilBERT; encoder–decoders: T5 / mT5, BART, mBART, Marian, M2M100 / NLLB,
            Pegasus, both stacks and the cross-attention), with or without its head; also placed by accelerate, or wrapped in
            DataParallel / DDP; a TransformerLens ``TransformerBridge`` (the rules at its mounts,
            :mod:`pyattr.integration.bridge`), an nnsight ``NNsight`` / ``LanguageModel`` (the
            rule forwards run inside its traces), a tdhook context or hooked module, or a
            module of the user's around one such model (:func:`~pyattr.integration.wrappers.mapped_inside`).
        rules (RelevanceRules | str, optional): which rules, or one of the methods' shorthands
            ``"all"``, ``"attnlrp"``, ``"ln"``, ``"none"``. ``RelevanceRules()`` is every rule off
            (TransformerLens' defaults: ``RelevanceRules(normalization=True)`` is the
            LN-rule alone). Default (``None``): ``RelevanceRules.all()``, the four rules
            with the AH-rule.
        generic (bool | "partial"): for an architecture without a rule map, install the
            rules structurally (:func:`pyattr.integration.generic.plan_generic`, with the
            functional rules of :mod:`pyattr.integration.functional`) instead of raising.
            The plan is checked first on a probe (:mod:`pyattr.integration.plan_check`):
            relevance lost where no rule was placed raises; a loss the plan declares
            raises too unless ``generic="partial"``, which warns
            (:class:`~pyattr.integration.plan_check.PartialRelevanceWarning`) with the
            measured gap. Default: False.

    Yields:
        RelevanceRuleCoverage: installed and skipped dotted paths.

    Quantized models: torchao-quantized ``nn.Linear`` layers get an input gradient
    (``dy`` times the dequantized weight) and bitsandbytes ``Linear4bit`` /
    ``Linear8bitLt`` keep their own (:mod:`pyattr.integration.quantized`).

    Forwards stay bit-identical to the model's own. Patches are per instance, refcounted
    per (module, rule kind) across nested scopes, and removed on exit, exceptions included.
    With Hugging Face gradient checkpointing, a recomputed block runs with exactly the
    rules its forward ran with, whenever and in whatever scope the backward runs (see
    :func:`checkpoints_bound`).

    Raises:
        RelevanceRuleUnsupportedError: unknown model type (without ``generic``), a
            mount that is not of the expected form, or (``generic``) a plan the probe
            shows losing relevance; raised before anything is patched.
        ValueError: ``generic`` is not False, True or ``"partial"``.
            Its subclass ``UnsupportedQuantizationError`` (also a ``NotImplementedError``):
            a quantized layer that is neither torchao's nor bitsandbytes' (see
            :mod:`pyattr.integration.quantized`).
        RelevanceRuleConflictError: a nested scope asks for another attention mode on the
            same module; a hook sits on an activation the gated rule bypasses; at run
            time, a forward hook replaces the output of a rule-carrying module.
    """
    names = mount_names(model) if is_transformer_bridge(model) else {}
    model = unwrap(model)
    # rules placed on modules that hold no weights yet: loading may put other module objects
    # in their place (an nnsight LanguageModel's dispatch does), which then run without them
    refuse_meta_model(model, "use_relevance_rules")
    rules = RelevanceRules.all() if rules is None else rules_from(rules)  # "all", "attnlrp", "ln", "none" too
    generic = check_mode(generic)
    if not generic and isinstance(model, nn.Module):
        model = mapped_inside(model, {**A.ARCHITECTURES, **A.SEQ2SEQ})
    pl = plan(model, rules, bool(generic))
    check_bridge(model, pl)
    pl.cov._name_mounts({st.path: names[id(st.module)] for st in pl.steps
                         if id(st.module) in names and st.kind != GATED_MEMORY})  # rules' mounts only
    if pl.generic and rules.any():
        # fail closed: the structural plan is checked on a probe before it answers
        check(model, rules, generic, installed, lambda m, r: plan(m, r, True))
    with installed(model, pl):
        yield pl.cov


@contextlib.contextmanager
def installed(model: nn.Module, pl: Planner) -> Iterator[None]:
    """The steps of ``pl`` installed on ``model`` for the ``with`` block (and, for a
    generic plan, the functional rules around its forward)."""
    # probe the backends (load the extension, register its ops) now, not first inside a
    # graph torch.compile traces, where the one-time registration cannot run
    from pyattr.backends import available_backends

    available_backends()
    done: List[Step] = []
    # quantized linear layers get their input gradient first: the rules mount on top of it
    with quantized_input_gradients(model):
        try:
            for st in pl.steps:
                acquire(st.module, st.path, st.kind, st.value, st.make_forward, st.check_output, st.verify)
                done.append(st)
            with _replaced_inside_refused(model, done), bridge_seams(model, pl), checkpoints_bound(model), \
                    frozen_attention(pl.frozen_attention), \
                    attnlrp_attention(pl.attnlrp_attention), \
                    (functional_rules(model, pl.rules, _roots(model), pl.native) if pl.generic else
                     _head_region(model, pl)):
                yield
        finally:
            for st in reversed(done):
                release(st.module, st.kind)


@contextlib.contextmanager
def _replaced_inside_refused(model: nn.Module, steps: List[Step]) -> Iterator[None]:
    """For the ``with`` block, each forward of ``model`` first checks that every module
    carrying a rule still runs its rule forward: one the user replaced on the instance
    inside the scope would run without its rule, silently; it raises
    :class:`RelevanceRuleConflictError` naming the module instead."""
    # the memory mount is not a rule: a module replaced under it only runs as it would without it
    steps = [st for st in steps if st.kind != GATED_MEMORY]
    mounted = {st.path: _at(model, st.path) for st in steps}

    def guard(mod, args):
        for st in steps:
            state = state_of(st.module)
            if state is not None and not holds_patch(st.module, state):
                raise RelevanceRuleConflictError(
                    f"{st.path!r}: its forward was replaced on the instance while a use_relevance_rules scope carrying "
                    f"its {st.kind} rule was open, so the rule would not run; replace the forward before opening the "
                    "scope (pyattr then reads the forward it runs), or after it closes")
            if _at(model, st.path) is not mounted[st.path]:
                raise RelevanceRuleConflictError(
                    f"{st.path!r}: another module took its place while a use_relevance_rules scope carrying its "
                    f"{st.kind} rule was open (a TransformerLens bridge built on the model inside the scope wraps it "
                    "in a component that may compute it without the rule); build the bridge first, then open the "
                    "scope on it")

    handle = model.register_forward_pre_hook(ScopeHook(guard, type(model).__name__), prepend=True)
    try:
        yield
    finally:
        handle.remove()


def _at(model: nn.Module, path: str):
    """The object at ``path`` as the model holds it now (a bridge component included)."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _head_region(model: nn.Module, pl: Planner):
    """The functional rules after the base model returns, where the plan needs them."""
    roots = _roots(model)
    if not pl.head_region or not roots:
        return contextlib.nullcontext()
    return head_functional_rules(model, roots[0], pl.rules)


def _roots(model: nn.Module) -> tuple:
    """The base model, which callers may run alone (``model.model(...)``)."""
    base = A.get_submodule(model, A.base_prefix(model))
    return (base,) if isinstance(base, nn.Module) and base is not model else ()
