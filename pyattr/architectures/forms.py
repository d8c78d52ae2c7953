"""What a module computes, read off the module itself: the bodies of the Hugging Face
forwards a rule forward may replace, matched on their flattened source (a forward that
computes something else keeps its own), and a norm's kind and weight, read off its outputs
on probe inputs (:func:`classify_norm`). Structural discovery
(:mod:`pyattr.architectures.discover`) and the rule planner read both."""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from typing import Optional, Tuple

import torch
from torch import nn

from pyattr._module_forward import forward_of, replaced_on_instance  # noqa: F401 - re-exported
from pyattr.architectures.table import FusedGatedForm

# The forms a rule forward re-implements, matched against the WHOLE body of the module's
# forward (statements joined by ";", whitespace removed): one extra statement or factor
# anywhere, and the module keeps its own forward (or the scope refuses).
GATED_CALL = r"self\.{down}\(self\.{act}\(self\.{gate}\((?P<x>\w+)\)\)\*self\.{up}\((?P=x)\)\)"


GATED_BODY = "return{call}"  # "v = call; return v" is folded into this first (body_matches)


GATED_FORM = re.compile(GATED_BODY.format(call=GATED_CALL.format(
    down="down_proj", act="act_fn", gate="gate_proj", up="up_proj")))


GENERIC_GATED_FORM = re.compile(GATED_BODY.format(call=GATED_CALL.format(
    down="(?P<down>\\w+)", act="(?P<act>\\w+)", gate="(?P<gate>\\w+)", up="(?P<up>\\w+)")))


HEAD_FORM = re.compile(r"x=self\.dense\(features\);x=gelu\(x\);x=self\.layer_norm\(x\);x=self\.decoder\(x\);returnx")


def flat_body(fn) -> Optional[str]:
    """The body of a function, docstring dropped, statements joined by ";" and all
    whitespace removed (None if the source is unknown)."""
    try:
        code = inspect.unwrap(fn).__code__
    except (AttributeError, TypeError, ValueError):
        return None
    return _flat_body_of(code)


