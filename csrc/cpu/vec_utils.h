// CPU helpers: float32 (float64 for double) accumulation over at::vec::Vectorized, loads
// and stores that convert 16-bit types once, and a parallel elementwise driver.
#pragma once

#include <algorithm>
#include <array>
#include <type_traits>

#include "api.h"  // first: in the stable build it includes at::vec before the stable headers
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

PYATTR_BEGIN
namespace cpu {

using at::vec::Vectorized;

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
using AccVec = Vectorized<acc_t<T>>;

template <typename T>
constexpr int64_t kStep = AccVec<T>::size();

// Load kStep<T> elements starting at p, converted to the accumulation type.
template <typename T>
inline AccVec<T> load_acc(const T* p) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    return AccVec<T>::loadu(p);
  } else {
    Vectorized<float> out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

template <typename T>
inline void store_acc(T* p, const AccVec<T>& v) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, kStep<T>);
  }
}

// 2 * kStep<T> elements starting at p, as two accumulation vectors (lo: the first half).
template <typename T>
inline void load_acc2(const T* p, AccVec<T>& lo, AccVec<T>& hi) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    lo = AccVec<T>::loadu(p);
    hi = AccVec<T>::loadu(p + kStep<T>);
  } else {
    at::vec::load_to_float<T>(p, lo, hi);
  }
}

template <typename T>
inline void store_acc2(T* p, const AccVec<T>& lo, const AccVec<T>& hi) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    lo.store(p);
    hi.store(p + kStep<T>);
  } else {
    at::vec::convert_from_float<T>(lo, hi).store(p);
  }
}

template <typename T>
inline acc_t<T> reduce_sum(const AccVec<T>& v) {
  return at::vec::vec_reduce_all<acc_t<T>>([](auto& a, auto& b) { return a + b; }, v);
}

// Elements per parallel task: large enough to amortise scheduling, small enough to split.
constexpr int64_t kGrain = 16384;

// out_k[i] = f(in_0[i], ..., in_{N-1}[i]) for every i, in parallel; vf works on
// AccVec<T> lanes. The tail that does not fill a vector goes through vf too, from a
// zero-padded copy, so an element's result never depends on where it falls in the tensor
// (a scalar tail with its own formula would round differently).
template <typename T, size_t NIN, size_t NOUT, typename VF>
void elementwise(const std::array<const T*, NIN>& in, const std::array<T*, NOUT>& out, int64_t n, VF vf) {
  // copied by value into the task: pointers read through a reference are reloaded after
  // every store (the compiler cannot rule out aliasing), a load per operand per step
  api::parallel_for(0, n, kGrain, [in, out, vf](int64_t begin, int64_t end) {
    int64_t i = begin;
    // Two accumulation vectors per step: a 16-bit type then converts a whole register
    // (16 lanes) each way instead of half of one, which halves the conversion work that
    // bounds these kernels for bfloat16; each lane's arithmetic is the same as below.
    for (; i + 2 * kStep<T> <= end; i += 2 * kStep<T>) {
      std::array<AccVec<T>, NIN> lo, hi;
      for (size_t k = 0; k < NIN; ++k) load_acc2<T>(in[k] + i, lo[k], hi[k]);
      const std::array<AccVec<T>, NOUT> rl = vf(lo), rh = vf(hi);
      for (size_t k = 0; k < NOUT; ++k) store_acc2<T>(out[k] + i, rl[k], rh[k]);
    }
    for (; i + kStep<T> <= end; i += kStep<T>) {
      std::array<AccVec<T>, NIN> a;
      for (size_t k = 0; k < NIN; ++k) a[k] = load_acc<T>(in[k] + i);
      std::array<AccVec<T>, NOUT> r = vf(a);
      for (size_t k = 0; k < NOUT; ++k) store_acc<T>(out[k] + i, r[k]);
    }
    if (i < end) {
      const int64_t m = end - i;
      std::array<AccVec<T>, NIN> a;
      for (size_t k = 0; k < NIN; ++k) {
        T buf[kStep<T>] = {};
        std::copy(in[k] + i, in[k] + end, buf);
        a[k] = load_acc<T>(buf);
      }
      std::array<AccVec<T>, NOUT> r = vf(a);
      for (size_t k = 0; k < NOUT; ++k) {
        T buf[kStep<T>];
        store_acc<T>(buf, r[k]);
        std::copy(buf, buf + m, out[k] + i);
      }
    }
  });
}

}  // namespace cpu
PYATTR_END
