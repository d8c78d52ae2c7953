// Frozen attention (AH-rule) backward on CPU: dV = P^T dO, with P = softmax(s * q k^T
// [softcap] + mask) recomputed per block of query rows and never kept whole.
//
// bfloat16 / float16 inputs keep their type in the GEMMs (at::native::cpublas::brgemm:
// 16-bit products, float32 accumulation and output, 2-4x the float32 GEMMs' rate on a CPU
// with bf16 instructions); scores, softmax and sums stay float32, and P is rounded to the
// input type only as the operand of P^T dO, as sdpa's own CPU flash kernel rounds it.
//
// Work items are (batch, key/value head, share of the query blocks); each runs its GEMMs
// single-threaded (inside at::parallel_for) on its own score buffer of
// (groups * kBlockRows) x kv_len, so the scale, softcap, mask, softmax pass reads the
// scores while they are in cache. A head with GQA stacks its query heads' rows in one
// block, so P^T dO sums over the group in the same GEMM. Items that share a head write
// separate partial sums, added at the end (only when there are fewer heads than threads).
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/all.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include "kernels.h"

PYATTR_BEGIN
namespace cpu {

namespace {

constexpr int64_t kBlockRows = 64;

template <typename A>
inline at::vec::Vectorized<A> vexp(const at::vec::Vectorized<A>& x) {
  if constexpr (std::is_same_v<A, float>) {
    return x.exp_u20();  // within 20 ulp; arguments here are <= 0 after the max shift
  } else {
    return x.exp();
  }
}

// The two passes of a softmax row in place: scale (and softcap), mask and the max over keys
// < limit, then exp(v - max) and its sum. Returns 1 / sum, or 0 when every key is masked
// (the row contributes nothing, as in PyTorch's SDPA), or NaN when a score is NaN or +inf
// (softmax's own answer). The first pass runs in lanes when there is no softcap and no mask
// (a 4k-key row spent most of the 16-bit kernel's time there, scalar): the same values, and
// the order does not change a max.
template <typename A>
A softmax_exp(A* row, int64_t limit, A scaling, std::optional<A> softcap, const A* mrow, int64_t mstride) {
  using V = at::vec::Vectorized<A>;
  constexpr int64_t W = V::size();
  const A ninf = -std::numeric_limits<A>::infinity();
  A mx = ninf;
  bool nan = false;  // tracked apart, so the max stays a plain max
  int64_t j = 0;
  A lanes[W];
  if (!softcap && !mrow) {
    const V vs(scaling);
    V vmx(ninf);
    for (; j + W <= limit; j += W) {
      const V v = V::loadu(row + j) * vs;
      v.store(row + j);
      vmx = at::vec::maximum(vmx, v);  // NaN propagates
    }
    vmx.store(lanes);
    for (int64_t l = 0; l < W; ++l) {
      nan |= lanes[l] != lanes[l];
      mx = lanes[l] > mx ? lanes[l] : mx;
    }
  }
  for (; j < limit; ++j) {
    A v = row[j] * scaling;
    if (softcap) v = std::tanh(v / *softcap) * *softcap;
    if (mrow) v += mrow[j * mstride];
    row[j] = v;
    mx = v > mx ? v : mx;
    nan |= v != v;
  }
  if (!nan && mx == ninf) return A(0);  // every key masked
  if (nan || mx == -ninf) return std::numeric_limits<A>::quiet_NaN();  // NaN, or exp(inf - inf)
  const V vmx(mx);
  V vsum(A(0));
  for (j = 0; j + W <= limit; j += W) {
    V e = vexp<A>(V::loadu(row + j) - vmx);
    e.store(row + j);
    vsum = vsum + e;
  }
  vsum.store(lanes);
  A sum = 0;
  for (int64_t l = 0; l < W; ++l) sum += lanes[l];
  for (; j < limit; ++j) {
    A e = std::exp(row[j] - mx);
    row[j] = e;
    sum += e;
  }
  return A(1) / sum;
}

// One score row in place: scale (and softcap), mask, keys >= limit dropped, softmax.
// A row whose keys are all masked becomes 0; a row with a NaN or +inf score is NaN except at
// keys >= limit (pyattr/backends/reference.py, attention_dv_reference).
template <typename A>
void softmax_row(A* row, int64_t kend, int64_t limit, A scaling, std::optional<A> softcap, const A* mrow,
                 int64_t mstride) {
  using V = at::vec::Vectorized<A>;
  constexpr int64_t W = V::size();
  const A inv = softmax_exp<A>(row, limit, scaling, softcap, mrow, mstride);
  if (inv != inv || inv == A(0)) {
    std::fill(row, row + limit, inv);
  } else {
    const V vinv(inv);
    int64_t j = 0;
    for (; j + W <= limit; j += W) (V::loadu(row + j) * vinv).store(row + j);
    for (; j < limit; ++j) row[j] *= inv;
  }
  std::fill(row + limit, row + kend, A(0));
}

// softmax_row for the 16-bit kernels: the same answers, rounded to T into ``out`` (the float
// row keeps the unnormalized exponentials), the normalization fused with the rounding.
template <typename T>
void softmax_row16(float* row, T* out, int64_t kend, int64_t limit, float scaling, std::optional<float> softcap,
                   const float* mrow, int64_t mstride) {
  using V = at::vec::Vectorized<float>;
  constexpr int64_t W = V::size();
  const float inv = softmax_exp<float>(row, limit, scaling, softcap, mrow, mstride);
  int64_t j = 0;
  if (inv != inv || inv == 0.f) {
    std::fill(out, out + limit, T(inv));
  } else {
    const V vinv(inv);
    for (; j + 2 * W <= limit; j += 2 * W) {
      at::vec::convert_from_float<T>(V::loadu(row + j) * vinv, V::loadu(row + j + W) * vinv).store(out + j);
    }
    for (; j < limit; ++j) out[j] = T(row[j] * inv);
  }
  std::fill(out + limit, out + kend, T(0));
}

// One row of dS in place of dP: dS = s * P * (dP - sum(P * dP)) [* (1 - t^2), t = tanh of
// the softcapped score], vectorized (the row sum in lanes, then the lanes summed).
template <typename A>
void score_grad_row(const A* p, A* dp, const A* t, int64_t n, A scaling) {
  using V = at::vec::Vectorized<A>;
  constexpr int64_t W = V::size();
  V vs(A(0));
  int64_t j = 0;
  for (; j + W <= n; j += W) vs = vs + V::loadu(p + j) * V::loadu(dp + j);
  A lanes[W];
  vs.store(lanes);
  A sum = 0;
  for (int64_t l = 0; l < W; ++l) sum += lanes[l];
  for (; j < n; ++j) sum += p[j] * dp[j];
  const V vsum(sum), vscale(scaling), one(A(1));
  j = 0;
  for (; j + W <= n; j += W) {
    V d = V::loadu(p + j) * (V::loadu(dp + j) - vsum) * vscale;
    if (t) {
      const V tt = V::loadu(t + j);
      d = d * (one - tt * tt);
    }
    d.store(dp + j);
  }
  for (; j < n; ++j) {
    A d = p[j] * (dp[j] - sum) * scaling;
    if (t) d *= A(1) - t[j] * t[j];
    dp[j] = d;
  }
}

// The additive mask as a (B, H, Lq, Lk) view in the accumulation type (broadcast dims keep
// stride 0), or undefined; checked for both kernels alike.
at::Tensor mask_view(const std::optional<at::Tensor>& mask_opt, int64_t B, int64_t H, int64_t Lq, int64_t Lk,
                     at::ScalarType acc, const char* op) {
  if (!mask_opt || !mask_opt->defined()) return at::Tensor();
  const at::Tensor& m = *mask_opt;
  TORCH_CHECK_VALUE(m.dim() == 4 && (m.size(0) == 1 || m.size(0) == B) && (m.size(1) == 1 || m.size(1) == H) &&
                        (m.size(2) == 1 || m.size(2) == Lq) && m.size(3) >= Lk,
                    op, ": mask ", m.sizes(), " does not broadcast to (", B, ", ", H, ", ", Lq, ", ", Lk, ")");
  TORCH_CHECK_TYPE(at::isFloatingType(m.scalar_type()), op, ": mask must be additive (floating)");
  return m.narrow(3, 0, Lk).to(acc).expand({B, H, Lq, Lk});
}

// The 16-bit GEMM path only where the CPU multiplies that type natively (oneDNN's brgemm
// ukernel packs it: AMX, AVX-512 bf16/fp16); elsewhere brgemm falls back to a loop that
// is far slower than the float32 GEMMs, so the inputs go to float32 as before.
inline bool gemm16_native(at::ScalarType st) {
  static const bool bf16 = at::native::cpublas::could_pack(at::kBFloat16);
  static const bool f16 = at::native::cpublas::could_pack(at::kHalf);
  return st == at::kBFloat16 ? bf16 : st == at::kHalf ? f16 : false;
}

// The row of the additive mask view (mask_view) for (batch b, head h, query i), or null.
template <typename A>
inline const A* mask_row(const at::Tensor& mask, int64_t b, int64_t h, int64_t i) {
  if (!mask.defined()) return nullptr;
  return mask.const_data_ptr<A>() + b * mask.stride(0) + h * mask.stride(1) + i * mask.stride(2);
}

// How many shares of its query blocks each (batch, key/value head) work item gets: 1 when
// the heads alone fill the threads, else enough shares for every thread (their partial
// sums are added at the end).
inline int64_t query_splits(int64_t heads, int64_t nblk) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return heads >= threads ? 1 : std::max<int64_t>(1, std::min(nblk, (threads + heads - 1) / heads));
}

// C (M x N, float, row stride ldc) (+)= A (M x K) . B (K x N), A and B row-major in a 16-bit
// type (row strides lda, ldb): products exact in float32, float32 sums.
// Columns go in chunks of kGemmCols: a (256 x 4096) float32 output tile leaves the L2 cache
// and ran at a third of the rate of (256 x 512) tiles on one core.
constexpr int64_t kGemmCols = 512;

template <typename T>
inline void gemm16(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, float* C,
                   int64_t ldc, bool add) {
  for (int64_t j = 0; j < N; j += kGemmCols) {
    at::native::cpublas::brgemm(M, std::min(kGemmCols, N - j), K, lda, ldb, ldc, add, A, B + j, C + j,
                                /*is_vnni=*/false);
  }
}

// attention_dv for bfloat16 / float16 q, k, dout (checked by the caller). Per block of query
// rows (the group's heads stacked): S = Q K^T from the 16-bit operands (K^T copied once per
// head), the float32 softmax in place, P rounded to T, then dV^T += dO^T P, so that both
// GEMM operands are row-major without transposing P; dV^T is transposed once at the end.
template <typename T>
at::Tensor attention_dv_16(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& dout_in,
                           const at::Tensor& mask, double scaling, std::optional<double> softcap, bool causal) {
  const int64_t B = q_in.size(0), H = q_in.size(1), Lq = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_in.size(1), Lk = k_in.size(2), Dv = dout_in.size(3);
  const at::Tensor q = q_in.contiguous(), dout = dout_in.contiguous();
  const at::Tensor kt = k_in.transpose(2, 3).contiguous();  // (B, Hkv, D, Lk)
  const int64_t G = H / Hkv;
  const bool skip_hidden = causal && at::isfinite(dout).all().item<bool>();
  const int64_t nblk = (Lq + kBlockRows - 1) / kBlockRows;
  const int64_t heads = B * Hkv;
  const int64_t splits = query_splits(heads, nblk);
  const auto fopt = q.options().dtype(at::kFloat);
  at::Tensor dvt = at::zeros({splits, B, Hkv, Dv, Lk}, fopt);  // dV^T, one slab per split
  const std::optional<float> cap = softcap ? std::optional<float>(float(*softcap)) : std::nullopt;
  const T* qd = q.const_data_ptr<T>();
  const T* kd = kt.const_data_ptr<T>();
  const T* dd = dout.const_data_ptr<T>();
  at::parallel_for(0, heads * splits, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // see attention_dv
    std::vector<float> scores(G * kBlockRows * Lk);
    std::vector<T> p16(G * kBlockRows * Lk), qrows(G * kBlockRows * D), dot(Dv * G * kBlockRows);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t bh = it / splits, sp = it % splits;
      const int64_t b = bh / Hkv, hk = bh % Hkv;
      float* target = dvt.data_ptr<float>() + ((sp * B + b) * Hkv + hk) * Dv * Lk;  // (Dv, Lk)
      const T* kth = kd + (b * Hkv + hk) * D * Lk;                                   // (D, Lk)
      for (int64_t blk = sp * nblk / splits; blk < (sp + 1) * nblk / splits; ++blk) {
        const int64_t s = blk * kBlockRows, n = std::min(kBlockRows, Lq - s), rows = G * n;
        const int64_t kend = skip_hidden ? std::min(Lk, s + n) : Lk;
        for (int64_t g = 0; g < G; ++g) {
          const T* src = qd + ((b * H + hk * G + g) * Lq + s) * D;
          std::copy(src, src + n * D, qrows.data() + g * n * D);
          const T* dsrc = dd + ((b * H + hk * G + g) * Lq + s) * Dv;
          for (int64_t i = 0; i < n; ++i)
            for (int64_t c = 0; c < Dv; ++c) dot[c * rows + g * n + i] = dsrc[i * Dv + c];
        }
        gemm16<T>(rows, kend, D, qrows.data(), D, kth, Lk, scores.data(), kend, false);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t g = r / n, i = s + r % n, h = hk * G + g;
          const int64_t limit = causal ? std::min(kend, i + 1) : kend;
          const float* mrow = mask_row<float>(mask, b, h, i);
          const int64_t mstride = mask.defined() ? mask.stride(3) : 0;
          softmax_row16<T>(scores.data() + r * kend, p16.data() + r * kend, kend, limit, float(scaling), cap, mrow,
                           mstride);
        }
        gemm16<T>(Dv, kend, rows, dot.data(), rows, p16.data(), kend, target, Lk, true);
      }
    }
    at::native::cpublas::brgemm_release(/*is_vnni=*/false);
  });
  return dvt.sum(0).transpose(2, 3).contiguous();
}

