// What the CPU kernels and their shared headers need from torch, in the two builds:
//   pyattr._C         (default)            ATen's C++ API, built for one torch version;
//   pyattr._C_stable  (PYATTR_STABLE_ABI)  torch's stable ABI (torch/csrc/stable): built
//                     once, it loads under every torch from the target version on
//                     (PYATTR_STABLE_ABI holds that version, e.g. 0x020a000000000000 for 2.10).
// The kernels read and write raw pointers in either build; only the checks, the dtype
// switch, allocation, copies to contiguous buffers and the thread pool differ, and those
// are spelled here once.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

// PYATTR_CAP: the CPU code path (instruction set) a translation unit is compiled for.
// pyattr._C_stable links one copy of the kernels per path (default, avx2, avx512) and
// picks one at load; each copy lives in its own inline namespace, so that the linker can
// never hand an inline function compiled for a wider instruction set to a narrower copy.
#ifndef PYATTR_CAP
#define PYATTR_CAP native
#endif
#define PYATTR_BEGIN \
  namespace pyattr { \
  inline namespace PYATTR_CAP {
#define PYATTR_END \
  }                \
  }

#ifdef PYATTR_STABLE_ABI
#include <torch/headeronly/util/Exception.h>
// std::runtime_error (RuntimeError in Python): the stable ABI carries no error types; the
// Python layer raises the typed errors before any kernel runs
#define PYATTR_CHECK_VALUE(cond, ...) STD_TORCH_CHECK(cond, __VA_ARGS__)
#define PYATTR_CHECK_TYPE(cond, ...) STD_TORCH_CHECK(cond, __VA_ARGS__)
#else
#include <c10/util/Exception.h>
#define PYATTR_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)
#define PYATTR_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, __VA_ARGS__)
#endif
