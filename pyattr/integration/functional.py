"""Rules for what a forward computes with functions rather than modules (``generic=True``).

A model without a rule map applies many of its nonlinearities as function calls that no
module rule can reach: ``gelu(x)`` in a masked-LM head, ``torch.tanh`` in a pooler,
``F.silu(gate) * up`` in a gated MLP, a gate computed in one statement and multiplied in
the next, a norm written inline (``x * torch.rsqrt(var + eps)``, ``F.normalize``). While
the model's forward runs inside a generic scope, a :class:`~torch.overrides.TorchFunctionMode`
sees those calls on tensors that carry gradient and gives each the rule of its family:

- **Identity-rule** (AttnLRP, ICML 2024, Eq. 9) on elementwise activations called as
  functions (``F.gelu`` exact or tanh, ``F.silu``, ``F.relu``, ``F.mish``, ``torch.tanh``):
  ``dx = dy·φ(x)``, ``φ(x) = act(x)/x`` (closed forms of :func:`pyattr.activations.phi`;
  tanh and mish divide, with their limits at 0).
- **LN-rule** (RelP, arXiv 2508.21258; AttnLRP Prop. 3.2): a normalising statistic
  (``rsqrt``, ``sqrt``, ``reciprocal``, ``norm``, ``var``, ``std`` of a path tensor, and
  ``F.normalize``'s denominator) is a constant where it multiplies or divides.
- **Gates** (sigmoid, softplus, exp, erf, and tanh where it multiplies): a gate factor is a
  constant where it multiplies another path tensor, as the AH-rule holds an attention
  pattern constant; so ``x·σ(x)`` written by hand gets SiLU's Identity-rule exactly.
- **Half-rule** (AttnLRP Eq. 12) on any other product of two path tensors:
  ``du = ½·dy·v``, ``dv = ½·dy·u`` (an activation's output times another branch: the
  gated-MLP rule of :mod:`pyattr.rules.half`).

Every rule keeps the native value: the output is the function's own result plus
``s − s.detach()`` (zero), where ``s`` carries the rule's gradient. A tag on the result
(its ``_pyattr_tag`` attribute) marks gates and statistics; views, casts, indexing and
arithmetic with constants keep it, so ``(1 + tanh(z))`` or ``rsqrt(var + eps).to(x)`` are
still recognised where they multiply. Anything else (``exp`` added to a path, ``einsum``
of two path tensors, an in-place op) stays native, where the plan check
(:mod:`pyattr.integration.plan_check`) measures the loss and refuses.

Inside a module whose forward pyattr already replaced (a mounted rule) and inside the
rule Functions themselves (gradient recording is off there), nothing is changed.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from pyattr.activations import Activation, phi
from pyattr.integration.errors import RelevanceRuleConflictError
from pyattr.integration.install import FUNCTIONAL_SCOPES, ONE_THREAD, _rule_forward, in_rule_forward

_TAG = "_pyattr_tag"

# tag -> priority where two tagged path tensors multiply: the higher is the constant
_PRIORITY = {"stat": 3, "gate": 2, "tanh": 1}

_GELU = (F.gelu,)
_SILU = (F.silu,)
_RELU = (F.relu, torch.relu, torch.Tensor.relu)
_TANH = (torch.tanh, torch.Tensor.tanh, F.tanh)
_MISH = (F.mish,)
# erf: GELU written out as x·½(1 + erf(x/√2)) (ESM's gelu) is then GELU's Identity-rule
_GATES = (torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid, F.softplus, torch.exp, torch.Tensor.exp, torch.erf,
          torch.Tensor.erf)
_STATS = (torch.rsqrt, torch.Tensor.rsqrt, torch.sqrt, torch.Tensor.sqrt, torch.reciprocal, torch.Tensor.reciprocal,
          torch.norm, torch.Tensor.norm, torch.linalg.vector_norm, torch.linalg.norm, torch.var, torch.Tensor.var,
          torch.std, torch.Tensor.std)
# methods whose tensor arguments after the first give a shape, a dtype or a device only
_TEMPLATES = {getattr(torch.Tensor, n) for n in ("expand_as", "view_as", "reshape_as", "type_as", "to", "new_zeros",
                                                 "new_ones", "new_full", "new_empty", "new_tensor")}
_MUL = (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.multiply)
_DIV = (torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.true_divide, torch.divide)
# ops whose result is still the tagged quantity (shape, dtype, device, indexing, and
# arithmetic with a constant: 1 + tanh(z) is a gate, var + eps a statistic's argument)
_KEEP = {getattr(torch.Tensor, n) for n in (
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "contiguous", "to", "float", "double", "half",
    "bfloat16", "type_as", "type", "unsqueeze", "squeeze", "expand", "expand_as", "flatten", "__getitem__", "clone",
    "repeat", "repeat_interleave", "chunk", "split", "unbind", "narrow", "__add__", "__radd__", "__sub__", "__rsub__",
    "add", "sub", "__neg__", "neg", "clamp", "clamp_min", "clamp_max", "t")} | {
    torch.transpose, torch.reshape, torch.unsqueeze, torch.squeeze, torch.flatten, torch.chunk, torch.split,
    torch.add, torch.sub, torch.neg, torch.clamp, torch.clamp_min, torch.rsub, torch.repeat_interleave}
_GELU_ACT, _GELU_TANH_ACT, _SILU_ACT, _RELU_ACT = (Activation(k, F.gelu) for k in ("gelu", "gelu_tanh", "silu", "relu"))
_TANH_ACT = Activation("custom", torch.tanh, 1.0)
_MISH_ACT = Activation("custom", F.mish, 0.6)  # mish(x)/x → tanh(ln 2) at 0


def _path(t) -> bool:
    """A tensor on the relevance path: it carries gradient from the model's input. A
    parameter is never one, whether or not it requires grad, nor is what the forward
    computes from parameters alone (a layer scale λ, DiffLlama's λ = exp(λq·λk) − …, a
    logit scale): their product with a path tensor is a product with a constant."""
    return (isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
            and not isinstance(t, nn.Parameter) and getattr(t, _TAG, None) != "param")


def _from_parameters(func, args, kwargs) -> bool:
    """The call computes from parameters alone: some argument requires grad, every argument
    that requires grad is a parameter or itself computed from parameters alone, and no
    argument holds the model's input data (its ids, pixels, masks: tagged ``"data"`` where
    the forward takes them, and what is computed from them). Constants the forward makes
    (``ones_like(y)``, ``arange``) are neither. A tensor used only for its shape or dtype
    (``gamma.expand_as(y)``, ``w.type_as(x)``) does not count."""
    if func in _TEMPLATES:
        args, kwargs = args[:1], {}
    seen = False
    for a in list(args) + list(kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if not isinstance(t, torch.Tensor):
                continue
            tag = getattr(t, _TAG, None)
            if tag == "data":
                return False
            if t.requires_grad:
                if not (isinstance(t, nn.Parameter) or tag == "param"):
                    return False
                seen = True
    return seen


def _holds_data(args, kwargs) -> bool:
    for a in list(args) + list(kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor) and getattr(t, _TAG, None) == "data":
                return True
    return False


def _tag_outputs(out, tag: str):
    for o in (out if isinstance(out, (tuple, list)) else (out,)):
        _tagged(o, tag)
    return out


def tag_of(t) -> Optional[str]:
    return getattr(t, _TAG, None) if isinstance(t, torch.Tensor) else None


def _tagged(t, tag: Optional[str]):
    if tag is not None and isinstance(t, torch.Tensor):
        try:
            setattr(t, _TAG, tag)
        except (AttributeError, RuntimeError):
            pass
    return t


def _with_grad(y: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``y``'s value, ``s``'s gradient."""
    return y.detach() + (s - s.detach()).to(y.dtype)


