"""``triton`` backend: the kernels of ``pyattr.kernels`` (CUDA tensors, or CPU tensors
under ``TRITON_INTERPRET=1``). Custom activation callables and broadcasting Half-rule
inputs run in the reference backend, as in the compiled backends.

Each kernel launcher is an operator ``pyattr_triton::<op>`` with the schema of the
matching ``pyattr::<op>`` of the extension (activations as their kind string, empty
tensors for parameter gradients not asked for). The dispatcher then unwraps batched
tensors (``torch.vmap``, ``is_grads_batched``) through the batching rules of
:mod:`pyattr.backends._vmap` before a kernel sees them.

With compiled Triton the operators are ``torch.library.triton_op``s whose launches go
through ``wrap_triton``: ``torch.compile`` (inductor) and export trace into them and see
the kernels themselves, and their fake implementation is the launcher run on fake
tensors. Under ``TRITON_INTERPRET=1`` a kernel cannot be traced (the interpreter runs it
on the tensors' data), so there they are ``custom_op``s with the fake implementations of
:mod:`pyattr.backends._fake`, opaque to the compiler.
"""

from __future__ import annotations

import importlib
from typing import Optional, Tuple

import torch
from torch import Tensor

from pyattr.activations import Activation
import pyattr.backends._fake as _fake
import pyattr.backends._vmap as _vmap
import pyattr.backends.reference as reference
from pyattr.backends.reference import promoted_dtype as _promoted

rms_norm_forward = reference.rms_norm_forward

gated_forward = reference.gated_forward


# --- the custom ops ---------------------------------------------------------------------

# traceable operators over compiled kernels; opaque ones (explicit fakes) under the interpreter.
# Their return annotations are builtin tuple[...]: torch 2.6 evaluates the (string, under
# `from __future__ import annotations`) annotation in its own namespace, which has Tensor
# and Optional but not typing.Tuple
# kernels/ is shipped as pyattr.kernels (a package_dir mapping), loaded here by name
INTERPRET = importlib.import_module("pyattr.kernels._common").INTERPRET
TRACEABLE = not INTERPRET


def _operator(name: str):
    make = torch.library.triton_op if TRACEABLE else torch.library.custom_op
    return make(name, mutates_args=())


@_operator("pyattr_triton::identity_backward")
def _identity_op(x: Tensor, dy: Tensor, act: str) -> Tensor:
    identity = importlib.import_module("pyattr.kernels.identity")

    return identity.identity_backward(x, dy, act)


