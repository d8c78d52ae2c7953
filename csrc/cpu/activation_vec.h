// Vectorised phi(x), act(x) and act'(x) for the CPU kernels (same math as activation.h).
#pragma once

#include "../activation.h"
#include "vec_utils.h"

PYATTR_BEGIN
namespace cpu {

// Calls f(std::integral_constant<Act, a>{}): the activation becomes a compile-time constant
// inside f, so the switch in phi_vec / act_vec / dact_vec folds away in the vector loop.
template <typename F>
inline void with_act(Act a, F&& f) {
  switch (a) {
    case Act::SiLU: f(std::integral_constant<Act, Act::SiLU>{}); break;
    case Act::GELU: f(std::integral_constant<Act, Act::GELU>{}); break;
    case Act::GELUTanh: f(std::integral_constant<Act, Act::GELUTanh>{}); break;
    case Act::QuickGELU: f(std::integral_constant<Act, Act::QuickGELU>{}); break;
    case Act::ReLU:
    default: f(std::integral_constant<Act, Act::ReLU>{}); break;
  }
}

template <typename V>
inline V sigmoid_vec(const V& x) {
  const V one(1);
  if constexpr (std::is_same_v<typename V::value_type, float>) {
    // exp_u20: at::vec's polynomial exp (no Sleef call), within 20 ulp. It clamps its
    // argument, so NaN and the far negative tail (sigmoid < 3e-39) are set explicitly.
    V s = one / (one + x.neg().exp_u20());
    s = V::blendv(s, V(0), x < V(-88.0f));
    return V::blendv(s, x, x != x);
  } else {
    return one / (one + x.neg().exp());
  }
}

// Phi(x) = (1 + erf(x/sqrt2))/2.
//
// double: at::vec's erf, a polynomial that turns +-inf into NaN, so the argument is
// clamped where erf has long saturated (maximum/minimum keep NaN).
//
// float: erfc(|z|) = t P(t) exp(-z^2), t = 1/(1 + p|z|), the polynomial at::vec's erf uses
// (Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7), with exp_u20 inlined instead of a Sleef
// call per vector (the call and its register spills made the kernel slower than
// PyTorch's own GELU backward); then Phi = erfc(|z|)/2 for z < 0 and 1 - erfc(|z|)/2
// otherwise, so the negative tail is not the difference of two numbers near 1.
template <typename V>
inline V gelu_cdf_vec(const V& x) {
  using S = typename V::value_type;
  if constexpr (std::is_same_v<S, float>) {
    // no clamp: exp_u20 is exactly 0 below ln(FLT_MIN), so +-inf give 1 and 0
    const V z = x * V(S(kInvSqrt2));
    const V a = z.abs();
    const V t = V(1.0f) / at::vec::fmadd(V(0.3275911f), a, V(1.0f));
    V poly = at::vec::fmadd(V(1.061405429f), t, V(-1.453152027f));
    poly = at::vec::fmadd(poly, t, V(1.421413741f));
    poly = at::vec::fmadd(poly, t, V(-0.284496736f));
    poly = at::vec::fmadd(poly, t, V(0.254829592f));
    const V half_erfc = V(0.5f) * (poly * t * (a * a).neg().exp_u20());
    const V phi = V::blendv(V(1.0f) - half_erfc, half_erfc, z < V(0.0f));
    return V::blendv(phi, x, x != x);  // NaN stays NaN
  } else {
    V xc = at::vec::minimum(at::vec::maximum(x, V(S(-10))), V(S(10)));
    return V(S(0.5)) * (V(S(1)) + (xc * V(S(kInvSqrt2))).erf());
  }
}

template <typename V>
inline V phi_vec(Act a, const V& x) {
  using S = typename V::value_type;
  const V one(1), half(0.5);
  switch (a) {
    case Act::SiLU:
      return sigmoid_vec(x);
    case Act::GELU:
      return gelu_cdf_vec(x);
    case Act::GELUTanh:
      return half * (one + (V(S(kSqrt2OverPi)) * (x + V(S(kGeluTanhCoef)) * x * x * x)).tanh());
    case Act::QuickGELU:
      return sigmoid_vec(V(S(kQuickGeluAlpha)) * x);
    case Act::ReLU:
    default: {
      V step = V::blendv(V(0), one, x > V(0));
      return V::blendv(step, x, x != x);  // NaN stays NaN
    }
  }
}

// act(x) = x * phi(x); ReLU is relu itself: 0 where x < 0, x elsewhere (NaN stays NaN and
// relu(-0) = -0, as torch.relu gives).
template <typename V>
inline V act_vec(Act a, const V& x) {
  if (a == Act::ReLU) return V::blendv(x, V(0), x < V(0));
  return x * phi_vec(a, x);
}

// x clamped to +-kDerivativeSaturated (NaN kept): act'(x) is exactly 1 or +-0 beyond it.
template <typename V>
inline V saturate_vec(const V& x) {
  using S = typename V::value_type;
  return at::vec::minimum(at::vec::maximum(x, V(S(-kDerivativeSaturated))), V(S(kDerivativeSaturated)));
}

template <typename V>
inline V dact_vec(Act a, const V& x_in) {
  using S = typename V::value_type;
  const V one(1), half(0.5);
  // SiLU, GELU and QuickGELU take their limits at +-inf (1 and 0), never inf * 0
  const V x = a == Act::SiLU || a == Act::GELU || a == Act::QuickGELU ? saturate_vec(x_in) : x_in;
  switch (a) {
    case Act::SiLU: {
      V s = sigmoid_vec(x);
      return s * (one + x * (one - s));
    }
    case Act::GELU:
      return gelu_cdf_vec(x) + x * V(S(kInvSqrt2Pi)) * (V(S(-0.5)) * x * x).exp();
    case Act::GELUTanh: {
      V xc = at::vec::minimum(at::vec::maximum(x, V(S(-10))), V(S(10)));
      V t = (V(S(kSqrt2OverPi)) * (xc + V(S(kGeluTanhCoef)) * xc * xc * xc)).tanh();
      V dinner = V(S(kSqrt2OverPi)) * (one + V(S(3 * kGeluTanhCoef)) * xc * xc);
      return half * (one + t) + half * xc * (one - t * t) * dinner;
    }
    case Act::QuickGELU: {
      V s = sigmoid_vec(V(S(kQuickGeluAlpha)) * x);
      return s + V(S(kQuickGeluAlpha)) * (x * (s * (one - s)));
    }
    case Act::ReLU:
    default:
      return phi_vec(a, x);
  }
}

}  // namespace cpu
PYATTR_END