def _identity(x: torch.Tensor, y: torch.Tensor, act: Activation) -> torch.Tensor:
    acc = torch.promote_types(x.dtype, torch.float32)
    f = phi(x.detach().to(acc), act).to(x.dtype)
    return _with_grad(y, x * f)


class FunctionalRules(TorchFunctionMode):
    """The mode (see the module docstring); active only inside the model's forward. Each
    family follows its switch in ``rules``: the Identity-rule ``activation``, the LN-rule
    ``normalization``, gates and the Half-rule ``multiplicative_gate``."""

    def __init__(self, rules):
        super().__init__()
        self.act, self.norm, self.gate = bool(rules.activation), bool(rules.normalization), bool(
            rules.multiplicative_gate)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if in_rule_forward() or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        if _from_parameters(func, args, kwargs):
            # computed from parameters alone: a constant of the relevance path, whatever it
            # is multiplied with later (never the Half-rule's second path tensor, never a
            # gate or a statistic of the path)
            return _tag_outputs(func(*args, **kwargs), "param")
        x = args[0] if args else kwargs.get("input")
        if func in _MUL or func in _DIV:
            return self._product(func, args, kwargs)
        out = func(*args, **kwargs)
        if _holds_data(args, kwargs) and not any(isinstance(o, torch.Tensor) and o.requires_grad
                                                for o in (out if isinstance(out, (tuple, list)) else (out,))):
            return _tag_outputs(out, "data")  # the input data, reshaped or converted: still the input
        if not _path(x) or not isinstance(out, torch.Tensor) and func not in _KEEP:
            return out
        if func in _GELU + _SILU + _RELU + _MISH and not self.act:
            return out
        if func in _GELU:
            approx = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
            return _identity(x, out, _GELU_TANH_ACT if approx == "tanh" else _GELU_ACT)
        if func in _SILU and not kwargs.get("inplace", False):
            return _identity(x, out, _SILU_ACT)
        if func in _RELU:
            return _identity(x, out, _RELU_ACT)
        if func in _TANH:
            return _tagged(_identity(x, out, _TANH_ACT) if self.act else out, "tanh")
        if func in _MISH:
            return _identity(x, out, _MISH_ACT)
        if func in _GATES:
            return _tagged(out, "gate")
        if func in _STATS:
            return _tagged(out, "stat")
        if func is F.normalize and self.norm:
            return self._normalize(x, out, args, kwargs)
        if func in _KEEP:
            tag = self._kept(args, kwargs)
            if tag is not None:
                if isinstance(out, (tuple, list)):
                    for o in out:
                        _tagged(o, tag)
                else:
                    _tagged(out, tag)
        return out

    @staticmethod
    def _kept(args, kwargs) -> Optional[str]:
        """The tag an op keeps: its one path operand's, when the others are constants."""
        paths = [a for a in list(args) + list(kwargs.values()) if _path(a)]
        if len(paths) != 1:
            return None
        return tag_of(paths[0])

    def _product(self, func, args, kwargs):
        out = func(*args, **kwargs)
        if len(args) < 2 or kwargs:
            return out
        a, b = args[0], args[1]
        if func is torch.Tensor.__rmul__:
            a, b = b, a
        if not (_path(a) and _path(b)) or not isinstance(out, torch.Tensor):
            tag = tag_of(a) if _path(a) else tag_of(b) if _path(b) else None
            return _tagged(out, tag)
        ta, tb = _PRIORITY.get(tag_of(a), 0), _PRIORITY.get(tag_of(b), 0)
        stat = _PRIORITY["stat"]
        if func in _DIV:
            if tb == stat and self.norm:  # x / norm(x): the LN-rule
                return _with_grad(out, a / b.detach())
            return out
        if max(ta, tb) == stat and not self.norm or max(ta, tb) < stat and not self.gate:
            return out
        if max(ta, tb) > 0:
            s = a * b.detach() if tb >= ta else a.detach() * b
            return _with_grad(out, s)
        return _with_grad(out, 0.5 * (a * b.detach()) + 0.5 * (a.detach() * b))

    @staticmethod
    def _normalize(x, out, args, kwargs):
        p = kwargs.get("p", args[1] if len(args) > 1 else 2.0)
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 1)
        eps = kwargs.get("eps", args[3] if len(args) > 3 else 1e-12)
        denom = x.detach().norm(p, dim, keepdim=True).clamp_min(eps)
        return _with_grad(out, x / denom)


