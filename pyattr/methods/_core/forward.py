"""One forward and its backward as every method runs them: the model called on the
prepared kwargs (caches copied, rotary state reset, read-outs per row), the targets
evaluated, and the (batched) backward."""

from __future__ import annotations

import contextlib
import time
from typing import List, Optional

import torch
from torch import nn

import pyattr.architectures as A
import pyattr.methods._core.readout as R
import pyattr.methods._core.state as S
import pyattr.targets as T
from pyattr.methods._core.inputs import Prepared, accepts
from pyattr.methods._core.taps import tap
from pyattr.targets.stacked import stacked_values


def evaluate_targets(targets: List[T.Target], fwd: T.Forward, several: bool):
    """``(values, ids, fixed)``: values ``Tensor[batch]`` / ``Tensor[]`` (``(k, batch)``
    when ``several``); ids like that when every target is a logit, else None; ``fixed``
    the targets with the token ids chosen here (top-1) kept, for the baseline and path
    passes, which must explain the token chosen at the real input."""
    if several:
        stacked = stacked_values(targets, fwd)
        if stacked is not None:  # token ids given: nothing to fix
            return stacked[0], stacked[1], list(targets)
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
        layout = (" (k targets, batch): the result's target layout, the transpose of (batch, k) target ids"
                  if value.dim() == 2 else " (batch,)")
        raise ValueError(f"grad_outputs of shape {tuple(grad_outputs.shape)} must match the target's shape "
                         f"{tuple(value.shape)}{layout}")
    if not bool(torch.isfinite(grad_outputs).all()):
        raise ValueError("grad_outputs holds NaN or inf; the relevance would be NaN")
    return grad_outputs.to(device=value.device, dtype=value.dtype)


def backward(value: torch.Tensor, wrt: List[torch.Tensor], go: torch.Tensor, several: bool, retain: bool = False,
             chunks=None, finite: bool = True):
    """Gradients of ``value`` (weighted by ``go``) with respect to ``wrt``; k targets run
    as one batched backward (``is_grads_batched``). ``chunks`` (k targets only): an object
    with ``next() -> int`` and ``measured(steps, seconds, peak_bytes)`` and a ``meter``
    (:class:`~pyattr.methods._core.peak_memory.PeakMemory`): the k targets then run as
    several batched backwards of ``chunks.next()`` targets over the one forward's graph
    (kept until the last), each timed and its memory peak measured for ``chunks``."""
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
            if chunks is None:
                grads = torch.autograd.grad(value, wrt, g, is_grads_batched=True, allow_unused=True,
                                            retain_graph=retain)
            else:
                grads = _chunked(value, wrt, g, chunks, retain)
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
    if finite:
        check_gradient_finite(grads[0], several)
    return grads


def check_gradient_finite(grad: torch.Tensor, several: bool) -> None:
    """A finite explained value can still have a NaN gradient (a softmax over a row its mask
    hides entirely, at a pad position, is NaN in float64's eager attention): relevance from it
    would be NaN. ValueError naming the row (and the target of k)."""
    where = _not_finite_at(grad, several)
    if where is None:
        return
    raise ValueError(f"the model's backward gives a gradient that is not finite (NaN or inf) at {where}, though the "
                     "explained value is finite, so its relevance would be NaN (an eager attention mask that hides a "
                     "whole row, at a pad position, does this in float64; try float32 or attn_implementation='sdpa')")


def _chunked(value: torch.Tensor, wrt: List[torch.Tensor], g: torch.Tensor, chunks, retain: bool):
    """``torch.autograd.grad`` of the k rows of ``g`` in consecutive chunks, the graph kept
    between them; the chunks' gradients concatenated (None stays None)."""
    k = g.shape[0]
    parts, t0 = [], 0
    while t0 < k:
        n = max(1, min(k - t0, chunks.next()))
        chunks.meter.start()
        tic = time.perf_counter()
        try:
            part = torch.autograd.grad(value, wrt, g[t0:t0 + n], is_grads_batched=True, allow_unused=True,
                                       retain_graph=retain or t0 + n < k)
        finally:
            seconds, peak = time.perf_counter() - tic, chunks.meter.stop()
        chunks.measured(n, seconds, peak)
        parts.append(part)
        t0 += n
    return tuple(None if parts[0][i] is None else torch.cat([p[i] for p in parts]) for i in range(len(wrt)))


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


