// The tensor operations of the CPU kernels' entry points, for both builds (see
// ../portable.h): pyattr._C over ATen, pyattr._C_stable over torch's stable ABI.
#pragma once

#include <optional>
#include <vector>

#include "../portable.h"

#ifdef PYATTR_STABLE_ABI
// at::vec and the 16-bit types are header code compiled into the library (no libtorch
// symbol of them is used, which the CI checks on the built library); torch refuses those
// headers once TORCH_TARGET_VERSION is set, so they come first
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#define TORCH_TARGET_VERSION PYATTR_STABLE_ABI
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <string_view>
#else
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: each translation unit parsed ~40% faster
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/string_view.h>
#endif

PYATTR_BEGIN
namespace api {

#ifdef PYATTR_STABLE_ABI
using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;
using StrArg = std::string_view;

inline Tensor contiguous(const Tensor& t) { return torch::stable::contiguous(t); }
inline Tensor to(const Tensor& t, ScalarType dtype) {
  return t.scalar_type() == dtype ? t : torch::stable::to(t, dtype);
}
// uninitialised, contiguous, with t's shape (dtype: t's unless given)
inline Tensor empty_like(const Tensor& t) { return torch::stable::new_empty(t, t.sizes()); }
inline Tensor empty(const std::vector<int64_t>& sizes, const Tensor& like, ScalarType dtype) {
  return torch::stable::new_empty(like, sizes, dtype);
}
inline void zero_(Tensor& t) { torch::stable::zero_(t); }
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  torch::stable::parallel_for(begin, end, grain, f);
}
inline int64_t num_threads() { return static_cast<int64_t>(torch::stable::get_num_threads()); }
inline std::string shape(const Tensor& t) {
  std::ostringstream s;
  s << "[";
  for (int64_t i = 0; i < t.dim(); ++i) s << (i ? ", " : "") << t.size(i);
  s << "]";
  return s.str();
}
#else
using Tensor = at::Tensor;
using ScalarType = at::ScalarType;
using StrArg = c10::string_view;

inline Tensor contiguous(const Tensor& t) { return t.contiguous(); }
inline Tensor to(const Tensor& t, ScalarType dtype) { return t.to(dtype); }
inline Tensor empty_like(const Tensor& t) { return at::empty_like(t, at::MemoryFormat::Contiguous); }
inline Tensor empty(const std::vector<int64_t>& sizes, const Tensor& like, ScalarType dtype) {
  return at::empty(sizes, like.options().dtype(dtype));
}
inline void zero_(Tensor& t) { t.zero_(); }
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}
inline int64_t num_threads() { return at::get_num_threads(); }
inline std::string shape(const Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}
#endif

inline bool same_shape(const Tensor& a, const Tensor& b) {
  if (a.dim() != b.dim()) return false;
  for (int64_t i = 0; i < a.dim(); ++i) {
    if (a.size(i) != b.size(i)) return false;
  }
  return true;
}
inline bool defined(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

template <typename T>
constexpr ScalarType scalar_type_of() {
  if constexpr (std::is_same_v<T, double>) return ScalarType::Double;
  else return ScalarType::Float;  // the accumulation types are float32 and float64
}

}  // namespace api
PYATTR_END

// body() with `scalar_t` bound to the C++ type of `dtype` (float64, float32, float16,
// bfloat16), as ATen's AT_DISPATCH_FLOATING_TYPES_AND2 does in pyattr._C.
#define PYATTR_DISPATCH_FLOATING(dtype, name, ...)                                        \
  [&] {                                                                                   \
    switch (dtype) {                                                                      \
      case ::pyattr::api::ScalarType::Double: {                                           \
        using scalar_t = double;                                                          \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      case ::pyattr::api::ScalarType::Float: {                                            \
        using scalar_t = float;                                                           \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      case ::pyattr::api::ScalarType::Half: {                                             \
        using scalar_t = c10::Half;                                                       \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      case ::pyattr::api::ScalarType::BFloat16: {                                         \
        using scalar_t = c10::BFloat16;                                                   \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      default:                                                                            \
        PYATTR_CHECK_TYPE(false, name, ": expected a floating dtype (float64, float32, "  \
                          "float16 or bfloat16)");                                        \
    }                                                                                     \
  }()
