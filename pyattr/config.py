"""Which rules to install, and what was installed."""

from __future__ import annotations

from pyattr._repr import summary_repr

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

_ATTENTION_MODES = {False: False, True: "frozen", "frozen": "frozen", "attnlrp": "attnlrp"}
_ROUTING_MODES = {False: False, True: "frozen", "frozen": "frozen"}


@dataclass(frozen=True)
class RelevanceRules:
    """Switches for the four rule families, with TransformerLens' names and defaults.

    As in TransformerLens every field is off by default, so ``RelevanceRules(normalization=True)``
    is the LN-rule alone; :meth:`all` switches on all four (what :func:`pyattr.relevance`
    uses when ``rules`` is not given).

    Attributes:
        normalization (bool): LN-rule on every residual-stream LayerNorm/RMSNorm,
            the final norm included; under ``attention="attnlrp"`` also on the per-head
            q/k norms (Qwen3), as the AttnLRP reference applies it to every norm.
            Default: False.
        activation (bool): Identity-rule on MLP activations. Default: False.
        multiplicative_gate (bool): Half-rule on the gated product ``act(g)·u``. Default: False.
        attention (bool | str): ``False`` (native), ``True`` or ``"frozen"`` (AH-rule: the
            attention pattern is a constant, gradient flows through V only) or
            ``"attnlrp"`` (uniform rule: q and k gradients ×¼, v gradient ×½). Default: False.
        routing (bool | str): mixture-of-experts routing. ``False`` (native: gradient also
            flows through the routing weights into the router) or ``True`` / ``"frozen"``:
            the routing weights that scale the selected experts' outputs (and Qwen2-MoE's
            shared-expert gate) are constants in the backward, as the attention pattern is
            under the AH-rule (AttnLRP, ICML 2024, treats the softmax-normalised attention
            weights this way; a router's top-k softmax is the same kind of data-dependent
            mixing weight). Relevance then flows only through the selected experts and
            is conserved. Only mixture-of-experts models have a mount for it. Default: False.

    Raises:
        ValueError: ``attention`` or ``routing`` is none of the values above.
        TypeError: a switch other than ``attention`` is not a bool.
    """

    normalization: bool = False
    activation: bool = False
    multiplicative_gate: bool = False
    attention: Union[bool, str] = False
    routing: Union[bool, str] = False

    def __post_init__(self):
        for name in ("normalization", "activation", "multiplicative_gate"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"RelevanceRules.{name} must be a bool, got {getattr(self, name)!r}")
        try:
            mode = _ATTENTION_MODES[self.attention]
        except (KeyError, TypeError):
            raise ValueError(
                f"RelevanceRules.attention must be False, True, 'frozen' or 'attnlrp', got {self.attention!r}"
            ) from None
        object.__setattr__(self, "attention", mode)
        try:
            routing = _ROUTING_MODES[self.routing]
        except (KeyError, TypeError):
            raise ValueError(f"RelevanceRules.routing must be False, True or 'frozen', got {self.routing!r}") from None
        object.__setattr__(self, "routing", routing)

    @classmethod
    def all(cls, attention: Union[bool, str] = True, routing: Union[bool, str] = "frozen") -> "RelevanceRules":
        """All four rules: LN-rule, Identity-rule, Half-rule and the AH-rule (``attention=True``),
        or the AttnLRP attention rule with ``attention="attnlrp"``; and frozen routing on
        mixture-of-experts models."""
        return cls(normalization=True, activation=True, multiplicative_gate=True, attention=attention,
                   routing=routing)

    @classmethod
    def none(cls) -> "RelevanceRules":
        """Every rule off (plain gradients); the same as ``RelevanceRules()``."""
        return cls(False, False, False, False)

    def any(self) -> bool:
        return bool(self.normalization or self.activation or self.multiplicative_gate or self.attention
                    or self.routing)


@dataclass
class RelevanceRuleCoverage:
    """What a :func:`use_relevance_rules` scope did.

    Attributes:
        model_type (str): the ``config.model_type`` (or ``"generic"``).
        installed (list[str]): dotted module paths (as in ``model.named_modules()``) whose
            forward carries a rule in this scope.
        skipped (list[str]): rule mounts and look-alike modules left native, with
            ``reasons[path]`` saying why (rule switched off, not a residual-stream norm…).
        by_kind (dict[str, list[str]]): installed paths per rule kind
            (``normalization``, ``activation``, ``multiplicative_gate``, ``attention``,
            ``routing``).
        inherited (dict[str, list[str]]): paths whose rule this scope leaves off but an
            enclosing scope still holds (nested scopes add rules, never remove them),
            with the kinds.
        mounts (dict[str, str]): on a TransformerLens bridge, each installed path's
            canonical mount name (``blocks.0.ln1``, ``blocks.0.mlp``, ``ln_final``…);
            empty otherwise.
    """

    __repr__ = summary_repr

    model_type: str
    installed: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)
    reasons: Dict[str, str] = field(default_factory=dict)
    by_kind: Dict[str, List[str]] = field(default_factory=dict)
    inherited: Dict[str, List[str]] = field(default_factory=dict)
    mounts: Dict[str, str] = field(default_factory=dict)

    def _name_mounts(self, names: Dict[str, str]) -> None:
        self.mounts.update(names)

    def _inherit(self, path: str, kind: str) -> None:
        self.inherited.setdefault(path, []).append(kind)

    def _add(self, kind: str, path: str) -> None:
        if path not in self.installed:
            self.installed.append(path)
        if path in self.skipped:  # another rule kind on the same module is off: by_kind says which
            self.skipped.remove(path)
            self.reasons.pop(path, None)
        self.by_kind.setdefault(kind, []).append(path)

    def _skip(self, path: str, reason: str) -> None:
        if path not in self.skipped and path not in self.installed:
            self.skipped.append(path)
            self.reasons[path] = reason


RULE_SHORTHANDS = ("all", "attnlrp", "ln", "none")


def rules_from(rules, name: str = "rules") -> Optional[RelevanceRules]:
    """``None`` / a :class:`RelevanceRules` unchanged; ``"all"`` (the four rules, AH-rule
    attention), ``"attnlrp"`` (the four rules, AttnLRP attention), ``"ln"`` (the LN-rule
    alone), ``"none"`` (every rule off: plain gradient × input).

    Anything else is returned as given, for the method to check (:func:`pyattr.methods._core.inputs.rule_defaults`).

    Raises:
        ValueError: an unknown shorthand.
    """
    if not isinstance(rules, str):  # RelevanceRules, None, or what the method itself refuses
        return rules
    if isinstance(rules, str):
        key = rules.strip().lower()
        if key == "all":
            return RelevanceRules.all()
        if key == "attnlrp":
            return RelevanceRules.all("attnlrp")
        if key == "ln":
            return RelevanceRules(normalization=True)
        if key == "none":
            return RelevanceRules()
        raise ValueError(f"{name}: expected a RelevanceRules or one of {', '.join(map(repr, RULE_SHORTHANDS))}, "
                         f"got {rules!r}")
