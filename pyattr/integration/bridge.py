"""TransformerLens 4 bridges: the rule scope on a model a ``TransformerBridge`` wraps.

A bridge replaces the Hugging Face model's submodules by its components (a
``NormalizationBridge`` around the ``LayerNorm``, an attention bridge around the attention,
…), each running hooks (``hook_in``, ``hook_scale``, ``hook_pattern``, ``hook_out``) around
the module it wraps. pyattr's rule map is written for the Hugging Face model, so the scope
reads each mount's module through its component (:func:`native`) and installs the rule
there, as without the bridge. Where a component computes the mount itself instead of calling
the module it wraps, the rule goes to the component's own seam:

- a norm component (``ln1``, ``ln2``, ``ln_final``…) computing its norm in Python (TL's
  python-norm path: always for GPT-2's LayerNorm, for every norm once a backward hook or a
  forward hook sits on ``hook_scale`` / ``hook_normalized``): the value entering
  ``hook_scale`` is held constant (the LN-rule, Ali et al. 2022, eq. 9: the standard
  deviation is a constant), so ``hook_normalized`` and the output carry the rule's
  gradient and a backward hook on ``hook_scale`` sees the gradient at the scale;
- an attention component computing attention itself (TL's own q/k/v, RoPE, softmax —
  every attention bridge but the delegating base class): the pattern entering
  ``hook_pattern`` is held constant (the AH-rule: attention weights are constants, RelP
  §3.2), with the same backward-hook behaviour. AttnLRP (a rule on the softmax and the
  q·k product) needs the Hugging Face attention core, which such a component never calls:
  refused by name;
- an MLP component running TL's processed weights (compatibility mode) with its functional
  activation: refused by name while the Identity- or Half-rule is on.

Forward values are unchanged: holding a tensor constant is a view of it. With no hook on a
native-path norm's ``hook_scale`` / ``hook_normalized``, the component calls the Hugging
Face norm, which carries the fused rule (bit-identical to the component's own output).
With forward hooks there, TL itself rebuilds the output from the hooked values once they
are edited; under the LN-rule they always are (the held scale), so the output is TL's
python-norm value, which differs from the Hugging Face norm's by float rounding, as TL's
own backward-hook path does (its warning about that is not repeated).

TransformerLens is not imported here (:mod:`pyattr._components` recognises its classes by
name and module), so pyattr works without it.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Dict, Iterator, List

import torch
from torch import nn

from pyattr._components import _has_class, is_component, is_transformer_bridge, native  # noqa: F401 - re-exported
from pyattr.integration.errors import RelevanceRuleUnsupportedError

_EDIT_WARNING = "A forward hook edited hook_scale/hook_normalized"


def components(model: nn.Module) -> Dict[int, nn.Module]:
    """id(wrapped module) -> the outermost component around it, for every component in
    ``model`` (empty when no bridge was built on it)."""
    out: Dict[int, nn.Module] = {}
    for mod in model.modules():
        if is_component(mod):
            out.setdefault(id(native(mod)), mod)
    return out


def mount_names(bridge) -> Dict[int, str]:
    """id(wrapped module) -> the bridge's canonical mount name (``blocks.0.ln1``,
    ``blocks.0.attn``, ``ln_final``…), read from the bridge's own component tree."""
    names: Dict[int, str] = {}

    def walk(comp, name):
        if is_component(comp):
            names.setdefault(id(native(comp)), name)
            for sub, child in (getattr(comp, "submodules", None) or {}).items():
                walk(child, f"{name}.{sub}")

    for top in dict.keys(getattr(bridge, "_modules", {})):
        mod = bridge._modules[top]
        if isinstance(mod, nn.ModuleList):
            for i, block in enumerate(mod):
                walk(block, f"{top}.{i}")
        else:
            walk(mod, top)
    return names


