// Gated activation backward on CPU: (d gate, d up) in one pass, each rule switchable.
#include "kernels.h"

#include "activation_vec.h"

PYATTR_BEGIN
namespace cpu {

std::tuple<api::Tensor, api::Tensor> gated_backward(const api::Tensor& g_in, const api::Tensor& u_in,
                                                   const api::Tensor& dh_in, api::StrArg act_name,
                                                   bool identity, bool half) {
  PYATTR_CHECK_VALUE(api::same_shape(g_in, u_in) && api::same_shape(g_in, dh_in),
                    "gate, up and dh must have one shape");
  PYATTR_CHECK_TYPE(g_in.scalar_type() == u_in.scalar_type(), "gate and up must have one dtype");
  const Act act = parse_act(std::string(act_name));
  api::Tensor g = api::contiguous(g_in), u = api::contiguous(u_in);
  api::Tensor dh = api::contiguous(api::to(dh_in, g.scalar_type()));
  api::Tensor dg = api::empty_like(g);
  api::Tensor du = api::empty_like(u);
  PYATTR_DISPATCH_FLOATING(g.scalar_type(), "gated_backward", [&] {
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


}  // namespace cpu
PYATTR_END