// attention_backward for bfloat16 / float16 q, k, v, dout (checked by the caller), with the
// GEMMs of attention_dv_16: per block of query rows, S = Q K^T and dP = dO V^T from the
// 16-bit operands, the float32 softmax and dS = P * (dP - rowsum(P * dP)) in place, P and dS
// rounded to T as GEMM operands (as sdpa's CPU flash backward rounds them), then
// dq = s dS K per head, dK^T += s Q^T dS and dV^T += dO^T P (transposed once at the end).
template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_16(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& dout_in,
    const at::Tensor& mask, double scaling, std::optional<double> softcap, bool causal) {
  const int64_t B = q_in.size(0), H = q_in.size(1), Lq = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_in.size(1), Lk = k_in.size(2), Dv = v_in.size(3);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), dout = dout_in.contiguous();
  const at::Tensor kt = k_in.transpose(2, 3).contiguous(), vt = v_in.transpose(2, 3).contiguous();
  const int64_t G = H / Hkv;
  const bool skip_hidden = causal && at::isfinite(dout).all().item<bool>() && at::isfinite(v_in).all().item<bool>();
  const int64_t nblk = (Lq + kBlockRows - 1) / kBlockRows;
  const int64_t heads = B * Hkv;
  const int64_t splits = query_splits(heads, nblk);
  const auto fopt = q.options().dtype(at::kFloat);
  at::Tensor dq = at::empty({B, H, Lq, D}, fopt);
  at::Tensor dkt = at::zeros({splits, B, Hkv, D, Lk}, fopt), dvt = at::zeros({splits, B, Hkv, Dv, Lk}, fopt);
  const std::optional<float> cap = softcap ? std::optional<float>(float(*softcap)) : std::nullopt;
  const float sc = float(scaling);
  const T *qd = q.const_data_ptr<T>(), *kd = k.const_data_ptr<T>(), *ktd = kt.const_data_ptr<T>();
  const T *vtd = vt.const_data_ptr<T>(), *dd = dout.const_data_ptr<T>();
  at::parallel_for(0, heads * splits, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // see attention_dv
    const int64_t cap_rows = G * kBlockRows;
    std::vector<float> scores(cap_rows * Lk), dprob(cap_rows * Lk), tanhs(cap ? cap_rows * Lk : 0);
    std::vector<T> p16(cap_rows * Lk), ds16(cap_rows * Lk), qrows(cap_rows * D), dorows(cap_rows * Dv);
    std::vector<T> qt(D * cap_rows), dot(Dv * cap_rows);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t bh = it / splits, sp = it % splits;
      const int64_t b = bh / Hkv, hk = bh % Hkv;
      float* tk = dkt.data_ptr<float>() + ((sp * B + b) * Hkv + hk) * D * Lk;   // (D, Lk)
      float* tv = dvt.data_ptr<float>() + ((sp * B + b) * Hkv + hk) * Dv * Lk;  // (Dv, Lk)
      const int64_t kv = (b * Hkv + hk) * Lk;
      for (int64_t blk = sp * nblk / splits; blk < (sp + 1) * nblk / splits; ++blk) {
        const int64_t s = blk * kBlockRows, n = std::min(kBlockRows, Lq - s), rows = G * n;
        const int64_t kend = skip_hidden ? std::min(Lk, s + n) : Lk;
        for (int64_t g = 0; g < G; ++g) {
          const T* qs = qd + ((b * H + hk * G + g) * Lq + s) * D;
          const T* ds = dd + ((b * H + hk * G + g) * Lq + s) * Dv;
          std::copy(qs, qs + n * D, qrows.data() + g * n * D);
          std::copy(ds, ds + n * Dv, dorows.data() + g * n * Dv);
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t c = 0; c < D; ++c) qt[c * rows + g * n + i] = qs[i * D + c];
            for (int64_t c = 0; c < Dv; ++c) dot[c * rows + g * n + i] = ds[i * Dv + c];
          }
        }
        gemm16<T>(rows, kend, D, qrows.data(), D, ktd + kv * D, Lk, scores.data(), kend, false);
        gemm16<T>(rows, kend, Dv, dorows.data(), Dv, vtd + kv * Dv, Lk, dprob.data(), kend, false);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t g = r / n, i = s + r % n, h = hk * G + g;
          const int64_t limit = causal ? std::min(kend, i + 1) : kend;
          float* row = scores.data() + r * kend;
          float* trow = cap ? tanhs.data() + r * kend : nullptr;
          if (cap) {
            for (int64_t j = 0; j < kend; ++j) trow[j] = std::tanh(row[j] * sc / *cap);
          }
          const float* mrow = mask_row<float>(mask, b, h, i);
          const int64_t mstride = mask.defined() ? mask.stride(3) : 0;
          softmax_row<float>(row, kend, limit, sc, cap, mrow, mstride);
          score_grad_row<float>(row, dprob.data() + r * kend, trow, kend, sc);
        }
        at::vec::convert(scores.data(), p16.data(), rows * kend);
        at::vec::convert(dprob.data(), ds16.data(), rows * kend);
        for (int64_t g = 0; g < G; ++g) {
          float* dqg = dq.data_ptr<float>() + ((b * H + hk * G + g) * Lq + s) * D;
          gemm16<T>(n, D, kend, ds16.data() + g * n * kend, kend, kd + kv * D, D, dqg, D, false);
        }
        gemm16<T>(D, kend, rows, qt.data(), rows, ds16.data(), kend, tk, Lk, true);
        gemm16<T>(Dv, kend, rows, dot.data(), rows, p16.data(), kend, tv, Lk, true);
      }
    }
    at::native::cpublas::brgemm_release(/*is_vnni=*/false);
  });
  return {dq, dkt.sum(0).transpose(2, 3).contiguous(), dvt.sum(0).transpose(2, 3).contiguous()};
}

}  // namespace

