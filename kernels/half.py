"""Half-rule backward: du = ½·dy·v and dv = ½·dy·u in one kernel."""

import torch
import triton
import triton.language as tl

from pyattr.kernels._common import acc_dtype, elementwise_configs, launch


@triton.autotune(configs=elementwise_configs(), key=["n"])
@triton.jit
def _half_backward(U, V, DY, DU, DV, n, ACC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    u = tl.load(U + offs, mask=mask, other=0.0).to(ACC)
    v = tl.load(V + offs, mask=mask, other=0.0).to(ACC)
    h = tl.load(DY + offs, mask=mask, other=0.0).to(ACC) * 0.5
    tl.store(DU + offs, (h * v).to(DU.dtype.element_ty), mask=mask)
    tl.store(DV + offs, (h * u).to(DV.dtype.element_ty), mask=mask)


def half_backward(u: torch.Tensor, v: torch.Tensor, dy: torch.Tensor):
    u, v = u.contiguous(), v.contiguous()
    dy = dy.to(u.dtype).contiguous()
    du = torch.empty_like(u, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    n = u.numel()
    if n:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)  # noqa: E731
        launch(_half_backward)[grid](u, v, dy, du, dv, n, ACC=acc_dtype(u.dtype))
    return du, dv
