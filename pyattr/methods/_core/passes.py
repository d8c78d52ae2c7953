"""The model state for an attribution pass: autograd on, eval mode, parameters frozen,
checkpointing kept, the rules installed, and the output head's sparse-rows backward."""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import List

import torch
from torch import nn

import pyattr._function as _function
import pyattr.methods._core.state as S
from pyattr.integration.checkpoint import CHECKPOINT_INNER, bind_checkpoint
from pyattr.config import RelevanceRules
from pyattr.integration.errors import RelevanceRuleConflictError
from pyattr.integration.scope import use_relevance_rules


def check_parameters_usable(model: nn.Module, caller: str) -> None:
    for name, p in model.named_parameters():
        if p.is_inference():
            raise RuntimeError(
                f"{caller}(): parameter {name!r} is an inference tensor (the model was created or "
                "loaded under torch.inference_mode()), and autograd cannot differentiate through it. "
                "Load the model outside inference_mode, or replace its parameters with clones made "
                "outside it."
            )


def check_grad_mode(caller: str) -> None:
    """Every method needs autograd. ``torch.no_grad()`` is overridden for the pass (as
    Captum does); ``torch.inference_mode()`` is refused, because tensors made under it
    (the caller's inputs, cached weights) can never enter a graph."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{caller}() cannot run under torch.inference_mode(): attribution needs autograd, and "
            "tensors created in inference mode cannot be recorded for backward. Call it outside "
            "the inference_mode block (torch.no_grad() is fine: the pass enables autograd for itself)."
        )


_CHECKPOINT_TEST = "self.gradient_checkpointing and self.training"


def _checkpointing_modules(model: nn.Module) -> List[nn.Module]:
    """Modules with Hugging Face gradient checkpointing switched on, whose forward reads
    ``self.training`` only to decide whether to checkpoint.

    Hugging Face checkpoints only in training mode, so a pass in eval mode would silently
    drop the memory saving the user asked for. These modules alone stay in training mode
    (dropout lives in their child modules, which go to eval). A module whose own forward
    reads ``self.training`` for anything else (a functional dropout) stays in eval mode:
    its blocks are then not checkpointed, and the result is still exact."""
    found = []
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) is not True or not callable(
                getattr(m, "_gradient_checkpointing_func", None)):
            continue
        fn = type(m).forward
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        if "self.training" not in src.replace(_CHECKPOINT_TEST, ""):
            found.append(m)
    return found


def _reentrant(fn) -> bool:
    """``fn`` is ``partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)``, as
    ``gradient_checkpointing_enable()`` sets by default. PyTorch refuses reentrant
    checkpoints under ``torch.autograd.grad``, which every pass uses; the non-reentrant
    form recomputes the same block with the same memory saving, so the pass swaps it in."""
    import torch.utils.checkpoint as ckpt

    return (isinstance(fn, functools.partial) and fn.func is ckpt.checkpoint
            and fn.keywords.get("use_reentrant", True) is not False)


@contextlib.contextmanager
def inference_state(model: nn.Module):
    """eval() mode and parameters frozen for the pass, restored afterwards.

    Modules that checkpoint (``gradient_checkpointing_enable()``) stay in training mode,
    which is when Hugging Face checkpoints (:func:`_checkpointing_modules`). Only
    parameters that required grad are touched, and the ``training`` flags are restored
    first."""
    training = [(m, m.training) for m in model.modules()]
    frozen, swapped = [], []
    try:
        model.eval()
        for m in _checkpointing_modules(model):
            m.training = True
            fn = m.__dict__.get("_gradient_checkpointing_func")
            # an open use_relevance_rules scope has wrapped it (scope.bind_checkpoint): look inside
            inner = getattr(fn, CHECKPOINT_INNER, fn)
            if _reentrant(inner):
                swapped.append((m, fn))
                new = functools.partial(inner.func, *inner.args, **{**inner.keywords, "use_reentrant": False})
                m.__dict__["_gradient_checkpointing_func"] = new if inner is fn else bind_checkpoint(new, m)
        for p in model.parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen.append(p)
        yield
    finally:
        for m, t in training:
            m.training = t
        for m, fn in swapped:
            m.__dict__["_gradient_checkpointing_func"] = fn
        for p in frozen:  # never inference tensors: check_parameters_usable refused those
            p.requires_grad_(True)


class SparseRowsHeadFunction(torch.autograd.Function):
    """The output head's logits (computed natively, passed in) with a backward that
    multiplies only the rows of the logits' gradient that are not zero.

    A logit target's gradient is one-hot over (seq × vocab): the head's native backward
    multiplies the whole (seq × vocab) gradient by the (vocab × hidden) weight, about as
    much work as the head's forward, for rows that are zero. Here ``dh = dlogits[rows] · W``
    over the nonzero rows only (the others are exactly 0 either way); with more than half
    the rows nonzero, or a gradient batched by vmap, or a backward being recorded, the
    dense product runs. Saves the weight (a parameter) only."""

    @staticmethod
    def forward(ctx, h, logits, weight):
        ctx.save_for_backward(weight)
        ctx.h_meta = (h.shape, h.dtype)
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensors
        shape, dtype = ctx.h_meta
        flat = dy.reshape(-1, dy.shape[-1])
        wt = w.to(flat.dtype)
        import pyattr.backends._vmap as _vmap

        if torch.is_grad_enabled() or _vmap.batched(dy):
            return (flat @ wt).view(shape).to(dtype), None, None
        rows = flat.ne(0).any(-1).nonzero().squeeze(1)
        if 2 * rows.numel() > flat.shape[0]:
            return (flat @ wt).view(shape).to(dtype), None, None
        dh = flat.new_zeros(flat.shape[0], w.shape[1])
        dh.index_copy_(0, rows, flat.index_select(0, rows) @ wt)
        return dh.view(shape).to(dtype), None, None


@contextlib.contextmanager
def sparse_rows_head(model: nn.Module):
    """During a pass, the output head (an ``nn.Linear`` with a frozen weight) runs its
    backward through :class:`SparseRowsHeadFunction`; its forward output is the module's own."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    from torch.nn.modules import module as _module

    if (not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward or "forward" in head.__dict__
            or hasattr(head, "_hf_hook") or head._forward_hooks or _module._global_forward_hooks):
        # only a plain Linear's output is h·Wᵀ + b: a subclass's forward (a logit scale),
        # an instance patch or forward hook that changes the output, or an accelerate hook
        # (which swaps the weight in for the call only) keeps the native backward
        yield
        return

    def hook(mod, args, out):
        h = args[0] if args else None
        if (not torch.is_grad_enabled() or not isinstance(h, torch.Tensor) or not h.requires_grad
                or mod.weight.requires_grad or mod.weight.device != h.device or not isinstance(out, torch.Tensor)
                or (mod.bias is not None and mod.bias.requires_grad)
                or out.shape[:-1] != h.shape[:-1]):
            return None
        return SparseRowsHeadFunction.apply(h, out.detach(), mod.weight)

    handle = head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def attribution_pass(model: nn.Module, rules: RelevanceRules, generic: bool, caller: str):
    """Autograd on, eval mode, parameters frozen, the rules installed; yields the coverage.
    The output head's backward skips the zero rows of its gradient (:class:`SparseRowsHeadFunction`)."""
    with torch.enable_grad(), inference_state(model), S.keep_rotary_state(model), \
            use_relevance_rules(model, rules, generic=generic) as cov, sparse_rows_head(model), \
            _function.first_order_saves():
        if cov.inherited:
            raise RelevanceRuleConflictError(
                f"{caller}(rules={rules}) runs inside a use_relevance_rules scope that keeps other "
                f"rules on ({', '.join(sorted(cov.inherited))[:200]}); the result would not reflect "
                f"`rules`. Call {caller}() outside that scope, or with the same rules."
            )
        try:
            yield cov
        except RuntimeError as e:
            if "use_reentrant=True" not in str(e):
                raise
            raise RuntimeError(
                f"{caller}(): the model checkpoints with use_reentrant=True through a function pyattr "
                "cannot switch to the non-reentrant form (transformers' offload=True wrapper, or your "
                "own), and torch.autograd.grad, which every method uses, refuses reentrant checkpoints. "
                "Enable checkpointing with use_reentrant=False: model.gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False})"
            ) from e
