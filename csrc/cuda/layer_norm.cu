// LN-rule backward for LayerNorm on CUDA. One block walks a fixed chunk of rows; for each
// row it recomputes mu and sigma with block reductions (a looped reduction, so any hidden
// size works), writes dx = g - mean(g) with g = dy*w/sigma, and adds dy*xhat and dy into
// the chunk's float32 partials, which a second kernel sums in chunk order.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "../checks.h"

#include "common.cuh"

namespace pyattr::cuda {

template <typename T, typename A>
__global__ void layer_norm_backward_kernel(const T* __restrict__ X, const T* __restrict__ DY, const A* __restrict__ W,
                                           T* __restrict__ DX, A* __restrict__ PW, A* __restrict__ PB, int64_t R,
                                           int64_t H, int64_t chunks, A eps) {
  __shared__ A shared[32];
  const int64_t c = blockIdx.x;
  const int64_t r0 = c * R / chunks, r1 = (c + 1) * R / chunks;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = X + r * H;
    const T* dr = DY + r * H;
    // the row mean of pyattr/backends/reference.py (row_mean): K + sum(x - K)/H, K the
    // row's first value (exact for a constant row); where not finite,
    // K + sum((x - K) * 2^-64)/H / 2^-64 (a finite row near the type's max), else NaN
    const A k = static_cast<A>(xr[0]);
    const A scale = A(5.42101086242752217e-20);  // 2^-64
    A s = 0, s2 = 0;
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      const A d = static_cast<A>(xr[j]) - k;
      s += d;
      s2 += d * scale;
    }
    A mean = k + block_sum(s, shared) / A(H);
    if (!isfinite(mean)) {  // the same value in every thread: the whole block branches
      const A big = k + block_sum(s2, shared) / A(H) / scale;
      mean = isfinite(big) ? big : A(NAN);
    }
    A q = 0;
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      const A d = static_cast<A>(xr[j]) - mean;
      q += d * d;
    }
    const A var = block_sum(q, shared) / A(H);
    const A rstd = A(1) / sqrt(var + eps);
    A gs = 0;
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) gs += static_cast<A>(dr[j]) * (W ? W[j] : A(1)) * rstd;
    const A gmean = block_sum(gs, shared) / A(H);
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      const A d = static_cast<A>(dr[j]);
      DX[r * H + j] = static_cast<T>(d * (W ? W[j] : A(1)) * rstd - gmean);
      if (PW) PW[c * H + j] += d * (static_cast<A>(xr[j]) - mean) * rstd;
      if (PB) PB[c * H + j] += d;
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(const at::Tensor& x_in, const std::optional<at::Tensor>& w_opt,
                                                                   double eps, const at::Tensor& dy_in, bool need_dw,
                                                                   bool need_db) {
  c10::cuda::CUDAGuard guard(x_in.device());
  const NormRows rows = prepare_norm_rows(x_in, dy_in, w_opt, eps);
  const at::Tensor &x = rows.x, &dy = rows.dy, &dx = rows.dx;
  const int64_t H = rows.H, R = rows.R;
  const bool has_w = rows.has_w;
  const auto acc = rows.acc;
  at::Tensor w = rows.weight_acc(w_opt);
  at::Tensor dw = rows.param_grad(need_dw), db = rows.param_grad(need_db);
  // without parameter gradients every row gets its own block; with them, fixed chunks
  const int64_t chunks = (need_dw || need_db) ? num_row_chunks(R) : R;
  at::Tensor pw = need_dw ? at::zeros({chunks, H}, x.options().dtype(acc)) : at::Tensor();
  at::Tensor pb = need_db ? at::zeros({chunks, H}, x.options().dtype(acc)) : at::Tensor();
  if (R > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "layer_norm_backward_cuda", [&] {
      using A = acc_t<scalar_t>;
      layer_norm_backward_kernel<scalar_t, A><<<chunks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          x.const_data_ptr<scalar_t>(), dy.const_data_ptr<scalar_t>(), has_w ? w.const_data_ptr<A>() : nullptr,
          dx.mutable_data_ptr<scalar_t>(), need_dw ? pw.mutable_data_ptr<A>() : nullptr,
          need_db ? pb.mutable_data_ptr<A>() : nullptr, R, H, chunks, static_cast<A>(eps));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (need_dw) finish_param_grad<A>(pw, chunks, H, dw);
      if (need_db) finish_param_grad<A>(pb, chunks, H, db);
    });
  } else {
    if (need_dw) dw.zero_();
    if (need_db) db.zero_();
  }
  return {dx, dw, db};
}

TORCH_LIBRARY_IMPL(pyattr, CUDA, m) { m.impl("layer_norm_backward", &layer_norm_backward); }

}  // namespace pyattr::cuda
