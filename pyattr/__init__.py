"""pyattr: fused relevance-rule kernels for attribution on transformer models.

See the README for the rule math and the methods. Public API::

    from pyattr.rules import ln_rule, ln_rule_grad, identity_rule, half_rule, scale_gradient
    pyattr.ops.layer_norm / rms_norm / activation / gated_activation
    pyattr.use_relevance_rules(model, pyattr.RelevanceRules(...))
    pyattr.audit(model, inputs, generic=True)   # where relevance leaks, per module
    pyattr.relevance(model, inputs, target=...)
    pyattr.layer_relevance(model, inputs, layers, target=...)
    pyattr.integrated_gradients(model, inputs, target=..., baseline="zeros")
    pyattr.generation_relevance(model, prompt_ids, max_new_tokens=16)   # (batch, generated, seq)
    with pyattr.capture(model, paths) as cap: ...
    pyattr.targets.Logit / LogitDiff / ModuleOutput / Cosine
    pyattr.patching.attribution_patching(model, clean, corrupt, metric, method="relp")   # or "atp", "atp*"
    pyattr.patching.activation_patching(model, clean, corrupt, metric, batch_size=...)
    pyattr.patching.attribution_patching(..., method="ig", steps=16)                      # EAP-IG
    pyattr.evaluate.perturbation_curve(model, inputs, relevance, order="morf"), pyattr.evaluate.abpc(...)
    pyattr.toy.load()   # the trained induction decoder with its known circuit
    pyattr.run(model, "prompts.jsonl", "results/", tokenizer=tok)   # Parquet shards + manifest
    pyattr.available_backends(), pyattr.backend("torch")
    result.save("r.safetensors"); pyattr.load("r.safetensors")   # any result; no pickle

The names below load on first use (PEP 562), so that ``import pyattr`` and the command
line's ``--help`` / ``--version`` do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pyattr._version import __version__  # noqa: F401

# public name -> module that defines it
_EXPORTS = {
    "relevance": "pyattr.methods.relevance",
    "RelevanceResult": "pyattr.methods.relevance",
    "layer_relevance": "pyattr.methods.layer_relevance",
    "LayerRelevance": "pyattr.methods.layer_relevance",
    "LayerRelevanceResult": "pyattr.methods.layer_relevance",
    "integrated_gradients": "pyattr.methods.integrated_gradients",
    "AttributionResult": "pyattr.methods.integrated_gradients",
    "ConvergenceWarning": "pyattr.methods.integrated_gradients",
    "sentence_similarity": "pyattr.methods.similarity",
    "generation_relevance": "pyattr.methods.generation",
    "GenerationRelevanceResult": "pyattr.methods.generation",
    "Seq2SeqRelevanceResult": "pyattr.methods.seq2seq",
    "Seq2SeqGenerationResult": "pyattr.methods.seq2seq_generation",
    "Seq2SeqAttributionResult": "pyattr.methods.seq2seq_ig",
    "context_attribution": "pyattr.methods.context",
    "ContextAttributionResult": "pyattr.methods.context",
    "run": "pyattr.apps.run",
    "RunSummary": "pyattr.apps.run",
    "capture": "pyattr.methods.capture",
    "Captured": "pyattr.methods.capture",
    "GradientCapture": "pyattr.methods.capture",
    "available_backends": "pyattr.backends",
    "backend": "pyattr.backends",
    "BackendUnavailableError": "pyattr.backends",
    "RelevanceRules": "pyattr.integration",
    "RelevanceRuleCoverage": "pyattr.integration",
    "use_relevance_rules": "pyattr.integration",
    "RelevanceRuleConflictError": "pyattr.integration",
    "RelevanceRuleUnsupportedError": "pyattr.integration",
    "PartialRelevanceWarning": "pyattr.integration",
    "audit": "pyattr.methods.audit",
    "RelevanceAudit": "pyattr.integration.audit",
    "load": "pyattr.results.store",
}
_SUBMODULES = ("evaluate", "ops", "patching", "rules", "targets", "toy")

__all__ = [*_SUBMODULES, *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"pyattr.{name}")
    raise AttributeError(f"module 'pyattr' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what static tools see
    from pyattr import evaluate, ops, patching, rules, targets, toy
    from pyattr.apps.run import RunSummary, run
    from pyattr.methods.generation import GenerationRelevanceResult, generation_relevance
    from pyattr.methods.seq2seq import Seq2SeqRelevanceResult
    from pyattr.methods.seq2seq_generation import Seq2SeqGenerationResult
    from pyattr.methods.seq2seq_ig import Seq2SeqAttributionResult
    from pyattr.methods.context import ContextAttributionResult, context_attribution
    from pyattr.methods.capture import Captured, GradientCapture, capture
    from pyattr.methods.integrated_gradients import AttributionResult, ConvergenceWarning, integrated_gradients
    from pyattr.methods.layer_relevance import LayerRelevance, LayerRelevanceResult, layer_relevance
    from pyattr.backends import BackendUnavailableError, available_backends, backend
    from pyattr.integration.audit import RelevanceAudit
    from pyattr.methods.audit import audit
    from pyattr.results.store import load
    from pyattr.integration import (
        PartialRelevanceWarning,
        RelevanceRuleConflictError,
        RelevanceRuleCoverage,
        RelevanceRules,
        RelevanceRuleUnsupportedError,
        use_relevance_rules,
    )
