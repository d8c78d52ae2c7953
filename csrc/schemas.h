// The operator schemas of the torch.ops.pyattr namespace, one list for pyattr._C
// (csrc/ops.cpp) and pyattr._C_stable (csrc/stable/module.cpp): X(name, schema) per op.
#pragma once

#define PYATTR_KERNEL_SCHEMAS(X)                                                                              \
  /* Identity-rule: dx = dy * phi(x). */                                                                      \
  X(identity_backward, "identity_backward(Tensor x, Tensor dy, str act) -> Tensor")                          \
  /* Half-rule: du = dy*v/2, dv = dy*u/2 (same-shape inputs). */                                             \
  X(half_backward, "half_backward(Tensor u, Tensor v, Tensor dy) -> (Tensor, Tensor)")                       \
  /* Gated activation h = act(gate)*up under the Identity- and/or Half-rule. */                               \
  X(gated_backward,                                                                                           \
    "gated_backward(Tensor gate, Tensor up, Tensor dh, str act, bool identity, bool half) -> (Tensor, Tensor)") \
  /* LN-rule for LayerNorm; dweight/dbias are empty tensors when not requested. */                            \
  X(layer_norm_backward,                                                                                      \
    "layer_norm_backward(Tensor x, Tensor? weight, float eps, Tensor dy, bool need_dweight, bool need_dbias) " \
    "-> (Tensor, Tensor, Tensor)")                                                                            \
  /* LN-rule dx of LayerNorm from the forward's per-row rstd: dx = rstd * (dy*w - mean(dy*w)). */             \
  X(layer_norm_rule_dx, "layer_norm_rule_dx(Tensor dy, Tensor? weight, Tensor rstd) -> Tensor")              \
  /* LN-rule backward of LayerNorm with the forward's per-row mean and rstd (no recomputation). */            \
  X(layer_norm_backward_stats,                                                                                \
    "layer_norm_backward_stats(Tensor x, Tensor? weight, Tensor dy, Tensor mean, Tensor rstd, "               \
    "bool need_dweight, bool need_dbias) -> (Tensor, Tensor, Tensor)")                                        \
  /* LN-rule for RMSNorm with weight offset (1.0 for Gemma). */                                               \
  X(rms_norm_backward,                                                                                        \
    "rms_norm_backward(Tensor x, Tensor? weight, float eps, float offset, Tensor dy, bool need_dweight) "     \
    "-> (Tensor, Tensor)")

// The attention ops, in pyattr._C only (their GEMMs run through ATen).
#define PYATTR_ATTENTION_SCHEMAS(X)                                                                           \
  /* Frozen attention (AH-rule): dV = P^T dO, P recomputed per block of query rows from q, k, */              \
  /* an additive mask, the scale, an optional softcap and causality (float32/float64 out). */                 \
  X(attention_dv,                                                                                             \
    "attention_dv(Tensor q, Tensor k, Tensor dout, Tensor? mask, float scaling, float? softcap, bool causal) " \
    "-> Tensor")                                                                                              \
  /* AttnLRP's attention core: the full gradient (dq, dk, dv) of softmax attention, P and dP */               \
  /* recomputed per block of query rows (float32/float64 out). */                                             \
  X(attention_backward,                                                                                       \
    "attention_backward(Tensor q, Tensor k, Tensor v, Tensor dout, Tensor? mask, float scaling, "             \
    "float? softcap, bool causal) -> (Tensor, Tensor, Tensor)")
