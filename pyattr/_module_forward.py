"""The forward a module runs now, whatever set it: the one thing every "what does this
module compute" question starts from (the rule planner's form checks, structural
discovery, activation kinds). A forward replaced on the instance (an ablation or steering
tool, a kernel library such as Liger-Kernel) is the module's forward."""

from __future__ import annotations

import inspect

from torch import nn

# pyattr.integration.install's and .quantized's per-module records, read by name (this is a lower layer)
_RULES_STATE = "_pyattr_rules"
_QUANTIZED_PATCH = "_pyattr_quantized"


def global_hooks() -> bool:
    """Whether hooks registered for every module (``torch.nn.modules.module.register_module_*_hook``)
    exist: they see every call a forward makes, so a forward rebuilt or cut by pyattr would
    show them other calls than the module's own (the gated MLP's fused op; blockwise's cuts)."""
    m = nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


def forward_of(module: nn.Module):
    """The forward ``module`` runs now, as the module computes it: a forward set on the
    instance (an ablation or steering tool, a kernel library such as Liger-Kernel), under
    an accelerate hook the one its wrapper calls (``_old_forward``), else the class's;
    pyattr's own rule forward is seen through (the one it replaced), and so is nnsight's
    controller (the body it runs). A method of the class
    bound to this module is the class's function; a method bound to another object, or any
    other callable, is returned as it is (it is not this module's class forward)."""
    d = module.__dict__
    st = d.get(_RULES_STATE)
    quantized = d.get(_QUANTIZED_PATCH)
    if st is not None:
        fn = getattr(st, "saved_forward", None)
    elif nnsight_controller(module) is not None:
        fn = d["forward"].state.body  # what nnsight's controller runs (the class's function)
    elif "_old_forward" in d and hasattr(module, "_hf_hook"):
        fn = d["_old_forward"]
    else:
        fn = d.get("forward")
    if quantized is not None and fn is getattr(quantized, "patched", None):
        fn = getattr(quantized, "saved", None)  # pyattr's own input gradient for a torchao layer
    if fn is None or not callable(fn):  # nothing on the instance (pyattr's MISSING marker included)
        return type(module).forward
    if inspect.ismethod(fn) and fn.__self__ is module:
        return fn.__func__
    return fn


def nnsight_controller(module: nn.Module):
    """nnsight's ``Controller`` when it is the module's instance forward (nnsight installs
    one on every module of a model it wraps, and runs ``controller.state.body(module, …)``,
    the class's forward, in a trace and out of it), else None. Read by its class's name
    and module: nnsight need not be installed."""
    fn = module.__dict__.get("forward")
    cls = type(fn)
    if fn is not None and cls.__name__ == "Controller" and cls.__module__.startswith("nnsight") \
            and callable(getattr(getattr(fn, "state", None), "body", None)):
        return fn
    return None


def nnsight_tracing(module: nn.Module) -> bool:
    """Whether an nnsight trace is running over ``module`` now (its controller hands each
    call to the trace's interleaver)."""
    ctrl = nnsight_controller(module)
    active = getattr(getattr(ctrl, "state", None), "active", None)
    try:
        return callable(active) and active()[0] is not None
    except Exception:  # noqa: BLE001 - a controller state that cannot answer runs no trace
        return False


def replaced_on_instance(module: nn.Module) -> bool:
    """Whether ``module`` runs a forward other than its class's (:func:`forward_of`)."""
    return forward_of(module) is not type(module).forward


def class_body(cls: type, fn) -> bool:
    """``fn`` is a forward as written in the body of a class of ``cls``'s MRO (its qualified
    name is that class's, in that class's module), not a function patched onto it later."""
    for c in cls.__mro__:
        if c.__dict__.get("forward") is fn:
            return getattr(fn, "__qualname__", "") == f"{c.__qualname__}.forward" and \
                getattr(fn, "__module__", None) == c.__module__
    return False


def forward_name(mod: nn.Module) -> str:
    """How a refusal names the forward a module runs: ``Cls.forward``, the forward set on
    the instance (an ablation, steering or kernel library's), or one patched onto the class,
    by its own name."""
    if not replaced_on_instance(mod):
        fn = type(mod).forward
        if class_body(type(mod), fn):
            return f"{type(mod).__name__}.forward"
        return (f"{type(mod).__name__}.forward ({getattr(fn, '__qualname__', type(fn).__name__)}, not written in the "
                "class body: patched onto the class)")
    fn = forward_of(mod)
    return (f"the forward replaced on this {type(mod).__name__} instance "
            f"({getattr(fn, '__qualname__', type(fn).__name__)})")
