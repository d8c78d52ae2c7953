// Identity-rule backward on CUDA: dx = dy * phi(x), float32 accumulation.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "elementwise.cuh"

namespace pyattr::cuda {

template <typename A>
struct IdentityOp {
  Act act;
  __device__ __forceinline__ void operator()(const A* a, A* r) const { r[0] = a[1] * phi_scalar<A>(act, a[0]); }
};

at::Tensor identity_backward(const at::Tensor& x_in, const at::Tensor& dy_in, c10::string_view act_name) {
  TORCH_CHECK_VALUE(x_in.sizes() == dy_in.sizes(), "dy must have the shape of x");
  const Act act = parse_act(std::string(act_name));
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous();  // strided inputs: one explicit copy
  at::Tensor dy = dy_in.to(x.scalar_type()).contiguous();
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "identity_backward_cuda", [&] {
    Ptrs<scalar_t, 2, 1> p{{x.const_data_ptr<scalar_t>(), dy.const_data_ptr<scalar_t>()}, {dx.mutable_data_ptr<scalar_t>()}};
    launch_elementwise(p, x.numel(), IdentityOp<acc_t<scalar_t>>{act});
  });
  return dx;
}

TORCH_LIBRARY_IMPL(pyattr, CUDA, m) { m.impl("identity_backward", &identity_backward); }

}  // namespace pyattr::cuda