def _enter_native(mod, args):
    _rule_forward.depth = getattr(_rule_forward, "depth", 0) + 1


def _leave_native(mod, args, out):
    _rule_forward.depth -= 1


@contextlib.contextmanager
def functional_rules(model: nn.Module, rules, roots=(), native=()) -> Iterator[None]:
    """For the ``with`` block: every forward of ``model`` (and of the ``roots``, its base
    model called alone) runs under :class:`FunctionalRules` with ``rules``' switches,
    except inside the ``native`` modules (left native on purpose by the plan)."""
    mode = FunctionalRules(rules)
    depth = {"n": 0}
    tagged: list = []
    owner = threading.current_thread()  # the mode is this thread's; another thread's forward runs without it

    def pre(mod, args, kwargs):
        if not torch.compiler.is_compiling() and threading.current_thread() != owner:
            if torch.is_grad_enabled():
                raise RelevanceRuleConflictError(
                    f"{type(mod).__name__} runs in a thread that opened no use_relevance_rules scope on it, while a "
                    f"scope in another thread holds relevance rules on it; its gradient would silently carry that "
                    f"scope's rules. {ONE_THREAD}")
            return
        if depth["n"] == 0:
            mode.__enter__()
            tagged.extend(_tag_inputs(args, kwargs))
        depth["n"] += 1

    def post(mod, args, kwargs, out):
        if not torch.compiler.is_compiling() and threading.current_thread() != owner:
            return
        depth["n"] -= 1
        if depth["n"] == 0:
            mode.__exit__(None, None, None)
            _untag(tagged)

    handles = []
    for m in native:
        handles.append(m.register_forward_pre_hook(_enter_native))
        handles.append(m.register_forward_hook(_leave_native, always_call=True))
    for m in (model, *roots):
        handles.append(m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
        handles.append(m.register_forward_hook(post, always_call=True, with_kwargs=True))
    with _hooked(handles):
        try:
            yield
        finally:
            while depth["n"] > 0:  # a forward that raised before its hook could pop the mode
                depth["n"] -= 1
                if depth["n"] == 0:
                    mode.__exit__(None, None, None)
            _untag(tagged)


def _tag_inputs(args, kwargs) -> list:
    """The model's input data (the tensors it is called with that carry no gradient: ids,
    pixels, masks, positions) tagged ``"data"`` for the call; returned, to be untagged after."""
    out = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor) and not a.requires_grad and getattr(a, _TAG, None) is None:
            try:
                setattr(a, _TAG, "data")
            except (AttributeError, RuntimeError):
                continue
            out.append(a)
    return out


