// LN-rule backward for LayerNorm on CPU. sigma is a constant, mu stays differentiable:
//   g = dy * w / sigma,  dx = g - mean(g);  dw = sum dy * xhat,  db = sum dy.
// mu and sigma are recomputed from x in the same pass over each row.
#include <cmath>
#include <limits>

#include "kernels.h"

#include "../checks.h"

#include "rows.h"

PYATTR_BEGIN
namespace cpu {

namespace {

// The row mean as every LayerNorm backward recomputes it (pyattr/backends/reference.py,
// row_mean): K + sum(x - K)/H with K the row's first value, so a constant row has exactly
// its value as mean (variance 0, as the native forward's Welford statistics); where that
// sum overflows, K + (sum((x - K) * 2^-64)/H) / 2^-64 (exact scaling): finite while every
// x - K is, as the native statistics are; NaN where that is not finite either (a value
// that is not finite, or values more than the type's max apart: NaN statistics natively).
template <typename T>
inline acc_t<T> row_mean(const T* xr, int64_t H) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  const A k = A(xr[0]);
  const V vk(k);
  const A mean = k + row_sum<T>(H, [&](int64_t j) { return load_acc<T>(xr + j) - vk; },
                                [&](int64_t j) { return A(xr[j]) - k; }) / A(H);
  if (std::isfinite(mean)) return mean;
  const A scale = A(5.42101086242752217e-20);  // 2^-64
  const V vs(scale);
  const A big = k + row_sum<T>(H, [&](int64_t j) { return (load_acc<T>(xr + j) - vk) * vs; },
                               [&](int64_t j) { return (A(xr[j]) - k) * scale; }) / A(H) / scale;
  return std::isfinite(big) ? big : std::numeric_limits<A>::quiet_NaN();
}

// mean_in / rstd_in: the forward's per-row statistics (one value per row), or undefined
// to recompute them from x.
std::tuple<api::Tensor, api::Tensor, api::Tensor> layer_norm_backward_impl(
    const api::Tensor& x_in, const std::optional<api::Tensor>& w_opt, double eps, const api::Tensor& dy_in,
    bool need_dw, bool need_db, const api::Tensor& mean_in, const api::Tensor& rstd_in) {
  const NormRows rows = prepare_norm_rows(x_in, dy_in, w_opt, eps);
  const bool stats = mean_in.defined() && rstd_in.defined();
  if (stats) {
    PYATTR_CHECK_VALUE(mean_in.numel() == rows.R && rstd_in.numel() == rows.R,
                      "mean and rstd must hold one value per row (", rows.R, ")");
  }
  const api::Tensor &x = rows.x, &dy = rows.dy, &dx = rows.dx;
  const int64_t H = rows.H, R = rows.R;
  // the weight in the accumulation type, once (H values), whatever its dtype
  const api::Tensor wacc = rows.weight_acc(w_opt);
  api::Tensor dw = rows.param_grad(need_dw), db = rows.param_grad(need_db);
  PYATTR_DISPATCH_FLOATING(x.scalar_type(), "layer_norm_backward", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    using V = AccVec<T>;
    const T* X = x.const_data_ptr<T>();
    const T* DY = dy.const_data_ptr<T>();
    const A* W = rows.has_w ? wacc.const_data_ptr<A>() : nullptr;
    T* DX = dx.mutable_data_ptr<T>();
    const api::Tensor macc = stats ? api::contiguous(api::to(mean_in, api::scalar_type_of<A>())) : api::Tensor();
    const api::Tensor racc = stats ? api::contiguous(api::to(rstd_in, api::scalar_type_of<A>())) : api::Tensor();
    const A* MS = stats ? macc.const_data_ptr<A>() : nullptr;
    const A* RS = stats ? racc.const_data_ptr<A>() : nullptr;
    const int64_t chunks = num_row_chunks(R);
    const bool partials = (need_dw || need_db) && R > 0;
    std::vector<A> pw(partials && need_dw ? chunks * H : 0, A(0)), pb(partials && need_db ? chunks * H : 0, A(0));
    // One row: dx, then (while the row is still in L1) its dw/db contributions. The
    // flags are template constants so that the inner loops carry no branches.
    auto row = [&](auto has_w, auto do_dw, auto do_db, int64_t r, A* PW, A* PB) {
      constexpr bool kW = decltype(has_w)::value, kDW = decltype(do_dw)::value, kDB = decltype(do_db)::value;
      auto wv = [&](int64_t j) { if constexpr (kW) return V::loadu(W + j); else return V(A(1)); };
      auto ws = [&](int64_t j) { if constexpr (kW) return W[j]; else return A(1); };
      const T* xr = X + r * H;
      const T* dr = DY + r * H;
      T* out = DX + r * H;
      A mean, rstd;
      if (MS) {
        mean = MS[r];
        rstd = RS[r];
      } else {
        mean = row_mean<T>(xr, H);
        const V vm0(mean);
        const A var = row_sum<T>(
                          H, [&](int64_t j) { V d = load_acc<T>(xr + j) - vm0; return d * d; },
                          [&](int64_t j) { A d = A(xr[j]) - mean; return d * d; }) / A(H);
        rstd = A(1) / std::sqrt(var + A(eps));
      }
      // Pass 1 reads dy and x together (two streams, so the prefetcher keeps both rows
      // coming): the sum for mean(g) and the row's dw/db contributions. Pass 2 writes dx
      // from dy, which is still in L1.
      const V vr(rstd), vm(mean);
      V acc(A(0));
      int64_t j = 0;
      for (; j + kStep<T> <= H; j += kStep<T>) {
        const V d = load_acc<T>(dr + j);
        acc = acc + d * wv(j) * vr;
        if constexpr (kDW) (V::loadu(PW + j) + d * (load_acc<T>(xr + j) - vm) * vr).store(PW + j);
        if constexpr (kDB) (V::loadu(PB + j) + d).store(PB + j);
      }
      A gsum = reduce_sum<T>(acc);
      for (; j < H; ++j) {
        const A d = A(dr[j]);
        gsum += d * ws(j) * rstd;
        if constexpr (kDW) PW[j] += d * (A(xr[j]) - mean) * rstd;
        if constexpr (kDB) PB[j] += d;
      }
      const A gmean = gsum / A(H);
      const V vg(gmean);
      j = 0;
      for (; j + kStep<T> <= H; j += kStep<T>) store_acc<T>(out + j, load_acc<T>(dr + j) * wv(j) * vr - vg);
      for (; j < H; ++j) out[j] = static_cast<T>(A(dr[j]) * ws(j) * rstd - gmean);
    };
    auto rows_of = [&](auto has_w, auto do_dw, auto do_db) {
      api::parallel_for(0, R > 0 ? chunks : 0, 1, [&](int64_t cb, int64_t ce) {
        for (int64_t c = cb; c < ce; ++c) {
          A* PW = need_dw ? pw.data() + c * H : nullptr;
          A* PB = need_db ? pb.data() + c * H : nullptr;
          for (int64_t r = c * R / chunks, r1 = (c + 1) * R / chunks; r < r1; ++r) row(has_w, do_dw, do_db, r, PW, PB);
        }
      });
    };
    using Y = std::true_type;
    using N = std::false_type;
    auto with_params = [&](auto has_w) {
      if (need_dw && need_db) rows_of(has_w, Y{}, Y{});
      else if (need_dw) rows_of(has_w, Y{}, N{});
      else if (need_db) rows_of(has_w, N{}, Y{});
      else rows_of(has_w, N{}, N{});
    };
    if (W) with_params(Y{}); else with_params(N{});
    if (need_dw) finish_param_grad<A>(pw, chunks, H, partials, dw);
    if (need_db) finish_param_grad<A>(pb, chunks, H, partials, db);
  });
  return {dx, dw, db};
}

}  // namespace

