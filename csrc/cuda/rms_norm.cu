// LN-rule backward for RMSNorm on CUDA: dx = dy*(offset + w)/r, dw = sum dy*x/r, with r
// recomputed per row by a looped block reduction; chunked partials as in layer_norm.cu.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "../checks.h"

#include "common.cuh"

namespace pyattr::cuda {

template <typename T, typename A>
__global__ void rms_norm_backward_kernel(const T* __restrict__ X, const T* __restrict__ DY, const A* __restrict__ W,
                                         T* __restrict__ DX, A* __restrict__ PW, int64_t R, int64_t H, int64_t chunks,
                                         A eps, A offset) {
  __shared__ A shared[32];
  const int64_t c = blockIdx.x;
  const int64_t r0 = c * R / chunks, r1 = (c + 1) * R / chunks;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = X + r * H;
    const T* dr = DY + r * H;
    A s = 0;
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      const A v = static_cast<A>(xr[j]);
      s += v * v;
    }
    const A rinv = A(1) / sqrt(block_sum(s, shared) / A(H) + eps);
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      const A d = static_cast<A>(dr[j]) * rinv;
      DX[r * H + j] = static_cast<T>(d * (W ? offset + W[j] : A(1)));
      if (PW) PW[c * H + j] += d * static_cast<A>(xr[j]);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& x_in, const std::optional<at::Tensor>& w_opt,
                                                     double eps, double offset, const at::Tensor& dy_in, bool need_dw) {
  TORCH_CHECK_VALUE(std::isfinite(offset), "offset must be finite, got ", offset);
  c10::cuda::CUDAGuard guard(x_in.device());
  const NormRows rows = prepare_norm_rows(x_in, dy_in, w_opt, eps);
  const at::Tensor &x = rows.x, &dy = rows.dy, &dx = rows.dx;
  const int64_t H = rows.H, R = rows.R;
  const bool has_w = rows.has_w;
  const auto acc = rows.acc;
  at::Tensor w = rows.weight_acc(w_opt);
  at::Tensor dw = rows.param_grad(need_dw);
  const int64_t chunks = need_dw ? num_row_chunks(R) : R;
  at::Tensor pw = need_dw ? at::zeros({chunks, H}, x.options().dtype(acc)) : at::Tensor();
  if (R > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_backward_cuda", [&] {
      using A = acc_t<scalar_t>;
      rms_norm_backward_kernel<scalar_t, A><<<chunks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          x.const_data_ptr<scalar_t>(), dy.const_data_ptr<scalar_t>(), has_w ? w.const_data_ptr<A>() : nullptr,
          dx.mutable_data_ptr<scalar_t>(), need_dw ? pw.mutable_data_ptr<A>() : nullptr, R, H, chunks,
          static_cast<A>(eps), static_cast<A>(offset));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (need_dw) finish_param_grad<A>(pw, chunks, H, dw);
    });
  } else if (need_dw) {
    dw.zero_();
  }
  return {dx, dw};
}

TORCH_LIBRARY_IMPL(pyattr, CUDA, m) { m.impl("rms_norm_backward", &rms_norm_backward); }

}  // namespace pyattr::cuda
