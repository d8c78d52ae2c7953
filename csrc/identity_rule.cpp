// Identity-rule activations as a C++ autograd Function (AttnLRP, ICML 2024, Eq. 9), for
// the eager path with the cpp backend and an activation whose forward is the native op
// (SiLU, GELU, GELU-tanh, ReLU): the forward is that op (bit for bit), the backward the
// fused kernel through the dispatcher, with no Python around them (the reason is the same
// as for csrc/layer_norm_rule.cpp). pyattr.rules.identity takes this path only where it
// gives the same result as its Python Function.
//
// Saved for backward: x.
#include <Python.h>

#include <cmath>
#include <string>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include "second_order.h"

namespace pyattr {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

at::Tensor activation(const at::Tensor& x, const std::string& kind) {
  if (kind == "silu") return at::silu(x);
  if (kind == "gelu") return at::gelu(x, "none");
  if (kind == "gelu_tanh") return at::gelu(x, "tanh");
  if (kind == "relu") return at::relu(x);
  TORCH_CHECK_VALUE(false, "identity_rule: no native forward for activation '", kind, "'");
}

// phi(x) as the reference backend writes it (pyattr/activations.py, phi), op for op:
// differentiable, for a backward that is itself recorded (create_graph=True).
at::Tensor reference_phi(const at::Tensor& x32, const std::string& kind) {
  if (kind == "silu") return at::sigmoid(x32);
  if (kind == "gelu") return at::erfc(-x32 * (1.0 / std::sqrt(2.0))) * 0.5;
  if (kind == "gelu_tanh") {
    const at::Tensor inner = (x32 + x32 * 0.044715 * x32 * x32) * std::sqrt(2.0 / M_PI);
    return (at::tanh(inner) + 1.0) * 0.5;
  }
  return at::where(at::isnan(x32), x32, (x32 > 0).to(x32.scalar_type()));  // relu
}

struct IdentityRule : public torch::autograd::Function<IdentityRule> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& kind) {
    ctx->save_for_backward({x});
    ctx->saved_data["kind"] = kind;
    return activation(x, kind);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor& dy = grads[0];
    const std::string kind = ctx->saved_data["kind"].toStringRef();
    if (!ctx->needs_input_grad(0)) return {at::Tensor(), at::Tensor()};
    // recorded for a second derivative with an incoming gradient computed from the graph:
    // refused (second_order.h; pyattr/_function.py, check_second_order)
    TORCH_CHECK(!at::GradMode::is_enabled() || !grads[0].defined() || grads[0].grad_fn() == nullptr,
                PYATTR_SECOND_PASS_MESSAGE);
    if (at::GradMode::is_enabled()) {
      const auto acc = [](const at::Tensor& t) { return t.to(t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat); };
      return {(acc(dy) * reference_phi(acc(x), kind)).to(x.scalar_type()), at::Tensor()};
    }
    // the kernel runs in the wider of the two dtypes and its result goes back to x's
    // (pyattr/backends/compiled.py, identity_backward); it has batching rules for both vmaps
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("pyattr::identity_backward", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>();
    const auto dt = at::promote_types(x.scalar_type(), dy.scalar_type());
    return {op.call(x.to(dt), dy.to(dt), kind).to(x.scalar_type()), at::Tensor()};
  }
};

}  // namespace

// pyattr._C.identity_rule(x, kind) -> Tensor; arguments checked by the caller.
PyObject* identity_rule_py(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* x;
  const char* kind;
  if (!PyArg_ParseTuple(args, "Os", &x, &kind)) return nullptr;
  return THPVariable_Wrap(IdentityRule::apply(THPVariable_Unpack(x), std::string(kind)));
  END_HANDLE_TH_ERRORS
}

}  // namespace pyattr
