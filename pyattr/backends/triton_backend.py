"""``triton`` backend: the kernels of ``pyattr.kernels`` (CUDA tensors, or CPU tensors
under ``TRITON_INTERPRET=1``). Custom activation callables and broadcasting Half-rule
inputs run in the reference backend, as in the compiled backends."""

from __future__ import annotations

from pyattr.activations import Activation
from pyattr.backends import reference
from pyattr.backends.reference import promoted_dtype as _promoted

rms_norm_forward = reference.rms_norm_forward

gated_forward = reference.gated_forward


def identity_backward(x, dy, act: Activation):
    if act.kind == "custom":
        return reference.identity_backward(x, dy, act)
    from pyattr.kernels import identity

    dt = _promoted(x, dy)
    return identity.identity_backward(x.to(dt), dy.to(dt), act.kind).to(x.dtype)


def half_backward(u, v, dy):
    if u.shape != dy.shape or v.shape != dy.shape or u.dtype != v.dtype:
        return reference.half_backward(u, v, dy)
    from pyattr.kernels import half

    dt = _promoted(u, dy)
    du, dv = half.half_backward(u.to(dt), v.to(dt), dy.to(dt))
    return du.to(u.dtype), dv.to(v.dtype)


def gated_backward(g, u, dh, act: Activation, identity: bool, half: bool):
    if act.kind == "custom":
        return reference.gated_backward(g, u, dh, act, identity, half)
    from pyattr.kernels import gated

    dt = _promoted(g, u, dh)
    dg, du = gated.gated_backward(g.to(dt), u.to(dt), dh.to(dt), act.kind, identity, half)
    return dg.to(g.dtype), du.to(u.dtype)


def layer_norm_backward(x, weight, eps, dy, need_dweight, need_dbias):
    from pyattr.kernels import layer_norm

    dt = _promoted(x, dy)
    dx, dw, db = layer_norm.layer_norm_backward(x.to(dt), weight, eps, dy.to(dt), need_dweight, need_dbias)
    return dx.to(x.dtype), dw, db


def rms_norm_backward(x, weight, eps, offset, dy, need_dweight):
    from pyattr.kernels import rms_norm

    dt = _promoted(x, dy)
    dx, dw = rms_norm.rms_norm_backward(x.to(dt), weight, eps, offset, dy.to(dt), need_dweight)
    return dx.to(x.dtype), dw
