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
  §3.2), with the same backward-hook behaviour. AttnLRP's rule sits in the q, k and v
  projections (the softmax's rule is its own gradient, which TL's attention computes), so
  those must run inside the component: TL's attention on q/k/v Linears it split off a
  fused projection (GPT-2, GPT-NeoX, Phi-3) never calls the fused one and is refused at
  its first forward;
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

import pyattr._function as _function
from pyattr._components import _has_class, is_component, is_transformer_bridge, native  # noqa: F401 - re-exported
from pyattr.integration.errors import RelevanceRuleUnsupportedError
from pyattr.integration.install import GATED_MEMORY

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


@_function.second_order_checked(held=True)
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


def _owner(model: nn.Module, path: str):
    """The module holding the one at ``path`` (a projection's attention)."""
    from pyattr.architectures.paths import get_submodule

    return get_submodule(model, path.rsplit(".", 1)[0]) if "." in path else None


def _path(model: nn.Module, comp: nn.Module) -> str:
    """The component's dotted path as the Hugging Face model names the module it wraps."""
    path = next((n for n, m in model.named_modules() if m is comp), type(comp).__name__)
    return repr(path.replace("._original_component", ""))


class _Reached:
    """The run-time check that each rule a component's mount carries was reached: when a
    component around rule-carrying modules returns (gradient recording on), each of them ran
    inside it, or (a norm, an attention under the AH-rule) the component's held seam did. A
    component that computes its mount some other way (TL's reconstructed gated MLP on fused
    gate/up weights, its attention on q/k/v projections split off a fused one under AttnLRP)
    raises instead of answering without the rule."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.ran: Dict[tuple, bool] = {}
        self.watched: Dict[int, List[tuple]] = {}
        self.what: Dict[tuple, str] = {}

    def watch(self, comp: nn.Module, inner: nn.Module, kind: str, handles: list) -> tuple:
        key = (id(comp), id(inner))
        self.what[key] = kind
        first = id(comp) not in self.watched
        self.watched.setdefault(id(comp), []).append(key)
        if first:
            handles.append(comp.register_forward_pre_hook(lambda m, a: self._start(id(m))))
            handles.append(comp.register_forward_hook(lambda m, a, o: self._check(m)))
        handles.append(inner.register_forward_pre_hook(lambda m, a: self.mark(key)))
        return key

    def _start(self, comp_id: int) -> None:
        for key in self.watched[comp_id]:
            self.ran[key] = False

    def mark(self, key: tuple) -> None:
        if key in self.ran:
            self.ran[key] = True

    def _check(self, comp: nn.Module) -> None:
        missed = [k for k in self.watched[id(comp)] if not self.ran.pop(k, True)]
        if not missed or not torch.is_grad_enabled():
            return
        kinds = sorted({self.what[k] for k in missed})
        raise RelevanceRuleUnsupportedError(
            f"{_path(self.model, comp)}: the TransformerLens {type(comp).__name__} computed this mount without "
            f"calling the module{'s' if len(missed) > 1 else ''} that carr{'y' if len(missed) > 1 else 'ies'} its "
            f"{' and '.join(kinds)} rule (nor a seam pyattr holds), so the rule would not run; open the scope on "
            "the Hugging Face model without the bridge, or switch that rule off")


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
        if st.kind == GATED_MEMORY:  # not a rule: a component computing the MLP itself just keeps its memory
            continue
        if st.kind == "attention":
            # q/k/v projections: under the AH-rule the held pattern below does their work;
            # AttnLRP's scaled gradients live only in them, so they must run
            owner = comps.get(id(_owner(model, st.path)))
            if st.value[0] == "attnlrp" and owner is not None:
                reached.watch(owner, st.module, "attention", handles)
            continue
        if comp is None:
            continue
        key = reached.watch(comp, st.module, st.kind, handles)
        if st.kind == "normalization":
            handles.append(comp.hook_scale.register_forward_pre_hook(_hold_input, prepend=True))
            handles.append(comp.hook_scale.register_forward_pre_hook(lambda m, a, key=key: reached.mark(key)))
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
