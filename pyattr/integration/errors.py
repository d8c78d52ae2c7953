"""Errors raised while installing relevance rules on a model."""


class RelevanceRuleUnsupportedError(RuntimeError):
    """A requested rule cannot be honoured on this model (unknown architecture, or a
    mount whose module does not have the expected form). Raised before any forward pass."""


class RelevanceRuleConflictError(RuntimeError):
    """Two rule settings, or a user hook and a rule, would both decide the same value:
    a nested scope asking for another attention mode, a hook on a module the rule
    bypasses, or a forward hook that replaces the output of a rule-active module."""
