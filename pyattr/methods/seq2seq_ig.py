"""Integrated gradients on encoder–decoder models: the straight path from a baseline to
the input at both stacks' entries at once (the source's and the target prefix's residual
streams), all path points in one batched forward and backward; the attribution of each
source token and of each target-prefix token, with one completeness sum over both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

import pyattr.methods._core as core
from pyattr.methods._core.convergence import baseline_hint, warn_unconverged
import pyattr.methods.seq2seq_baseline as B
import pyattr.methods.seq2seq_inputs as SI
import pyattr.methods.seq2seq_targets as ST
import pyattr.targets as T
from pyattr._repr import summary_repr
from pyattr.results import ResultViews
from pyattr.methods.seq2seq_names import TwoStacks
from pyattr.config import RelevanceRuleCoverage, RelevanceRules
from pyattr.methods._core.forward import evaluate_targets, leaf
from pyattr.methods.seq2seq import _words_to_ids, explained, prepare, strings


@dataclass
class Seq2SeqAttributionResult(TwoStacks, ResultViews):
    """Output of :func:`pyattr.integrated_gradients` on an encoder–decoder model.

    Attributes:
        source_attribution (Tensor[batch, source_len]): per source token, ``(x − x₀) ·
            Σ_i w_i ∂f/∂x`` at the encoder's entry, summed over the hidden dimension
            (float32, or float64 for a float64 model).
        target_attribution (Tensor[batch, target_len]): the same at the decoder's entry.
        convergence_delta (Tensor[batch], float64): ``Σ source + Σ target −
            (f(x) − f(x₀))``.
        target (Tensor[batch], float64): f(x); ``baseline_target`` f(x₀).
        target_ids (Tensor[batch] or None): token ids of logit targets.
        n_steps (int), method (str): the quadrature used.
        coverage (RelevanceRuleCoverage): what the rule scope installed and skipped.
        source_tokens, decoder_tokens: with ``tokenizer=``, the tokens as strings;
            ``target_tokens`` the explained token of each row.
    """

    __repr__ = summary_repr
    own_tokens = True

    source_attribution: torch.Tensor
    target_attribution: torch.Tensor
    convergence_delta: torch.Tensor
    target: torch.Tensor
    baseline_target: torch.Tensor
    target_ids: Optional[torch.Tensor]
    n_steps: int
    method: str
    coverage: RelevanceRuleCoverage
    source_tokens: Optional[List[List[Optional[str]]]] = None
    decoder_tokens: Optional[List[List[Optional[str]]]] = None
    target_tokens: Optional[list] = None


def _repeat(kwargs: dict, times: int) -> dict:
    """Every batch-first tensor of the model's kwargs repeated ``times`` (path point major)."""
    return {k: (v.repeat(times, *([1] * (v.dim() - 1))) if isinstance(v, torch.Tensor) and v.dim() >= 1 else v)
            for k, v in kwargs.items()}


