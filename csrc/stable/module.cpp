// pyattr._C_stable: the CPU kernels of the LN-, Identity- and Half-rules over torch's
// stable ABI (torch/csrc/stable), built once and loaded by every torch from the target
// version in PYATTR_STABLE_ABI on, so that a wheel needs no compiler on the user's
// machine. It registers the same torch.ops.pyattr schemas as pyattr._C (csrc/schemas.h)
// but for the attention ops, which run their GEMMs through ATen; the two libraries are
// never loaded into one process (pyattr.backends.extension picks one).
//
// The kernels are linked three times, once per CPU code path (csrc/portable.h, PYATTR_CAP:
// portable x86-64, AVX2 + FMA, AVX-512), and the widest one the CPU runs is picked when the
// library loads (PYATTR_CPU_CAPABILITY=AVX2 or DEFAULT caps it, as for the source build).
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#include <cstdlib>
#include <cstring>

#include "../cpu/api.h"
#include "../schemas.h"

#include <torch/csrc/stable/library.h>

// The entry points of the three copies (csrc/cpu/kernels.h, declared per namespace).
#undef PYATTR_CAP
#define PYATTR_CAP cap_default
#include "../cpu/kernel_decls.inc"
#undef PYATTR_CAP
#define PYATTR_CAP cap_avx2
#include "../cpu/kernel_decls.inc"
#undef PYATTR_CAP
#define PYATTR_CAP cap_avx512
#include "../cpu/kernel_decls.inc"

namespace {

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// 2: AVX-512, 1: AVX2, 0: portable; decided once, when the library loads
int choose_level() {
  const char* cap = std::getenv("PYATTR_CPU_CAPABILITY");
  int most = 2;
  if (cap != nullptr && (std::strcmp(cap, "AVX2") == 0 || std::strcmp(cap, "avx2") == 0)) most = 1;
  if (cap != nullptr && (std::strcmp(cap, "DEFAULT") == 0 || std::strcmp(cap, "default") == 0)) most = 0;
  if (most >= 2 && cpu_has_avx512()) return 2;
  if (most >= 1 && cpu_has_avx2()) return 1;
  return 0;
}

const int kLevel = choose_level();
const char* const kLevelNames[] = {"DEFAULT", "AVX2", "AVX512"};

// Pick<F0, F1, F2>::call forwards to the copy for the CPU's code path.
template <auto F0, auto F1, auto F2>
struct Pick;

template <typename R, typename... A, R (*F0)(A...), R (*F1)(A...), R (*F2)(A...)>
struct Pick<F0, F1, F2> {
  static R call(A... args) {
    switch (kLevel) {
      case 2: return F2(args...);
      case 1: return F1(args...);
      default: return F0(args...);
    }
  }
};

}  // namespace

STABLE_TORCH_LIBRARY(pyattr, m) {
#define PYATTR_DEF(name, schema) m.def(schema);
  PYATTR_KERNEL_SCHEMAS(PYATTR_DEF)
#undef PYATTR_DEF
}

STABLE_TORCH_LIBRARY_IMPL(pyattr, CPU, m) {
#define PYATTR_IMPL(name, schema)                                                                 \
  m.impl(#name, TORCH_BOX((&Pick<&pyattr::cap_default::cpu::name, &pyattr::cap_avx2::cpu::name, \
                                 &pyattr::cap_avx512::cpu::name>::call)));
  PYATTR_KERNEL_SCHEMAS(PYATTR_IMPL)
#undef PYATTR_IMPL
}

static PyModuleDef pyattr_stable_module = {PyModuleDef_HEAD_INIT, "_C_stable",
                                           "pyattr CPU kernels over torch's stable ABI", -1, nullptr};

PyMODINIT_FUNC PyInit__C_stable(void) {
  PyObject* mod = PyModule_Create(&pyattr_stable_module);
  if (mod == nullptr) return nullptr;
  if (PyModule_AddIntConstant(mod, "WITH_CUDA", 0) < 0 ||
      PyModule_AddStringConstant(mod, "CPU_CAPABILITY", kLevelNames[kLevel]) < 0 ||
      PyModule_AddIntConstant(mod, "TORCH_TARGET_MAJOR", (PYATTR_STABLE_ABI >> 56) & 0xff) < 0 ||
      PyModule_AddIntConstant(mod, "TORCH_TARGET_MINOR", (PYATTR_STABLE_ABI >> 48) & 0xff) < 0) {
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
