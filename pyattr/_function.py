"""Calling pyattr's ``autograd.Function``s without the cost of the vmappable form.

The rule Functions are written in the form ``torch.func`` needs (``forward`` without
``ctx``, a separate ``setup_context``, ``generate_vmap_rule``), so that ``torch.vmap``,
``torch.func.grad`` and ``torch.compile`` take them. PyTorch's ``Function.apply`` then
binds the call to ``inspect.signature(forward)`` on every call and goes through the
functorch-aware path: about 60 µs per call here, against about 5 µs for a Function in the
combined ``forward(ctx, ...)`` form. On a LayerNorm of 2048 × 1024 that is 2–3 % of the
whole forward + backward, which is the difference between pyattr matching the native op
and not.

:func:`apply` runs the combined-form twin of a Function whenever no functorch transform
is active and nothing is being compiled; the twin calls the same ``forward``,
``setup_context`` and ``backward``, so the two differ only in how they are entered.
Everywhere else (``vmap``, ``grad``, ``torch.compile``) the Function itself runs.
:func:`cpp_node_applies` says where the extension's C++ autograd nodes may stand in for a
Function (LayerNorm, the Identity-rule).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Iterator, Type

import torch

_TWIN = "_pyattr_eager_twin"


def no_forward_mode(ctx=None, *args):
    """The rule Functions' ``jvp`` (their eager twins'; a Function of its own with one is not
    traced by ``torch.compile``) and, under ``torch.func``'s forward-mode transforms, what
    :func:`apply` raises: the rules are backward rules, and forward-mode AD has none to run
    (torch's own message named neither pyattr nor what to do)."""
    raise NotImplementedError(
        "pyattr's relevance rules are defined on the backward pass; forward-mode AD (torch.func.jvp, jacfwd, "
        "hessian, torch.autograd.forward_ad) cannot carry them. Use reverse mode (backward(), "
        "torch.autograd.grad, torch.func.grad / vjp / jacrev), or run it outside the use_relevance_rules scope")


def _twin(cls: Type[torch.autograd.Function]) -> Type[torch.autograd.Function]:
    params = inspect.signature(cls.forward).parameters.values()
    if any(p.default is not p.empty or p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        # the twin passes the arguments through as given: defaults would be lost
        raise TypeError(f"{cls.__name__}.forward must take positional arguments without defaults")

    # The methods are looked up on cls at each call, so that a patched method (a test's
    # monkeypatch) reaches both forms alike, and its undoing too.
    def forward(ctx, *args):
        out = cls.forward(*args)
        cls.setup_context(ctx, args, out)
        return out

    def backward(ctx, *grads):
        return cls.backward(ctx, *grads)

    # same name, so the graph shows the same <Name>Backward node either way
    twin = type(cls.__name__, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward), "jvp": staticmethod(no_forward_mode),
        "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
    })
    setattr(cls, _TWIN, twin)
    return twin


def second_order_checked(cls=None, *, held: bool = False):
    """Class decorator of a rule Function: its backward refuses to be recorded for a further
    derivative where that derivative would not be the derivative of the rule gradient
    (:func:`check_second_order`), on every path (the eager twin calls the same backward).
    ``held``: the Function holds a value constant (no gradient to its input), so any
    recorded backward through it misses that value's dependence on the input."""
    def wrap(cls):
        inner = cls.backward
        # where the forward ran under a torch.func transform, its backward runs as functorch
        # records it (tf.vjp's function too, later, outside the transform): only a nested
        # level is a further derivative there
        setup = "setup_context" if "setup_context" in cls.__dict__ else "forward"
        first = getattr(cls, setup)

        def marked(ctx, *args):
            ctx.pyattr_functorch = torch._C._are_functorch_transforms_active()
            return first(ctx, *args)

        def backward(ctx, *grads):
            check_second_order(cls, ctx, grads, held)
            return inner(ctx, *grads)

        setattr(cls, setup, staticmethod(marked))
        cls.backward = staticmethod(backward)
        return cls

    return wrap(cls) if cls is not None else wrap


def _grad_levels() -> int:
    stack = getattr(torch._C._functorch, "get_interpreter_stack", lambda: None)() or ()
    return sum(i.key() == torch._C._functorch.TransformType.Grad for i in stack)


