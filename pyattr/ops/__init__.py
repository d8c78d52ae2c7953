"""Fused-op entry points: norms, activations and gated activations under the rules."""

from pyattr.ops.gated import gated_activation
from pyattr.ops.layer_norm import layer_norm
from pyattr.ops.rms_norm import rms_norm
from pyattr.rules.identity import identity_rule as activation

__all__ = ["layer_norm", "rms_norm", "activation", "gated_activation"]
