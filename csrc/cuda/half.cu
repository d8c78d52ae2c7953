// Half-rule backward on CUDA: du = dy*v/2 and dv = dy*u/2 in one pass.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "elementwise.cuh"

namespace pyattr::cuda {

template <typename A>
struct HalfOp {
  __device__ __forceinline__ void operator()(const A* a, A* r) const {
    const A h = a[2] * A(0.5);
    r[0] = h * a[1];
    r[1] = h * a[0];
  }
};

std::tuple<at::Tensor, at::Tensor> half_backward(const at::Tensor& u_in, const at::Tensor& v_in, const at::Tensor& dy_in) {
  TORCH_CHECK_VALUE(u_in.sizes() == dy_in.sizes() && v_in.sizes() == dy_in.sizes(),
                    "u, v and dy must have one shape (broadcasting is undone by the caller)");
  TORCH_CHECK_TYPE(u_in.scalar_type() == v_in.scalar_type(), "u and v must have one dtype");
  c10::cuda::CUDAGuard guard(u_in.device());
  at::Tensor u = u_in.contiguous(), v = v_in.contiguous();
  at::Tensor dy = dy_in.to(u.scalar_type()).contiguous();
  at::Tensor du = at::empty_like(u, at::MemoryFormat::Contiguous);
  at::Tensor dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, u.scalar_type(), "half_backward_cuda", [&] {
    Ptrs<scalar_t, 3, 2> p{{u.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(), dy.const_data_ptr<scalar_t>()},
                           {du.mutable_data_ptr<scalar_t>(), dv.mutable_data_ptr<scalar_t>()}};
    launch_elementwise(p, u.numel(), HalfOp<acc_t<scalar_t>>{});
  });
  return {du, dv};
}

TORCH_LIBRARY_IMPL(pyattr, CUDA, m) { m.impl("half_backward", &half_backward); }

}  // namespace pyattr::cuda