class _Held(torch.autograd.Function):
    """The same values, held constant: no gradient passes to the input."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None


def _hold_input(hook_point, args):
    # Under no_grad a native-path norm computes the hook values only to show them and then
    # calls the Hugging Face norm (which carries the rule) when they come back unchanged:
    # replacing them there would make it rebuild the output.
    if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if not x.requires_grad:
        if not hook_point._backward_hooks:
            return None
        # q and k already held by the projections' rule: a backward hook here (TL's
        # run_with_cache(incl_bwd=True)) still sees the gradient at the pattern
        return (x.detach().requires_grad_(),) + tuple(args[1:])
    return (_Held.apply(x),) + tuple(args[1:])


def _delegates(component) -> bool:
    """Whether an attention component calls the Hugging Face attention (TL's base
    ``AttentionBridge.forward``) rather than computing attention itself."""
    base = _has_class(component, "AttentionBridge")
    fwd = component.__dict__.get("forward", None) or type(component).forward
    return base is not None and getattr(fwd, "__func__", fwd) is base.__dict__.get("forward")


def check_plan(model: nn.Module, pl) -> None:
    """Refuse, before anything is installed, a mount whose bridge component computes it in a
    way the rule cannot reach (see the module docstring)."""
    comps = components(model)
    if not comps:
        return
    for mod in pl.attnlrp_attention:
        comp = comps.get(id(mod))
        if comp is not None and not _delegates(comp):
            raise RelevanceRuleUnsupportedError(
                f"{_path(model, comp)}: the TransformerLens {type(comp).__name__} computes attention itself "
                "(its own q/k/v, softmax and hook_pattern) and never calls the Hugging Face attention core that "
                "AttnLRP's rule runs in; use the AH-rule (RelevanceRules.all()), or open the scope on the Hugging "
                "Face model before building the bridge")
    for st in pl.steps:
        comp = comps.get(id(st.module))
        if comp is None:
            continue
        if st.kind in ("activation", "multiplicative_gate") and getattr(comp, "_use_processed_weights", False):
            raise RelevanceRuleUnsupportedError(
                f"{_path(model, comp)}: the TransformerLens {type(comp).__name__} runs its processed weights "
                "with a functional activation (compatibility mode), which the Identity- and Half-rules cannot "
                "reach; build the bridge without processed weights, or switch the activation and "
                "multiplicative_gate rules off")
        if st.kind == "normalization" and not isinstance(getattr(comp, "hook_scale", None), nn.Module):
            raise RelevanceRuleUnsupportedError(
                f"{_path(model, comp)}: the TransformerLens {type(comp).__name__} around this norm has no "
                "hook_scale seam to hold the scale constant at (the LN-rule)")


def _path(model: nn.Module, comp: nn.Module) -> str:
    """The component's dotted path as the Hugging Face model names the module it wraps."""
    path = next((n for n, m in model.named_modules() if m is comp), type(comp).__name__)
    return repr(path.replace("._original_component", ""))


class _Reached:
    """The run-time check that each rule a component's mount carries was reached: when a
    component around a rule-carrying module returns (gradient recording on), the module
    itself ran inside it, or (a norm, an attention) the component's held seam did. A
    component that computes its mount some other way (TL's reconstructed gated MLP on
    fused gate/up weights, for one) raises instead of answering without the rule."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.ran: Dict[int, bool] = {}
        self.what: Dict[int, str] = {}

    def watch(self, comp: nn.Module, inner: nn.Module, kind: str, handles: list) -> None:
        key = id(comp)
        self.what[key] = kind
        handles.append(comp.register_forward_pre_hook(lambda m, a: self.ran.__setitem__(key, False)))
        handles.append(inner.register_forward_pre_hook(lambda m, a: self._mark(key)))
        handles.append(comp.register_forward_hook(lambda m, a, o: self._check(m, key)))

    def _mark(self, key: int) -> None:
        if key in self.ran:
            self.ran[key] = True

    def _check(self, comp: nn.Module, key: int) -> None:
        if self.ran.pop(key, True) or not torch.is_grad_enabled():
            return
        raise RelevanceRuleUnsupportedError(
            f"{_path(self.model, comp)}: the TransformerLens {type(comp).__name__} computed this mount without "
            f"calling the module that carries its {self.what[key]} rule (nor a seam pyattr holds), so the rule "
            "would not run; open the scope on the Hugging Face model without the bridge, or switch that rule off")


@contextlib.contextmanager
def bridge_seams(model: nn.Module, pl) -> Iterator[None]:
    """For the ``with`` block: the LN-rule at each rule-carrying norm component's
    ``hook_scale`` and the AH-rule at each frozen attention component's ``hook_pattern``
    (forward pre-hooks, first in line), and the run-time check that every rule-carrying
    component reached its rule (:class:`_Reached`). Nothing when ``model`` holds no
    component."""
    comps = components(model)
    if not comps:
        yield
        return
    handles: list = []
    reached = _Reached(model)
    for st in pl.steps:
        comp = comps.get(id(st.module))
        if comp is None or st.kind == "attention":  # q/k projections: the pattern below holds them
            continue
        reached.watch(comp, st.module, st.kind, handles)
        if st.kind == "normalization":
            handles.append(comp.hook_scale.register_forward_pre_hook(_hold_input, prepend=True))
            handles.append(comp.hook_scale.register_forward_pre_hook(
                lambda m, a, key=id(comp): reached._mark(key)))
    for mod in pl.frozen_attention:
        comp = comps.get(id(mod))
        if comp is not None and isinstance(getattr(comp, "hook_pattern", None), nn.Module):
            handles.append(comp.hook_pattern.register_forward_pre_hook(_hold_input, prepend=True))
            if not _delegates(comp):
                reached.watch(comp, comp.hook_pattern, "attention", handles)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_EDIT_WARNING)
            yield
    finally:
        for h in handles:
            h.remove()
