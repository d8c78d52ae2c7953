"""LN-rule backward for LayerNorm: σ constant, μ differentiable, ``dx = g − mean(g)`` with
``g = dy·w/σ``; μ and σ are recomputed from ``x`` in the same kernel. Each program walks a
fixed chunk of rows and loops over the row in blocks (any hidden size); ``dw``/``db``
partials are float32 per program and summed in program order by a second kernel."""

import torch
import triton
import triton.language as tl

from pyattr.kernels._common import acc_dtype, launch, row_configs


OVERFLOW_SCALE = tl.constexpr(2.0 ** -64)


def num_row_chunks(rows: int, need_params: bool) -> int:
    # shape-only, so parameter gradients are bit-reproducible
    return max(1, min(rows, 256)) if need_params else max(rows, 1)


@triton.autotune(configs=row_configs(), key=["H"])
@triton.jit
def _layer_norm_backward(X, DY, W, DX, PW, PB, R, H, chunks, eps, HAS_W: tl.constexpr, NEED_W: tl.constexpr,
                         NEED_B: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    r0 = c * R // chunks
    r1 = (c + 1) * R // chunks
    cols = tl.arange(0, BLOCK)
    for r in range(r0, r1):
        base = r * H
        # the row mean of pyattr.backends.reference.row_mean: K + Σ(x − K)/H (K the row's
        # first value: exact for a constant row), else (not finite) K + Σ((x − K)·2⁻⁶⁴)/H
        # scaled back (a finite row near the type's max), else NaN
        k0 = tl.load(X + base).to(ACC)
        s = tl.zeros([BLOCK], dtype=ACC)
        s2 = tl.zeros([BLOCK], dtype=ACC)
        for j in range(0, H, BLOCK):
            m = j + cols < H
            xv = tl.load(X + base + j + cols, mask=m, other=0.0).to(ACC)
            d = tl.where(m, xv - k0, 0.0)
            s += d
            s2 += d * OVERFLOW_SCALE
        shifted = k0 + tl.sum(s, axis=0) / H
        big = k0 + tl.sum(s2, axis=0) / H / OVERFLOW_SCALE
        big = tl.where((big == big) & (tl.abs(big) < float("inf")), big, float("nan"))
        mean = tl.where((shifted == shifted) & (tl.abs(shifted) < float("inf")), shifted, big)
        q = tl.zeros([BLOCK], dtype=ACC)
        for j in range(0, H, BLOCK):
            m = j + cols < H
            d = tl.where(m, tl.load(X + base + j + cols, mask=m, other=0.0).to(ACC) - mean, 0.0)
            q += d * d
        rstd = 1.0 / tl.sqrt(tl.sum(q, axis=0) / H + eps)
        gs = tl.zeros([BLOCK], dtype=ACC)
        for j in range(0, H, BLOCK):
            m = j + cols < H
            dy = tl.load(DY + base + j + cols, mask=m, other=0.0).to(ACC)
            if HAS_W:
                dy = dy * tl.load(W + j + cols, mask=m, other=0.0).to(ACC)
            gs += dy * rstd
        gmean = tl.sum(gs, axis=0) / H
        for j in range(0, H, BLOCK):
            m = j + cols < H
            dy = tl.load(DY + base + j + cols, mask=m, other=0.0).to(ACC)
            w = tl.load(W + j + cols, mask=m, other=0.0).to(ACC) if HAS_W else 1.0
            tl.store(DX + base + j + cols, (dy * w * rstd - gmean).to(DX.dtype.element_ty), mask=m)
            if NEED_W:  # dy·(x − μ)·rstd, in this order on every backend
                xc = tl.load(X + base + j + cols, mask=m, other=0.0).to(ACC) - mean
                p = PW + c * H + j + cols
                tl.store(p, tl.load(p, mask=m, other=0.0) + dy * xc * rstd, mask=m)
            if NEED_B:
                p = PB + c * H + j + cols
                tl.store(p, tl.load(p, mask=m, other=0.0) + dy, mask=m)


@triton.jit
def _sum_partials(P, OUT, chunks, H, BLOCK: tl.constexpr):
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float64 if P.dtype.element_ty == tl.float64 else tl.float32)
    for c in range(0, chunks):
        acc += tl.load(P + c * H + cols, mask=m, other=0.0)
    tl.store(OUT + cols, acc.to(OUT.dtype.element_ty), mask=m)


def sum_partials(partial: torch.Tensor, out: torch.Tensor) -> None:
    chunks, H = partial.shape
    launch(_sum_partials)[(triton.cdiv(H, 256),)](partial, out, chunks, H, BLOCK=256)


def prepare_rows(x, weight, dy):
    """Contiguous ``x`` and ``dy`` (strided inputs copied once), rows ``R`` of length ``H``,
    the accumulation dtype, the weight in it, and an empty contiguous ``dx``."""
    x = x.contiguous()
    dy = dy.to(x.dtype).contiguous()
    H = x.shape[-1]
    R = x.numel() // H if H else 0
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = weight.to(acc).contiguous() if weight is not None else None
    return x, dy, R, H, acc, w, torch.empty_like(x, memory_format=torch.contiguous_format)


def layer_norm_backward(x, weight, eps, dy, need_dw, need_db):
    x, dy, R, H, acc, w, dx = prepare_rows(x, weight, dy)
    pdt = weight.dtype if weight is not None else x.dtype
    dw = torch.zeros(H, dtype=pdt, device=x.device) if need_dw else None
    db = torch.zeros(H, dtype=pdt, device=x.device) if need_db else None
    if R == 0:
        return dx, dw, db
    chunks = num_row_chunks(R, need_dw or need_db)
    pw = torch.zeros(chunks, H, dtype=acc, device=x.device) if need_dw else dx
    pb = torch.zeros(chunks, H, dtype=acc, device=x.device) if need_db else dx
    launch(_layer_norm_backward)[(chunks,)](
        x, dy, w if w is not None else x, dx, pw, pb, R, H, chunks, eps,
        HAS_W=w is not None, NEED_W=bool(need_dw), NEED_B=bool(need_db), ACC=acc_dtype(x.dtype),
    )
    if need_dw:
        sum_partials(pw, dw)
    if need_db:
        sum_partials(pb, db)
    return dx, dw, db
