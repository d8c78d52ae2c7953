// The CPU kernels registered for the ops defined in ops.cpp (TORCH_LIBRARY(pyattr, ...)).
#include <torch/library.h>

#include "kernels.h"

namespace pyattr::cpu {

TORCH_LIBRARY_IMPL(pyattr, CPU, m) {
  m.impl("attention_dv", &attention_dv);
  m.impl("gated_backward", &gated_backward);
  m.impl("half_backward", &half_backward);
  m.impl("identity_backward", &identity_backward);
  m.impl("layer_norm_backward", &layer_norm_backward);
  m.impl("layer_norm_rule_dx", &layer_norm_rule_dx);
  m.impl("layer_norm_backward_stats", &layer_norm_backward_stats);
  m.impl("rms_norm_backward", &rms_norm_backward);
}

}  // namespace pyattr::cpu
