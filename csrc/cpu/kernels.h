// The CPU kernels' entry points, registered for the CPU dispatch key in csrc/ops.cpp.
// The kernel files include only the ATen headers they use (ATen/core/Tensor.h and the
// ops they call), not torch/library.h: parsing that and ATen/ATen.h was about 40% of
// each kernel file's compile time. csrc/ops.cpp alone pays for torch/library.h.
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

namespace pyattr::cpu {

at::Tensor attention_dv(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& dout_in,
                        const std::optional<at::Tensor>& mask_opt, double scaling, std::optional<double> softcap,
                        bool causal);
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& dout_in,
    const std::optional<at::Tensor>& mask_opt, double scaling, std::optional<double> softcap, bool causal);
std::tuple<at::Tensor, at::Tensor> gated_backward(const at::Tensor& g_in, const at::Tensor& u_in,
                                                   const at::Tensor& dh_in, c10::string_view act_name,
                                                   bool identity, bool half);
std::tuple<at::Tensor, at::Tensor> half_backward(const at::Tensor& u_in, const at::Tensor& v_in,
                                                  const at::Tensor& dy_in);
at::Tensor identity_backward(const at::Tensor& x_in, const at::Tensor& dy_in, c10::string_view act_name);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(const at::Tensor& x_in,
                                                                   const std::optional<at::Tensor>& w_opt,
                                                                   double eps, const at::Tensor& dy_in,
                                                                   bool need_dw, bool need_db);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_stats(
    const at::Tensor& x_in, const std::optional<at::Tensor>& w_opt, const at::Tensor& dy_in, const at::Tensor& mean,
    const at::Tensor& rstd, bool need_dw, bool need_db);
at::Tensor layer_norm_rule_dx(const at::Tensor& dy_in, const std::optional<at::Tensor>& w_opt,
                              const at::Tensor& rstd_in);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& x_in, const std::optional<at::Tensor>& w_opt,
                                                     double eps, double offset, const at::Tensor& dy_in,
                                                     bool need_dw);

}  // namespace pyattr::cpu
