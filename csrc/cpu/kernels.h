// The CPU kernels' entry points, registered for the CPU dispatch key in csrc/ops.cpp
// (pyattr._C) and csrc/stable/module.cpp (pyattr._C_stable, once per CPU code path).
// The kernel files include only the headers they use (api.h), not torch/library.h:
// parsing that and ATen/ATen.h was about 40% of each kernel file's compile time.
#pragma once

#include <optional>
#include <tuple>

#include "api.h"

#include "kernel_decls.inc"

#ifndef PYATTR_STABLE_ABI
PYATTR_BEGIN
namespace cpu {

// the attention kernels run their GEMMs through ATen (pyattr._C only)
Tensor attention_dv(const Tensor& q_in, const Tensor& k_in, const Tensor& dout_in, const std::optional<Tensor>& mask_opt,
                    double scaling, std::optional<double> softcap, bool causal);
Triple attention_backward(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& dout_in,
                          const std::optional<Tensor>& mask_opt, double scaling, std::optional<double> softcap,
                          bool causal);
}  // namespace cpu
PYATTR_END
#endif
