// Half-rule backward on CPU: both outputs in one pass.
#include <ATen/Dispatch.h>
#include "kernels.h"

#include "vec_utils.h"

namespace pyattr::cpu {

std::tuple<at::Tensor, at::Tensor> half_backward(const at::Tensor& u_in, const at::Tensor& v_in,
                                                  const at::Tensor& dy_in) {
  TORCH_CHECK_VALUE(u_in.sizes() == dy_in.sizes() && v_in.sizes() == dy_in.sizes(),
                    "u, v and dy must have one shape (broadcasting is undone by the caller)");
  TORCH_CHECK_TYPE(u_in.scalar_type() == v_in.scalar_type(), "u and v must have one dtype");
  at::Tensor u = u_in.contiguous(), v = v_in.contiguous();
  at::Tensor dy = dy_in.to(u.scalar_type()).contiguous();
  at::Tensor du = at::empty_like(u, at::MemoryFormat::Contiguous);
  at::Tensor dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, u.scalar_type(), "half_backward", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    elementwise<T, 3, 2>(
        {u.const_data_ptr<T>(), v.const_data_ptr<T>(), dy.const_data_ptr<T>()},
        {du.mutable_data_ptr<T>(), dv.mutable_data_ptr<T>()}, u.numel(),
        [](const std::array<AccVec<T>, 3>& a) {
          AccVec<T> h = a[2] * AccVec<T>(A(0.5));
          return std::array<AccVec<T>, 2>{h * a[1], h * a[0]};
        });
  });
  return {du, dv};
}


}  // namespace pyattr::cpu
