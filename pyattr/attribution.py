"""Relevance (gradient × input under the rules), as in RelP (arXiv 2508.21258) and AttnLRP
(ICML 2024): with the rules installed, the backward of the target is a relevance
propagation, and ``input · grad`` at the embeddings is each input's relevance."""

from __future__ import annotations

import contextlib
import inspect
import numbers
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
    # a tokenizer or collator may hand over None for absent inputs
    for key in [k for k, v in kwargs.items() if v is None]:
        del kwargs[key]
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
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token), or booleans")
        if bool((mask.sum(1) == 0).any()):
            raise ValueError("attention_mask has a row with no real token (all zeros)")
        kwargs["attention_mask"] = mask
    return kwargs


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _has_sliding_window(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return False
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return True
    return bool(getattr(cfg, "sliding_window", None)) and getattr(cfg, "use_sliding_window", True) is not False


def _padding_positions(model: nn.Module, kwargs: dict) -> dict:
    """Position ids that make a padded row equal to the same row alone.

    Hugging Face models build positions with ``arange(seq)`` whatever the mask, so a row
    left-padded by ``p`` tokens would see its tokens at positions ``p, p+1, …``: a different
    input for absolute position embeddings (GPT-2, BERT) and for sliding windows. As
    ``generate`` does, the real tokens get ``0, 1, …`` counted along the mask; pad
    positions get 0 (they are masked out and never attended to). Right-padded and
    unpadded rows get the same ids as ``arange``. Ids the caller passes are kept.
    """
    mask = kwargs.get("attention_mask")
    if mask is None:
        return kwargs
    m = mask.to(torch.long)
    # padding between real tokens: a sliding window counts raw positions, so a gap would
    # change which tokens a query sees
    first = m.argmax(1)
    last = m.shape[1] - 1 - m.flip(1).argmax(1)
    gaps = (m.sum(1) != last - first + 1)
    if bool(gaps.any()) and _has_sliding_window(model):
        row = int(gaps.nonzero()[0, 0])
        raise ValueError(
            f"attention_mask row {row} has padding between real tokens; {type(model).__name__} uses "
            "sliding-window attention over raw positions, so that row would not equal the row alone. "
            "Pad on the left or on the right only."
        )
    if "position_ids" in kwargs:
        return kwargs
    pos = (m.cumsum(-1) - 1).clamp_min(0) * m
    if torch.equal(pos, torch.arange(m.shape[1], device=m.device).expand_as(m) * m):
        return kwargs  # no row has padding before a real token: arange is already right
    if not _accepts(model, "position_ids"):
        raise ValueError(
            f"attention_mask pads some rows on the left, but {type(model).__name__}.forward takes no "
            "position_ids, so those rows would see shifted positions and a different result than "
            "alone; pad on the right, or pass inputs the model can position itself"
        )
    return {**kwargs, "position_ids": pos}


def _last_positions(ids: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    if mask is None:
        return torch.full((ids.shape[0],), ids.shape[1] - 1, dtype=torch.long, device=ids.device)
    flipped = torch.flip(mask.to(torch.long), dims=[1])
    return ids.shape[1] - 1 - flipped.argmax(dim=1)


def _is_integer(v) -> bool:
    """Python and NumPy integers (``numbers.Integral``), not bools."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_int64(v: int) -> None:
    if not -(2**63) <= v < 2**63:
        raise ValueError(f"target: token id {v} is out of range for a token id")


def _target_ids(target, batch: int) -> torch.Tensor:
    """Token-id targets in any integer form → LongTensor[batch].

    Accepted: an int or NumPy integer, a 0-d integer tensor or array (one id for every
    row); a list / tuple, 1-d integer tensor or array with one id per row; a ``(batch, 1)``
    tensor, array or nested list. A single id given as a length-1 sequence is used for
    every row only when ``batch == 1``.
    """
    if _is_integer(target):
        _check_int64(int(target))
        return torch.full((batch,), int(target), dtype=torch.long)
    if isinstance(target, torch.Tensor):
        t = target.detach()
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise TypeError(f"target: token ids must be an integer tensor, got dtype {t.dtype}")
        t = t.to("cpu", torch.long)
    elif type(target).__module__ == "numpy" and hasattr(target, "dtype") and hasattr(target, "shape"):
        if target.dtype.kind not in "iu":
            raise TypeError(f"target: token ids must be an integer array, got dtype {target.dtype}")
        for v in (target.min(initial=0), target.max(initial=0)):
            _check_int64(int(v))
        t = torch.as_tensor(target.astype("int64"))
    elif isinstance(target, (list, tuple)):
        flat = [v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v for v in target]
        bad = [v for v in flat if not _is_integer(v) and not (isinstance(v, torch.Tensor) and v.numel() == 1)]
        if bad or any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.dtype == torch.bool) for v in flat):
            raise TypeError(f"target: token ids must be integers, got {target!r}")
        for v in flat:
            _check_int64(int(v))
        t = torch.tensor([int(v) for v in flat], dtype=torch.long)
    else:
        raise TypeError(f"target: token ids must be integers, got {type(target).__name__}")
    if t.dim() == 0:
        return t.expand(batch).clone()
    if t.dim() == 2 and t.shape[1] == 1:
        t = t[:, 0]
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(
            f"target: expected one token id per batch row, shape ({batch},) or ({batch}, 1), "
            f"got shape {tuple(t.shape)}"
        )
    return t


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
        tid = _target_ids(target, batch).to(logits.device)
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
    """eval() mode and parameters frozen for the pass, restored afterwards.

    Only parameters that required grad are touched, and the ``training`` flags are
    restored first."""
    training = [(m, m.training) for m in model.modules()]
    frozen = []
    try:
        model.eval()
        for p in model.parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen.append(p)
        yield
    finally:
        for m, t in training:
            m.training = t
        for p in frozen:  # never inference tensors: _check_parameters_usable refused those
            p.requires_grad_(True)


def _no_inference_tensors(kwargs: dict) -> dict:
    """Inputs created under ``torch.inference_mode()`` cannot enter an autograd graph;
    copies of them can (integer ids and masks are small)."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) and v.is_inference() else v) for k, v in kwargs.items()}


def _check_parameters_usable(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if p.is_inference():
            raise RuntimeError(
                f"relevance(): parameter {name!r} is an inference tensor (the model was created or "
                "loaded under torch.inference_mode()), and autograd cannot differentiate through it. "
                "Load the model outside inference_mode, or replace its parameters with clones made "
                "outside it."
            )


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
            a token id (``int``, NumPy integer, 0-d tensor), one token id per row (list,
            1-d or ``(batch, 1)`` integer tensor or array), or a callable ``f(output) -> Tensor[]`` or
            ``Tensor[batch]`` for any other differentiable target. Default: None.
        rules (RelevanceRules, optional): Default: ``RelevanceRules.all()``, the four rules
            with AH-rule attention (``RelevanceRules()`` is every rule off).
        attention_mask (Tensor[batch, seq], optional): 1 for real tokens.
        generic (bool): class-based rule installation for unknown architectures.

    Returns:
        RelevanceResult with ``token_relevance`` (batch, seq), ``relevance``
        (batch, seq, hidden), ``target`` and ``conservation_delta``.

    The model runs in eval mode with its parameters' ``requires_grad`` off during the
    pass; both are restored afterwards, also when the call fails. The pass enables
    autograd for itself, so a call under ``torch.no_grad()`` or ``torch.inference_mode()``
    returns the same result. Padded rows (``attention_mask``) equal the same row alone:
    position ids are counted along the mask (see :func:`_padding_positions`).

    Raises:
        TypeError / ValueError: malformed inputs or target (the message names which); a
            left-padded batch on a model whose forward takes no ``position_ids``.
        RuntimeError: the model's parameters are inference tensors.
        RelevanceRuleUnsupportedError, RelevanceRuleConflictError: see :func:`use_relevance_rules`.
    """
    kwargs = _normalise_inputs(inputs, attention_mask)
    ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
    if isinstance(target, (bool, str, bytes, float)) or (
        target is not None
        and not callable(target)
        and not _is_integer(target)
        and not isinstance(target, (Sequence, torch.Tensor))
        and type(target).__module__ != "numpy"
    ):
        raise TypeError(
            f"target must be None, a token id, a list of ids or a callable, got {type(target).__name__}"
        )
    entry, where = _entry_module(model)
    _check_parameters_usable(model)
    kwargs = _padding_positions(model, _no_inference_tensors(kwargs))
    store: list = []
    rules = RelevanceRules.all() if rules is None else rules
    # The pass needs autograd whatever the caller's grad mode: a call under torch.no_grad()
    # or torch.inference_mode() gives the same result as outside (as Captum does).
    with torch.inference_mode(False), torch.enable_grad(), _inference_state(model), use_relevance_rules(
        model, rules, generic=generic
    ) as cov:
        if cov.inherited:
            raise RelevanceRuleConflictError(
                f"relevance(rules={rules}) runs inside a use_relevance_rules scope that keeps other "
                f"rules on ({', '.join(sorted(cov.inherited))[:200]}); the result would not reflect "
                "`rules`. Call relevance() outside that scope, or with the same rules."
            )
        with _capture_leaf(entry, where, store):
            output = model(**kwargs)
        if not store:
            raise RuntimeError("the embedding entry point was not reached during the forward pass")
        x = store[0]
        if callable(target):
            t = target(output)
            if not isinstance(t, torch.Tensor) or t.dim() > 1 or (t.dim() == 1 and t.shape[0] != ids.shape[0]):
                raise ValueError("target: the callable must return a scalar tensor or one value per batch row")
            if not t.is_floating_point():
                raise TypeError(
                    f"target: the callable returned a {t.dtype} tensor; it must return a floating value "
                    "computed from the output (e.g. out.logits[:, -1, token_id]), not ids or a comparison"
                )
            if not t.requires_grad:
                raise ValueError(
                    "target: the callable's value does not depend on the model output through "
                    "differentiable operations (detached, .item(), argmax, …), so every relevance would be 0"
                )
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
