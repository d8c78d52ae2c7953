"""``pyattr.audit``: where relevance leaks, per module, on this model and this input.

The same measurement the ``generic=True`` plan check makes on its probe
(:mod:`pyattr.integration.audit`), on the caller's input and target: one forward under
the rules with every module's boundary recorded, one backward, and per module the
relevance in, out, what its biases take, and its own gap (what its own forward code
loses). With every rule on and a conserving plan each own gap is rounding; a nonlinearity
without its rule shows up where it is computed.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import pyattr.methods._core as core
import pyattr.methods._core.text as text
import pyattr.targets as T
from pyattr.config import RelevanceRules
from pyattr.integration.audit import ModuleAudit, RelevanceAudit, bypassed_activations
from pyattr.integration.plan_check import unchecked
from pyattr.integration.wrappers import unwrap
from pyattr.methods._core.forward import evaluate_targets, leaf, run_model


@text.text_inputs("audit")
def audit(model: nn.Module, inputs, target=None, rules: Optional[RelevanceRules] = None, *,
          attention_mask: Optional[torch.Tensor] = None, generic=False, tokenizer=None) -> RelevanceAudit:
    """Per-module relevance balance of one relevance pass (AttnLRP, ICML 2024, §3.1: every
    rule conserves, so a module whose own gap is not rounding computes a nonlinearity
    without its rule).

    Args:
        model (nn.Module): a Hugging Face model, mapped or (with ``generic``) not.
        inputs: token ids ``LongTensor[batch, seq]``, a tokenizer's output, or pixels, as
            for :func:`pyattr.relevance`.
        target: one target per row, as for :func:`pyattr.relevance` (a single target:
            k targets are audited one call each). Default: each row's top-1 next token.
        rules (RelevanceRules, optional): default ``RelevanceRules.all()``.
        attention_mask (Tensor[batch, seq], optional): 1 for real tokens, 0 for padding.
        generic (bool | "partial"): as for :func:`pyattr.use_relevance_rules`, without
            its plan check: the audit is how to see what that check would refuse.
        tokenizer (optional): the model's Hugging Face tokenizer, for text inputs, a word
            ``target`` (as :func:`pyattr.relevance`), and the result's ``tokens`` (each
            token as a string). ``model`` may be a hub id, a directory or a bundled
            name, and ``rules`` a shorthand (``"all"``, ``"attnlrp"``, ``"ln"``,
            ``"none"``), as for :func:`pyattr.relevance`.

    Returns:
        RelevanceAudit: ``.modules`` (one :class:`~pyattr.integration.audit.ModuleGap`
        per module on the path: path, class, calls, relevance in / out, bias relevance,
        gap, own gap, scale, leak), ``.leaks`` (own gap beyond the dtype's tolerance),
        ``.target``, ``.entry_relevance``, ``.bias_relevance``, ``.gap``, ``.to_pandas()``.
        Relevance values are float (Python floats, float64 sums), in units of the target.

    Raises:
        ValueError / TypeError: as :func:`pyattr.relevance` for malformed inputs or
            targets; ValueError for k targets per row.
        RelevanceRuleUnsupportedError: as :func:`pyattr.use_relevance_rules`.
    """
    model = unwrap(model)
    prep = core.prepare(model, inputs, attention_mask, "audit", generic)
    tgts, several = T.normalize(target, prep.input_ids.shape[0])
    if several:
        raise ValueError("target: audit explains one target per row; audit each of the k targets in its own call")
    rules = core.rule_defaults(rules)
    with unchecked(), core.attribution_pass(model, rules, generic, "audit") as cov:
        absorbed = list(cov.by_kind.get("attention", []))
        exempt = {}
        if rules.attention == "attnlrp":
            exempt = {p.rsplit(".", 1)[0]: "AttnLRP's softmax keeps its native gradient: not conservative by design"
                      for p in absorbed if "." in p}
        rec = ModuleAudit(model, absorbed, exempt, bypassed_activations(model))
        store: dict = {}

        def entry_fn(t):
            x = leaf(t)
            rec.entered(x)
            return x

        with rec, core.tap(prep.entry, prep.where, entry_fn, once=True), \
                core.record_modules(model, T.module_paths(tgts), store), core.stream_tails() as tails:
            fwd = run_model(model, prep, tgts, store)
            value, _, _ = evaluate_targets(tgts, fwd, several)
            return rec.finish(value, extra_entries=tails[-1:])  # ProphetNet's streams enter with the tokens

