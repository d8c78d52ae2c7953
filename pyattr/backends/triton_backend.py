"""``triton`` backend: the kernels of ``pyattr.kernels`` (CUDA tensors, or CPU tensors
under ``TRITON_INTERPRET=1``). Custom activation callables and broadcasting Half-rule
inputs run in the reference backend, as in the compiled backends."""

from __future__ import annotations

from pyattr.activations import Activation
from pyattr.backends import reference

rms_norm_forward = reference.rms_norm_forward
gated_forward = reference.gated_forward


def identity_backward(x, dy, act: Activation):
    if act.kind == "custom":
        return reference.identity_backward(x, dy, act)
    from pyattr.kernels import identity

    return identity.identity_backward(x, dy, act.kind)


def half_backward(u, v, dy):
    if u.shape != dy.shape or v.shape != dy.shape or u.dtype != v.dtype:
        return reference.half_backward(u, v, dy)
    from pyattr.kernels import half

    return half.half_backward(u, v, dy)


def gated_backward(g, u, dh, act: Activation, identity: bool, half: bool):
    if act.kind == "custom":
        return reference.gated_backward(g, u, dh, act, identity, half)
    from pyattr.kernels import gated

    return gated.gated_backward(g, u, dh, act.kind, identity, half)


def layer_norm_backward(x, weight, eps, dy, need_dweight, need_dbias):
    from pyattr.kernels import layer_norm

    return layer_norm.layer_norm_backward(x, weight, eps, dy, need_dweight, need_dbias)


def rms_norm_backward(x, weight, eps, offset, dy, need_dweight):
    from pyattr.kernels import rms_norm

    return rms_norm.rms_norm_backward(x, weight, eps, offset, dy, need_dweight)
