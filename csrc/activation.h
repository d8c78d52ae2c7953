// Activation kinds and their Identity-rule factor phi(x) = act(x)/x, in closed form.
// Shared by the CPU and CUDA sources; the math follows DESIGN.md section 2.
#pragma once

#include <cmath>
#include <math.h>
#include <cstdint>
#include <string>

#include "portable.h"

#if defined(__CUDACC__)
#define PYATTR_HD __host__ __device__ __forceinline__
#else
#define PYATTR_HD inline
#endif

PYATTR_BEGIN

enum class Act : int { SiLU = 0, GELU = 1, GELUTanh = 2, QuickGELU = 3, ReLU = 4 };

inline Act parse_act(const std::string& name) {
  if (name == "silu") return Act::SiLU;
  if (name == "gelu") return Act::GELU;
  if (name == "gelu_tanh") return Act::GELUTanh;
  if (name == "quick_gelu") return Act::QuickGELU;
  if (name == "relu") return Act::ReLU;
  PYATTR_CHECK_VALUE(false, "act: unknown activation '", name,
                    "'; expected silu, gelu, gelu_tanh, quick_gelu or relu");
}

constexpr double kSqrt2OverPi = 0.79788456080286535587989211986876;
constexpr double kInvSqrt2 = 0.70710678118654752440084436210485;
constexpr double kQuickGeluAlpha = 1.702;
constexpr double kGeluTanhCoef = 0.044715;
constexpr double kInvSqrt2Pi = 0.39894228040143267793994605993438;
// act'(x) of SiLU, GELU and QuickGELU is exactly 1 (x > 0) or +-0 (x < 0) in float and
// double beyond this |x|; the derivatives clamp x to it, so that +-inf give the limits
// (1 and 0) instead of inf * 0 = NaN (pyattr/activations.py, derivative).
constexpr double kDerivativeSaturated = 1.0e4;

// float and double overloads that exist in host and device code alike
PYATTR_HD float exp_(float x) { return ::expf(x); }
PYATTR_HD double exp_(double x) { return ::exp(x); }
PYATTR_HD float erf_(float x) { return ::erff(x); }
PYATTR_HD double erf_(double x) { return ::erf(x); }
PYATTR_HD float tanh_(float x) { return ::tanhf(x); }
PYATTR_HD double tanh_(double x) { return ::tanh(x); }

template <typename T>
PYATTR_HD T sigmoid_(T x) {
  return T(1) / (T(1) + exp_(-x));
}

// phi(x) = act(x) / x without a division; phi(NaN) = NaN for every kind.
template <typename T>
PYATTR_HD T phi_scalar(Act a, T x) {
  switch (a) {
    case Act::SiLU:
      return sigmoid_(x);
    case Act::GELU:
      return T(0.5) * (T(1) + erf_(x * T(kInvSqrt2)));
    case Act::GELUTanh:
      return T(0.5) * (T(1) + tanh_(T(kSqrt2OverPi) * (x + T(kGeluTanhCoef) * x * x * x)));
    case Act::QuickGELU:
      return sigmoid_(T(kQuickGeluAlpha) * x);
    case Act::ReLU:
    default:
      return x != x ? x : (x > T(0) ? T(1) : T(0));
  }
}

// act(x) in the accumulation type: x * phi(x); ReLU is relu itself (NaN stays NaN,
// relu(-0) = -0, as torch.relu gives).
template <typename T>
PYATTR_HD T act_scalar(Act a, T x) {
  if (a == Act::ReLU) return x < T(0) ? T(0) : x;
  return x * phi_scalar(a, x);
}

// act'(x), the ordinary derivative (used when the Identity-rule is switched off); the
// limits 1 and 0 at +-inf.
template <typename T>
PYATTR_HD T dact_scalar(Act a, T x) {
  if (a == Act::SiLU || a == Act::GELU || a == Act::QuickGELU) {
    const T lim = T(kDerivativeSaturated);
    x = x != x ? x : (x < -lim ? -lim : (x > lim ? lim : x));
  }
  switch (a) {
    case Act::SiLU: {
      T s = sigmoid_(x);
      return s * (T(1) + x * (T(1) - s));
    }
    case Act::GELU:
      return T(0.5) * (T(1) + erf_(x * T(kInvSqrt2))) + x * T(kInvSqrt2Pi) * exp_(T(-0.5) * x * x);
    case Act::GELUTanh: {
      // saturated beyond |x| = 10 (derivative 0 or 1 in float32); the clamp keeps
      // x^2 from overflowing into inf * 0
      T xc = x != x ? x : (x < T(-10) ? T(-10) : (x > T(10) ? T(10) : x));
      T t = tanh_(T(kSqrt2OverPi) * (xc + T(kGeluTanhCoef) * xc * xc * xc));
      T dinner = T(kSqrt2OverPi) * (T(1) + T(3 * kGeluTanhCoef) * xc * xc);
      return T(0.5) * (T(1) + t) + T(0.5) * xc * (T(1) - t * t) * dinner;
    }
    case Act::QuickGELU: {
      T s = sigmoid_(T(kQuickGeluAlpha) * x);
      return s + T(kQuickGeluAlpha) * (x * (s * (T(1) - s)));
    }
    case Act::ReLU:
    default:
      return x != x ? x : (x > T(0) ? T(1) : T(0));
  }
}

PYATTR_END
