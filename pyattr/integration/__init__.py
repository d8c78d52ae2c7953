"""Scoped rule installation on Hugging Face models."""

from pyattr.config import RelevanceRuleCoverage, RelevanceRules
from pyattr.integration.errors import RelevanceRuleConflictError, RelevanceRuleUnsupportedError
from pyattr.integration.plan_check import PartialRelevanceWarning
from pyattr.integration.scope import use_relevance_rules

__all__ = [
    "RelevanceRules",
    "RelevanceRuleCoverage",
    "use_relevance_rules",
    "RelevanceRuleConflictError",
    "RelevanceRuleUnsupportedError",
    "PartialRelevanceWarning",
]
