// Argument checks and row layout of the norm ops, shared by the CPU and CUDA kernels. The
// Python layer validates first; the checks keep direct torch.ops.pyattr.* calls from
// reading out of bounds.
#pragma once

#include <cmath>
#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

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

// The norm inputs as the kernels read them: contiguous x and dy in one dtype (strided
// inputs copied once), rows R of length H, and the dtypes of the accumulation and of the
// parameter gradients.
struct NormRows {
  at::Tensor x, dy, dx;
  int64_t H = 0, R = 0;
  bool has_w = false;
  at::ScalarType acc, param_dtype;

  // dweight / dbias in the weight's dtype, or an empty tensor when not requested
  at::Tensor param_grad(bool need) const {
    return need ? at::empty({H}, x.options().dtype(param_dtype)) : at::empty({0}, x.options());
  }
  // the weight in the accumulation dtype (undefined without a weight)
  at::Tensor weight_acc(const std::optional<at::Tensor>& w) const {
    return has_w ? w->to(acc).contiguous() : at::Tensor();
  }
};

inline NormRows prepare_norm_rows(const at::Tensor& x_in, const at::Tensor& dy_in,
                                  const std::optional<at::Tensor>& w, double eps) {
  check_norm_args(x_in, dy_in, w, eps);
  NormRows r;
  r.x = x_in.contiguous();
  r.dy = dy_in.to(r.x.scalar_type()).contiguous();
  r.dx = at::empty_like(r.x, at::MemoryFormat::Contiguous);
  r.H = r.x.size(-1);
  r.R = r.H == 0 ? 0 : r.x.numel() / r.H;
  r.has_w = w.has_value() && w->defined();
  r.acc = r.x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  r.param_dtype = r.has_w ? w->scalar_type() : r.x.scalar_type();
  return r;
}

}  // namespace pyattr
