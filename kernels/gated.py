"""Gated activation backward: (d gate, d up) for h = act(gate)·up, each rule switchable."""

import torch
import triton
import triton.language as tl

from pyattr.kernels._common import ACT_IDS, acc_dtype, act_, dact, elementwise_configs, launch, phi


@triton.autotune(configs=elementwise_configs(), key=["n"])
@triton.jit
def _gated_backward(G, U, DH, DG, DU, n, scale, ACT: tl.constexpr, IDENTITY: tl.constexpr, ACC: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(ACC)
    u = tl.load(U + offs, mask=mask, other=0.0).to(ACC)
    sd = tl.load(DH + offs, mask=mask, other=0.0).to(ACC) * scale
    if IDENTITY:
        local = phi(g, ACT)
    else:
        local = dact(g, ACT)
    tl.store(DG + offs, (sd * u * local).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (sd * act_(g, ACT)).to(DU.dtype.element_ty), mask=mask)


def gated_backward(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, act: str, identity: bool, half: bool):
    g, u = g.contiguous(), u.contiguous()
    dh = dh.to(g.dtype).contiguous()
    dg = torch.empty_like(g, memory_format=torch.contiguous_format)
    du = torch.empty_like(u, memory_format=torch.contiguous_format)
    n = g.numel()
    if n:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)  # noqa: E731
        launch(_gated_backward)[grid](g, u, dh, dg, du, n, 0.5 if half else 1.0, ACT=ACT_IDS[act], IDENTITY=bool(identity),
                              ACC=acc_dtype(g.dtype))
    return dg, du
