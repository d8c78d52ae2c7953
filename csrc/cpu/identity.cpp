// Identity-rule backward on CPU: dx = dy * phi(x), float32 accumulation.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "activation_vec.h"

namespace pyattr::cpu {

at::Tensor identity_backward(const at::Tensor& x_in, const at::Tensor& dy_in, c10::string_view act_name) {
  TORCH_CHECK_VALUE(x_in.sizes() == dy_in.sizes(), "dy must have the shape of x");
  const Act act = parse_act(std::string(act_name));
  // Strided inputs are copied once to contiguous buffers; contiguous ones are used as is.
  at::Tensor x = x_in.contiguous();
  at::Tensor dy = dy_in.to(x.scalar_type()).contiguous();
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "identity_backward", [&] {
    using T = scalar_t;
    with_act(act, [&](auto c) {
      constexpr Act K = decltype(c)::value;
      elementwise<T, 2, 1>(
          {x.const_data_ptr<T>(), dy.const_data_ptr<T>()}, {dx.mutable_data_ptr<T>()}, x.numel(),
          [](const std::array<AccVec<T>, 2>& a) { return std::array<AccVec<T>, 1>{a[1] * phi_vec(K, a[0])}; });
    });
  });
  return dx;
}

TORCH_LIBRARY_IMPL(pyattr, CPU, m) { m.impl("identity_backward", &identity_backward); }

}  // namespace pyattr::cpu