def seq2seq_integrated_gradients(model: nn.Module, inputs, target, *, decoder_input_ids, decoder_attention_mask,
                                 attention_mask, baseline, alphas, weights, method: str, rules: RelevanceRules,
                                 tokenizer=None) -> Seq2SeqAttributionResult:
    B.check(baseline)
    kwargs, dec, dmask, (enc_entry, dec_entry) = prepare(model, inputs, attention_mask, decoder_input_ids,
                                                         decoder_attention_mask, "integrated_gradients", tokenizer)
    batch = dec.shape[0]
    tgts, several = T.normalize(_words_to_ids(target, tokenizer), batch)
    if several:
        raise ValueError("target: integrated_gradients explains one target per row; call it once per target")
    side = ST.side_of(model, tgts, "integrated_gradients")
    n = len(alphas)
    with core.attribution_pass(model, rules, False, "integrated_gradients") as cov:
        seen: List[List[torch.Tensor]] = [[], []]

        def keep(i, scale=None, store=None, x0=None):
            """Record the entry; with ``scale``: x₀ + α (x − x₀) in its place (x₀ 0 or given)."""
            def fn(t):
                seen[i].append(t.detach())
                if scale is None:
                    return None
                a = scale.view(-1, *([1] * (t.dim() - 1))).to(t.dtype)
                base = torch.zeros_like(t) if x0 is None else x0.to(device=t.device, dtype=t.dtype)
                z = leaf(base + a * (t.detach() - base))
                store[i] = z
                return z
            return fn

        # f(x) at the input (the top-1 ids fixed there) and f(x₀) at the zero baseline
        with torch.no_grad():
            with core.tap(enc_entry, "input", SI.one_per_token(keep(0), kwargs["input_ids"].shape[1], model,
                                                               "integrated_gradients"), once=True), \
                    core.tap(dec_entry, "input", keep(1), once=True), ST.recording(model, tgts, store := {}):
                out = model(**kwargs)
            value, tid, fixed = evaluate_targets(tgts, ST.forward(side, out, kwargs, store), False)
            if value.dim() != 1 or value.shape[0] != batch:
                raise ValueError(f"target: integrated_gradients needs one value per row ({batch},), got shape "
                                 f"{tuple(value.shape)} (a callable target must not sum over the rows)")
            zero = torch.zeros(batch)
            x0 = (None, None) if baseline in (None, "zeros") else \
                B.entries_at(model, kwargs, (enc_entry, dec_entry), baseline, seen[0][0], seen[1][0])
            with core.tap(enc_entry, "input", keep(0, zero, {}, x0[0]), once=True), \
                    core.tap(dec_entry, "input", keep(1, zero, {}, x0[1]), once=True), \
                    ST.recording(model, fixed, store := {}):
                out0 = model(**kwargs)
            value0, _, _ = evaluate_targets(fixed, ST.forward(side, out0, kwargs, store), False)
        x_src, x_tgt = seen[0][0], seen[1][0]
        scale = torch.tensor(alphas, dtype=torch.float64).repeat_interleave(batch)
        zs: dict = {}
        rows = torch.arange(n * batch) % batch
        path = [t.rows(rows, batch) for t in fixed]
        repeated = _repeat(kwargs, n)
        x0_path = [None if b is None else b.repeat(n, *([1] * (b.dim() - 1))) for b in x0]
        with core.tap(enc_entry, "input", keep(0, scale, zs, x0_path[0]), once=True), \
                core.tap(dec_entry, "input", keep(1, scale, zs, x0_path[1]), once=True), \
                ST.recording(model, path, store := {}):
            out_p = model(**repeated)
        vals, _, _ = evaluate_targets(path, ST.forward(side, out_p, repeated, store), False)
        w = torch.tensor(weights, dtype=vals.dtype, device=vals.device).repeat_interleave(batch)
        g_src, g_tgt = torch.autograd.grad(vals, [zs[0], zs[1]], w, allow_unused=True)
    dt = torch.promote_types(torch.float32, x_src.dtype)

    def integrate(x, base, g):
        g = torch.zeros((n * batch, *x.shape[1:]), dtype=x.dtype) if g is None else g
        d = x if base is None else x - base.to(x.dtype)
        return (d.to(dt) * g.to(dt).view(n, batch, *x.shape[1:]).sum(0)).sum(-1)

    a_src, a_tgt = integrate(x_src, x0[0], g_src), integrate(x_tgt, x0[1], g_tgt)
    t64, b64 = value.detach().double(), value0.detach().double()
    delta = a_src.double().sum(-1) + a_tgt.double().sum(-1) - (t64 - b64)
    warn_unconverged(delta, t64 - b64, n, baseline_hint(model, baseline))  # completeness checked as on one stack
    return Seq2SeqAttributionResult(
        source_attribution=a_src, target_attribution=a_tgt, convergence_delta=delta, target=t64,
        baseline_target=b64, target_ids=tid, n_steps=n, method=method, coverage=cov,
        source_tokens=strings(tokenizer, kwargs["input_ids"], kwargs.get("attention_mask")),
        decoder_tokens=strings(tokenizer, dec, dmask), target_tokens=explained(tokenizer, tid))
