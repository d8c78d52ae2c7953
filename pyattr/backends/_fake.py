"""Fake (meta) implementations of the ``pyattr::`` ops (and of the Triton backend's
``pyattr_triton::`` ops), so that ``torch.compile`` and
``torch.library.opcheck`` can trace them without running a kernel."""

from __future__ import annotations

import torch

_DONE: set = set()


def _like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _check_norm(x, weight, dy):
    # mirrors csrc/checks.h; a tensor on "meta" routes the call here instead of a kernel
    if dy.shape != x.shape:
        raise ValueError("dy must have the shape of x")
    if weight is not None:
        if weight.device != x.device:
            raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            raise ValueError(f"weight must have shape (hidden_size,) = ({x.shape[-1]},), got {tuple(weight.shape)}")


def _param(x, weight, need):
    if not need:
        return x.new_empty((0,))
    dtype = weight.dtype if weight is not None else x.dtype
    return x.new_empty((x.shape[-1],), dtype=dtype)


def register() -> None:
    """Fake implementations of the extension's ``pyattr::`` ops (once)."""
    if "pyattr" in _DONE:
        return
    register_ops("pyattr")
    lib = torch.library

    @lib.register_fake("pyattr::layer_norm_rule_dx")
    def _layer_norm_rule_dx(dy, weight, rstd):
        return _like(dy)

    @lib.register_fake("pyattr::layer_norm_backward_stats")
    def _layer_norm_stats(x, weight, dy, mean, rstd, need_dweight, need_dbias):
        _check_norm(x, weight, dy)
        return _like(x), _param(x, weight, need_dweight), _param(x, weight, need_dbias)

    if not hasattr(torch.ops.pyattr, "attention_dv"):  # pyattr._C_stable has no attention ops
        return

    @lib.register_fake("pyattr::attention_dv")
    def _attention_dv(q, k, dout, mask, scaling, softcap, causal):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_empty((q.shape[0], k.shape[1], k.shape[2], dout.shape[-1]), dtype=acc)

    @lib.register_fake("pyattr::attention_backward")
    def _attention_backward(q, k, v, dout, mask, scaling, softcap, causal):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_empty(q.shape, dtype=acc), k.new_empty(k.shape, dtype=acc), v.new_empty(v.shape, dtype=acc)


def register_ops(namespace: str) -> None:
    """Fake implementations of ``namespace::<op>`` for the five backward ops, once per
    namespace (``pyattr`` for the extension, ``pyattr_triton`` for the Triton backend's
    custom ops, which share the schemas)."""
    if namespace in _DONE:
        return
    _DONE.add(namespace)
    lib = torch.library

    @lib.register_fake(f"{namespace}::identity_backward")
    def _identity(x, dy, act):
        return _like(x)

    @lib.register_fake(f"{namespace}::half_backward")
    def _half(u, v, dy):
        return _like(u), _like(v)

    @lib.register_fake(f"{namespace}::gated_backward")
    def _gated(gate, up, dh, act, identity, half):
        return _like(gate), _like(up)

    @lib.register_fake(f"{namespace}::layer_norm_backward")
    def _layer_norm(x, weight, eps, dy, need_dweight, need_dbias):
        _check_norm(x, weight, dy)
        return _like(x), _param(x, weight, need_dweight), _param(x, weight, need_dbias)

    @lib.register_fake(f"{namespace}::rms_norm_backward")
    def _rms_norm(x, weight, eps, offset, dy, need_dweight):
        _check_norm(x, weight, dy)
        return _like(x), _param(x, weight, need_dweight)
