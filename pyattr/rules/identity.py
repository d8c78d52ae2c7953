"""Identity-rule for elementwise activations (AttnLRP, ICML 2024, Eq. 9).

The forward is the activation's own; the backward passes ``dx = dy · φ(x)`` with
``φ(x) = act(x)/x``, so ``x · dx == act(x) · dy``: relevance goes through unchanged.
"""

from __future__ import annotations

import torch

from pyattr import _function, backends
from pyattr._validation import check_float
from pyattr.activations import Activation, resolve_activation


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
    return _function.apply(IdentityRuleFunction, x, resolve_activation(act, zero_limit))
