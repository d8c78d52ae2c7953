// Argument checks of the norm ops, shared by the CPU and CUDA kernels. The Python layer
// validates first; these keep direct torch.ops.pyattr.* calls from reading out of bounds.
#pragma once

#include <cmath>
#include <optional>

#include <ATen/ATen.h>

namespace pyattr {

inline void check_norm_args(const at::Tensor& x, const at::Tensor& dy, const std::optional<at::Tensor>& w, double eps) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must have at least one dimension (..., hidden_size)");
  TORCH_CHECK_VALUE(x.sizes() == dy.sizes(), "dy must have the shape of x");
  TORCH_CHECK_VALUE(dy.device() == x.device(), "dy is on ", dy.device(), " but x is on ", x.device());
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  if (w.has_value() && w->defined()) {
    TORCH_CHECK_VALUE(w->dim() == 1 && w->size(0) == x.size(-1), "weight must have shape (hidden_size,) = (",
                      x.size(-1), ",), got ", w->sizes());
    TORCH_CHECK_VALUE(w->device() == x.device(), "weight is on ", w->device(), " but x is on ", x.device());
    TORCH_CHECK_TYPE(at::isFloatingType(w->scalar_type()), "weight must be a floating tensor, got ", w->scalar_type());
  }
}

}  // namespace pyattr
