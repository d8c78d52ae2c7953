"""TransformerLens bridge components, recognised without importing TransformerLens (by the
names and modules of their classes): a component wraps a Hugging Face module and runs
hooks around it; :func:`native` is the module it wraps."""

from __future__ import annotations

from typing import Optional

from torch import nn

_TL = "transformer_lens"


def _has_class(obj, name: str) -> Optional[type]:
    for cls in type(obj).__mro__:
        if cls.__name__ == name and cls.__module__.startswith(_TL):
            return cls
    return None


def is_transformer_bridge(obj) -> bool:
    """Whether ``obj`` is a TransformerLens ``TransformerBridge`` (the model it wraps is
    ``obj.original_model``)."""
    return _has_class(obj, "TransformerBridge") is not None


def is_component(mod) -> bool:
    """Whether ``mod`` is a TransformerLens bridge component (``GeneralizedComponent``)."""
    return isinstance(mod, nn.Module) and _has_class(mod, "GeneralizedComponent") is not None


def native(mod):
    """The module a bridge component wraps (through nested components); anything else as is."""
    while is_component(mod):
        inner = mod._modules.get("_original_component")
        if not isinstance(inner, nn.Module):
            break
        mod = inner
    return mod


def written_by_component(mod: nn.Module, fn, wrapper) -> bool:
    """Whether ``fn``, the forward set on ``mod``'s instance, is one the TransformerLens
    component ``wrapper`` around it wrote (``T5BlockBridge`` patches the T5 block's forward
    to run hook points between the block's own sublayer calls): a function of that
    component's class, in TransformerLens."""
    if wrapper is None or not is_component(wrapper):
        return False
    owner = getattr(fn, "__qualname__", "").split(".")[0]
    return getattr(fn, "__module__", "").startswith(_TL) and any(
        c.__name__ == owner and c.__module__.startswith(_TL) for c in type(wrapper).__mro__)
