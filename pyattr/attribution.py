"""Relevance (gradient × input under the rules), as in RelP (arXiv 2508.21258) and AttnLRP
(ICML 2024): with the rules installed, the backward of the target is a relevance
propagation, and ``input · grad`` at the embeddings is each input's relevance."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from pyattr import backends
from pyattr.integration import architectures as A
from pyattr.integration.config import RelevanceRuleCoverage, RelevanceRules
from pyattr.integration.errors import RelevanceRuleConflictError
from pyattr.integration.scope import model_type_of, use_relevance_rules

Target = Union[None, int, Sequence[int], torch.Tensor, Callable]


@dataclass
class RelevanceResult:
    """Output of :func:`relevance`.

    Attributes:
        token_relevance (Tensor[batch, seq], float32): relevance per token (sum over hidden).
        relevance (Tensor[batch, seq, hidden], float32): relevance per embedding dimension.
        target (Tensor[batch] or Tensor[], float64): the explained value(s).
        conservation_delta (Tensor, like ``target``, float64): ``target − Σ relevance``
            (per row for per-row targets). Near 0 for bias-free models with all rules on;
            otherwise the relevance absorbed by biases and rules left off.
        target_ids (Tensor[batch] or None): the token ids explained, for logit targets.
        coverage (RelevanceRuleCoverage): what the rule scope installed and skipped.
        backend (str): the backend that ran the rule backwards.
    """

    token_relevance: torch.Tensor
    relevance: torch.Tensor
    target: torch.Tensor
    conservation_delta: torch.Tensor
    target_ids: Optional[torch.Tensor]
    coverage: RelevanceRuleCoverage
    backend: str


def _normalise_inputs(inputs, attention_mask):
    if isinstance(inputs, torch.Tensor):
        kwargs = {"input_ids": inputs}
    elif isinstance(inputs, Mapping):
        if "input_ids" not in inputs:
            raise ValueError("inputs: a mapping must contain 'input_ids'")
        kwargs = dict(inputs)
    else:
        raise TypeError(f"inputs must be a LongTensor of token ids or a mapping, got {type(inputs).__name__}")
    ids = kwargs["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise TypeError("inputs: input_ids must be an integer tensor of shape (batch, seq)")
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(
            f"inputs: input_ids must have shape (batch, seq) with batch > 0 and seq > 0, got {tuple(ids.shape)}"
        )
    kwargs["input_ids"] = ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a tensor of shape (batch, seq), got {type(mask).__name__}")
        if mask.dim() == 1:
            mask = mask.unsqueeze(0)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask of shape {tuple(mask.shape)} must match input_ids {tuple(ids.shape)}")
        if bool((mask.sum(1) == 0).any()):
            raise ValueError("attention_mask has a row with no real token (all zeros)")
        kwargs["attention_mask"] = mask
    return kwargs


def _last_positions(ids: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    if mask is None:
        return torch.full((ids.shape[0],), ids.shape[1] - 1, dtype=torch.long, device=ids.device)
    flipped = torch.flip(mask.to(torch.long), dims=[1])
    return ids.shape[1] - 1 - flipped.argmax(dim=1)


def _logit_target(output, ids, mask, target):
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, torch.Tensor):
        logits = output
    if logits is None or logits.dim() != 3:
        raise ValueError(
            "target: a token id needs a model that returns next-token logits of shape (batch, seq, vocab); "
            "for other outputs pass a callable target"
        )
    batch, vocab = ids.shape[0], logits.shape[-1]
    pos = _last_positions(ids, mask)
    rows = torch.arange(batch, device=logits.device)
    last = logits[rows, pos]  # (batch, vocab)
    if target is None:
        tid = last.detach().argmax(-1)
    else:
        if isinstance(target, int):
            tid = torch.full((batch,), target, dtype=torch.long)
        else:
            items = target.tolist() if isinstance(target, torch.Tensor) else list(target)
            if any(isinstance(i, bool) or not isinstance(i, int) for i in items):
                raise TypeError(f"target: token ids must be integers, got {target!r}")
            tid = torch.tensor(items, dtype=torch.long)
            if tid.dim() != 1 or tid.shape[0] != batch:
                raise ValueError(f"target: expected one token id per batch row ({batch}), got {target!r}")
        tid = tid.to(device=logits.device, dtype=torch.long)
        if bool(((tid < 0) | (tid >= vocab)).any()):
            raise ValueError(f"target: token ids must be in [0, {vocab}), got {tid.tolist()}")
    return last.gather(1, tid[:, None]).squeeze(1), tid


def _entry_module(model: nn.Module):
    mt = model_type_of(model)
    if mt in A.ARCHITECTURES:
        path, _ = A.ARCHITECTURES[mt].entry
        mod = A.get_submodule(model, A.join(A.base_prefix(model), path))
        if mod is not None:
            return mod, "input"
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        raise ValueError("cannot find where the input embeddings enter the model")
    return emb, "output"


@contextlib.contextmanager
def _capture_leaf(module: nn.Module, where: str, store: list):
    """Make the residual stream entering the model a leaf that requires grad."""

    def leaf(x):
        y = x.detach().requires_grad_(True)
        store.append(y)
        return y

    if where == "input":

        def pre(mod, args, kwargs):
            if store:
                return None
            if args:
                return (leaf(args[0]),) + tuple(args[1:]), kwargs
            for key in ("hidden_states", "input", "x"):
                if key in kwargs:
                    kwargs = dict(kwargs)
                    kwargs[key] = leaf(kwargs[key])
                    return args, kwargs
            return None

        h = module.register_forward_pre_hook(pre, with_kwargs=True)
    else:

        def post(mod, args, out):
            return None if store else leaf(out)

        h = module.register_forward_hook(post)
    try:
        yield
    finally:
        h.remove()


@contextlib.contextmanager
def _inference_state(model: nn.Module):
    """eval() mode and parameters frozen for the pass, restored afterwards."""
    training = [(m, m.training) for m in model.modules()]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, f in flags:
            p.requires_grad_(f)
        for m, t in training:
            m.training = t


def relevance(
    model: nn.Module,
    inputs,
    target: Target = None,
    rules: Optional[RelevanceRules] = None,
    *,
    attention_mask: Optional[torch.Tensor] = None,
    generic: bool = False,
) -> RelevanceResult:
    """Relevance of each input token for ``target``: gradient × input under the rules.

    The input is the residual stream as the first block sees it: ``inputs_embeds`` for
    Llama-style models, word + position embeddings for GPT-2 / GPT-NeoX, and the sum of
    word, position and token-type embeddings before the first LayerNorm for BERT.

    Args:
        model (nn.Module): a supported Hugging Face model (see :func:`use_relevance_rules`).
        inputs (LongTensor[batch, seq] | Mapping): token ids, or a tokenizer output
            (``input_ids``, optional ``attention_mask`` and other model kwargs).
        target: ``None`` (the top-1 next-token logit at each row's last real position),
            a token id, one token id per row, or a callable ``f(output) -> Tensor[]`` or
            ``Tensor[batch]`` for any other differentiable target. Default: None.
        rules (RelevanceRules, optional): Default: all four rules, AH-rule attention.
        attention_mask (Tensor[batch, seq], optional): 1 for real tokens.
        generic (bool): class-based rule installation for unknown architectures.

    Returns:
        RelevanceResult with ``token_relevance`` (batch, seq), ``relevance``
        (batch, seq, hidden), ``target`` and ``conservation_delta``.

    The model runs in eval mode with its parameters' ``requires_grad`` off during the
    pass; both are restored afterwards.

    Raises:
        TypeError / ValueError: malformed inputs or target (the message names which).
        RelevanceRuleUnsupportedError, RelevanceRuleConflictError: see :func:`use_relevance_rules`.
    """
    kwargs = _normalise_inputs(inputs, attention_mask)
    ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
    if isinstance(target, (bool, str, bytes, float)) or (
        target is not None and not callable(target) and not isinstance(target, (int, Sequence, torch.Tensor))
    ):
        raise TypeError(
            f"target must be None, a token id, a list of ids or a callable, got {type(target).__name__}"
        )
    if torch.is_inference_mode_enabled():
        raise RuntimeError("relevance() needs autograd; it cannot run under torch.inference_mode()")
    entry, where = _entry_module(model)
    store: list = []
    rules = RelevanceRules() if rules is None else rules
    with _inference_state(model), use_relevance_rules(model, rules, generic=generic) as cov:
        if cov.inherited:
            raise RelevanceRuleConflictError(
                f"relevance(rules={rules}) runs inside a use_relevance_rules scope that keeps other "
                f"rules on ({', '.join(sorted(cov.inherited))[:200]}); the result would not reflect "
                "`rules`. Call relevance() outside that scope, or with the same rules."
            )
        with _capture_leaf(entry, where, store), torch.enable_grad():
            output = model(**kwargs)
        if not store:
            raise RuntimeError("the embedding entry point was not reached during the forward pass")
        x = store[0]
        if callable(target):
            t = target(output)
            if not isinstance(t, torch.Tensor) or t.dim() > 1 or (t.dim() == 1 and t.shape[0] != ids.shape[0]):
                raise ValueError("target: the callable must return a scalar tensor or one value per batch row")
            tid = None
        else:
            t, tid = _logit_target(output, ids, mask, target)
        if t.requires_grad:
            (grad,) = torch.autograd.grad(t.sum(), x, allow_unused=True)
        else:
            grad = None
        if grad is None:
            grad = torch.zeros_like(x)
        backend_name = backends.select(x.device, "identity")
    rel = x.detach().float() * grad.float()
    tok = rel.sum(-1)
    t64 = t.detach().double()
    if t64.dim() == 0:
        delta = t64 - rel.double().sum()
    else:
        delta = t64 - rel.double().sum(dim=(1, 2))
    return RelevanceResult(
        token_relevance=tok,
        relevance=rel,
        target=t64,
        conservation_delta=delta,
        target_ids=tid,
        coverage=cov,
        backend=backend_name,
    )
