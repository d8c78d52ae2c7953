"""Recognising activation functions and their Identity-rule factor φ.

The Identity-rule (AttnLRP, ICML 2024, Eq. 9) replaces the local derivative of an
elementwise activation ``act`` by ``φ(x) = act(x) / x``. For the activations used by
transformer MLPs φ has a closed form that needs no division and is exact at ``x = 0``:

=============  ==========================================================
``silu``       ``σ(x)``
``gelu``       ``Φ(x) = ½(1 + erf(x/√2))``
``gelu_tanh``  ``½(1 + tanh(√(2/π)(x + 0.044715 x³)))``
``quick_gelu`` ``σ(1.702 x)``
``relu``       ``1[x > 0]``
=============  ==========================================================

Any other callable falls back to ``act(x) / x`` with ``φ(0) = zero_limit``.

Edge values (the one answer every backend gives, tests/test_edge_values.py): φ(NaN) = NaN;
φ(±0) = φ(subnormal) = ½ (ReLU: 1[x > 0]); φ(+inf) = 1 and φ(−inf) = 0 (the limits). In a
backward, ``act(x)`` is :func:`act_value`: ``x·φ(x)`` for the smooth kinds, so act(+inf) =
+inf and act(−inf) = −inf·0 = NaN (the native forward's value too; PyTorch's own float32
GELU gives NaN at +inf and overflows above ``finfo.max / 2``, the closed form gives the
mathematical value); ReLU's own ``relu`` (relu(−0) = −0). The ordinary derivative
:func:`derivative` takes its limits at ±inf (1 and 0) where PyTorch's gives NaN.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pyattr._module_forward import class_body, replaced_on_instance

KNOWN_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "quick_gelu", "relu")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_QUICK_GELU_ALPHA = 1.702

# Names accepted as strings; the Hugging Face ``ACT2FN`` keys map onto the same kinds.
_NAME_TO_KIND = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "quick_gelu": "quick_gelu",
    "relu": "relu",
}

# Hugging Face activation classes by class name, so that transformers stays optional.
_HF_CLASS_TO_KIND = {
    "SiLUActivation": "silu",
    "NewGELUActivation": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "QuickGELUActivation": "quick_gelu",
}


@dataclass(frozen=True)
class Activation:
    """A resolved activation.

    Attributes:
        kind: one of :data:`KNOWN_ACTIVATIONS`, or ``"custom"`` for any other callable.
        fn: the callable that computes the forward ``act(x)``: for a known kind the
            out-of-place ``torch.nn.functional`` op (same values as any of its forms, and
            an in-place module can no longer overwrite the saved input); for a custom
            callable the callable itself.
        zero_limit: φ(0) used by the ``custom`` kind (ignored for known kinds).
    """

    kind: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    zero_limit: float = 0.5

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """``act(x)`` for use inside a backward: the functional op for known kinds (no
        module hooks run), the callable on a copy for custom ones."""
        if self.kind == "custom":
            return self.eval_custom(x)
        return _native_fn(self.kind)(x)

    @property
    def name(self) -> str:
        return self.kind if self.kind != "custom" else getattr(self.fn, "__name__", type(self.fn).__name__)

    def eval_custom(self, x: torch.Tensor) -> torch.Tensor:
        """``act(x)`` for a custom callable on a copy of ``x`` (a callable that works in
        place must not overwrite a saved tensor), in float32/float64 where the callable
        allows it, else in ``x``'s own dtype (e.g. a module with float16 parameters)."""
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        try:
            return self.fn(x.to(acc).clone()).to(acc)
        except RuntimeError:
            own = _param_dtype(self.fn)
            if own is None or own == acc:
                raise
            return self.fn(x.to(own)).to(acc)


def _param_dtype(fn) -> Optional[torch.dtype]:
    if isinstance(fn, nn.Module):
        for t in list(fn.parameters()) + list(fn.buffers()):
            if t.is_floating_point():
                return t.dtype
    return None


def known(kind: str, zero_limit: float = 0.5) -> Activation:
    """The :class:`Activation` of a known kind, computed with the functional op."""
    return Activation(kind, _native_fn(kind), zero_limit)


