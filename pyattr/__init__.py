"""pyattr: fused relevance-rule kernels for attribution on transformer models.

See ``DESIGN.md`` for the rule math. Public API::

    from pyattr.rules import ln_rule, ln_rule_grad, identity_rule, half_rule, scale_gradient
    pyattr.ops.layer_norm / rms_norm / activation / gated_activation
    pyattr.use_relevance_rules(model, pyattr.RelevanceRules(...))
    pyattr.relevance(model, inputs, target=...)
    pyattr.available_backends(), pyattr.backend("torch")
"""

from pyattr import ops, rules
from pyattr.attribution import RelevanceResult, relevance
from pyattr.backends import BackendUnavailableError, available_backends, backend
from pyattr.integration import (
    RelevanceRuleConflictError,
    RelevanceRuleCoverage,
    RelevanceRules,
    RelevanceRuleUnsupportedError,
    use_relevance_rules,
)

__version__ = "0.1.0"

__all__ = [
    "ops",
    "rules",
    "relevance",
    "RelevanceResult",
    "available_backends",
    "backend",
    "BackendUnavailableError",
    "RelevanceRules",
    "RelevanceRuleCoverage",
    "use_relevance_rules",
    "RelevanceRuleConflictError",
    "RelevanceRuleUnsupportedError",
]