std::tuple<api::Tensor, api::Tensor, api::Tensor> layer_norm_backward(const api::Tensor& x_in,
                                                                   const std::optional<api::Tensor>& w_opt,
                                                                   double eps, const api::Tensor& dy_in,
                                                                   bool need_dw, bool need_db) {
  return layer_norm_backward_impl(x_in, w_opt, eps, dy_in, need_dw, need_db, api::Tensor(), api::Tensor());
}

// The same with the forward's per-row mean and rstd instead of recomputing them.
std::tuple<api::Tensor, api::Tensor, api::Tensor> layer_norm_backward_stats(
    const api::Tensor& x_in, const std::optional<api::Tensor>& w_opt, const api::Tensor& dy_in, const api::Tensor& mean,
    const api::Tensor& rstd, bool need_dw, bool need_db) {
  return layer_norm_backward_impl(x_in, w_opt, 0.0, dy_in, need_dw, need_db, mean, rstd);
}

// dx only, from the per-row rstd the native forward returned (no pass over x):
//   g = dy * w,  dx = rstd * (g - mean(g)).
api::Tensor layer_norm_rule_dx(const api::Tensor& dy_in, const std::optional<api::Tensor>& w_opt,
                              const api::Tensor& rstd_in) {
  PYATTR_CHECK_VALUE(dy_in.dim() >= 1, "dy must have at least one dimension (..., hidden_size)");
  const int64_t H = dy_in.size(-1);
  const int64_t R = H == 0 ? 0 : dy_in.numel() / H;
  PYATTR_CHECK_VALUE(rstd_in.numel() == R, "rstd must hold one value per row (", R, "), got ", rstd_in.numel());
  const bool has_w = api::defined(w_opt);
  if (has_w) {
    PYATTR_CHECK_VALUE(w_opt->dim() == 1 && w_opt->size(0) == H, "weight must have shape (hidden_size,)");
  }
  const api::Tensor dy = api::contiguous(dy_in);
  api::Tensor dx = api::empty_like(dy);
  PYATTR_DISPATCH_FLOATING(dy.scalar_type(), "layer_norm_rule_dx", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    using V = AccVec<T>;
    const api::Tensor wacc = has_w ? api::contiguous(api::to(*w_opt, api::scalar_type_of<A>())) : api::Tensor();
    const api::Tensor racc = api::contiguous(api::to(rstd_in, api::scalar_type_of<A>()));
    const A* W = has_w ? wacc.const_data_ptr<A>() : nullptr;
    const A* RS = racc.const_data_ptr<A>();
    const T* DY = dy.const_data_ptr<T>();
    T* DX = dx.mutable_data_ptr<T>();
    auto wv = [&](int64_t j) { return W ? V::loadu(W + j) : V(A(1)); };
    auto ws = [&](int64_t j) { return W ? W[j] : A(1); };
    api::parallel_for(0, R, std::max<int64_t>(1, kGrain / std::max<int64_t>(H, 1)), [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) {
        const T* dr = DY + r * H;
        T* out = DX + r * H;
        const A rstd = RS[r];
        const A gmean = row_sum<T>(H, [&](int64_t j) { return load_acc<T>(dr + j) * wv(j); },
                                   [&](int64_t j) { return A(dr[j]) * ws(j); }) / A(H);
        const V vg(gmean), vr(rstd);
        int64_t j = 0;
        for (; j + kStep<T> <= H; j += kStep<T>) store_acc<T>(out + j, (load_acc<T>(dr + j) * wv(j) - vg) * vr);
        for (; j < H; ++j) out[j] = static_cast<T>((A(dr[j]) * ws(j) - gmean) * rstd);
      }
    });
  });
  return dx;
}


}  // namespace cpu
PYATTR_END