@functools.lru_cache(maxsize=4096)
def function_def(code) -> Optional[Tuple[ast.FunctionDef, list]]:
    """The parsed definition of a function's code object and its statements without the
    docstring (None if the source is unknown or not a function definition).

    Keyed by the code object: the planner and structural discovery ask for the same few
    forwards on every pass, and reading and parsing their source was most of a generic
    pass's time. A redefined or monkey-patched forward is another code object."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError):
        return None
    func = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if func is None:
        return None
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return func, body


@functools.lru_cache(maxsize=4096)
def _flat_body_of(code) -> Optional[str]:
    parsed = function_def(code)
    if parsed is None:
        return None
    return ";".join(re.sub(r"\s+", "", ast.unparse(st)) for st in parsed[1])


def module_body_matches(module: nn.Module, form) -> Optional["re.Match"]:
    """``form`` matched against the body of the forward ``module`` runs now
    (:func:`forward_of`); None for a method bound to another object (its body would name
    that object's submodules) or a forward whose source is unknown."""
    fn = forward_of(module)
    if inspect.ismethod(fn):
        return None
    return body_matches(fn, form)


def body_matches(fn, form) -> Optional["re.Match"]:
    body = flat_body(fn)
    if body is None:
        return None
    one = re.fullmatch(r"(\w+)=([^;]+);return\1", body)  # v = expr; return v  ->  return expr
    return re.fullmatch(form, "return" + one[2] if one else body)


def plain_fused_gated_forward(mlp: nn.Module, form: FusedGatedForm) -> bool:
    """True when the forward the MLP runs (its instance's, else its class's) is exactly ``form``'s."""
    return module_body_matches(mlp, form.pattern) is not None


def plain_gelu_head(head: nn.Module) -> bool:
    """True when the head's forward is exactly ``decoder(layer_norm(gelu(dense(x))))``."""
    return module_body_matches(head, HEAD_FORM) is not None


def plain_gated_forward(mlp: nn.Module) -> bool:
    """True when the forward the MLP runs (a forward replaced on the instance included) is
    exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: the form the gated rule
    re-implements (no extra norm, multiplier or dropout)."""
    return module_body_matches(mlp, GATED_FORM) is not None


# --------------------------------------------------------------------------- norms by what they compute


def _eps(module: nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(module, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return 1e-5


def _normalised(x: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    if kind == "layer_norm":
        c = x - x.mean(-1, keepdim=True)
        return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def norm_width(module: nn.Module, hidden: Optional[int]) -> Optional[int]:
    """The width a norm normalises: its own 1-D weight's, else its ``normalized_shape``
    (``nn.RMSNorm`` without a weight), else ``hidden``."""
    own = getattr(module, "weight", None)
    if isinstance(own, torch.Tensor) and own.dim() == 1:
        return int(own.shape[0])
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and len(shape) == 1:
        return int(shape[0])
    return hidden if isinstance(hidden, int) else None


def classify_norm(module: nn.Module, hidden: Optional[int]) -> Optional[Tuple[str, Tuple[Optional[torch.Tensor], float]]]:
    """``(kind, (weight, offset))`` when ``module`` maps every row x to ``n(x)·w + b`` with
    ``n`` the layer or RMS normalisation over its last dimension, else None.

    The probe width is the module's own (:func:`norm_width`: its 1-D weight's, its
    ``normalized_shape``), else ``hidden``. Four random rows go through the module without
    gradient (in its parameters' dtype); the per-column weight is fitted from the first two
    and must predict the others (0.1 % in float32 / float64, 5 % in 16-bit dtypes). The
    weight returned is the module's own 1-D ``weight`` (with Gemma's offset of 1 when that
    is what it computes) if it has one of that size; else the fitted one, a plain tensor:
    the true scale of a parameter-free norm (ones for x/rms; 1/√n for an L2 norm
    x/‖x‖ = x/rms · 1/√n), a 0-d tensor when it is the same in every column (such a norm
    is applied at any width)."""
    hidden = norm_width(module, hidden)
    if hidden is None:
        return None
    p = next((t for t in module.parameters(recurse=False)), None)
    dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
    device = p.device if p is not None and p.device.type != "meta" else torch.device("cpu")
    if device.type == "meta":
        return None
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, hidden, generator=g, dtype=torch.float64) * 2 + 0.3).to(device=device, dtype=dtype)
    try:
        with torch.no_grad():
            y = module(x)
    except Exception:  # noqa: BLE001 - a module that does not take one tensor is not a norm
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    tol = 5e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-3
    xd, yd = x.double(), y.double()
    for kind in ("layer_norm", "rms_norm"):
        n = _normalised(xd, kind, _eps(module))
        dn = n[0] - n[1]
        w = (yd[0] - yd[1]) / torch.where(dn.abs() > 1e-6, dn, torch.ones_like(dn))
        b = yd[0] - n[0] * w
        pred = n * w + b
        if kind == "rms_norm" and b.abs().max() > tol * (yd.abs().max() + 1e-12):
            continue  # an RMS norm has no bias
        if (pred - yd).abs().max() <= tol * (yd.abs().max() + 1e-12):
            own = getattr(module, "weight", None)
            if isinstance(own, torch.Tensor) and own.dim() == 1 and own.shape[0] == hidden:
                for offset in (0.0, 1.0):
                    cand = own.detach().double() + offset
                    if (cand - w).abs().max() <= tol * (w.abs().max() + 1e-12):
                        return kind, (own, offset)
                return None  # a weight of the right size that is not what it multiplies by
            uniform = (w - w.mean()).abs().max() <= tol * (w.abs().max() + 1e-12)
            return kind, ((w.mean() if uniform else w).to(dtype), 0.0)
    return None
