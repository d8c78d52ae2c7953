// Gated activation backward on CUDA: (d gate, d up) in one pass, each rule switchable.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "elementwise.cuh"

namespace pyattr::cuda {

template <typename A>
struct GatedOp {
  Act act;
  bool identity;
  A s;
  __device__ __forceinline__ void operator()(const A* a, A* r) const {
    const A sd = a[2] * s;
    const A local = identity ? phi_scalar<A>(act, a[0]) : dact_scalar<A>(act, a[0]);
    r[0] = sd * a[1] * local;
    r[1] = sd * act_scalar<A>(act, a[0]);
  }
};

std::tuple<at::Tensor, at::Tensor> gated_backward(const at::Tensor& g_in, const at::Tensor& u_in, const at::Tensor& dh_in,
                                                   c10::string_view act_name, bool identity, bool half) {
  TORCH_CHECK_VALUE(g_in.sizes() == u_in.sizes() && g_in.sizes() == dh_in.sizes(), "gate, up and dh must have one shape");
  TORCH_CHECK_TYPE(g_in.scalar_type() == u_in.scalar_type(), "gate and up must have one dtype");
  const Act act = parse_act(std::string(act_name));
  c10::cuda::CUDAGuard guard(g_in.device());
  at::Tensor g = g_in.contiguous(), u = u_in.contiguous();
  at::Tensor dh = dh_in.to(g.scalar_type()).contiguous();
  at::Tensor dg = at::empty_like(g, at::MemoryFormat::Contiguous);
  at::Tensor du = at::empty_like(u, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "gated_backward_cuda", [&] {
    using A = acc_t<scalar_t>;
    Ptrs<scalar_t, 3, 2> p{{g.const_data_ptr<scalar_t>(), u.const_data_ptr<scalar_t>(), dh.const_data_ptr<scalar_t>()},
                           {dg.mutable_data_ptr<scalar_t>(), du.mutable_data_ptr<scalar_t>()}};
    launch_elementwise(p, g.numel(), GatedOp<A>{act, identity, half ? A(0.5) : A(1)});
  });
  return {dg, du};
}

TORCH_LIBRARY_IMPL(pyattr, CUDA, m) { m.impl("gated_backward", &gated_backward); }

}  // namespace pyattr::cuda
