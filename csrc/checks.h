// Argument checks and row layout of the norm ops, shared by the CPU and CUDA kernels. The
// Python layer validates first; the checks keep direct torch.ops.pyattr.* calls from
// reading out of bounds.
#pragma once

#include <cmath>
#include <optional>

#include "cpu/api.h"

PYATTR_BEGIN

inline void check_norm_args(const api::Tensor& x, const api::Tensor& dy, const std::optional<api::Tensor>& w,
                            double eps) {
  PYATTR_CHECK_VALUE(x.dim() >= 1, "x must have at least one dimension (..., hidden_size)");
  PYATTR_CHECK_VALUE(api::same_shape(x, dy), "dy must have the shape of x");
#ifndef PYATTR_STABLE_ABI
  PYATTR_CHECK_VALUE(dy.device() == x.device(), "dy is on ", dy.device(), " but x is on ", x.device());
#endif  // the stable build registers CPU kernels only: the dispatcher has put every tensor there
  PYATTR_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  if (api::defined(w)) {
    PYATTR_CHECK_VALUE(w->dim() == 1 && w->size(0) == x.size(-1), "weight must have shape (hidden_size,) = (",
                       x.size(-1), ",), got ", api::shape(*w));
#ifndef PYATTR_STABLE_ABI
    PYATTR_CHECK_VALUE(w->device() == x.device(), "weight is on ", w->device(), " but x is on ", x.device());
    PYATTR_CHECK_TYPE(at::isFloatingType(w->scalar_type()), "weight must be a floating tensor, got ", w->scalar_type());
#else
    const auto wt = w->scalar_type();
    PYATTR_CHECK_TYPE(wt == api::ScalarType::Float || wt == api::ScalarType::Double || wt == api::ScalarType::Half ||
                          wt == api::ScalarType::BFloat16,
                      "weight must be a floating tensor");
#endif
  }
}

// The norm inputs as the kernels read them: contiguous x and dy in one dtype (strided
// inputs copied once), rows R of length H, and the dtypes of the accumulation and of the
// parameter gradients.
struct NormRows {
  api::Tensor x, dy, dx;
  int64_t H = 0, R = 0;
  bool has_w = false;
  api::ScalarType acc, param_dtype;

  // dweight / dbias in the weight's dtype, or an empty tensor when not requested
  api::Tensor param_grad(bool need) const {
    return need ? api::empty({H}, x, param_dtype) : api::empty({0}, x, x.scalar_type());
  }
  // the weight in the accumulation dtype (undefined without a weight)
  api::Tensor weight_acc(const std::optional<api::Tensor>& w) const {
    return has_w ? api::contiguous(api::to(*w, acc)) : api::Tensor();
  }
};

inline NormRows prepare_norm_rows(const api::Tensor& x_in, const api::Tensor& dy_in,
                                  const std::optional<api::Tensor>& w, double eps) {
  check_norm_args(x_in, dy_in, w, eps);
  NormRows r;
  r.x = api::contiguous(x_in);
  r.dy = api::contiguous(api::to(dy_in, r.x.scalar_type()));
  r.dx = api::empty_like(r.x);
  r.H = r.x.size(-1);
  r.R = r.H == 0 ? 0 : r.x.numel() / r.H;
  r.has_w = api::defined(w);
  r.acc = r.x.scalar_type() == api::ScalarType::Double ? api::ScalarType::Double : api::ScalarType::Float;
  r.param_dtype = r.has_w ? w->scalar_type() : r.x.scalar_type();
  return r;
}

PYATTR_END
