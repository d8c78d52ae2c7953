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
``LLMGradientAttribution``, the metrics and ``captum.attr.visualization``, stays.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from pyattr.config import RelevanceRules

try:
    from captum.attr import InputXGradient, LayerGradientXActivation
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


class LayerRelevance(LayerGradientXActivation):
    """Captum's ``LayerGradientXActivation`` under pyattr's rules.

    Args:
        model (nn.Module): the Hugging Face model; also the forward function unless
            ``forward_func`` is given.
        layer (nn.Module, optional): where relevance is read (default: the model's input
            embeddings, ``model.get_input_embeddings()``).
        rules (RelevanceRules, optional): default all four rules (AH-rule attention).
        forward_func (callable, optional): what Captum calls (default ``model``).
        multiply_by_inputs (bool): gradient × activation (True, default) or the gradient.

    ``attribute(inputs, target=None, additional_forward_args=None,
    attribute_to_layer_input=False)`` as Captum's; the result has the layer's shape
    (for the embeddings, (batch, seq, hidden): sum the last dimension for token relevance).
    """

    def __init__(self, model: nn.Module, layer: Optional[nn.Module] = None, rules: Optional[RelevanceRules] = None,
                 forward_func: Optional[Callable] = None, multiply_by_inputs: bool = True):
        model = _check_model(model)
        if layer is None:
            layer = model.get_input_embeddings()
        super().__init__(forward_func or model, layer, multiply_by_inputs=multiply_by_inputs)
        self.relevance_model = model
        self.rules = _rules(rules)

    def attribute(self, *args, **kwargs):
        from pyattr.integration import use_relevance_rules

        with use_relevance_rules(self.relevance_model, self.rules):
            return super().attribute(*args, **kwargs)


class InputRelevance(InputXGradient):
    """Captum's ``InputXGradient`` on ``forward_func`` under pyattr's rules on ``model``.

    Args:
        forward_func (callable): float inputs (e.g. input embeddings, (batch, seq, hidden))
            → one value per row (or logits and a Captum ``target``).
        model (nn.Module): the model ``forward_func`` runs, on which the rules are installed.
        rules (RelevanceRules, optional): default all four rules.
    """

    def __init__(self, forward_func: Callable, model: nn.Module, rules: Optional[RelevanceRules] = None):
        super().__init__(forward_func)
        self.relevance_model = _check_model(model)
        self.rules = _rules(rules)

    def attribute(self, *args, **kwargs):
        from pyattr.integration import use_relevance_rules

        with use_relevance_rules(self.relevance_model, self.rules):
            return super().attribute(*args, **kwargs)
