// CUDA helpers: float32 (float64 for double) accumulation, 64-bit indexing, grid-stride
// loops, warp-shuffle block reductions, launch on the current stream.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../activation.h"

namespace pyattr::cuda {

template <typename T>
using acc_t = at::opmath_type<T>;

constexpr int kThreads = 256;

inline int64_t num_blocks(int64_t n, int threads = kThreads) {
  // enough blocks to fill the device several times over; the kernels loop over the rest
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = (n + threads - 1) / threads;
  return std::max<int64_t>(1, std::min<int64_t>(want, sms * 32));
}

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sum over the block; every thread gets the result. `shared` holds >= 32 values.
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  A r = threadIdx.x < nwarps ? shared[threadIdx.x] : A(0);
  if (warp == 0) {
    r = warp_sum(r);
    if (lane == 0) shared[0] = r;
  }
  __syncthreads();
  return shared[0];
}

// Fixed row chunks for parameter-gradient partials: shape-only, so dweight/dbias are
// bit-reproducible across runs and devices.
inline int64_t num_row_chunks(int64_t rows) { return std::max<int64_t>(1, std::min<int64_t>(rows, 256)); }

// out[j] = sum_c partial[c * n + j], in chunk order.
template <typename A, typename P>
__global__ void sum_partials_kernel(const A* __restrict__ partial, int64_t chunks, int64_t n, P* __restrict__ out) {
  for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < n; j += (int64_t)gridDim.x * blockDim.x) {
    A s = 0;
    for (int64_t c = 0; c < chunks; ++c) s += partial[c * n + j];
    out[j] = static_cast<P>(s);
  }
}

template <typename A>
void finish_param_grad(const at::Tensor& partial, int64_t chunks, int64_t n, at::Tensor& out) {
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "param_grad", [&] {
    sum_partials_kernel<A, scalar_t><<<num_blocks(n), kThreads, 0, stream>>>(
        partial.const_data_ptr<A>(), chunks, n, out.mutable_data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace pyattr::cuda
