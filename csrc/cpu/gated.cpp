// Gated activation backward on CPU: (d gate, d up) in one pass, each rule switchable.
#include <ATen/Dispatch.h>
#include "kernels.h"

#include "activation_vec.h"

namespace pyattr::cpu {

std::tuple<at::Tensor, at::Tensor> gated_backward(const at::Tensor& g_in, const at::Tensor& u_in,
                                                   const at::Tensor& dh_in, c10::string_view act_name,
                                                   bool identity, bool half) {
  TORCH_CHECK_VALUE(g_in.sizes() == u_in.sizes() && g_in.sizes() == dh_in.sizes(),
                    "gate, up and dh must have one shape");
  TORCH_CHECK_TYPE(g_in.scalar_type() == u_in.scalar_type(), "gate and up must have one dtype");
  const Act act = parse_act(std::string(act_name));
  at::Tensor g = g_in.contiguous(), u = u_in.contiguous();
  at::Tensor dh = dh_in.to(g.scalar_type()).contiguous();
  at::Tensor dg = at::empty_like(g, at::MemoryFormat::Contiguous);
  at::Tensor du = at::empty_like(u, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "gated_backward", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const A s = half ? A(0.5) : A(1);
    with_act(act, [&](auto c) {
      constexpr Act K = decltype(c)::value;
      elementwise<T, 3, 2>(
          {g.const_data_ptr<T>(), u.const_data_ptr<T>(), dh.const_data_ptr<T>()},
          {dg.mutable_data_ptr<T>(), du.mutable_data_ptr<T>()}, g.numel(),
          [=](const std::array<AccVec<T>, 3>& a) {
            AccVec<T> sd = a[2] * AccVec<T>(s);
            AccVec<T> p = phi_vec(K, a[0]);
            AccVec<T> local = identity ? p : dact_vec(K, a[0]);
            AccVec<T> actg = K == Act::ReLU ? act_vec(K, a[0]) : a[0] * p;
            return std::array<AccVec<T>, 2>{sd * a[1] * local, sd * actg};
          });
    });
  });
  return {dg, du};
}


}  // namespace pyattr::cpu
