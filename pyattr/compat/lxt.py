"""An LXT drop-in: LXT's call shape (``monkey_patch(modeling_module)``, then
``inputs_embeds.requires_grad_()``, ``backward()``, ``grad * input``) on pyattr's kernels,
working on transformers 5 (where LXT 2.1 fails at import).

``monkey_patch(transformers.models.llama.modeling_llama)`` wraps the ``forward`` of every
Hugging Face model class defined in that module: the outermost call of such a forward
runs inside :func:`pyattr.use_relevance_rules` with AttnLRP's rules (LN-, Identity- and
Half-rule, AttnLRP attention; Achtibat et al., ICML 2024). The forward returns the
model's own values (bit-identical); the graph it builds carries the rule backwards, so a
later ``backward()`` gives AttnLRP gradients and ``grad * input`` the relevance.

An LXT user changes one import: ``from lxt.efficient import monkey_patch`` becomes
``from pyattr.compat.lxt import monkey_patch``. ``undo(module)`` restores the module.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from types import ModuleType
from typing import List, Optional

from pyattr.config import RelevanceRules

#: AttnLRP as LXT's efficient mode applies it
ATTNLRP = RelevanceRules.all(attention="attnlrp")
_PATCHED = "__pyattr_lxt_original_forward__"
# a model's forward calls its inner models' forwards: only the outermost opens the scope
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("pyattr_lxt_active", default=False)


def _model_classes(module: ModuleType) -> List[type]:
    from transformers import PreTrainedModel

    return [c for _, c in inspect.getmembers(module, inspect.isclass)
            if issubclass(c, PreTrainedModel) and c.__module__ == module.__name__ and "forward" in c.__dict__]


def _wrap(forward, rules: RelevanceRules):
    @functools.wraps(forward)
    def patched(self, *args, **kwargs):
        if _ACTIVE.get():
            return forward(self, *args, **kwargs)
        from pyattr.integration import use_relevance_rules

        token = _ACTIVE.set(True)
        try:
            with use_relevance_rules(self, rules):
                return forward(self, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    setattr(patched, _PATCHED, forward)
    return patched


def monkey_patch(module: ModuleType, verbose: bool = False, rules: Optional[RelevanceRules] = None) -> List[str]:
    """Make every model class of a transformers modeling module compute AttnLRP gradients.

    Args:
        module: a transformers modeling module, e.g. ``transformers.models.llama.modeling_llama``.
        verbose (bool): print the patched classes (as LXT does).
        rules (RelevanceRules, optional): default AttnLRP (:data:`ATTNLRP`).

    Returns:
        The names of the patched classes.

    Raises:
        TypeError: ``module`` is not a module, or ``rules`` not a RelevanceRules.
        ValueError: the module defines no Hugging Face model class.
    """
    if not isinstance(module, ModuleType):
        raise TypeError(f"monkey_patch: module must be a transformers modeling module, got {type(module).__name__}")
    rules = ATTNLRP if rules is None else rules
    if not isinstance(rules, RelevanceRules):
        raise TypeError(f"rules must be a pyattr.RelevanceRules, got {type(rules).__name__}")
    classes = _model_classes(module)
    if not classes:
        raise ValueError(f"monkey_patch: {module.__name__} defines no Hugging Face model class (PreTrainedModel) "
                         "with a forward; pass a modeling module such as transformers.models.llama.modeling_llama")
    names = []
    for cls in classes:
        forward = cls.__dict__["forward"]
        original = getattr(forward, _PATCHED, forward)  # patching twice wraps once
        cls.forward = _wrap(original, rules)
        names.append(cls.__name__)
    if verbose:
        print(f"pyattr.compat.lxt: AttnLRP rules on {', '.join(names)}")
    return names


def undo(module: ModuleType) -> None:
    """Restore the forwards :func:`monkey_patch` wrapped in ``module``."""
    for cls in _model_classes(module):
        original = getattr(cls.__dict__["forward"], _PATCHED, None)
        if original is not None:
            cls.forward = original
