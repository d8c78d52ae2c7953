"""LayerNorm with the LN-rule backward (AttnLRP, ICML 2024, Prop. 3.3)."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import pyattr._function as _function
import pyattr.backends as backends
from pyattr._validation import check_eps, check_float, check_has_hidden, check_norm_param, check_same_device


def _plain_layer_norm(native: Optional[Callable]) -> bool:
    """``native`` is ``nn.LayerNorm.forward`` itself (bound), so ``F.layer_norm`` is its math."""
    return native is None or getattr(native, "__func__", None) is torch.nn.LayerNorm.forward


@_function.second_order_checked
class LayerNormRuleFunction(torch.autograd.Function):
    """Saves ``x`` and ``weight``; for float32 / float64 inputs with a plain LayerNorm
    forward also the per-row mean and rstd that ``torch.native_layer_norm`` (the forward:
    its output is ``F.layer_norm``'s) returns, so the backward makes no pass over ``x``
    for μ and σ (and none at all for ``dx`` alone).
    Otherwise (16-bit inputs, whose native statistics are rounded to 16 bits; a module's
    own forward), and for parameter gradients or a backward being recorded (a second
    derivative needs σ as a function of ``x``), μ and σ are recomputed from ``x`` in
    float32. Inside pyattr's own passes (:func:`pyattr._function.first_order_saves`) with
    the parameters frozen it saves ``weight`` and the per-row rstd only. Vmappable (the
    batching rule of the backward op gives ``dweight``/``dbias`` per example)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, eps: float, native: Optional[Callable]):
        dt = x.dtype
        if (dt == torch.float32 or dt == torch.float64) and (weight is None or weight.dtype == dt) and (
                bias is None or bias.dtype == dt) and _plain_layer_norm(native):
            out, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
            return out, mean, rstd
        out = native(x) if native is not None else F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
        return out, x.new_empty((0,)), x.new_empty((0,))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, ctx.eps, _ = inputs
        _, mean, rstd = output
        ctx.mark_non_differentiable(mean, rstd)
        ctx.has_bias = bias is not None
        ctx.stats = rstd.numel() > 0
        ctx.first_order = _function.first_order(weight, bias)
        if ctx.first_order:  # pyattr's own pass: the per-row rstd (the reference backward's), not x
            from pyattr.backends.reference import layer_norm_centred

            ctx.save_for_backward(weight, rstd if ctx.stats else layer_norm_centred(x, ctx.eps)[1])
            return
        ctx.save_for_backward(x, weight, mean if ctx.stats else None, rstd if ctx.stats else None)

    @staticmethod
    def backward(ctx, dy, _dmean, _drstd):
        if ctx.first_order:
            weight, rstd = ctx.saved_tensors
            _function.refuse_create_graph("layer_norm", "the per-row rstd")
            if ctx.stats:  # what the saved-statistics path below computes
                return layer_norm_rule_dx(dy, weight, rstd), None, None, None, None
            # the reference backward's order: g = dy·w·rstd, dx = g − mean(g)
            g = dy.to(rstd.dtype) * rstd if weight is None else dy.to(rstd.dtype) * weight.to(rstd.dtype) * rstd
            return (g - g.mean(-1, keepdim=True)).to(dy.dtype), None, None, None, None
        x, weight, mean, rstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.stats and not torch.is_grad_enabled():
            if not (need_w or need_b):
                dx = layer_norm_rule_dx(dy, weight, rstd) if need_x else None
                return dx, None, None, None, None
            if _plain_cpp(dy):
                from pyattr.backends.compiled import _ops

                dx, dw, db = _ops().layer_norm_backward_stats(x, weight, dy, mean, rstd, need_w,
                                                               need_b and ctx.has_bias)
                return (dx if need_x else None), (dw if need_w else None), \
                    (db if need_b and ctx.has_bias else None), None, None
        impl = backends.backward_implementation(x.device, "layer_norm")
        dx, dw, db = impl.layer_norm_backward(x, weight, ctx.eps, dy, need_w, need_b and ctx.has_bias)
        return (dx if need_x else None), dw, db, None, None


def _plain_cpp(dy: torch.Tensor) -> bool:
    """The ``cpp`` backend runs this call, on a gradient no vmap has batched."""
    import pyattr.backends._vmap as _vmap

    return dy.device.type == "cpu" and not _vmap.batched(dy) and backends.select(dy.device, "layer_norm") == "cpp"


