"""Relevance (gradient × input under the rules), as in RelP (arXiv 2508.21258) and AttnLRP
(ICML 2024): with the rules installed, the backward of the target is a relevance
propagation, and ``input · grad`` at the embeddings is each input's relevance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from pyattr import _forward as F
from pyattr import _groups as G
from pyattr import _model_state as S
from pyattr import _readout as R
from pyattr import backends
from pyattr import targets as T
from pyattr.integration.config import RelevanceRuleCoverage, RelevanceRules
from pyattr.integration.wrappers import unwrap

Target = Union[None, int, Sequence[int], torch.Tensor, Callable, T.Target, Sequence[T.Target]]


@dataclass
class RelevanceResult:
    """Output of :func:`relevance`.

    With k targets per row (``target`` a ``LongTensor[batch, k]`` or a list of k target
    objects) every tensor field gains a leading ``k`` dimension.

    Attributes:
        token_relevance (Tensor[batch, seq], float32): relevance per token (sum over hidden).
        relevance (Tensor[batch, seq, hidden], float32): relevance per embedding dimension,
            ``x · g``, or ``(x − x₀) · g`` with a baseline.
        target (Tensor[batch] or Tensor[], float64): the explained value(s) f(x).
        conservation_delta (Tensor, like ``target``, float64): ``w·target − Σ relevance``
            per row, ``w`` the ``grad_outputs`` (1 by default); with a baseline,
            ``w·(f(x) − f(x₀)) − Σ relevance``. Near 0 for bias-free models with all rules
            on; otherwise the relevance absorbed by biases and rules left off.
        target_ids (Tensor[batch] or None): the token ids explained, for logit targets.
        coverage (RelevanceRuleCoverage): what the rule scope installed and skipped.
        backend (str): the backend that ran the rule backwards.
        baseline_target (Tensor like ``target``, float64, or None): f(x₀) with a baseline.
        patch_grid ((rows, cols) or None): for image inputs (``pixel_values``), the patch
            grid; ``token_relevance`` then holds the [CLS] token first and the patches row
            by row (see :meth:`patch_relevance`).
    """

    token_relevance: torch.Tensor
    relevance: torch.Tensor
    target: torch.Tensor
    conservation_delta: torch.Tensor
    target_ids: Optional[torch.Tensor]
    coverage: RelevanceRuleCoverage
    backend: str
    baseline_target: Optional[torch.Tensor] = None
    patch_grid: Optional[Tuple[int, int]] = None

    def patch_relevance(self) -> torch.Tensor:
        """Relevance per image patch, ``Tensor[..., batch, rows, cols]`` (float32): the
        patch tokens of ``token_relevance`` laid out as the image's grid, the [CLS] token
        (``token_relevance[..., 0]``) left out.

        Raises:
            ValueError: the input was not an image (no ``patch_grid``).
        """
        if self.patch_grid is None:
            raise ValueError("patch_relevance(): the input was token ids, not an image (pixel_values)")
        rows, cols = self.patch_grid
        return self.token_relevance[..., 1:].reshape(*self.token_relevance.shape[:-1], rows, cols)


# --------------------------------------------------------------------------- shared pieces


def evaluate_targets(targets: List[T.Target], fwd: T._Forward, several: bool):
    """``(values, ids, fixed)``: values ``Tensor[batch]`` / ``Tensor[]`` (``(k, batch)``
    when ``several``); ids like that when every target is a logit, else None; ``fixed``
    the targets with the token ids chosen here (top-1) kept, for the baseline and path
    passes, which must explain the token chosen at the real input."""
    vals, ids = zip(*(t.value(fwd) for t in targets))
    fixed = [t.fixed(i) for t, i in zip(targets, ids)]
    if not several:
        return vals[0], ids[0], fixed
    batch = fwd.input_ids.shape[0]
    for v in vals:
        if v.dim() != 1 or v.shape[0] != batch:
            raise ValueError(f"target: each of k targets must give one value per batch row ({batch},), got shape {tuple(v.shape)}")
    tid = torch.stack(ids) if all(i is not None for i in ids) else None
    return torch.stack(vals), tid, fixed


def check_grad_outputs(grad_outputs, value: torch.Tensor) -> torch.Tensor:
    """The initial gradient (tdhook's ``init_attr_grads``), shaped like the target."""
    if grad_outputs is None:
        return torch.ones_like(value)
    if not isinstance(grad_outputs, torch.Tensor):
        grad_outputs = torch.as_tensor(grad_outputs)
    if not (grad_outputs.is_floating_point()):
        raise TypeError(f"grad_outputs must be a floating tensor, got dtype {grad_outputs.dtype}")
    if grad_outputs.shape != value.shape:
        raise ValueError(
            f"grad_outputs of shape {tuple(grad_outputs.shape)} must match the target's shape {tuple(value.shape)}"
        )
    return grad_outputs.to(device=value.device, dtype=value.dtype)


def backward(value: torch.Tensor, wrt: List[torch.Tensor], go: torch.Tensor, several: bool, retain: bool = False):
    """Gradients of ``value`` (weighted by ``go``) with respect to ``wrt``; k targets run
    as one batched backward (``is_grads_batched``)."""
    if not value.requires_grad:
        raise ValueError(
            "target: the explained value does not depend on the inputs through differentiable "
            "operations (detached, .item(), argmax, or a module computed before the input embeddings), "
            "so every relevance would be 0"
        )
    if several:
        k = value.shape[0]
        if _runs_compiled_backward(value):
            raise _unbatchable(k, "a torch.compile'd model's backward cannot run batched")
        eye = torch.eye(k, dtype=value.dtype, device=value.device)
        g = eye.view(k, k, *([1] * (value.dim() - 1))) * go.unsqueeze(0)  # (k, k, batch)
        try:
            grads = torch.autograd.grad(value, wrt, g, is_grads_batched=True, allow_unused=True, retain_graph=retain)
        except (NotImplementedError, RuntimeError) as e:
            text = str(e)
            if "atch" not in text:  # "Batching rule", "BatchedTensorImpl", "batched"
                raise
            raise _unbatchable(k, f"an op in this model's backward cannot run batched ({' '.join(text.split())[:200]})") from e
    else:
        grads = torch.autograd.grad(value, wrt, go, allow_unused=True, retain_graph=retain)
    if grads[0] is None:
        raise ValueError(
            "target: the explained value does not depend on the inputs (its gradient at the input "
            "embeddings is empty); choose a target computed after the embeddings"
        )
    return grads


def _unbatchable(k: int, why: str) -> RuntimeError:
    return RuntimeError(f"target: {k} targets run as one batched backward (is_grads_batched), and {why}; explain "
                        "the targets one call at a time")


def _runs_compiled_backward(value: torch.Tensor) -> bool:
    """The autograd graph behind ``value`` holds a torch.compile'd region
    (``CompiledFunctionBackward``); a walk over its nodes, each once."""
    seen, todo = set(), [value.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in type(node).__name__:
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


def pad_token_id(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    pad = getattr(cfg, "pad_token_id", None)
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    if pad is None:
        raise ValueError(
            f"baseline='pad' needs a pad token id, and {type(model).__name__}.config.pad_token_id is None; "
            "set model.config.pad_token_id, or pass baseline='zeros' or a tensor"
        )
    return int(pad)


def precheck_baseline(model: nn.Module, baseline, inputs=None) -> None:
    """What can be checked about a baseline before any pass: its kind, and a pad token for
    ``"pad"`` (its shape is checked against the embeddings once they are known)."""
    if isinstance(baseline, str):
        if baseline not in ("zeros", "pad"):
            raise ValueError(f"baseline must be 'zeros', 'pad' or a tensor, got {baseline!r}")
        if baseline == "pad" and F._is_pixels(inputs):
            raise ValueError(
                "baseline='pad' runs the pad token at every position, and image inputs (pixel_values) have "
                "no tokens; pass baseline='zeros' or a tensor shaped like the patch embeddings (batch, tokens, hidden)"
            )
        if baseline == "pad":
            pad_token_id(model)
    elif baseline is not None:
        if not isinstance(baseline, torch.Tensor):
            raise TypeError(f"baseline must be 'zeros', 'pad' or a tensor, got {type(baseline).__name__}")
        if not baseline.is_floating_point():
            raise TypeError(f"baseline must be a floating tensor, got dtype {baseline.dtype}")
        if not torch.isfinite(baseline).all():
            raise ValueError("baseline holds NaN or inf")


def check_baseline(baseline, x: torch.Tensor) -> Union[None, str, torch.Tensor]:
    """A baseline :func:`precheck_baseline` accepted, against the embeddings ``x``: a tensor
    is broadcast to ``x``'s shape (batch, seq, hidden) from ``x``'s, ``(1, seq, hidden)``
    or ``(seq, hidden)``; ``None``, ``"zeros"`` and ``"pad"`` pass through."""
    if not isinstance(baseline, torch.Tensor):
        return baseline
    ok = (tuple(x.shape), (1, *x.shape[1:]), tuple(x.shape[1:]))
    if tuple(baseline.shape) not in ok:
        raise ValueError(
            f"baseline of shape {tuple(baseline.shape)} does not match the input embeddings: expected "
            f"{tuple(x.shape)} (batch, seq, hidden), {(1, *x.shape[1:])} or {tuple(x.shape[1:])}"
        )
    return baseline.detach().to(device=x.device, dtype=x.dtype).expand(x.shape)


def baseline_forward(model, prep: F.Prepared, baseline, x: torch.Tensor, targets, extra_pairs=(), extra_names=()):
    """One forward at the baseline input (no gradient): ``(x₀, f(x₀), extra activations)``.

    ``"pad"`` runs the pad token at every real position (same mask and positions), so
    every module, those before the entry included, sees the baseline input;
    ``"zeros"`` and tensors replace the embeddings where they enter the first block, so
    a module in ``extra_pairs`` that runs before that point cannot see them: ValueError.
    """
    kwargs = dict(prep.kwargs)
    seen: dict = {}
    if isinstance(baseline, str) and baseline == "pad":
        R.check_pad_baseline(model, prep.attention_mask, "baseline")
        kwargs["input_ids"] = torch.full_like(prep.input_ids, pad_token_id(model))
        replace = None
    else:
        replace = torch.zeros_like(x) if isinstance(baseline, str) else baseline

    def entry_fn(t):
        seen["x0"] = t.detach() if replace is None else replace
        return None if replace is None else replace

    acts: List[Optional[torch.Tensor]] = [None] * len(extra_pairs)
    early: List[str] = []

    def fn_for(i):
        def fn(t):
            if "x0" not in seen and replace is not None and extra_pairs[i][0] is not prep.entry:
                early.append(extra_names[i] if extra_names else str(i))
            acts[i] = t.detach().clone()
            return None

        return fn

    store: dict = {}
    with torch.no_grad(), F.tap(prep.entry, prep.where, entry_fn, once=True), F.taps(extra_pairs, fn_for), \
            F.record_modules(model, T.module_paths(targets), store):
        fwd = run_model(model, prep, targets, store, kwargs,
                        keep_logits=head_free(model, [m for m, _ in extra_pairs]))
        value, _, _ = evaluate_targets(targets, fwd, len(targets) > 1)
    if "x0" not in seen:
        raise RuntimeError("the embedding entry point was not reached during the baseline forward pass")
    if early:
        raise ValueError(
            f"baseline: layer {early[0]!r} runs before the input embeddings enter the first block, where "
            "a 'zeros' or tensor baseline is placed, so it would never see the baseline; use "
            + ("a later layer (image inputs have no pad token)" if prep.patch_grid is not None else
               "baseline='pad' (the pad token runs through every module) or a later layer")
        )
    return seen["x0"], value.detach().double(), acts


def run_model(model: nn.Module, prep: F.Prepared, targets, store: dict, kwargs: Optional[dict] = None,
              keep_logits: bool = False) -> T._Forward:
    """``model(**kwargs)`` → what the targets read.

    ``keep_logits``: when every target is a logit, the language-model head runs only at
    the positions they read (``logits_to_keep``, for models whose forward takes it and a
    caller who passed neither it nor ``labels``). The head's full-vocabulary matmul at every position is
    the largest single cost of a pass on a long input (its backward too, with k targets).
    A logit it gives equals the full head's up to float rounding (another matmul shape,
    so possibly not in the last bits, a few ulp); a caller who wants the full head passes
    ``logits_to_keep=0`` with the inputs. Off where a read layer runs on the cut
    hidden states (:func:`head_free`)."""
    kwargs = prep.kwargs if kwargs is None else kwargs
    check_caller_logits_to_keep(kwargs, targets)
    kept = T.logit_positions(targets, prep.input_ids, prep.attention_mask) if keep_logits else None
    # with labels, the model's own loss would compare the kept logits with every label
    if (kept is not None and "logits_to_keep" not in kwargs and "labels" not in kwargs
            and F.accepts(model, "logits_to_keep", by_name=True)):
        kwargs = {**kwargs, "logits_to_keep": kept.to(prep.input_ids.device)}
    else:
        kept = None
    # each forward gets its own copy of the caller's caches and starts from the rotary
    # modules' pretrained state: no forward sees what an earlier one left behind
    kwargs = S.fresh(kwargs)
    S.reset_rotary(model)
    with R.first_real_token(model, prep.attention_mask):
        out = model(**kwargs)
    return T._Forward(out, prep.input_ids, prep.attention_mask, store, kept)


def check_caller_logits_to_keep(kwargs: dict, targets) -> None:
    """A ``logits_to_keep`` of the caller other than 0 (the full head) leaves logits at
    some positions only, indexed from 0 again; a logit target names its position in the
    input, so it would read another position's logit (or fail on an index): ValueError."""
    given = kwargs.get("logits_to_keep")
    every = isinstance(given, int) and not isinstance(given, bool) and given == 0
    if given is None or every or not any(isinstance(t, (T.Logit, T.LogitDiff)) for t in targets):
        return
    shown = given.tolist() if isinstance(given, torch.Tensor) else given
    raise ValueError(
        f"inputs: logits_to_keep={shown!r} keeps the logits of some positions only, but a logit target reads the "
        "logit at its position in the input; pass logits_to_keep=0 (the full head) or leave it out (pyattr then "
        "runs the head at the target positions itself)"
    )


def head_free(model: nn.Module, modules) -> bool:
    """No module in ``modules`` runs after the hidden states are cut to the kept
    positions: then the head may run at the target positions only (the layers read keep
    their full shape). Hugging Face cuts before everything outside the base model (BERT's
    ``cls.predictions.transform``, RoBERTa's ``lm_head.dense`` run on the cut states too),
    so a read module must lie inside ``model.base_model`` and outside the output embeddings."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not model:
        inside = {id(m) for m in base.modules()}
        return all(id(m) in inside for m in modules)
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    cut = {id(m) for m in head.modules()} if head is not None else set()
    return not any(id(m) in cut for m in modules)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


# --------------------------------------------------------------------------- relevance


def relevance(
    model: nn.Module,
    inputs,
    target: Target = None,
    rules: Optional[RelevanceRules] = None,
    *,
    baseline=None,
    grad_outputs=None,
    attention_mask: Optional[torch.Tensor] = None,
    generic: bool = False,
) -> RelevanceResult:
    """Relevance of each input token for ``target``: gradient × input under the rules.

    The input is the residual stream as the first block sees it: ``inputs_embeds`` for
    Llama-style models, word + position embeddings for GPT-2 / GPT-NeoX, and the sum of
    word, position and token-type embeddings before the first LayerNorm for BERT.

    Args:
        model (nn.Module): a supported Hugging Face model (see :func:`use_relevance_rules`).
        inputs (LongTensor[batch, seq] | FloatTensor[batch, channels, height, width] | Mapping):
            token ids, or a tokenizer output (``input_ids``, optional ``attention_mask`` and
            other model kwargs); for vision transformers (ViT, CLIP's vision tower) the
            ``pixel_values`` or an image processor's output. An image's relevance is
            measured at the patch embeddings as the first block sees them ([CLS] token and
            position embeddings added): one value per token, [CLS] first.
        target: what to explain (:mod:`pyattr.targets`): ``None`` (the top-1 next-token
            logit at each row's last real position; for a classifier, the top-1 class
            logit), a token or class id (``int``, NumPy integer,
            0-d tensor), one token id per row (list, 1-d or ``(batch, 1)`` integer tensor
            or array), ``Logit`` / ``LogitDiff`` / ``ModuleOutput``, or a callable
            ``f(output) -> Tensor[]`` or ``Tensor[batch]``. k targets per row: a
            ``LongTensor[batch, k]`` or a list of k target objects, explained with one
            forward and one batched backward (``is_grads_batched``); every result field
            gains a leading ``k`` dimension. Default: None.
        rules (RelevanceRules, optional): Default: ``RelevanceRules.all()``, the four rules
            with AH-rule attention (``RelevanceRules()`` is every rule off: plain gradients).
        baseline: ``None``, ``"zeros"``, ``"pad"`` (the pad token's embedding at every
            position; needs ``model.config.pad_token_id``) or a tensor shaped like the
            embeddings (batch, seq, hidden) or (seq, hidden). Relevance becomes
            ``(x − x₀) · g`` and the delta is taken against ``f(x) − f(x₀)`` (one more
            forward, without gradient).
        grad_outputs (Tensor, optional): the initial gradient, shaped like the target
            ((batch,), or (k, batch)); default ones (tdhook's ``init_attr_grads``).
        attention_mask (Tensor[batch, seq], optional): 1 for real tokens.
        generic (bool): structural rule installation for architectures without a rule map.

    Returns:
        RelevanceResult with ``token_relevance`` (batch, seq), ``relevance``
        (batch, seq, hidden), ``target`` and ``conservation_delta``.

    Logit targets run the language-model head at their positions only
    (``logits_to_keep``, where the model's forward takes it): ``target`` is the model's
    logit from that call, equal to the full head's up to the last bits (a few ulp). Passing
    ``logits_to_keep=0`` with the inputs keeps the full head. No key/value cache is built
    (``use_cache=False`` unless the inputs set it).

    The model runs in eval mode with its parameters' ``requires_grad`` off during the
    pass; both are restored afterwards, also when the call fails. The pass enables
    autograd for itself, so a call under ``torch.no_grad()`` returns the same result.
    Padded rows (``attention_mask``) equal the same row alone: position ids are counted
    along the mask in the model's own convention (see
    :func:`pyattr._forward.padding_positions`), read-outs at position 0 ([CLS]) take each
    row's first real token (:mod:`pyattr._readout`), and on a model whose forward depends
    on the longest position in the batch (dynamic-NTK RoPE, LongRoPE) rows run in groups
    of one rotary regime (:mod:`pyattr._groups`). A key/value cache in the inputs
    (``past_key_values`` / ``cache``, with a mask over cache + new tokens or none) is
    copied for every forward, so the call leaves it unchanged and a second call gives the
    same result.

    Raises:
        TypeError / ValueError: malformed inputs, target, baseline or grad_outputs (the
            message names which); a target that does not depend on the inputs; a
            left-padded batch on a model whose forward takes no ``position_ids``.
        RuntimeError: a call under ``torch.inference_mode()``; the model's parameters are
            inference tensors.
        RelevanceRuleUnsupportedError, RelevanceRuleConflictError: see :func:`use_relevance_rules`.
    """
    model = unwrap(model)
    precheck_baseline(model, baseline, inputs)
    prep = F.prepare(model, inputs, attention_mask, "relevance")
    batch = prep.input_ids.shape[0]
    tgts, several = T.normalize(target, batch)
    rules = F.rule_defaults(rules)
    groups = G.row_groups(model, prep)
    if groups is None:
        return _relevance(model, prep, tgts, several, rules, baseline, grad_outputs, generic)
    # the forward depends on the batch (dynamic-NTK / LongRoPE): one call per regime
    d = 1 if several else 0
    grad_outputs = None if grad_outputs is None else torch.as_tensor(grad_outputs)
    parts = [_relevance(model, F.select_rows(prep, idx), [t.rows(idx, batch) for t in tgts], several, rules,
                        G.rows_of(baseline, idx, batch) if isinstance(baseline, torch.Tensor) and baseline.dim() == 3
                        else baseline, G.rows_of(grad_outputs, idx, batch, d), generic) for idx in groups]
    dims = {"token_relevance": d, "relevance": d, "target": d, "conservation_delta": d, "target_ids": d,
            "baseline_target": d}
    return G.merge(parts, groups, batch, dims)


def _relevance(model, prep: F.Prepared, tgts, several: bool, rules: RelevanceRules, baseline, grad_outputs,
               generic: bool) -> RelevanceResult:
    store: dict = {}
    with F.attribution_pass(model, rules, generic, "relevance") as cov:
        xs: List[torch.Tensor] = []

        def entry_fn(t):
            xs.append(leaf(t))
            return xs[-1]

        with F.tap(prep.entry, prep.where, entry_fn, once=True), F.record_modules(model, T.module_paths(tgts), store):
            fwd = run_model(model, prep, tgts, store, keep_logits=True)
        if not xs:
            raise RuntimeError("the embedding entry point was not reached during the forward pass")
        x = xs[0]
        value, tid, fixed = evaluate_targets(tgts, fwd, several)
        go = check_grad_outputs(grad_outputs, value)
        base = check_baseline(baseline, x)
        (grad,) = backward(value, [x], go, several)
        backend_name = backends.select(x.device, "identity")
        del fwd, store
        if base is not None:
            x0, f0, _ = baseline_forward(model, prep, base, x, fixed)
    xd = x.detach()
    diff = xd if base is None else xd - x0
    rel = diff.float() * grad.float()
    tok = rel.sum(-1)
    t64 = value.detach().double()
    w = go.detach().double()
    explained = t64 if base is None else t64 - f0
    sums = rel.double().sum(dim=(-2, -1)) if t64.dim() >= 1 else rel.double().sum()
    delta = w * explained - sums
    return RelevanceResult(
        token_relevance=tok,
        relevance=rel,
        target=t64,
        conservation_delta=delta,
        target_ids=tid,
        coverage=cov,
        backend=backend_name,
        baseline_target=None if base is None else f0,
        patch_grid=prep.patch_grid,
    )