@_operator("pyattr_triton::half_backward")
def _half_op(u: Tensor, v: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    half = importlib.import_module("pyattr.kernels.half")

    return half.half_backward(u, v, dy)


@_operator("pyattr_triton::gated_backward")
def _gated_op(gate: Tensor, up: Tensor, dh: Tensor, act: str, identity: bool, half: bool) -> tuple[Tensor, Tensor]:
    gated = importlib.import_module("pyattr.kernels.gated")

    return gated.gated_backward(gate, up, dh, act, identity, half)


def _or_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    return like.new_empty((0,)) if t is None else t


@_operator("pyattr_triton::layer_norm_backward")
def _layer_norm_op(
    x: Tensor, weight: Optional[Tensor], eps: float, dy: Tensor, need_dweight: bool, need_dbias: bool
) -> tuple[Tensor, Tensor, Tensor]:
    layer_norm = importlib.import_module("pyattr.kernels.layer_norm")

    dx, dw, db = layer_norm.layer_norm_backward(x, weight, eps, dy, need_dweight, need_dbias)
    return dx, _or_empty(dw, x), _or_empty(db, x)


@_operator("pyattr_triton::rms_norm_backward")
def _rms_norm_op(
    x: Tensor, weight: Optional[Tensor], eps: float, offset: float, dy: Tensor, need_dweight: bool
) -> tuple[Tensor, Tensor]:
    rms_norm = importlib.import_module("pyattr.kernels.rms_norm")

    dx, dw = rms_norm.rms_norm_backward(x, weight, eps, offset, dy, need_dweight)
    return dx, _or_empty(dw, x)


if not TRACEABLE:
    _fake.register_ops("pyattr_triton")
_vmap.register("pyattr_triton")


# --- the backend functions --------------------------------------------------------------

def identity_backward(x, dy, act: Activation):
    if act.kind == "custom":
        return reference.identity_backward(x, dy, act)
    dt = _promoted(x, dy)
    return _identity_op(x.to(dt), dy.to(dt), act.kind).to(x.dtype)


def half_backward(u, v, dy):
    if u.shape != dy.shape or v.shape != dy.shape or u.dtype != v.dtype:
        return reference.half_backward(u, v, dy)
    dt = _promoted(u, dy)
    du, dv = _half_op(u.to(dt), v.to(dt), dy.to(dt))
    return du.to(u.dtype), dv.to(v.dtype)


def gated_backward(g, u, dh, act: Activation, identity: bool, half: bool):
    if act.kind == "custom":
        return reference.gated_backward(g, u, dh, act, identity, half)
    dt = _promoted(g, u, dh)
    dg, du = _gated_op(g.to(dt), u.to(dt), dh.to(dt), act.kind, bool(identity), bool(half))
    return dg.to(g.dtype), du.to(u.dtype)


def layer_norm_backward(x, weight, eps, dy, need_dweight, need_dbias):
    dt = _promoted(x, dy)
    dx, dw, db = _layer_norm_op(x.to(dt), weight, float(eps), dy.to(dt), bool(need_dweight), bool(need_dbias))
    return dx.to(x.dtype), (dw if need_dweight else None), (db if need_dbias else None)


def rms_norm_backward(x, weight, eps, offset, dy, need_dweight):
    dt = _promoted(x, dy)
    dx, dw = _rms_norm_op(x.to(dt), weight, float(eps), float(offset), dy.to(dt), bool(need_dweight))
    return dx.to(x.dtype), (dw if need_dweight else None)


# --- frozen attention -------------------------------------------------------------------

@_operator("pyattr_triton::attention_dv")
def _attention_dv_op(q: Tensor, k: Tensor, dout: Tensor, mask: Optional[Tensor], scaling: float,
                     softcap: Optional[float], causal: bool) -> Tensor:
    attention = importlib.import_module("pyattr.kernels.attention")

    return attention.attention_dv(q, k, dout, mask, scaling, softcap, causal)


if not TRACEABLE:
    @_attention_dv_op.register_fake
    def _(q, k, dout, mask, scaling, softcap, causal):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_empty((q.shape[0], k.shape[1], k.shape[2], dout.shape[-1]), dtype=acc)


def attention_dv(q, k, dout, mask, scaling: float, softcap, causal: bool) -> Tensor:
    """Frozen attention's dV through the Triton kernels (``kernels/attention.py``)."""
    from pyattr.backends.reference import additive_mask

    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return _attention_dv_op(q, k, dout, additive_mask(mask, k.shape[2], acc), float(scaling),
                            None if softcap is None else float(softcap), bool(causal))


@_operator("pyattr_triton::attention_backward")
def _attention_backward_op(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, mask: Optional[Tensor], scaling: float,
                           softcap: Optional[float], causal: bool) -> Tuple[Tensor, Tensor, Tensor]:
    attention = importlib.import_module("pyattr.kernels.attention_backward")

    return attention.attention_backward(q, k, v, dout, mask, scaling, softcap, causal)


if not TRACEABLE:
    @_attention_backward_op.register_fake
    def _(q, k, v, dout, mask, scaling, softcap, causal):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_empty(q.shape, dtype=acc), k.new_empty(k.shape, dtype=acc), v.new_empty(v.shape, dtype=acc)


def attention_backward(q, k, v, dout, mask, scaling: float, softcap, causal: bool):
    """AttnLRP attention's (dq, dk, dv) through the Triton kernels (``kernels/attention_backward.py``)."""
    from pyattr.backends.reference import additive_mask

    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return tuple(_attention_backward_op(q, k, v, dout, additive_mask(mask, k.shape[2], acc), float(scaling),
                                        None if softcap is None else float(softcap), bool(causal)))
