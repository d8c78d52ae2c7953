"""Rule primitives: the LN-rule, the Identity-rule, the Half-rule and gradient scaling."""

from pyattr.rules.half import half_rule
from pyattr.rules.identity import identity_rule
from pyattr.rules.ln import ln_rule, ln_rule_grad
from pyattr.rules.scale import scale_gradient

__all__ = ["ln_rule", "ln_rule_grad", "identity_rule", "half_rule", "scale_gradient"]