def _lm_head(model: nn.Module) -> bool:
    """The model's logits come from a language-model head (its output embeddings), one row
    per kept position: a sequence-classification model that takes ``logits_to_keep`` too
    (BioGPT's) pools its per-position scores afterwards, and a cut would break the pooling."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        return isinstance(get() if callable(get) else None, nn.Module)
    except (NotImplementedError, AttributeError):
        return False


def run_model(model: nn.Module, prep: Prepared, targets, store: dict, kwargs: Optional[dict] = None,
              keep_logits: bool = False) -> T.Forward:
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
    kept = head_positions(model, prep, targets, kwargs) if keep_logits else None
    if kept is not None:
        kwargs = {**kwargs, "logits_to_keep": kept.to(prep.input_ids.device)}
    # each forward gets its own copy of the caller's caches and starts from the rotary
    # modules' pretrained state: no forward sees what an earlier one left behind
    kwargs = S.fresh(kwargs)
    S.reset_rotary(model)
    with R.first_real_token(model, prep.attention_mask), entry_layout(model, prep):
        out = model(**kwargs)
    return T.Forward(out, prep.input_ids, prep.attention_mask, store, kept)


def head_positions(model: nn.Module, prep: Prepared, targets, kwargs: dict) -> Optional[torch.Tensor]:
    """The positions the language-model head runs at under :func:`run_model`'s
    ``keep_logits`` (the logit targets' positions, sorted), or None where it runs at every
    position: a target that is not a logit, a model whose forward takes no ``logits_to_keep``
    or whose logits are not a language-model head's, a caller's own ``logits_to_keep``, or
    ``labels`` (the model's own loss would compare the kept logits with every label)."""
    kept = T.logit_positions(targets, prep.input_ids, prep.attention_mask)
    if (kept is None or "logits_to_keep" in kwargs or "labels" in kwargs
            or not accepts(model, "logits_to_keep", by_name=True) or not _lm_head(model)):
        return None
    return kept


def _not_finite_at(t: torch.Tensor, several: bool) -> Optional[str]:
    """Where ``t`` (a value (batch,) / (k, batch), or a gradient with the same leading
    dimensions) first holds a NaN or an infinity: ``"row r"`` (``"row r, target j"`` of k
    targets); None where it is finite."""
    bad = ~torch.isfinite(t.detach())
    if not bool(bad.any()):
        return None
    at = [int(i) for i in bad.nonzero()[0]]
    return f"row {at[1]}, target {at[0]}" if several and len(at) >= 2 else f"row {at[0] if at else 0}"


def check_finite(value: torch.Tensor, caller: str, several: bool) -> None:
    """The explained value must be finite: relevance of a NaN or an infinity is NaN, with no
    number a reader could use. ValueError naming the row (and the target of k)."""
    where = _not_finite_at(value, several)
    if where is None:
        return
    raise ValueError(
        f"{caller}(): the model's output is not finite (NaN or inf) at {where}, so nothing can be computed from it "
        "(some models' eager attention masks give NaN in float64: transformers' left-padded eager attention, "
        "ProphetNet with any attention mask; try float32)")


def check_steps_finite(steps: torch.Tensor, value: torch.Tensor) -> None:
    """Every generated step's explained value (Tensor[batch, generated], where ``steps``
    is true) must be finite: ValueError naming the first row and step that is not."""
    bad = steps.cpu() & ~torch.isfinite(value)
    if bool(bad.any()):
        row, step = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"the model's output is not finite (NaN or inf) at row {row}, step {step}: no relevance can be computed "
            "there (some models' eager attention masks give NaN in float64: transformers' left-padded eager "
            "attention, ProphetNet with any attention mask; try float32 or attn_implementation='sdpa')")


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


@contextlib.contextmanager
def entry_layout(model: nn.Module, prep: Prepared):
    """During a forward, check that the residual stream enters the blocks as (batch,
    position, …) in the layout every method reads: one row per input row, one position per
    token, and for an image [CLS] then its patches row by row. ValueError otherwise, before
    a number is read: a model that runs its inputs position first (XLNet transposes its
    token ids), adds tokens (DeiT's distillation token, DINOv2's registers) or drops
    patches (ViT-MAE's random masking) would give relevance on the wrong tokens."""
    batch, seq = (int(n) for n in prep.input_ids.shape[:2])
    name = type(model).__name__

    def entry(t):
        if prep.patch_grid is not None and t.dim() >= 2 and t.shape[0] == batch and t.shape[1] != seq:
            rows, cols = prep.patch_grid
            raise ValueError(
                f"inputs: the blocks of {name} see {t.shape[1]} tokens per image, but the patch layout ([CLS] + "
                f"{rows}×{cols} patches) has {seq}: the model adds tokens (a distillation or register token) or "
                "drops patches (random masking), so relevance per patch cannot be laid out on the image")
        if t.dim() < 2 or tuple(t.shape[:2]) != (batch, seq):
            raise ValueError(_position_first(name, tuple(t.shape), batch, seq))
        if t.dim() > 3:
            raise ValueError(
                f"inputs: the blocks of {name} carry hidden states shaped {tuple(t.shape)}, (batch, position, "
                f"{', '.join(map(str, t.shape[2:-1]))}, hidden): several residual streams (hyper-connections), which "
                "relevance per token (one residual stream per position) cannot describe")
        return None

    def ids(mod, args):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        ref = prep.kwargs.get("input_ids")
        if x is not None and isinstance(ref, torch.Tensor) and x.dim() == 2 and ref.dim() == 2 and \
                x.shape == ref.shape[::-1] and not torch.equal(x, ref) and torch.equal(x, ref.transpose(0, 1)):
            raise ValueError(_position_first(name, tuple(x.shape), batch, seq))

    emb = None
    if prep.patch_grid is None and isinstance(prep.kwargs.get("input_ids"), torch.Tensor):
        emb = A.input_embeddings(model)
    handle = emb.register_forward_pre_hook(ids) if isinstance(emb, nn.Module) else None
    try:
        with tap(prep.entry, prep.where, entry, once=True):
            yield
    finally:
        if handle is not None:
            handle.remove()


def _position_first(name: str, shape: tuple, batch: int, seq: int) -> str:
    how = "(position, batch, …)" if shape[:2] == (seq, batch) else "another layout"
    return (f"inputs: {name} runs its inputs with shape {shape}, {how} rather than (batch {batch}, position {seq}, "
            "…): pyattr reads the residual stream per row and position, and cannot lay out relevance for a model "
            "that reorders them (XLNet runs position first)")
