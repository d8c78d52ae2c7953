// Half-rule backward on CPU: both outputs in one pass.
#include "kernels.h"

#include "vec_utils.h"

PYATTR_BEGIN
namespace cpu {

std::tuple<api::Tensor, api::Tensor> half_backward(const api::Tensor& u_in, const api::Tensor& v_in,
                                                  const api::Tensor& dy_in) {
  PYATTR_CHECK_VALUE(api::same_shape(u_in, dy_in) && api::same_shape(v_in, dy_in),
                    "u, v and dy must have one shape (broadcasting is undone by the caller)");
  PYATTR_CHECK_TYPE(u_in.scalar_type() == v_in.scalar_type(), "u and v must have one dtype");
  api::Tensor u = api::contiguous(u_in), v = api::contiguous(v_in);
  api::Tensor dy = api::contiguous(api::to(dy_in, u.scalar_type()));
  api::Tensor du = api::empty_like(u);
  api::Tensor dv = api::empty_like(v);
  PYATTR_DISPATCH_FLOATING(u.scalar_type(), "half_backward", [&] {
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


}  // namespace cpu
PYATTR_END
