"""Triton kernels for the rule backwards, shipped as ``pyattr.kernels``: one module per rule
family (``identity``, ``half``, ``gated``, ``layer_norm``, ``rms_norm``, ``attention``,
``attention_backward``). They run on CUDA tensors, and on CPU tensors under
``TRITON_INTERPRET=1`` (how CI tests them). Every kernel loads, casts to float32 (float64
stays float64), computes, and casts once on store; offsets are int64; masks cover any size.

The folder has no ``__init__.py`` on purpose: ``pyattr.kernels`` is a namespace package,
so a checkout's root on ``sys.path`` never makes ``kernels/`` a regular top-level package
that shadows the ``kernels`` distribution transformers imports.

Shared Triton helpers (this module): launch configuration and the activation math (φ, act, act')
used by the identity and gated kernels. Everything is computed in the accumulation type
(float32, float64 for float64 inputs) after one load-and-cast; results are cast once on
store. ``tanh`` is written through ``sigmoid`` (no libdevice under the interpreter)."""

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

ACT_IDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "quick_gelu": 3, "relu": 4}


def launch(kernel):
    """``kernel`` through ``torch.library.wrap_triton``: inside a ``torch.library.triton_op``
    that torch.compile or export traces, the launch is recorded as the kernel itself
    (inductor sees and schedules it); when the op runs, the kernel launches as is."""
    return torch.library.wrap_triton(kernel)


def acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def elementwise_configs():
    if INTERPRET:  # the interpreter runs blocks in numpy: one small config, no tuning
        return [triton.Config({"BLOCK": 1024}, num_warps=4)]
    return [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((1024, 4), (2048, 8), (4096, 8), (8192, 16))]


def row_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK": 256}, num_warps=4)]
    return [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((1024, 4), (2048, 8), (4096, 8), (8192, 16))]


@triton.jit
def tanh_(z):
    return 2.0 * tl.sigmoid(2.0 * z) - 1.0


@triton.jit
def phi(x, ACT: tl.constexpr):
    """act(x)/x in closed form; NaN stays NaN."""
    if ACT == 0:
        r = tl.sigmoid(x)
    elif ACT == 1:
        xc = tl.minimum(tl.maximum(x, -10.0), 10.0)
        r = 0.5 * (1.0 + tl.math.erf(xc * 0.7071067811865476))
    elif ACT == 2:
        xc = tl.minimum(tl.maximum(x, -10.0), 10.0)
        r = 0.5 * (1.0 + tanh_(0.7978845608028654 * (xc + 0.044715 * xc * xc * xc)))
    elif ACT == 3:
        r = tl.sigmoid(1.702 * x)
    else:
        r = tl.where(x > 0, 1.0, 0.0).to(x.dtype)
    return tl.where(x != x, x, r)


@triton.jit
def act_(x, ACT: tl.constexpr):
    """act(x) = x·φ(x); ReLU is relu itself (NaN stays NaN, relu(−0) = −0 as torch.relu)."""
    if ACT == 4:
        return tl.where(x < 0, 0.0, x).to(x.dtype)
    return x * phi(x, ACT)


# act'(x) of SiLU, GELU and QuickGELU is exactly 1 or ±0 beyond this |x| (float32 and
# float64); x is clamped to it so that ±inf give the limits 1 and 0, never inf·0
DERIVATIVE_SATURATED = tl.constexpr(1.0e4)


@triton.jit
def dact(x, ACT: tl.constexpr):
    """act'(x), for the gated kernel with the Identity-rule off; the limits 1 and 0 at ±inf."""
    if ACT == 0:
        xs = tl.minimum(tl.maximum(x, -DERIVATIVE_SATURATED), DERIVATIVE_SATURATED)
        s = tl.sigmoid(xs)
        r = s * (1.0 + xs * (1.0 - s))
    elif ACT == 1:
        xc = tl.minimum(tl.maximum(x, -10.0), 10.0)
        xs = tl.minimum(tl.maximum(x, -DERIVATIVE_SATURATED), DERIVATIVE_SATURATED)
        r = 0.5 * (1.0 + tl.math.erf(xc * 0.7071067811865476)) + xs * 0.3989422804014327 * tl.exp(-0.5 * xs * xs)
    elif ACT == 2:
        xc = tl.minimum(tl.maximum(x, -10.0), 10.0)
        t = tanh_(0.7978845608028654 * (xc + 0.044715 * xc * xc * xc))
        dinner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * xc * xc)
        r = 0.5 * (1.0 + t) + 0.5 * xc * (1.0 - t * t) * dinner
    elif ACT == 3:
        xs = tl.minimum(tl.maximum(x, -DERIVATIVE_SATURATED), DERIVATIVE_SATURATED)
        s = tl.sigmoid(1.702 * xs)
        r = s + 1.702 * (xs * (s * (1.0 - s)))
    else:
        r = tl.where(x > 0, 1.0, 0.0).to(x.dtype)
    return tl.where(x != x, x, r)
