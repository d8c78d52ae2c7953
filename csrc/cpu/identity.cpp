// Identity-rule backward on CPU: dx = dy * phi(x), float32 accumulation.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "kernels.h"

#include "activation_vec.h"

PYATTR_BEGIN
namespace cpu {

namespace {

// torch.set_flush_denormal(True) sets FTZ and DAZ in the calling thread's MXCSR: float
// arithmetic then reads and writes subnormals as zero, which the bit-pattern path below
// would not do.
inline bool denormals_flushed() {
#if defined(__x86_64__) || defined(_M_X64)
  return (_mm_getcsr() & 0x8040) != 0;
#else
  return false;
#endif
}

// ReLU's phi is 1[x > 0] (NaN for a NaN x), so in a 16-bit type dx = dy * phi takes no
// arithmetic: dy where x > 0; dy * 0 where x <= 0, a zero with dy's sign (NaN for an
// infinite or NaN dy); NaN where x is NaN. That is the float32 product rounded back, bit
// for bit (NaN payloads aside). It works on the bit patterns, a whole register of 16-bit
// lanes at a time: the conversions to float32 and back were what bounded this kernel.
template <typename T>
void relu_rule_16bit(const T* x, const T* dy, T* dx, int64_t n) {
  using I = Vectorized<int16_t>;
  constexpr bool kBF16 = std::is_same_v<T, c10::BFloat16>;
  const I inf(int16_t(kBF16 ? 0x7F80 : 0x7C00)), nan(int16_t(kBF16 ? 0x7FC0 : 0x7E00));
  const I magnitude(int16_t(0x7FFF)), sign(int16_t(-0x8000)), zero(int16_t(0));
  auto rule = [&](const I& xv, const I& dv) {
    const I x_pos = (xv > zero) & (xv <= inf);  // signed: sign bit clear, not +0, not NaN
    const I x_nan = (xv & magnitude) > inf;
    const I d_nonfinite = (dv & magnitude) >= inf;
    const I times_zero = I::blendv(dv & sign, nan, d_nonfinite);
    return I::blendv(I::blendv(times_zero, dv, x_pos), nan, x_nan);
  };
  const auto* X = reinterpret_cast<const int16_t*>(x);
  const auto* DY = reinterpret_cast<const int16_t*>(dy);
  auto* DX = reinterpret_cast<int16_t*>(dx);
  constexpr int64_t W = I::size();
  api::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + W <= end; i += W) rule(I::loadu(X + i), I::loadu(DY + i)).store(DX + i);
    if (i < end) {  // the same code on a zero-padded copy
      int16_t bx[W] = {}, bd[W] = {}, bo[W];
      std::copy(X + i, X + end, bx);
      std::copy(DY + i, DY + end, bd);
      rule(I::loadu(bx), I::loadu(bd)).store(bo);
      std::copy(bo, bo + (end - i), DX + i);
    }
  });
}

}  // namespace

api::Tensor identity_backward(const api::Tensor& x_in, const api::Tensor& dy_in, api::StrArg act_name) {
  PYATTR_CHECK_VALUE(api::same_shape(x_in, dy_in), "dy must have the shape of x");
  const Act act = parse_act(std::string(act_name));
  // Strided inputs are copied once to contiguous buffers; contiguous ones are used as is.
  api::Tensor x = api::contiguous(x_in);
  api::Tensor dy = api::contiguous(api::to(dy_in, x.scalar_type()));
  api::Tensor dx = api::empty_like(x);
  PYATTR_DISPATCH_FLOATING(x.scalar_type(), "identity_backward", [&] {
    using T = scalar_t;
    with_act(act, [&](auto c) {
      constexpr Act K = decltype(c)::value;
      if constexpr (K == Act::ReLU && (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>)) {
        if (!denormals_flushed()) {  // else the float path, which flushes as the other backends do
          relu_rule_16bit<T>(x.const_data_ptr<T>(), dy.const_data_ptr<T>(), dx.mutable_data_ptr<T>(), x.numel());
          return;
        }
      }
      elementwise<T, 2, 1>(
          {x.const_data_ptr<T>(), dy.const_data_ptr<T>()}, {dx.mutable_data_ptr<T>()}, x.numel(),
          [](const std::array<AccVec<T>, 2>& a) { return std::array<AccVec<T>, 1>{a[1] * phi_vec(K, a[0])}; });
    });
  });
  return dx;
}


}  // namespace cpu
PYATTR_END
