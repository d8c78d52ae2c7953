// Row-wise helpers for the norm kernels: rows of any length (vector body + scalar tail)
// and deterministic parameter-gradient reductions (fixed row chunks, fixed-order sum).
#pragma once

#include <vector>

#include "vec_utils.h"

PYATTR_BEGIN
namespace cpu {

// Row chunks for parameter-gradient partials. Depends on the shape only, never on the
// thread count, so dweight/dbias are bit-reproducible run to run.
inline int64_t num_row_chunks(int64_t rows) { return std::max<int64_t>(1, std::min<int64_t>(rows, 64)); }

// sum_i f(i) over one row, vectorised.
template <typename T, typename VF, typename SF>
inline acc_t<T> row_sum(int64_t n, VF vf, SF sf) {
  AccVec<T> acc(0);
  int64_t i = 0;
  for (; i + kStep<T> <= n; i += kStep<T>) acc = acc + vf(i);
  acc_t<T> s = reduce_sum<T>(acc);
  for (; i < n; ++i) s += sf(i);
  return s;
}

// Sum `chunks` partial rows of length n (float32/float64) in chunk order into out. The
// sum runs along the rows (contiguous, vectorisable) into a block of running sums; a walk
// down each column would stride n elements per load, a page apart at hidden size 1024.
template <typename A, typename P>
inline void sum_partials(const std::vector<A>& partial, int64_t chunks, int64_t n, P* out) {
  constexpr int64_t kBlock = 512;
  api::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t bb, int64_t be) {
    A s[kBlock];
    for (int64_t blk = bb; blk < be; ++blk) {
      const int64_t j0 = blk * kBlock, m = std::min(kBlock, n - j0);
      std::fill(s, s + m, A(0));
      for (int64_t c = 0; c < chunks; ++c) {
        const A* p = partial.data() + c * n + j0;
        for (int64_t j = 0; j < m; ++j) s[j] += p[j];
      }
      for (int64_t j = 0; j < m; ++j) out[j0 + j] = static_cast<P>(s[j]);
    }
  });
}

// Write the summed partials (or zeros when there were no rows) into a parameter gradient
// of any floating dtype.
template <typename A>
inline void finish_param_grad(const std::vector<A>& partial, int64_t chunks, int64_t n, bool any_rows,
                              api::Tensor& out) {
  if (!any_rows) {
    api::zero_(out);
    return;
  }
  PYATTR_DISPATCH_FLOATING(out.scalar_type(), "param_grad", [&] {
    sum_partials<A, scalar_t>(partial, chunks, n, out.mutable_data_ptr<scalar_t>());
  });
}

}  // namespace cpu
PYATTR_END
