// LN-rule backward for RMSNorm on CPU: r is a constant,
//   dx = dy * (offset + w) / r,  dw = sum dy * x / r,  r = sqrt(mean(x^2) + eps),
// with r recomputed from x in the same pass over each row.
#include <cmath>

#include "kernels.h"

#include "../checks.h"

#include "rows.h"

PYATTR_BEGIN
namespace cpu {

std::tuple<api::Tensor, api::Tensor> rms_norm_backward(const api::Tensor& x_in, const std::optional<api::Tensor>& w_opt,
                                                     double eps, double offset, const api::Tensor& dy_in,
                                                     bool need_dw) {
  PYATTR_CHECK_VALUE(std::isfinite(offset), "offset must be finite, got ", offset);
  const NormRows rows = prepare_norm_rows(x_in, dy_in, w_opt, eps);
  const api::Tensor &x = rows.x, &dy = rows.dy, &dx = rows.dx;
  const int64_t H = rows.H, R = rows.R;
  const api::Tensor wacc = rows.weight_acc(w_opt);
  api::Tensor dw = rows.param_grad(need_dw);
  PYATTR_DISPATCH_FLOATING(x.scalar_type(), "rms_norm_backward", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    using V = AccVec<T>;
    const T* X = x.const_data_ptr<T>();
    const T* DY = dy.const_data_ptr<T>();
    T* DX = dx.mutable_data_ptr<T>();
    // w_eff in the accumulation type, once (H values), so the row loop reads one array.
    std::vector<A> weff(H, A(1));
    if (rows.has_w) {
      const A* wp = wacc.const_data_ptr<A>();
      for (int64_t j = 0; j < H; ++j) weff[j] = A(offset) + wp[j];
    }
    const A* WE = weff.data();
    const int64_t chunks = num_row_chunks(R);
    const bool partials = need_dw && R > 0;
    std::vector<A> pw(partials ? chunks * H : 0, A(0));
    api::parallel_for(0, R > 0 ? chunks : 0, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        const int64_t r0 = c * R / chunks, r1 = (c + 1) * R / chunks;
        A* PW = partials ? pw.data() + c * H : nullptr;
        for (int64_t r = r0; r < r1; ++r) {
          const T* xr = X + r * H;
          const T* dr = DY + r * H;
          T* out = DX + r * H;
          const A ms = row_sum<T>(H, [&](int64_t j) { V v = load_acc<T>(xr + j); return v * v; },
                                  [&](int64_t j) { A v = A(xr[j]); return v * v; }) / A(H);
          const A rinv = A(1) / std::sqrt(ms + A(eps));
          const V vr(rinv);
          int64_t j = 0;
          for (; j + kStep<T> <= H; j += kStep<T>) {
            V d = load_acc<T>(dr + j) * vr;
            store_acc<T>(out + j, d * V::loadu(WE + j));
            if (PW) (V::loadu(PW + j) + d * load_acc<T>(xr + j)).store(PW + j);
          }
          for (; j < H; ++j) {
            A d = A(dr[j]) * rinv;
            out[j] = static_cast<T>(d * WE[j]);
            if (PW) PW[j] += d * A(xr[j]);
          }
        }
      }
    });
    if (need_dw) finish_param_grad<A>(pw, chunks, H, partials, dw);
  });
  return {dx, dw};
}


}  // namespace cpu
PYATTR_END
