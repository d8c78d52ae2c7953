"""Source forms: the bodies of the Hugging Face forwards a rule forward may replace,
matched on their flattened source (a forward that computes something else keeps its own)."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from typing import Optional

from torch import nn

from pyattr.integration.forwards import FusedGatedForm

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
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    func = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if func is None:
        return None
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return ";".join(re.sub(r"\s+", "", ast.unparse(st)) for st in body)


def body_matches(fn, form) -> Optional["re.Match"]:
    body = flat_body(fn)
    if body is None:
        return None
    one = re.fullmatch(r"(\w+)=([^;]+);return\1", body)  # v = expr; return v  ->  return expr
    return re.fullmatch(form, "return" + one[2] if one else body)


def plain_fused_gated_forward(mlp: nn.Module, form: FusedGatedForm) -> bool:
    """True when the MLP's forward is exactly ``form``'s."""
    return body_matches(type(mlp).forward, form.pattern) is not None


def plain_gelu_head(head: nn.Module) -> bool:
    """True when the head's forward is exactly ``decoder(layer_norm(gelu(dense(x))))``."""
    return body_matches(type(head).forward, HEAD_FORM) is not None


def plain_gated_forward(mlp: nn.Module) -> bool:
    """True when the MLP's forward is exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``:
    the form the gated rule re-implements (no extra norm, multiplier or dropout)."""
    return body_matches(type(mlp).forward, GATED_FORM) is not None
