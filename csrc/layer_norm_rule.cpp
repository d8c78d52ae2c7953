// LayerNorm under the LN-rule as a C++ autograd Function (AttnLRP, ICML 2024, Prop. 3.3),
// for the eager path with the cpp backend: the forward is at::native_layer_norm (the
// native op, bit for bit) and keeps its per-row mean and rstd; the backward calls the
// fused kernels through the dispatcher. The Python autograd.Function around the same
// kernels costs tens of microseconds of interpreter time per call, run with caches that
// the op's own data has just flushed; on a LayerNorm of 2048 x 1024 that was 5-10 % of the
// forward + backward. pyattr.ops.layer_norm takes this path only where it gives the same
// result as the Python one (pyattr/ops/layer_norm.py, _cpp_function_applies).
//
// Saved for backward: x, weight, mean and rstd (one value each per row).
#include <Python.h>

#include <limits>

#include <ATen/ATen.h>
#include <ATen/LegacyBatchedTensorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include "second_order.h"

namespace pyattr {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

bool batched(const at::Tensor& t) {
  // is_grads_batched (the older vmap) or torch.vmap over a backward
  return t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Batched, c10::DispatchKey::FuncTorchBatched}));
}

std::optional<at::Tensor> maybe(const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; }

// The reference backend's formula (pyattr/backends/reference.py, layer_norm_backward) in
// the same ops and order: differentiable, for a backward that is itself recorded
// (create_graph=True), as every rule backward does then.
Triple reference_backward(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& dy, bool need_w,
                          bool need_b) {
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor x32 = x.to(acc), dy32 = dy.to(acc);
  // row_mean: K + mean(x - K), K the row's first value; where that is not finite,
  // K + mean((x - K) * 2^-64) / 2^-64; NaN where neither is finite
  const at::Tensor k = x32.narrow(-1, 0, std::min<int64_t>(1, x32.size(-1)));
  const at::Tensor d = x32 - k;
  const at::Tensor shifted = k + d.mean(-1, true);
  const double scale = 5.42101086242752217e-20;  // 2^-64
  const at::Tensor big = k + (d * scale).mean(-1, true) / scale;
  const at::Tensor mu = at::where(at::isfinite(shifted), shifted,
                                  at::where(at::isfinite(big), big, std::numeric_limits<double>::quiet_NaN()));
  const at::Tensor xc = x32 - mu;
  const at::Tensor rstd = at::rsqrt((xc * xc).mean(-1, true) + eps);
  const at::Tensor g = w.defined() ? dy32 * w.to(acc) * rstd : dy32 * rstd;
  const at::Tensor dx = g - g.mean(-1, true);
  const int64_t H = x.size(-1);
  at::Tensor dw, db;
  if (need_w) dw = (dy32 * xc * rstd).reshape({-1, H}).sum(0).to(w.scalar_type());
  if (need_b) db = dy32.reshape({-1, H}).sum(0).to(w.defined() ? w.scalar_type() : dy.scalar_type());
  return {dx.to(x.scalar_type()), dw, db};
}

// dx alone from the forward's rstd, as pyattr/ops/layer_norm.py (layer_norm_rule_dx) does
// it: the kernel; for k gradients batched by is_grads_batched the kernel once on the
// physical tensor (k gradients, one rstd); under torch.vmap PyTorch ops, which batch.
at::Tensor rule_dx(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& rstd) {
  if (rstd.numel() == 0 || dy.numel() == 0) return at::zeros_like(dy);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pyattr::layer_norm_rule_dx", "")
                       .typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&)>();
  if (!batched(dy)) return op.call(dy, maybe(w), rstd);
  const at::BatchedTensorImpl* legacy = at::maybeGetBatchedImpl(dy);
  if (legacy != nullptr && legacy->bdims().size() == 1 && !batched(rstd) && !(w.defined() && batched(w))) {
    const auto& bdim = legacy->bdims()[0];
    const at::Tensor phys = legacy->value().movedim(bdim.dim(), 0);
    if (!batched(phys)) {
      std::vector<int64_t> shape{phys.size(0)};
      shape.insert(shape.end(), rstd.sizes().begin(), rstd.sizes().end());
      return at::addBatchDim(op.call(phys, maybe(w), rstd.unsqueeze(0).expand(shape)), bdim.level(), 0);
    }
  }
  const at::Tensor g = w.defined() ? dy * w : dy;
  return ((g - g.mean(-1, true)) * rstd).to(dy.scalar_type());
}

struct LayerNormRule : public torch::autograd::Function<LayerNormRule> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps) {
    auto [out, mean, rstd] = at::native_layer_norm(x, {x.size(-1)}, weight, bias, eps);
    ctx->save_for_backward({x, weight.value_or(at::Tensor()), mean, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &mean = saved[2], &rstd = saved[3];
    const at::Tensor& dy = grads[0];
    const double eps = ctx->saved_data["eps"].toDouble();
    // an absent weight or bias is no input at all: needs_input_grad counts present ones
    const bool has_w = w.defined(), has_b = ctx->saved_data["has_bias"].toBool();
    const bool need_x = ctx->needs_input_grad(0);
    const bool need_w = has_w && ctx->needs_input_grad(1);
    const bool need_b = has_b && ctx->needs_input_grad(has_w ? 2 : 1);
    Triple r;
    // recorded for a second derivative with an incoming gradient computed from the graph:
    // refused (second_order.h; pyattr/_function.py, check_second_order)
    TORCH_CHECK(!at::GradMode::is_enabled() || !grads[0].defined() || grads[0].grad_fn() == nullptr,
                PYATTR_SECOND_PASS_MESSAGE);
    if (at::GradMode::is_enabled()) {
      r = reference_backward(x, w, eps, dy, need_w, need_b);
    } else if (!need_w && !need_b) {
      r = {rule_dx(dy, w, rstd), at::Tensor(), at::Tensor()};
    } else if (batched(dy)) {
      // k gradients with parameter gradients: the op with batching rules for both vmaps
      static auto op = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("pyattr::layer_norm_backward", "")
                           .typed<Triple(const at::Tensor&, const std::optional<at::Tensor>&, double,
                                         const at::Tensor&, bool, bool)>();
      r = op.call(x, maybe(w), eps, dy, need_w, need_b);
    } else {
      static auto op = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("pyattr::layer_norm_backward_stats", "")
                           .typed<Triple(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, bool, bool)>();
      r = op.call(x, maybe(w), dy, mean, rstd, need_w, need_b);
    }
    auto [dx, dw, db] = r;
    return {need_x ? dx : at::Tensor(), need_w ? dw : at::Tensor(), need_b ? db : at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// pyattr._C.layer_norm_rule(x, weight, bias, eps) -> Tensor; arguments checked by the caller.
PyObject* layer_norm_rule_py(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *x, *w, *b;
  double eps;
  if (!PyArg_ParseTuple(args, "OOOd", &x, &w, &b, &eps)) return nullptr;
  auto opt = [](PyObject* o) {
    return o == Py_None ? std::optional<at::Tensor>() : std::optional<at::Tensor>(THPVariable_Unpack(o));
  };
  return THPVariable_Wrap(LayerNormRule::apply(THPVariable_Unpack(x), opt(w), opt(b), eps));
  END_HANDLE_TH_ERRORS
}

}  // namespace pyattr