at::Tensor attention_dv(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& dout_in,
                        const std::optional<at::Tensor>& mask_opt, double scaling, std::optional<double> softcap,
                        bool causal) {
  TORCH_CHECK_VALUE(q_in.dim() == 4 && k_in.dim() == 4 && dout_in.dim() == 4,
                    "attention_dv: q, k and dout must be 4-D (batch, heads, seq, head_dim)");
  const int64_t B = q_in.size(0), H = q_in.size(1), Lq = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_in.size(1), Lk = k_in.size(2), Dv = dout_in.size(3);
  TORCH_CHECK_VALUE(k_in.size(0) == B && k_in.size(3) == D && Hkv > 0 && H % Hkv == 0,
                    "attention_dv: k ", k_in.sizes(), " does not fit q ", q_in.sizes());
  TORCH_CHECK_VALUE(dout_in.size(0) == B && dout_in.size(1) == H && dout_in.size(2) == Lq,
                    "attention_dv: dout ", dout_in.sizes(), " does not fit q ", q_in.sizes());
  TORCH_CHECK_VALUE(std::isfinite(scaling), "attention_dv: scaling must be finite");
  TORCH_CHECK_VALUE(!softcap || (std::isfinite(*softcap) && *softcap > 0), "attention_dv: softcap must be > 0");
  TORCH_CHECK_VALUE(k_in.device() == q_in.device() && dout_in.device() == q_in.device(),
                    "attention_dv: q, k and dout must be on one device");
  const at::ScalarType acc = q_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::ScalarType st = q_in.scalar_type();
  if (gemm16_native(st) && k_in.scalar_type() == st && dout_in.scalar_type() == st) {
    const at::Tensor mask16 = mask_view(mask_opt, B, H, Lq, Lk, at::kFloat, "attention_dv");
    if (st == at::kBFloat16) return attention_dv_16<at::BFloat16>(q_in, k_in, dout_in, mask16, scaling, softcap, causal);
    return attention_dv_16<at::Half>(q_in, k_in, dout_in, mask16, scaling, softcap, causal);
  }
  const at::Tensor q = q_in.to(acc).contiguous(), k = k_in.to(acc).contiguous(), dout = dout_in.to(acc).contiguous();
  const at::Tensor mask = mask_view(mask_opt, B, H, Lq, Lk, acc, "attention_dv");
  const int64_t G = H / Hkv;
  // causal: a block of rows skips the keys after its last row (P = 0 there), unless dO
  // has a value that is not finite, which meets those zeros as 0 * inf = NaN
  const bool skip_hidden = causal && at::isfinite(dout).all().item<bool>();
  const int64_t nblk = (Lq + kBlockRows - 1) / kBlockRows;
  const int64_t heads = B * Hkv;
  const int64_t splits = query_splits(heads, nblk);
  at::Tensor dv = at::zeros({B, Hkv, Lk, Dv}, q.options());
  at::Tensor partial = splits > 1 ? at::zeros({splits - 1, B, Hkv, Lk, Dv}, q.options()) : at::Tensor();

  AT_DISPATCH_FLOATING_TYPES(acc, "attention_dv", [&] {
    using A = scalar_t;
    const std::optional<A> cap = softcap ? std::optional<A>(A(*softcap)) : std::nullopt;
    at::parallel_for(0, heads * splits, 1, [&](int64_t begin, int64_t end) {
      // The pool's worker threads do not inherit the caller's autograd state (grad mode
      // is on there, the Autograd keys not excluded): without this guard at::mm_out on
      // tensors that require grad (q, k, v saved by a Function) raises in every thread
      // but the caller's. The kernel is a backward: nothing here is recorded.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      at::Tensor scores = at::empty({G * kBlockRows * Lk}, q.options());
      at::Tensor gathered = G > 1 ? at::empty({G * kBlockRows, Dv}, q.options()) : at::Tensor();
      for (int64_t it = begin; it < end; ++it) {
        const int64_t bh = it / splits, sp = it % splits;
        const int64_t b = bh / Hkv, hk = bh % Hkv;
        at::Tensor target = sp == 0 ? dv[b][hk] : partial[sp - 1][b][hk];  // (Lk, Dv)
        const at::Tensor kmat = k[b][hk];                                      // (Lk, D)
        for (int64_t blk = sp * nblk / splits; blk < (sp + 1) * nblk / splits; ++blk) {
          const int64_t s = blk * kBlockRows, n = std::min(kBlockRows, Lq - s);
          const int64_t kend = skip_hidden ? std::min(Lk, s + n) : Lk;
          at::Tensor S = scores.narrow(0, 0, G * n * kend).view({G * n, kend});
          const at::Tensor kt = kmat.narrow(0, 0, kend).t();
          for (int64_t g = 0; g < G; ++g) {
            at::Tensor Sg = S.narrow(0, g * n, n);
            at::mm_out(Sg, q[b][hk * G + g].narrow(0, s, n), kt);
          }
          A* base = S.data_ptr<A>();
          for (int64_t r = 0; r < G * n; ++r) {
            const int64_t g = r / n, i = s + r % n, h = hk * G + g;
            const int64_t limit = causal ? std::min(kend, i + 1) : kend;
            const A* mrow = mask_row<A>(mask, b, h, i);
            const int64_t mstride = mask.defined() ? mask.stride(3) : 0;
            softmax_row<A>(base + r * kend, kend, limit, A(scaling), cap, mrow, mstride);
          }
          at::Tensor dO;
          if (G == 1) {
            dO = dout[b][hk].narrow(0, s, n);
          } else {
            dO = gathered.narrow(0, 0, G * n);
            for (int64_t g = 0; g < G; ++g) dO.narrow(0, g * n, n).copy_(dout[b][hk * G + g].narrow(0, s, n));
          }
          at::Tensor t = target.narrow(0, 0, kend);
          t.addmm_(S.t(), dO);
        }
      }
    });
  });
  if (splits > 1) dv.add_(partial.sum(0));
  return dv;
}