def _untag(tagged: list) -> None:
    """The caller's own tensors given back without the tag (what the forward computed from them keeps it, and dies with it)."""
    for t in tagged:
        try:
            delattr(t, _TAG)
        except AttributeError:
            pass
    tagged.clear()


@contextlib.contextmanager
def _hooked(handles) -> Iterator[None]:
    """A functional scope's hooks (``handles``) for the ``with`` block: counted open, and
    removed on exit (exceptions included)."""
    FUNCTIONAL_SCOPES[0] += 1
    try:
        yield
    finally:
        FUNCTIONAL_SCOPES[0] -= 1
        for h in handles:
            h.remove()


@contextlib.contextmanager
def head_functional_rules(model: nn.Module, base: nn.Module, rules) -> Iterator[None]:
    """For the ``with`` block: the stretch of ``model``'s forward after its base model
    returns (the head region: a classification head that calls ``torch.tanh``, Gemma 2's
    ``cap·tanh(logits/cap)``) runs under :class:`FunctionalRules`, nothing before it. The
    mode is entered when the base model's forward returns inside a forward of ``model``
    and left when that forward returns (exceptions included)."""
    mode = FunctionalRules(rules)
    state = {"outer": 0, "on": False}

    def model_pre(mod, args):
        state["outer"] += 1

    def base_post(mod, args, out):
        if state["outer"] == 1 and not state["on"]:
            mode.__enter__()
            state["on"] = True

    def model_post(mod, args, out):
        state["outer"] -= 1
        if state["outer"] == 0 and state["on"]:
            state["on"] = False
            mode.__exit__(None, None, None)

    handles = [model.register_forward_pre_hook(model_pre, prepend=True),
               base.register_forward_hook(base_post, always_call=True),
               model.register_forward_hook(model_post, always_call=True)]
    with _hooked(handles):
        try:
            yield
        finally:
            if state["on"]:
                mode.__exit__(None, None, None)

