"""LN-rule backward for RMSNorm: r constant, ``dx = dy·(offset + w)/r``, ``dw = Σ dy·x/r``,
with r recomputed from ``x`` per row (looped, any hidden size); chunked float32 partials
for ``dw`` as in :mod:`pyattr.kernels.layer_norm`."""

import torch
import triton
import triton.language as tl

from pyattr.kernels._common import acc_dtype, launch, row_configs
from pyattr.kernels.layer_norm import num_row_chunks, prepare_rows, sum_partials


@triton.autotune(configs=row_configs(), key=["H"])
@triton.jit
def _rms_norm_backward(X, DY, W, DX, PW, R, H, chunks, eps, offset, HAS_W: tl.constexpr, NEED_W: tl.constexpr,
                       ACC: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    r0 = c * R // chunks
    r1 = (c + 1) * R // chunks
    cols = tl.arange(0, BLOCK)
    for r in range(r0, r1):
        base = r * H
        s = tl.zeros([BLOCK], dtype=ACC)
        for j in range(0, H, BLOCK):
            m = j + cols < H
            v = tl.load(X + base + j + cols, mask=m, other=0.0).to(ACC)
            s += v * v
        rinv = 1.0 / tl.sqrt(tl.sum(s, axis=0) / H + eps)
        for j in range(0, H, BLOCK):
            m = j + cols < H
            d = tl.load(DY + base + j + cols, mask=m, other=0.0).to(ACC) * rinv
            w = offset + tl.load(W + j + cols, mask=m, other=0.0).to(ACC) if HAS_W else 1.0
            tl.store(DX + base + j + cols, (d * w).to(DX.dtype.element_ty), mask=m)
            if NEED_W:
                p = PW + c * H + j + cols
                xv = tl.load(X + base + j + cols, mask=m, other=0.0).to(ACC)
                tl.store(p, tl.load(p, mask=m, other=0.0) + d * xv, mask=m)


def rms_norm_backward(x, weight, eps, offset, dy, need_dw):
    x, dy, R, H, acc, w, dx = prepare_rows(x, weight, dy)
    dw = torch.zeros(H, dtype=weight.dtype if weight is not None else x.dtype, device=x.device) if need_dw else None
    if R == 0:
        return dx, dw
    chunks = num_row_chunks(R, need_dw)
    pw = torch.zeros(chunks, H, dtype=acc, device=x.device) if need_dw else dx
    launch(_rms_norm_backward)[(chunks,)](
        x, dy, w if w is not None else x, dx, pw, R, H, chunks, eps, offset,
        HAS_W=w is not None, NEED_W=bool(need_dw), ACC=acc_dtype(x.dtype),
    )
    if need_dw:
        sum_partials(pw, dw)
    return dx, dw