// AttnLRP's attention core: the full gradient (dq, dk, dv) of softmax attention, P recomputed
// per block of query rows as above; dP = dO V^T, dS = P * (dP - rowsum(P * dP)) [* (1 - tanh^2)
// under a softcap], dq = s * dS K, dk += s * dS^T Q, dv += P^T dO. The row sums come from
// the full rows of the block, so no forward output or statistic is saved.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& dout_in,
    const std::optional<at::Tensor>& mask_opt, double scaling, std::optional<double> softcap, bool causal) {
  TORCH_CHECK_VALUE(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4 && dout_in.dim() == 4,
                    "attention_backward: q, k, v and dout must be 4-D (batch, heads, seq, head_dim)");
  const int64_t B = q_in.size(0), H = q_in.size(1), Lq = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_in.size(1), Lk = k_in.size(2), Dv = v_in.size(3);
  TORCH_CHECK_VALUE(k_in.size(0) == B && k_in.size(3) == D && Hkv > 0 && H % Hkv == 0,
                    "attention_backward: k ", k_in.sizes(), " does not fit q ", q_in.sizes());
  TORCH_CHECK_VALUE(v_in.size(0) == B && v_in.size(1) == Hkv && v_in.size(2) == Lk,
                    "attention_backward: v ", v_in.sizes(), " does not fit k ", k_in.sizes());
  TORCH_CHECK_VALUE(dout_in.size(0) == B && dout_in.size(1) == H && dout_in.size(2) == Lq && dout_in.size(3) == Dv,
                    "attention_backward: dout ", dout_in.sizes(), " does not fit q ", q_in.sizes(), " and v ",
                    v_in.sizes());
  TORCH_CHECK_VALUE(std::isfinite(scaling), "attention_backward: scaling must be finite");
  TORCH_CHECK_VALUE(!softcap || (std::isfinite(*softcap) && *softcap > 0), "attention_backward: softcap must be > 0");
  TORCH_CHECK_VALUE(k_in.device() == q_in.device() && v_in.device() == q_in.device() &&
                        dout_in.device() == q_in.device(),
                    "attention_backward: q, k, v and dout must be on one device");
  const at::ScalarType acc = q_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::ScalarType st = q_in.scalar_type();
  if (gemm16_native(st) && k_in.scalar_type() == st && v_in.scalar_type() == st &&
      dout_in.scalar_type() == st) {
    const at::Tensor mask16 = mask_view(mask_opt, B, H, Lq, Lk, at::kFloat, "attention_backward");
    if (st == at::kBFloat16) {
      return attention_backward_16<at::BFloat16>(q_in, k_in, v_in, dout_in, mask16, scaling, softcap, causal);
    }
    return attention_backward_16<at::Half>(q_in, k_in, v_in, dout_in, mask16, scaling, softcap, causal);
  }
  const at::Tensor q = q_in.to(acc).contiguous(), k = k_in.to(acc).contiguous(), v = v_in.to(acc).contiguous();
  const at::Tensor dout = dout_in.to(acc).contiguous();
  const at::Tensor mask = mask_view(mask_opt, B, H, Lq, Lk, acc, "attention_backward");
  const int64_t G = H / Hkv;
  const bool skip_hidden = causal && at::isfinite(dout).all().item<bool>() && at::isfinite(v).all().item<bool>();
  const int64_t nblk = (Lq + kBlockRows - 1) / kBlockRows;
  const int64_t heads = B * Hkv;
  const int64_t splits = query_splits(heads, nblk);
  at::Tensor dq = at::empty({B, H, Lq, D}, q.options());
  at::Tensor dk = at::zeros({B, Hkv, Lk, D}, q.options());
  at::Tensor dv = at::zeros({B, Hkv, Lk, Dv}, q.options());
  at::Tensor pk = splits > 1 ? at::zeros({splits - 1, B, Hkv, Lk, D}, q.options()) : at::Tensor();
  at::Tensor pv = splits > 1 ? at::zeros({splits - 1, B, Hkv, Lk, Dv}, q.options()) : at::Tensor();

  AT_DISPATCH_FLOATING_TYPES(acc, "attention_backward", [&] {
    using A = scalar_t;
    const std::optional<A> cap = softcap ? std::optional<A>(A(*softcap)) : std::nullopt;
    at::parallel_for(0, heads * splits, 1, [&](int64_t begin, int64_t end) {
      // The pool's worker threads do not inherit the caller's autograd state (grad mode
      // is on there, the Autograd keys not excluded): without this guard at::mm_out on
      // tensors that require grad (q, k, v saved by a Function) raises in every thread
      // but the caller's. The kernel is a backward: nothing here is recorded.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      at::Tensor scores = at::empty({G * kBlockRows * Lk}, q.options());
      at::Tensor dprob = at::empty({G * kBlockRows * Lk}, q.options());
      at::Tensor tanhs = cap ? at::empty({G * kBlockRows * Lk}, q.options()) : at::Tensor();
      at::Tensor qrows = G > 1 ? at::empty({G * kBlockRows, D}, q.options()) : at::Tensor();
      at::Tensor dorows = G > 1 ? at::empty({G * kBlockRows, Dv}, q.options()) : at::Tensor();
      for (int64_t it = begin; it < end; ++it) {
        const int64_t bh = it / splits, sp = it % splits;
        const int64_t b = bh / Hkv, hk = bh % Hkv;
        at::Tensor tk = sp == 0 ? dk[b][hk] : pk[sp - 1][b][hk];  // (Lk, D)
        at::Tensor tv = sp == 0 ? dv[b][hk] : pv[sp - 1][b][hk];  // (Lk, Dv)
        const at::Tensor kmat = k[b][hk], vmat = v[b][hk];
        for (int64_t blk = sp * nblk / splits; blk < (sp + 1) * nblk / splits; ++blk) {
          const int64_t s = blk * kBlockRows, n = std::min(kBlockRows, Lq - s);
          const int64_t kend = skip_hidden ? std::min(Lk, s + n) : Lk;
          at::Tensor S = scores.narrow(0, 0, G * n * kend).view({G * n, kend});
          at::Tensor dP = dprob.narrow(0, 0, G * n * kend).view({G * n, kend});
          const at::Tensor kk = kmat.narrow(0, 0, kend), vv = vmat.narrow(0, 0, kend);
          for (int64_t g = 0; g < G; ++g) {
            at::Tensor Sg = S.narrow(0, g * n, n), dPg = dP.narrow(0, g * n, n);
            at::mm_out(Sg, q[b][hk * G + g].narrow(0, s, n), kk.t());
            at::mm_out(dPg, dout[b][hk * G + g].narrow(0, s, n), vv.t());
          }
          A* base = S.data_ptr<A>();
          A* dbase = dP.data_ptr<A>();
          A* tbase = cap ? tanhs.data_ptr<A>() : nullptr;
          for (int64_t r = 0; r < G * n; ++r) {
            const int64_t g = r / n, i = s + r % n, h = hk * G + g;
            const int64_t limit = causal ? std::min(kend, i + 1) : kend;
            A* row = base + r * kend;
            if (cap) {
              for (int64_t j = 0; j < kend; ++j) tbase[r * kend + j] = std::tanh(row[j] * A(scaling) / *cap);
            }
            const A* mrow = mask_row<A>(mask, b, h, i);
            const int64_t mstride = mask.defined() ? mask.stride(3) : 0;
            softmax_row<A>(row, kend, limit, A(scaling), cap, mrow, mstride);
            score_grad_row<A>(row, dbase + r * kend, cap ? tbase + r * kend : nullptr, kend, A(scaling));
          }
          at::Tensor Q, dO;
          if (G == 1) {
            Q = q[b][hk].narrow(0, s, n);
            dO = dout[b][hk].narrow(0, s, n);
          } else {
            Q = qrows.narrow(0, 0, G * n);
            dO = dorows.narrow(0, 0, G * n);
            for (int64_t g = 0; g < G; ++g) {
              Q.narrow(0, g * n, n).copy_(q[b][hk * G + g].narrow(0, s, n));
              dO.narrow(0, g * n, n).copy_(dout[b][hk * G + g].narrow(0, s, n));
            }
          }
          for (int64_t g = 0; g < G; ++g) {
            at::Tensor dqg = dq[b][hk * G + g].narrow(0, s, n);
            at::mm_out(dqg, dP.narrow(0, g * n, n), kk);
          }
          tk.narrow(0, 0, kend).addmm_(dP.t(), Q);
          tv.narrow(0, 0, kend).addmm_(S.t(), dO);
        }
      }
    });
  });
  if (splits > 1) {
    dk.add_(pk.sum(0));
    dv.add_(pv.sum(0));
  }
  return {dq, dk, dv};
}

}  // namespace cpu
PYATTR_END