def _native_fn(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if kind == "silu":
        return F.silu
    if kind == "gelu":
        return F.gelu
    if kind == "gelu_tanh":
        return functools.partial(F.gelu, approximate="tanh")
    if kind == "quick_gelu":
        return lambda x: x * torch.sigmoid(_QUICK_GELU_ALPHA * x)
    if kind == "relu":
        return F.relu
    raise AssertionError(kind)


def _kind_of_module(act: nn.Module) -> Optional[str]:
    """The known kind an activation module computes, from its class, or None. A module
    whose forward is replaced on the instance (an ablation that masks neurons) or a torch
    subclass with a forward of its own computes something else: None (a custom callable,
    whose Identity-rule factor φ = act(x)/x is read off its own output)."""
    if replaced_on_instance(act):
        return None
    for cls, kind in ((nn.SiLU, "silu"), (nn.ReLU, "relu"), (nn.GELU, None)):
        if isinstance(act, cls):
            # torch's own forward, not a subclass's nor one patched onto the class
            if type(act).forward is not cls.forward or not class_body(cls, cls.forward):
                return None
            return kind or ("gelu_tanh" if act.approximate == "tanh" else "gelu")
    name = type(act).__name__
    kind = _HF_CLASS_TO_KIND.get(name, "gelu" if name == "GELUActivation" else None)
    # (GELUActivation is either F.gelu, exact, or the erf formula in Python: both exact GELU.)
    # A class known by its name is observed once: its forward must compute that kind.
    return kind if kind is not None and _computes(act, kind) else None


_OBSERVED: dict = {}


def _computes(act: nn.Module, kind: str) -> bool:
    """Whether ``act``'s class forward computes ``kind`` (to 1e-6 of the largest value, on
    49 float64 points in [-6, 6]); once per class. A forward that cannot run on them (a
    module with 16-bit buffers) is taken at its class name's word."""
    key = (type(act), type(act).forward, kind)  # a class whose forward is patched later is observed again
    if key not in _OBSERVED:
        x = torch.linspace(-6.0, 6.0, 49, dtype=torch.float64)
        try:
            with torch.no_grad():
                y = type(act).forward(act, x)
            ok = isinstance(y, torch.Tensor) and y.shape == x.shape and bool(
                ((y.double() - _native_fn(kind)(x)).abs() <= 1e-6 * 6.0).all())
        except Exception:  # noqa: BLE001 - see the docstring
            ok = True
        _OBSERVED[key] = ok
    return _OBSERVED[key]


def _kind_of_function(fn: Callable) -> Optional[str]:
    if isinstance(fn, functools.partial):
        inner = _kind_of_function(fn.func)
        if inner == "gelu" and not fn.args:
            approx = fn.keywords.get("approximate", "none")
            if approx == "tanh":
                return "gelu_tanh"
            if approx == "none" and set(fn.keywords) <= {"approximate"}:
                return "gelu"
            return None
        if inner is not None and not fn.args and not fn.keywords:
            return inner
        # partial(F.silu, inplace=...) keeps the same math
        if inner in ("silu", "relu") and set(fn.keywords) <= {"inplace"} and not fn.args:
            return inner
        return None
    if isinstance(fn, nn.Module):
        return _kind_of_module(fn)
    if fn in (F.silu, torch.nn.functional.silu):
        return "silu"
    if fn in (F.gelu, torch.nn.functional.gelu):
        return "gelu"
    if fn in (F.relu, torch.relu, torch.nn.functional.relu):
        return "relu"
    return None


def resolve_activation(act, zero_limit: float = 0.5) -> Activation:
    """Resolve ``act`` (name, function, ``functools.partial`` or module) to an :class:`Activation`.

    Raises:
        ValueError: ``act`` is a string that names no known activation, or ``zero_limit``
            is not finite.
        TypeError: ``act`` is neither a string nor a callable.
    """
    if not isinstance(zero_limit, (int, float)) or not math.isfinite(zero_limit):
        raise ValueError(f"zero_limit must be a finite float, got {zero_limit!r}")
    if isinstance(act, Activation):
        return act
    if isinstance(act, str):
        key = act.lower()
        if key not in _NAME_TO_KIND:
            raise ValueError(
                f"act: unknown activation name {act!r}; expected one of "
                f"{sorted(_NAME_TO_KIND)} or a callable"
            )
        return known(_NAME_TO_KIND[key], float(zero_limit))
    if isinstance(act, nn.Module):
        kind = _kind_of_module(act)
    elif callable(act):
        kind = _kind_of_function(act)
    else:
        raise TypeError(f"act must be an activation name or a callable, got {type(act).__name__}")
    if kind is None:
        return Activation("custom", act, float(zero_limit))
    return Activation(kind, forward_fn(act, kind), float(zero_limit))


def _is_inplace(act) -> bool:
    if isinstance(act, functools.partial):
        return bool(act.keywords.get("inplace", False))
    return bool(getattr(act, "inplace", False))


def forward_fn(act, kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The callable that computes the forward of a known-kind activation: the object
    itself (so the forward is bit-identical to it, e.g. Hugging Face's Python GELU
    formulas), except in-place forms, which are replaced by the out-of-place op with
    the same values so that the input saved for the backward is not overwritten."""
    return _native_fn(kind) if _is_inplace(act) else act


def phi(x32: torch.Tensor, act: Activation) -> torch.Tensor:
    """Identity-rule factor φ(x) = act(x)/x, computed on a float32/float64 tensor.

    Closed forms for the known kinds; ``custom`` divides and sets φ(±0) = ``zero_limit``.
    NaN inputs give NaN, as the native derivative would; ±inf gives the limit.
    """
    k = act.kind
    if k == "silu":
        return torch.sigmoid(x32)
    if k == "gelu":
        # erfc, not 1 + erf: for x below about -5 the sum cancels to 0 while Φ is ~1e-9
        return 0.5 * torch.erfc(-x32 * _INV_SQRT_2)
    if k == "gelu_tanh":
        inner = _SQRT_2_OVER_PI * (x32 + 0.044715 * x32 * x32 * x32)
        # x³ overflows to ±inf for huge |x|; tanh saturates correctly there.
        return 0.5 * (1.0 + torch.tanh(inner))
    if k == "quick_gelu":
        return torch.sigmoid(_QUICK_GELU_ALPHA * x32)
    if k == "relu":
        # NaN stays NaN (a comparison alone would turn it into 0)
        return torch.where(torch.isnan(x32), x32, (x32 > 0).to(x32.dtype))
    y = act.eval_custom(x32)
    zero = x32 == 0
    # divide by 1 where x == 0: the branch torch.where drops must stay finite, or its
    # derivative (a second backward) would be NaN·0 = NaN there
    out = y / torch.where(zero, torch.ones_like(x32), x32)
    at_zero = torch.full_like(out, act.zero_limit)
    if torch.is_grad_enabled() and x32.requires_grad and bool(zero.any()):
        # recorded for a second backward: φ near 0 is φ(0) + x·act''(0)/2 (Taylor), so that
        # dφ/dx at 0 is act''(0)/2 and not the constant's 0
        at_zero = at_zero + x32 * (0.5 * _second_derivative_at_zero(act, x32))
    out = torch.where(zero, at_zero, out)
    # At ±inf the quotient is inf/inf; take it at the largest finite value instead.
    inf = torch.isinf(x32)
    if bool(inf.any()):
        big = torch.where(inf, torch.sign(x32) * torch.finfo(x32.dtype).max, x32)
        out = torch.where(inf, act.eval_custom(big) / big, out)
    return out


def _second_derivative_at_zero(act: Activation, like: torch.Tensor) -> torch.Tensor:
    """act''(0) of a custom callable (0 where it has none), shaped like ``like``, no graph."""
    with torch.enable_grad():
        z = torch.zeros_like(like).detach().requires_grad_(True)
        (d1,) = torch.autograd.grad(act.fn(z * 1.0).sum(), z, create_graph=True)
        if not d1.requires_grad:
            return torch.zeros_like(like).detach()
        (d2,) = torch.autograd.grad(d1.sum(), z, allow_unused=True)
    return torch.zeros_like(like).detach() if d2 is None else d2.detach()


def act_value(x32: torch.Tensor, act: Activation) -> torch.Tensor:
    """``act(x)`` as the rule backwards use it (the Half-rule's ``du = ½·dh·act(g)``), on a
    float32/float64 tensor: ``x·φ(x)`` in closed form for the smooth kinds (the compiled
    kernels compute the same product), ``relu`` for ReLU, the callable for custom ones."""
    k = act.kind
    if k == "custom":
        return act.eval_custom(x32)
    if k == "relu":
        return F.relu(x32)
    return x32 * phi(x32, act)


# act'(x) of SiLU, GELU and QuickGELU is exactly 1 (x > 0) or ±0 (x < 0) in float32 and
# float64 beyond this |x|; clamping x to it keeps x·(1 − σ) and x·pdf from being inf·0 at ±inf.
_DERIVATIVE_SATURATED = 1.0e4


def derivative(x32: torch.Tensor, act: Activation) -> torch.Tensor:
    """Ordinary derivative act'(x), used when the Identity-rule is switched off. At ±inf it
    is the limit (1 and 0), where PyTorch's own derivative gives NaN."""
    k = act.kind
    # Products are ordered so that a saturated factor (s·(1−s) = 0) meets x before any
    # constant can overflow it: huge finite x gives the native 0/1, never inf·0.
    if k in ("silu", "gelu", "quick_gelu"):
        x32 = torch.clamp(x32, -_DERIVATIVE_SATURATED, _DERIVATIVE_SATURATED)  # NaN stays NaN
    if k == "silu":
        s = torch.sigmoid(x32)
        return s * (1.0 + x32 * (1.0 - s))
    if k == "gelu":
        pdf = torch.exp(-0.5 * x32 * x32) / math.sqrt(2.0 * math.pi)
        return 0.5 * torch.erfc(-x32 * _INV_SQRT_2) + x32 * pdf
    if k == "gelu_tanh":
        # saturated beyond |x| = 10; the clamp keeps x² from overflowing into inf·0
        xc = torch.clamp(x32, -10.0, 10.0)
        t = torch.tanh(_SQRT_2_OVER_PI * (xc + 0.044715 * xc * xc * xc))
        dinner = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * xc * xc)
        return 0.5 * (1.0 + t) + 0.5 * xc * (1.0 - t * t) * dinner
    if k == "quick_gelu":
        s = torch.sigmoid(_QUICK_GELU_ALPHA * x32)
        return s + _QUICK_GELU_ALPHA * (x32 * (s * (1.0 - s)))
    if k == "relu":
        return phi(x32, act)
    if torch.is_grad_enabled() and x32.requires_grad:
        # inside a backward recorded for a second one (create_graph=True): keep the graph
        (d,) = torch.autograd.grad(act.fn(x32 * 1.0).sum(), x32, create_graph=True)
        return d
    with torch.enable_grad():
        xr = x32.detach().clone().requires_grad_(True)
        (d,) = torch.autograd.grad(act.fn(xr * 1.0).sum(), xr)
    return d
