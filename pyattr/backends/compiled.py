"""``cpp`` and ``cuda`` backends: the kernels of the extension ``pyattr._C`` (or of the
prebuilt ``pyattr._C_stable``, which has no attention kernels: those two ops then run in
the reference backend).

Both run through ``torch.ops.pyattr.*``; the dispatcher picks the CPU or CUDA kernel
from the tensors' device. What the kernels do not cover runs in the reference backend,
stated per function: custom activation callables (no closed form to compile) and
broadcasting Half-rule inputs (the kernel takes equal shapes). Non-contiguous inputs are
copied once to contiguous buffers inside the kernels' C++ wrappers.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from pyattr.activations import Activation
import pyattr.backends.reference as reference
from pyattr.backends.reference import promoted_dtype as _promoted

# Forwards stay on the native ops: they are what keeps forwards bit-identical.
rms_norm_forward = reference.rms_norm_forward

gated_forward = reference.gated_forward


def _ops():
    """``torch.ops.pyattr``, once the extension that registers its ops is loaded (a plain
    flag read, so that ``torch.compile`` traces through it; the scopes load it first)."""
    import pyattr.backends.extension as extension

    if not extension.LOADED:
        extension.load()  # loads pyattr._C, which registers the ops
    return torch.ops.pyattr


def _has_attention() -> bool:
    """The loaded library has the attention kernels (pyattr._C does, pyattr._C_stable does not)."""
    import pyattr.backends.extension as extension

    _ops()
    return extension.HAS_ATTENTION


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # ``Tensor.to`` with nothing to do still costs a dispatcher call (~2 us); these run in
    # every rule backward
    return t if t.dtype == dtype else t.to(dtype)


def identity_backward(x: torch.Tensor, dy: torch.Tensor, act: Activation) -> torch.Tensor:
    if act.kind == "custom":
        return reference.identity_backward(x, dy, act)
    dt = _promoted(x, dy)
    return _to(_ops().identity_backward(_to(x, dt), _to(dy, dt), act.kind), x.dtype)


def half_backward(u: torch.Tensor, v: torch.Tensor, dy: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    if u.shape != dy.shape or v.shape != dy.shape or u.dtype != v.dtype:
        return reference.half_backward(u, v, dy)
    dt = _promoted(u, dy)
    du, dv = _ops().half_backward(_to(u, dt), _to(v, dt), _to(dy, dt))
    return _to(du, u.dtype), _to(dv, v.dtype)


def gated_backward(g, u, dh, act: Activation, identity: bool, half: bool):
    if act.kind == "custom":
        return reference.gated_backward(g, u, dh, act, identity, half)
    dt = _promoted(g, u, dh)
    dg, du = _ops().gated_backward(_to(g, dt), _to(u, dt), _to(dh, dt), act.kind, identity, half)
    return _to(dg, g.dtype), _to(du, u.dtype)


def layer_norm_backward(x, weight: Optional[torch.Tensor], eps: float, dy, need_dweight: bool, need_dbias: bool):
    dt = _promoted(x, dy)
    dx, dw, db = _ops().layer_norm_backward(_to(x, dt), weight, eps, _to(dy, dt), need_dweight, need_dbias)
    return _to(dx, x.dtype), (dw if need_dweight else None), (db if need_dbias else None)


def rms_norm_backward(x, weight: Optional[torch.Tensor], eps: float, offset: float, dy, need_dweight: bool):
    dt = _promoted(x, dy)
    dx, dw = _ops().rms_norm_backward(_to(x, dt), weight, eps, offset, _to(dy, dt), need_dweight)
    return _to(dx, x.dtype), (dw if need_dweight else None)


def attention_dv(q, k, dout, mask, scaling: float, softcap, causal: bool) -> torch.Tensor:
    """Frozen attention's dV on the CPU kernel; on CUDA the Triton kernel (or the reference)."""
    from pyattr.backends.reference import additive_mask, attention_dv_reference

    if q.device.type == "cpu" and not _has_attention():
        return attention_dv_reference(q, k, dout, mask, scaling, softcap, causal)
    if q.device.type != "cpu":
        try:
            import pyattr.backends.triton_backend as triton_backend

            return triton_backend.attention_dv(q, k, dout, mask, scaling, softcap, causal)
        except ImportError:
            return attention_dv_reference(q, k, dout, mask, scaling, softcap, causal)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return _ops().attention_dv(q, k, dout, additive_mask(mask, k.shape[2], acc), float(scaling),
                               None if softcap is None else float(softcap), bool(causal))
def attention_backward(q, k, v, dout, mask, scaling: float, softcap, causal: bool):
    """AttnLRP attention's (dq, dk, dv) on the CPU kernel; on CUDA the Triton kernels (or the reference)."""
    from pyattr.backends.reference import additive_mask, attention_backward_reference

    if q.device.type == "cpu" and not _has_attention():
        return attention_backward_reference(q, k, v, dout, mask, scaling, softcap, causal)
    if q.device.type != "cpu":
        try:
            import pyattr.backends.triton_backend as triton_backend

            return triton_backend.attention_backward(q, k, v, dout, mask, scaling, softcap, causal)
        except ImportError:
            return attention_backward_reference(q, k, v, dout, mask, scaling, softcap, causal)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return tuple(_ops().attention_backward(q, k, v, dout, additive_mask(mask, k.shape[2], acc), float(scaling),
                                           None if softcap is None else float(softcap), bool(causal)))


