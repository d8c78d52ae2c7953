"""Identity-rule for elementwise activations (AttnLRP, ICML 2024, Eq. 9).

The forward is the activation's own; the backward passes ``dx = dy · φ(x)`` with
``φ(x) = act(x)/x``, so ``x · dx == act(x) · dy``: relevance goes through unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import pyattr._function as _function
import pyattr.backends as backends
from pyattr._validation import check_float
from pyattr.activations import Activation, resolve_activation


@_function.second_order_checked
class IdentityRuleFunction(torch.autograd.Function):
    """Saves ``x`` only; φ is recomputed from it in the backward. Vmappable: the forward
    and backward are batched as they stand (the backward's kernels have batching rules)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, act: Activation) -> torch.Tensor:
        # a custom callable may work in place; the saved x must stay the input
        return act.fn(x.clone()) if act.kind == "custom" else act.fn(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.act = inputs
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None
        impl = backends.backward_implementation(x.device, "identity")
        return impl.identity_backward(x, dy, ctx.act), None


def identity_rule(x: torch.Tensor, act="silu", zero_limit: float = 0.5) -> torch.Tensor:
    """Apply ``act`` with the Identity-rule backward.

    Args:
        x (Tensor[...], float16/bfloat16/float32/float64): activation input.
        act (str | callable | nn.Module): ``"silu"``, ``"gelu"``, ``"gelu_tanh"``,
            ``"quick_gelu"``, ``"relu"`` (and the Hugging Face names such as
            ``"gelu_new"``, ``"gelu_pytorch_tanh"``, ``"swish"``), the matching
            ``torch.nn.functional`` functions, ``functools.partial(F.gelu, approximate=...)``,
            ``nn.Module`` instances (``nn.SiLU()``, ``nn.GELU(approximate=...)`` and the
            Hugging Face activation classes), or any other elementwise callable.
            Default: ``"silu"``.
        zero_limit (float): φ(0) for callables without a closed form. Default: 0.5.

    Returns:
        Tensor shaped and typed like ``x``, bit-identical to ``act(x)``.

    Backward: ``dx = dy · φ(x)`` in float32 (float64 stays float64). Saves ``x`` only.

    Raises:
        TypeError: ``x`` is not a floating tensor, or ``act`` is not callable.
        ValueError: ``act`` names no known activation; ``zero_limit`` is not finite.
    """
    check_float("x", x)
    return apply_identity_rule(x, resolve_activation(act, zero_limit))


def apply_identity_rule(x: torch.Tensor, act: Activation) -> torch.Tensor:
    """The Identity-rule on a checked floating ``x``: :class:`IdentityRuleFunction`, or on
    the eager CPU path with the cpp backend and a native activation (SiLU, GELU,
    GELU-tanh, ReLU) the C++ autograd Function ``pyattr._C.identity_rule`` (csrc/
    identity_rule.cpp): the same forward and kernel without the Python around them. For
    that node the backend is the one selected when the forward runs."""
    if _cpp_function_applies(x, act):
        return backends._probe_extension()[0].identity_rule(x, act.kind)
    return _function.apply(IdentityRuleFunction, x, act)


def _native_forward(act: Activation) -> bool:
    """``act.fn`` is the functional op the C++ Function runs, or the forward of a
    ``torch.nn`` SiLU / GELU / ReLU module (not in place), which calls it: not another
    module's own forward, which may compute otherwise."""
    fn, k = act.fn, act.kind
    mod = getattr(fn, "__self__", None)  # a bound method (builtins have one too: their module)
    if isinstance(mod, torch.nn.Module) and getattr(fn, "__func__", None) is type(mod).forward:
        if type(mod) in (torch.nn.SiLU, torch.nn.ReLU):
            return not mod.inplace and k == ("silu" if type(mod) is torch.nn.SiLU else "relu")
        if type(mod) is torch.nn.GELU:
            return k == ("gelu_tanh" if mod.approximate == "tanh" else "gelu")
        return False
    if k == "gelu_tanh":
        return (isinstance(fn, functools.partial) and fn.func is F.gelu and not fn.args
                and fn.keywords == {"approximate": "tanh"})
    return fn is {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}.get(k)


def _cpp_function_applies(x: torch.Tensor, act: Activation) -> bool:
    if type(x) is not torch.Tensor or not x.is_cpu or not x.is_floating_point() or not _native_forward(act):
        return False
    return _function.cpp_node_applies(x.device, "identity")