def check_second_order(cls, ctx, grads, held: bool) -> None:
    """A rule node's backward recorded for a further derivative (eager ``create_graph=True``,
    or a ``torch.func.grad`` inside another) raises where the second derivative would flow
    back through the op's *output* (an incoming gradient computed from the graph: a
    nonlinearity after the op, any model; under ``torch.func`` every nested level), since
    the node has the rule's Jacobian where the forward's own is needed, or through a held
    value (``held``). A node that runs no rule this time (``cls.native_jacobian(ctx)``)
    and a given incoming gradient (a leaf: ``grad_outputs``, gradgradcheck's) run: their
    second derivative is exact. The C++ nodes (csrc/second_order.h) say the same."""
    if not torch.is_grad_enabled():
        return
    functorch = getattr(ctx, "pyattr_functorch", False) or torch._C._are_functorch_transforms_active()
    if functorch and _grad_levels() < 2:  # one torch.func.grad records its own backward
        return
    native = getattr(cls, "native_jacobian", None)
    if native is not None and native(ctx):
        return
    from pyattr.backends._vmap import batched  # is_grads_batched's gradients hide their grad_fn

    if held or functorch or any(isinstance(g, torch.Tensor) and (g.grad_fn is not None or batched(g))
                                for g in grads):
        what = "a value the rule holds constant" if held else "the output of one of pyattr's rule ops"
        raise RuntimeError(
            f"{cls.__name__}: a second derivative (create_graph=True) would flow back through {what}, whose node "
            "gives the rule's Jacobian where the derivative of the rule gradient needs the forward's own, so the "
            "result would not be that derivative. Second-order gradients are exact with respect to a rule op's own "
            "input and a given incoming gradient only (identity_rule(x, act) with grad_outputs); through a model "
            "under use_relevance_rules, differentiate the rule gradient by finite differences, or take second "
            "derivatives outside the scope")


def refuse_forward_mode() -> None:
    """Under ``torch.func.jvp`` / ``jacfwd`` / ``hessian`` (a forward-mode transform on the
    stack), :func:`no_forward_mode`'s refusal."""
    stack = getattr(torch._C._functorch, "get_interpreter_stack", lambda: None)() or ()
    if any(i.key() == torch._C._functorch.TransformType.Jvp for i in stack):
        no_forward_mode()


def apply(cls: Type[torch.autograd.Function], *args: Any) -> Any:
    """``cls.apply(*args)``, through the combined-form twin where that is the same call.

    ``args`` are positional and complete (every ``forward`` parameter given)."""
    if torch.compiler.is_compiling():
        return cls.apply(*args)
    if torch._C._are_functorch_transforms_active():
        refuse_forward_mode()
        return cls.apply(*args)
    twin = cls.__dict__.get(_TWIN) or _twin(cls)
    return twin.apply(*args)


def cpp_node_applies(device: torch.device, op: str) -> bool:
    """A C++ autograd node of the extension (``pyattr._C.layer_norm_rule``,
    ``pyattr._C.identity_rule``) gives what the Python Function gives: eager code (no
    compilation, functorch transform, torch-function mode or jit tracing would see the ops
    inside the Python Function) with the ``cpp`` backend selected for ``op``. A backend
    that cannot be selected (unavailable, or a bad ``PYATTR_BACKEND``) answers False: the
    Python Function then raises in its backward, as before."""
    if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch._C._is_torch_function_mode_enabled() or torch.jit.is_tracing()):
        return False
    import pyattr.backends as backends

    try:
        chosen = backends.select(device, op)
    except (backends.BackendUnavailableError, ValueError):
        return False
    # pyattr._C_stable has the kernels but not the C++ nodes
    return chosen == "cpp" and backends.extension.HAS_AUTOGRAD_NODES


_first_order = threading.local()


@contextlib.contextmanager
def first_order_saves(on: bool = True) -> Iterator[None]:
    """Inside the block (this thread), the norms' rule Functions of a forward that no
    parameter gradient is asked of save the per-row scale the LN-rule holds constant
    instead of their input, for a backward that is not differentiated again: pyattr's own
    passes, which run their backward once and never with ``create_graph``. On a
    Llama-3.2-1B-shaped model in float32 that is 16 MB per block of 1024 tokens (two
    norms' inputs) out of about 100 MB it saves. A backward that is being recorded
    (``create_graph=True``) through such a node raises. ``on=False`` switches it off for an
    inner block (a checkpointed block recomputed as its forward ran)."""
    stack = _first_order.__dict__.setdefault("stack", [])
    stack.append(bool(on))
    try:
        yield
    finally:
        stack.pop()


def first_order(*params) -> bool:
    """Inside :func:`first_order_saves`, in eager code (no ``torch.func`` transform or
    compilation, which see the Function's own saves), and none of ``params`` (a rule op's
    parameters, None allowed) asks for a gradient."""
    stack = getattr(_first_order, "stack", None)
    return (bool(stack) and stack[-1] and not torch.compiler.is_compiling()
            and not torch._C._are_functorch_transforms_active()
            and not any(p is not None and p.requires_grad for p in params))


def refuse_create_graph(op: str, kept: str) -> None:
    """A first-order node's backward (:func:`first_order_saves`) being recorded for a second
    derivative: it lacks the input that one needs, so it says so instead of a wrong value."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{op}: this node was recorded by one of pyattr's own passes, which keep {kept} "
                           "instead of x and do not support a backward with create_graph=True")
