"""Identity-rule backward: dx = dy · φ(x) (AttnLRP, ICML 2024, Eq. 9)."""

import torch
import triton
import triton.language as tl

from pyattr.kernels._common import ACT_IDS, acc_dtype, elementwise_configs, launch, phi


@triton.autotune(configs=elementwise_configs(), key=["n"])
@triton.jit
def _identity_backward(X, DY, DX, n, ACT: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(ACC)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(ACC)
    tl.store(DX + offs, (dy * phi(x, ACT)).to(DX.dtype.element_ty), mask=mask)


def identity_backward(x: torch.Tensor, dy: torch.Tensor, act: str) -> torch.Tensor:
    """``dx`` for contiguous copies of ``x`` and ``dy`` (strided inputs are copied once)."""
    x = x.contiguous()
    dy = dy.to(x.dtype).contiguous()
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    n = x.numel()
    if n:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)  # noqa: E731
        launch(_identity_backward)[grid](x, dy, dx, n, ACT=ACT_IDS[act], ACC=acc_dtype(x.dtype))
    return dx
