// Elementwise driver for the rule backwards: N inputs, M outputs of one dtype, computed in
// the accumulation type. Loads and stores go 16 bytes at a time when every pointer is
// 16-byte aligned; otherwise, and for the tail, one element at a time.
#pragma once

#include "common.cuh"

namespace pyattr::cuda {

template <typename T, int NIN, int NOUT>
struct Ptrs {
  const T* in[NIN];
  T* out[NOUT];
};

template <typename T>
constexpr int vec_width() {
  return 16 / sizeof(T);
}

template <typename T, int W>
struct alignas(16) Pack {
  T v[W];
};

template <typename T, int NIN, int NOUT, bool VEC, typename F>
__global__ void elementwise_kernel(Ptrs<T, NIN, NOUT> p, int64_t n, F f) {
  using A = acc_t<T>;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  constexpr int W = vec_width<T>();
  int64_t done = 0;
  if constexpr (VEC) {
    const int64_t nvec = n / W;
    for (int64_t v = tid; v < nvec; v += stride) {
      Pack<T, W> in[NIN], out[NOUT];
#pragma unroll
      for (int k = 0; k < NIN; ++k) in[k] = reinterpret_cast<const Pack<T, W>*>(p.in[k])[v];
#pragma unroll
      for (int e = 0; e < W; ++e) {
        A a[NIN], r[NOUT];
#pragma unroll
        for (int k = 0; k < NIN; ++k) a[k] = static_cast<A>(in[k].v[e]);
        f(a, r);
#pragma unroll
        for (int k = 0; k < NOUT; ++k) out[k].v[e] = static_cast<T>(r[k]);
      }
#pragma unroll
      for (int k = 0; k < NOUT; ++k) reinterpret_cast<Pack<T, W>*>(p.out[k])[v] = out[k];
    }
    done = nvec * W;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    A a[NIN], r[NOUT];
#pragma unroll
    for (int k = 0; k < NIN; ++k) a[k] = static_cast<A>(p.in[k][i]);
    f(a, r);
#pragma unroll
    for (int k = 0; k < NOUT; ++k) p.out[k][i] = static_cast<T>(r[k]);
  }
}

template <typename T, int NIN, int NOUT, typename F>
void launch_elementwise(const Ptrs<T, NIN, NOUT>& p, int64_t n, F f) {
  if (n == 0) return;
  bool aligned = true;
  for (int k = 0; k < NIN; ++k) aligned &= reinterpret_cast<uintptr_t>(p.in[k]) % 16 == 0;
  for (int k = 0; k < NOUT; ++k) aligned &= reinterpret_cast<uintptr_t>(p.out[k]) % 16 == 0;
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t work = aligned ? (n + vec_width<T>() - 1) / vec_width<T>() : n;
  const int64_t blocks = num_blocks(work);
  if (aligned) {
    elementwise_kernel<T, NIN, NOUT, true><<<blocks, kThreads, 0, stream>>>(p, n, f);
  } else {
    elementwise_kernel<T, NIN, NOUT, false><<<blocks, kThreads, 0, stream>>>(p, n, f);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace pyattr::cuda
