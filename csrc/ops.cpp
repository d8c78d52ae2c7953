// Operator schemas of pyattr._C, the CPU kernels' registrations and the Python module init.
// The CPU kernels (csrc/cpu/*.cpp, one file per rule family) register here, so that only this
// file parses torch/library.h (see csrc/cpu/kernels.h); the CUDA kernels register in
// csrc/cuda/*.cu.
#include <Python.h>
#include <torch/library.h>

#include "cpu/kernels.h"

TORCH_LIBRARY(pyattr, m) {
  // Identity-rule: dx = dy * phi(x).
  m.def("identity_backward(Tensor x, Tensor dy, str act) -> Tensor");
  // Half-rule: du = dy*v/2, dv = dy*u/2 (same-shape inputs).
  m.def("half_backward(Tensor u, Tensor v, Tensor dy) -> (Tensor, Tensor)");
  // Gated activation h = act(gate)*up under the Identity- and/or Half-rule.
  m.def("gated_backward(Tensor gate, Tensor up, Tensor dh, str act, bool identity, bool half) -> (Tensor, Tensor)");
  // LN-rule for LayerNorm; dweight/dbias are empty tensors when not requested.
  m.def("layer_norm_backward(Tensor x, Tensor? weight, float eps, Tensor dy, bool need_dweight, bool need_dbias) -> (Tensor, Tensor, Tensor)");
  // LN-rule dx of LayerNorm from the forward's per-row rstd: dx = rstd * (dy*w - mean(dy*w)).
  m.def("layer_norm_rule_dx(Tensor dy, Tensor? weight, Tensor rstd) -> Tensor");
  // LN-rule backward of LayerNorm with the forward's per-row mean and rstd (no recomputation).
  m.def("layer_norm_backward_stats(Tensor x, Tensor? weight, Tensor dy, Tensor mean, Tensor rstd, bool need_dweight, bool need_dbias) -> (Tensor, Tensor, Tensor)");
  // LN-rule for RMSNorm with weight offset (1.0 for Gemma).
  m.def("rms_norm_backward(Tensor x, Tensor? weight, float eps, float offset, Tensor dy, bool need_dweight) -> (Tensor, Tensor)");
  // Frozen attention (AH-rule): dV = P^T dO, P recomputed per block of query rows from q, k,
  // an additive mask, the scale, an optional softcap and causality (float32/float64 out).
  m.def("attention_dv(Tensor q, Tensor k, Tensor dout, Tensor? mask, float scaling, float? softcap, bool causal) -> Tensor");
  // AttnLRP's attention core: the full gradient (dq, dk, dv) of softmax attention, P and dP
  // recomputed per block of query rows (float32/float64 out).
  m.def("attention_backward(Tensor q, Tensor k, Tensor v, Tensor dout, Tensor? mask, float scaling, float? softcap, bool causal) -> (Tensor, Tensor, Tensor)");
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

namespace pyattr::cpu {

TORCH_LIBRARY_IMPL(pyattr, CPU, m) {
  m.impl("attention_dv", &attention_dv);
  m.impl("attention_backward", &attention_backward);
  m.impl("gated_backward", &gated_backward);
  m.impl("half_backward", &half_backward);
  m.impl("identity_backward", &identity_backward);
  m.impl("layer_norm_backward", &layer_norm_backward);
  m.impl("layer_norm_rule_dx", &layer_norm_rule_dx);
  m.impl("layer_norm_backward_stats", &layer_norm_backward_stats);
  m.impl("rms_norm_backward", &rms_norm_backward);
}

}  // namespace pyattr::cpu