def layer_norm_rule_dx(dy: torch.Tensor, weight: Optional[torch.Tensor], rstd: torch.Tensor) -> torch.Tensor:
    """LN-rule ``dx = rstd·(dy·w − mean(dy·w))`` from the forward's per-row rstd
    (shape ``(..., 1)``); the ``cpp`` kernel where it can run, else PyTorch ops. A gradient
    batched by ``is_grads_batched`` runs on its physical tensor (k gradients, one rstd)."""
    if rstd.numel() == 0 or dy.numel() == 0:
        return torch.zeros_like(dy)
    import pyattr.backends._vmap as _vmap

    found = _vmap.legacy_physical(dy, rstd, weight)
    if found is not None:
        phys, level = found
        dx = layer_norm_rule_dx(phys, weight, rstd.unsqueeze(0).expand(phys.shape[0], *rstd.shape))
        return torch._add_batch_dim(dx, 0, level)
    if not torch.is_grad_enabled() and _plain_cpp(dy):
        from pyattr.backends.compiled import _ops

        return _ops().layer_norm_rule_dx(dy, weight, rstd)
    g = dy if weight is None else dy * weight
    return ((g - g.mean(-1, keepdim=True)) * rstd).to(dy.dtype)


def layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    _native: Optional[Callable] = None,
) -> torch.Tensor:
    """LayerNorm over the last dimension with the LN-rule backward.

    Forward: ``F.layer_norm(x, (hidden,), weight, bias, eps)`` (bit-identical to
    ``nn.LayerNorm``). Backward: σ is a constant and μ stays differentiable,
    ``g = dy·w/σ``, ``dx = g − mean(g)``; ``dw = Σ dy·x̂`` and ``db = Σ dy`` are ordinary.

    Args:
        x (Tensor[..., hidden], float16/bfloat16/float32/float64): input.
        weight (Tensor[hidden], optional): scale. Default: None.
        bias (Tensor[hidden], optional): shift. Default: None.
        eps (float): finite, >= 0. Default: 1e-5.

    Saved for backward: ``x`` and ``weight``, and for float32/float64 with
    ``nn.LayerNorm``'s own math the per-row mean and rstd of the native forward (one value
    each per row), which the backward uses instead of recomputing μ and σ. Inside pyattr's
    own attribution passes with ``weight`` and ``bias`` frozen: ``weight`` and the per-row
    rstd only (such a node refuses a backward with ``create_graph=True``).

    On CPU with the ``cpp`` backend (float32/float64, plain tensors, eager code) the
    autograd node is a C++ Function (``pyattr._C.layer_norm_rule``) with the same forward
    and the same kernels, without the Python ``autograd.Function`` around them; for that
    node the backend is the one selected when the forward runs.

    Raises:
        TypeError: non-floating tensors or non-numeric ``eps``.
        ValueError: ``weight``/``bias`` not of shape ``(hidden,)``, tensors on different
            devices, ``eps`` negative or not finite.
    """
    if _valid_for_cpp_function(x, weight, bias, eps) and _cpp_function_applies(x, weight, bias, _native) and not _function.first_order(weight, bias):
        # (inside pyattr's own passes with frozen parameters the Python Function saves less)
        return backends._probe_extension()[0].layer_norm_rule(x, weight, bias, eps)
    check_float("x", x)
    check_has_hidden("x", x)
    check_norm_param("weight", weight, x)
    check_norm_param("bias", bias, x)
    check_same_device(x=x, weight=weight, bias=bias)
    eps = check_eps(eps)
    return _function.apply(LayerNormRuleFunction, x, weight, bias, eps, _native)[0]


# nn.Parameter has no __torch_function__ of its own: to the ops it is a plain tensor
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _valid_for_cpp_function(x, weight, bias, eps) -> bool:
    """The arguments pass the checks below (a CPU float32/float64 ``x`` with at least one
    dimension, parameters of shape ``(hidden,)`` in its dtype and on its device, a finite
    float ``eps`` >= 0) and suit the C++ Function: true means the checks have nothing to
    say; false sends the call through them, for their errors. Cheap attribute tests only,
    since the Python time around a kernel is what the C++ Function saves."""
    if type(x) is not torch.Tensor or type(eps) is not float or not 0.0 <= eps < math.inf:
        return False
    dt = x.dtype
    if (dt is not torch.float32 and dt is not torch.float64) or not x.is_cpu or x.dim() == 0:
        return False
    hidden = x.shape[-1]
    for p in (weight, bias):
        if p is not None and (type(p) not in _PLAIN or p.dtype is not dt or not p.is_cpu or p.dim() != 1
                              or p.shape[0] != hidden):
            return False
    return True


def _cpp_function_applies(x, weight, bias, native) -> bool:
    """The C++ autograd Function (csrc/layer_norm_rule.cpp) gives what the Python one
    gives, for arguments :func:`_valid_for_cpp_function` passed: ``nn.LayerNorm``'s math
    and :func:`pyattr._function.cpp_node_applies`."""
    return _plain_layer_norm(native) and _function.cpp_node_applies(x.device, "layer_norm")
