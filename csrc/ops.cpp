// Operator schemas of pyattr._C, the CPU kernels' registrations and the Python module init.
// The CPU kernels (csrc/cpu/*.cpp, one file per rule family) register here, so that only this
// file parses torch/library.h (see csrc/cpu/kernels.h); the CUDA kernels register in
// csrc/cuda/*.cu.
#include <Python.h>
#include <torch/library.h>

#include "cpu/kernels.h"
#include "schemas.h"

TORCH_LIBRARY(pyattr, m) {
#define PYATTR_DEF(name, schema) m.def(schema);
  PYATTR_KERNEL_SCHEMAS(PYATTR_DEF)
  PYATTR_ATTENTION_SCHEMAS(PYATTR_DEF)
#undef PYATTR_DEF
}

namespace pyattr {
PyObject* layer_norm_rule_py(PyObject* self, PyObject* args);  // csrc/layer_norm_rule.cpp
PyObject* identity_rule_py(PyObject* self, PyObject* args);    // csrc/identity_rule.cpp
}

static PyMethodDef pyattr_methods[] = {
    {"layer_norm_rule", pyattr::layer_norm_rule_py, METH_VARARGS,
     "layer_norm_rule(x, weight, bias, eps) -> Tensor: LayerNorm with the LN-rule backward as a C++ "
     "autograd Function (arguments checked by pyattr.ops.layer_norm)."},
    {"identity_rule", pyattr::identity_rule_py, METH_VARARGS,
     "identity_rule(x, kind) -> Tensor: silu / gelu / gelu_tanh / relu with the Identity-rule backward as a C++ "
     "autograd Function (arguments checked by pyattr.rules.identity)."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef pyattr_module = {PyModuleDef_HEAD_INIT, "_C", "pyattr compiled kernels", -1, pyattr_methods};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* mod = PyModule_Create(&pyattr_module);
  if (mod == nullptr) return nullptr;
#ifdef PYATTR_WITH_CUDA
  PyModule_AddIntConstant(mod, "WITH_CUDA", 1);
#else
  PyModule_AddIntConstant(mod, "WITH_CUDA", 0);
#endif
  return mod;
}

TORCH_LIBRARY_IMPL(pyattr, CPU, m) {
#define PYATTR_IMPL(name, schema) m.impl(#name, &pyattr::cpu::name);
  PYATTR_KERNEL_SCHEMAS(PYATTR_IMPL)
  PYATTR_ATTENTION_SCHEMAS(PYATTR_IMPL)
#undef PYATTR_IMPL
}
