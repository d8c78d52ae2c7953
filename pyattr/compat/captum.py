"""Captum drop-ins: pyattr's relevance behind Captum's ``Attribution`` interface.

Both classes are Captum classes (so every Captum code path that checks ``isinstance``
accepts them) whose gradients are taken with pyattr's rules installed on the model
(:func:`pyattr.use_relevance_rules`) for the length of each ``attribute`` call:

- :class:`LayerRelevance`: Captum's ``LayerGradientXActivation`` (gradient × the layer's
  activation). At the input embeddings of a model whose embeddings enter the first block
  directly (Llama-style models) this is :func:`pyattr.relevance`'s ``relevance``; it is
  what ``captum.attr.LLMGradientAttribution`` wraps.
- :class:`InputRelevance`: Captum's ``InputXGradient`` on a function of float inputs
  (e.g. ``lambda e: model(inputs_embeds=e).logits[:, -1, token]``): for
  ``captum.metrics.infidelity`` / ``sensitivity_max``, which perturb the inputs.

A Captum user changes the class name (``LayerGradientXActivation`` → ``LayerRelevance``,
``InputXGradient`` → ``InputRelevance``) and passes the model; the rest of the code,
``NoiseTunnel``, ``LLMGradientAttribution``, ``captum.concept.TCAV``, the metrics and
``captum.attr.visualization``, stays.

Captum's wrappers do not always call ``attribute``: ``NoiseTunnel`` and ``TCAV`` call
``method.attribute.__wrapped__(method, ...)``, the function under Captum's usage-logging
decorator, so that inner calls are not logged twice. The drop-ins' ``attribute`` is built
the way Captum builds its own (:func:`_attribute_under_rules`): the logged method's
``__wrapped__`` is a function that also installs the rules, and both carry Captum's
signature and docstring, so whichever of the two a wrapper calls, the rules apply.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

from torch import nn

from pyattr.config import RelevanceRules

try:
    from captum.attr import InputXGradient, LayerGradientXActivation
    from captum.log import log_usage
except ImportError as e:  # pragma: no cover - captum is in the dev extra
    raise ImportError("pyattr.compat.captum needs captum (pip install captum)") from e


def _rules(rules: Optional[RelevanceRules]) -> RelevanceRules:
    if rules is None:
        return RelevanceRules.all()
    if not isinstance(rules, RelevanceRules):
        raise TypeError(f"rules must be a pyattr.RelevanceRules, got {type(rules).__name__}")
    return rules


def _check_model(model) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the torch.nn.Module the rules are installed on, got {type(model).__name__}")
    return model


def _attribute_under_rules(captum_attribute: Callable, owner: str) -> Callable:
    """``attribute`` for a drop-in of the Captum class whose ``attribute`` is ``captum_attribute``.

    Args:
        captum_attribute (callable): the Captum class's ``attribute`` as found on the
            class (``LayerGradientXActivation.attribute``): Captum's ``log_usage``
            wrapper, whose ``__wrapped__`` is the unlogged computation.
        owner (str): the drop-in's class name (for ``__qualname__``).

    Returns:
        callable: Captum's ``log_usage`` wrapper around a function ``f(self, *args,
        **kwargs)`` that runs the unlogged computation inside
        ``use_relevance_rules(self.relevance_model, self.rules)``. The returned method's
        ``__wrapped__`` is ``f`` (what ``NoiseTunnel`` and ``TCAV`` call); both have
        the Captum method's name, docstring and ``inspect.signature``. ``f`` has no
        ``__wrapped__`` of its own, so no introspection path leads around the rules.

    Raises:
        ImportError: at import, if the installed Captum's ``log_usage`` sets no
            ``__wrapped__`` (the wrappers above would then call a function without the rules).
    """
    unlogged = getattr(captum_attribute, "__wrapped__", captum_attribute)

    def attribute(self, *args, **kwargs):
        from pyattr.integration import use_relevance_rules

        with use_relevance_rules(self.relevance_model, self.rules):
            return unlogged(self, *args, **kwargs)

    attribute.__name__ = "attribute"
    attribute.__qualname__ = f"{owner}.attribute"
    attribute.__doc__ = unlogged.__doc__
    attribute.__signature__ = inspect.signature(unlogged)
    attribute.__annotations__ = dict(getattr(unlogged, "__annotations__", {}))

    logged = log_usage(part_of_slo=True)(attribute)
    if getattr(logged, "__wrapped__", None) is not attribute:
        raise ImportError("pyattr.compat.captum needs a Captum whose log_usage sets __wrapped__ (Captum 0.9 does)")
    return logged


class LayerRelevance(LayerGradientXActivation):
    """Captum's ``LayerGradientXActivation`` under pyattr's rules.

    Args:
        model (nn.Module): the Hugging Face model; also the forward function unless
            ``forward_func`` is given.
        layer (nn.Module, optional): where relevance is read (default: the model's input
            embeddings, ``model.get_input_embeddings()``).
        rules (RelevanceRules, optional): default all four rules (AH-rule attention);
            ``RelevanceRules()`` (every rule off) gives exactly Captum's
            ``LayerGradientXActivation``.
        forward_func (callable, optional): what Captum calls (default ``model``).
        multiply_by_inputs (bool): gradient × activation (True, default) or the gradient.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``rules`` not a ``RelevanceRules``.

    ``attribute(inputs, target=None, additional_forward_args=None,
    attribute_to_layer_input=False)`` as Captum's (same signature and docstring); the
    result has the layer's shape (for the embeddings, (batch, seq, hidden): sum the last
    dimension for token relevance). ``NoiseTunnel(LayerRelevance(...))`` and
    ``TCAV(..., layer_attr_method=LayerRelevance(...))`` take the gradients under the
    rules too.
    """

    def __init__(self, model: nn.Module, layer: Optional[nn.Module] = None, rules: Optional[RelevanceRules] = None,
                 forward_func: Optional[Callable] = None, multiply_by_inputs: bool = True):
        model = _check_model(model)
        if layer is None:
            layer = model.get_input_embeddings()
        super().__init__(forward_func or model, layer, multiply_by_inputs=multiply_by_inputs)
        self.relevance_model = model
        self.rules = _rules(rules)

    attribute = _attribute_under_rules(LayerGradientXActivation.attribute, "LayerRelevance")


class InputRelevance(InputXGradient):
    """Captum's ``InputXGradient`` on ``forward_func`` under pyattr's rules on ``model``.

    Args:
        forward_func (callable): float inputs (e.g. input embeddings, (batch, seq, hidden))
            → one value per row (or logits and a Captum ``target``).
        model (nn.Module): the model ``forward_func`` runs, on which the rules are installed.
        rules (RelevanceRules, optional): default all four rules; ``RelevanceRules()``
            (every rule off) gives exactly Captum's ``InputXGradient``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``rules`` not a ``RelevanceRules``.

    ``attribute(inputs, target=None, additional_forward_args=None)`` as Captum's (same
    signature and docstring); the result has the inputs' shape. ``NoiseTunnel(InputRelevance(...))``
    (SmoothGrad, SmoothGrad², VarGrad) takes every sample's gradient under the rules.
    """

    def __init__(self, forward_func: Callable, model: nn.Module, rules: Optional[RelevanceRules] = None):
        super().__init__(forward_func)
        self.relevance_model = _check_model(model)
        self.rules = _rules(rules)

    attribute = _attribute_under_rules(InputXGradient.attribute, "InputRelevance")
