"""Where an architecture's roles are in a model instance: its base model, its blocks, its
``model_type``, and dotted paths (those written for a DataParallel / DDP wrapper included)."""

from __future__ import annotations

from typing import List, Optional

from torch import nn

from pyattr._components import native
from pyattr.architectures.table import Arch


def base_prefix(model: nn.Module) -> str:
    """Dotted path of the base model inside ``model`` ("" if ``model`` is the base)."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    if _vision_classifier(model):
        return "vision_model"
    return ""


def _vision_classifier(model: nn.Module) -> bool:
    """CLIP's image classifier: a ``clip`` config, the vision tower alone at ``vision_model``."""
    return (getattr(getattr(model, "config", None), "model_type", None) == "clip"
            and isinstance(getattr(model, "vision_model", None), nn.Module)
            and getattr(model, "text_model", None) is None)


def model_type(model: nn.Module):
    """``config.model_type``; CLIP's image classifier (a ``clip`` config around the vision
    tower alone) reads as its tower, ``clip_vision_model``."""
    if _vision_classifier(model):
        return "clip_vision_model"
    return getattr(getattr(model, "config", None), "model_type", None)


def join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


#: the attribute under which DataParallel / DistributedDataParallel (and FSDP) keep the model
WRAPPER_PREFIX = "module."


def get_submodule(model: nn.Module, path: str) -> Optional[nn.Module]:
    """``model.get_submodule(path)``, or None. A path written for the model inside a
    DataParallel / DDP wrapper (``module.`` + the model's own path, as the wrapper's
    ``named_modules()`` and ``state_dict()`` print it) names the same module of the
    unwrapped model. On a model a TransformerLens bridge was built on, the module at the
    path is the Hugging Face module its component wraps (:func:`pyattr._components.native`)."""
    try:
        return native(model.get_submodule(path)) if path else model
    except AttributeError:
        pass
    if path.startswith(WRAPPER_PREFIX) and not isinstance(getattr(model, "module", None), nn.Module):
        return get_submodule(model, path[len(WRAPPER_PREFIX):])
    return None


def layer_paths(model: nn.Module, arch: Arch) -> List[str]:
    prefix = base_prefix(model)
    layers = get_submodule(model, join(prefix, arch.layers))
    if not isinstance(layers, nn.ModuleList):
        return []
    return [join(prefix, arch.layers, str(i)) for i in range(len(layers))]


def no_neurons(model: nn.Module, arg: str) -> ValueError:
    return ValueError(
        f"{arg}: {type(model).__name__} is a mixture-of-experts model; its MLP hidden units belong to "
        "each expert (rows of 3-D weights), not to a position, so there is no 'neurons' layer. Use "
        "'mlp' (each sparse block's output) or dotted module paths"
    )


def input_embeddings(model):
    """``model.get_input_embeddings()``, or None where the model has none: no such method,
    or transformers' default raising NotImplementedError (vision backbones: ResNet,
    MobileNet, PVT, SegFormer)."""
    get = getattr(model, "get_input_embeddings", None)
    if not callable(get):
        return None
    try:
        return get()
    except (NotImplementedError, AttributeError):
        return None
