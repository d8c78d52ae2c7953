"""Wrappers around a model: relevance runs on the module they wrap.

Interpretability frameworks hand their users a wrapper object (nnsight's ``NNsight`` /
``LanguageModel``, tdhook's prepared contexts, a TransformerLens ``TransformerBridge``):
every entry point takes it where it takes a model and works on the module inside
(:func:`framework_inner`); the framework's own forward (a trace, a bridge's hooks) still
runs that module, so a scope opened on the wrapper is open under the framework's backward.

``nn.DataParallel`` and ``DistributedDataParallel`` exist to split a training step's
batch and all-reduce parameter gradients. Relevance needs neither: the parameters are
frozen for the pass, and each process explains its own prompts (``pyattr run`` under
torchrun splits the prompts, not the batch). So every public entry point explains
``wrapper.module``, on the device it lives on, with results identical to the unwrapped
model. FSDP shards the parameters themselves, so its inner module cannot run alone: it
is refused with a pointer to ``device_map``.
"""

from __future__ import annotations

from torch import nn

from pyattr._components import is_transformer_bridge


def _fsdp_types() -> tuple:
    types = []
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        types.append(FullyShardedDataParallel)
    except ImportError:  # pragma: no cover - torch built without distributed
        pass
    try:
        from torch.distributed.fsdp import FSDPModule

        types.append(FSDPModule)
    except ImportError:  # pragma: no cover - torch < 2.6
        pass
    return tuple(types)


def _named(obj, package: str, name: str) -> bool:
    return any(c.__name__ == name and (c.__module__ or "").split(".")[0] == package for c in type(obj).__mro__)


def framework_inner(obj):
    """The module an interpretability framework's wrapper object holds, else None: an
    nnsight ``Envoy`` (``NNsight``, ``LanguageModel``, a child envoy) holds it in
    ``_module``; a tdhook ``HookingContext`` (what ``method.prepare(model, …)`` returns) in
    its ``TensorDictModule``, a tdhook ``HookedModule`` (what its ``with`` gives) in
    ``hook_root``; a tensordict ``TensorDictModule`` in ``module``; a TransformerLens
    ``TransformerBridge`` in ``original_model``; a PEFT ``PeftModel`` in ``get_base_model()``
    (:func:`_peft_base`). Read by class name and module, so none of them need be installed."""
    if _named(obj, "nnsight", "Envoy"):
        return obj.__dict__.get("_module")
    if _named(obj, "tdhook", "HookingContext"):
        return getattr(obj, "_module", None)
    if _named(obj, "tdhook", "HookedModule"):
        return getattr(obj, "hook_root", None)
    if _named(obj, "tensordict", "TensorDictModule"):
        return getattr(obj, "module", None)
    if is_transformer_bridge(obj):
        return getattr(obj, "original_model", None)
    if _named(obj, "peft", "PeftModel") and callable(getattr(obj, "get_base_model", None)):
        return _peft_base(obj)
    if _named(obj, "peft", "PeftMixedModel"):  # forward: base_model (the tuner) → its model
        return getattr(getattr(obj, "base_model", None), "model", None)
    return None


def _peft_base(obj):
    """A PEFT ``PeftModel``'s model: its adapters (LoRA, IA³, …) are injected into that
    model's own modules, so its forward is the PeftModel's. Prompt learning (prompt, prefix,
    p-tuning) instead changes the inputs in ``PeftModel.forward``: the model alone would
    explain another forward, so it is refused."""
    config = getattr(obj, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        raise TypeError(f"model: a PeftModel with a prompt-learning adapter ({type(config).__name__}) adds virtual "
                        "tokens in PeftModel.forward, which pyattr does not read; explain a model with injected "
                        "adapters (LoRA, IA3, ...) or one with the adapter merged")
    return obj.get_base_model()


def framework_tokenizer(obj):
    """The tokenizer a framework's wrapper carries (a ``TransformerBridge``'s, an nnsight
    ``LanguageModel`` / ``TransformersModel``'s), else None: text given with such a wrapper
    is read with the tokenizer the framework itself reads it with."""
    if framework_inner(obj) is None:
        return None
    try:
        tok = obj.__dict__.get("tokenizer") if _named(obj, "nnsight", "Envoy") else getattr(obj, "tokenizer", None)
    except Exception:  # noqa: BLE001 - a wrapper property that cannot answer has no tokenizer to give
        return None
    return tok if callable(getattr(tok, "encode", None)) else None


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside ``nn.DataParallel`` / ``DistributedDataParallel`` wrappers (any depth),
    and inside the wrappers of nnsight, tdhook, TransformerLens and PEFT (:func:`framework_inner`).

    Raises:
        TypeError: ``model`` is sharded with FSDP (``FullyShardedDataParallel`` or
            ``fully_shard``): no process holds whole parameters to explain with; a PEFT
            model with a prompt-learning adapter (:func:`_peft_base`).
    """
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, (nn.DataParallel, DistributedDataParallel)):
            model = model.module
        elif isinstance(framework_inner(model), nn.Module):
            model = framework_inner(model)
        else:
            break
    if not isinstance(model, nn.Module):
        return model  # the caller's own check names the argument
    fsdp = _fsdp_types()
    if fsdp and any(isinstance(m, fsdp) for m in model.modules()):
        raise TypeError(
            f"model is sharded with FSDP ({type(model).__name__}): relevance needs whole "
            "parameters in one process. Load the model unsharded, and for a model bigger than "
            "one device use device_map= (accelerate) instead"
        )
    return model


def mapped_inside(model: nn.Module, mapped) -> nn.Module:
    """``model`` when its ``config.model_type`` is in ``mapped``; else the one outermost
    module inside it whose type is (a user's adapter around a Hugging Face model, as tdhook
    users write one to return logits as a tensor: the rules go on that model, and what the
    adapter computes from its output is the user's target). ``model`` itself when there is
    none or more than one."""
    from pyattr.architectures.paths import model_type

    if model_type(model) in mapped:
        return model
    found, inside = [], set()
    for name, mod in model.named_modules():
        if not name or any(name.startswith(p + ".") for p in inside):
            continue
        if model_type(mod) in mapped:
            found.append(mod)
            inside.add(name)
    return found[0] if len(found) == 1 else model
