"""``capture``: record module outputs, inputs and the gradients reaching them, over any
number of forward and backward passes, with optional gradient interventions.

Semantics follow the anchors: nnsight's ``.grad`` on a module's output (one value per
backward pass, hooks removed once done), Captum's layer capture (recorded values are
detached clones, so in-place ops after the module cannot corrupt them), and tdhook's
``output_grad_callbacks`` (``grad_edits`` replace the gradient at a module's output).

The module is not named ``capture.py``: the public function ``pyattr.capture`` would be
shadowed by a submodule of the same name.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

import pyattr.architectures as A
import pyattr.backends._vmap as _vmap
from pyattr.integration.wrappers import unwrap
from pyattr.results import ResultViews

GradEdit = Callable[[torch.Tensor], torch.Tensor]


# --- helpers ------------------------------------------------------------------------------


def _task_id() -> int:
    """The running backward pass's graph-task id (unique per ``backward`` / ``autograd.grad``
    call), -1 outside a backward."""
    return torch._C._current_graph_task_id()


def _first_tensor(obj: Any) -> Optional[torch.Tensor]:
    """The first tensor of ``obj`` depth-first: itself, or inside a tuple / list / mapping
    (Hugging Face ``ModelOutput`` included)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, Mapping):
        obj = obj.values()
    elif not isinstance(obj, (tuple, list)):
        return None
    for item in obj:
        t = _first_tensor(item)
        if t is not None:
            return t
    return None


def _detached_clone(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a detached clone, the structure kept: tuples
    (named ones included), lists, dicts and ``ModelOutput``s; other objects (``None``,
    caches, numbers) are kept as they are, by reference."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, tuple):
        items = [_detached_clone(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [_detached_clone(x) for x in obj]
    if isinstance(obj, Mapping):
        items = {k: _detached_clone(v) for k, v in obj.items()}
        if type(obj) is not dict and hasattr(obj, "to_tuple"):  # transformers' ModelOutput
            return type(obj)(**items)
        return items
    return obj


def _arg_order(module: nn.Module) -> List[str]:
    """Parameter names of the module class's ``forward``, in order (the instance's
    ``forward`` may be a rule patch taking ``*args, **kwargs``)."""
    try:
        return list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return []


def _first_tensor_arg(args: tuple, kwargs: dict, order: List[str]) -> Optional[torch.Tensor]:
    """The first tensor argument: positional first, then keyword in the order of the
    ``forward`` signature, then any other keyword in the order given."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for name in [*(n for n in order if n in kwargs), *(n for n in kwargs if n not in order)]:
        if isinstance(kwargs[name], torch.Tensor):
            return kwargs[name]
    return None


def _resolve(model: nn.Module, path: str) -> nn.Module:
    if not isinstance(path, str):
        raise TypeError(f"capture paths must be dotted module paths (str), got {type(path).__name__}")
    mod = A.get_submodule(model, path)
    if isinstance(mod, nn.Module):
        return mod
    names = [n for n, _ in model.named_modules(remove_duplicate=False)]
    near = difflib.get_close_matches(path, names, n=5, cutoff=0.6)
    hint = f"nearest: {', '.join(repr(n) for n in near)}" if near else "no module path is close to it"
    raise ValueError(f"{path!r} is not a module of this {type(model).__name__}; {hint}")


# --- records ------------------------------------------------------------------------------


class Captured(ResultViews):
    """What :func:`capture` recorded for one module path.

    Each call of the module inside the scope is one *call* (index ``i`` in call order,
    counted over every forward of the scope); each ``backward`` / ``autograd.grad`` that
    reaches the module's output is one *pass*.

    Attributes:
        path (str): the dotted module path.
        outputs (list): one entry per call: the output as the module returned it (a
            tensor, or a tuple / list / dict / ``ModelOutput`` such as
            ``(attn_output, attn_weights)``), every tensor in it a detached clone.
        output: the latest call's entry of ``outputs``; ``None`` before any call.
        inputs (list[Tensor or None]): with ``inputs=True``, one entry per call: a
            detached clone of the module's first tensor argument (positional, else keyword
            such as ``hidden_states``), taken before the module ran (an in-place module
            cannot change it); ``None`` for a call without a tensor argument.
        input (Tensor or None): the latest call's entry of ``inputs``.
        grads (list[Tensor]): one entry per backward pass that reached the output of any
            call, in pass order: the gradient of the output's first tensor, shaped like
            it, as it arrived (before ``grad_edits``), a detached clone; a batched backward
            (``is_grads_batched``, as for k targets in :func:`pyattr.relevance`) records
            one entry with the k gradients stacked in a leading dimension. When a pass
            reached several calls, the entry is the one of the latest call it reached (the
            call ``output`` shows when the pass followed the latest forward); every call's
            is in ``call_grads``. A pass that did not reach the module adds nothing.
        grad (Tensor or None): ``grads[-1]``; ``None`` while no pass reached the module.
        call_grads (list[dict[int, Tensor]]): one dict per entry of ``grads``, mapping
            each call index the pass reached to the gradient at that call's output.

    Reading ``input`` / ``inputs`` of a capture opened without ``inputs=True`` raises
    ``RuntimeError``. The records stay readable after the scope; they hold the memory
    of their clones until the :class:`Captured` (and its :class:`GradientCapture`) is
    dropped.
    """

    def __init__(self, path: str, record_inputs: bool):
        self.path = path
        self.outputs: List[Any] = []
        self._inputs: List[Optional[torch.Tensor]] = []
        self._record_inputs = record_inputs
        self._pending: List[Optional[torch.Tensor]] = []  # inputs of calls still running
        self._entries: List[Tuple[int, int, torch.Tensor]] = []  # (pass id, call, grad)

    @property
    def output(self) -> Any:
        return self.outputs[-1] if self.outputs else None

    @property
    def inputs(self) -> List[Optional[torch.Tensor]]:
        if not self._record_inputs:
            raise RuntimeError(f"{self.path!r}: inputs were not recorded; open the capture with inputs=True")
        return self._inputs

    @property
    def input(self) -> Optional[torch.Tensor]:
        inputs = self.inputs
        return inputs[-1] if inputs else None

    @property
    def call_grads(self) -> List[Dict[int, torch.Tensor]]:
        passes: Dict[int, Dict[int, torch.Tensor]] = {}
        for task, call, grad in self._entries:
            passes.setdefault(task, {})[call] = grad
        return [dict(sorted(p.items())) for p in passes.values()]

    @property
    def grads(self) -> List[torch.Tensor]:
        return [p[max(p)] for p in self.call_grads]

    @property
    def grad(self) -> Optional[torch.Tensor]:
        grads = self.grads
        return grads[-1] if grads else None

    def __repr__(self) -> str:
        return f"Captured({self.path!r}, calls={len(self.outputs)}, passes={len(self.call_grads)})"

    # save / load (pyattr.results.store): the records, without the hooks' bookkeeping
    def _pyattr_state(self) -> dict:
        return {"path": self.path, "outputs": self.outputs, "inputs": self._inputs,
                "record_inputs": self._record_inputs, "entries": [list(e) for e in self._entries]}

    @classmethod
    def _pyattr_restore(cls, state: dict) -> "Captured":
        out = cls(state["path"], state["record_inputs"])
        out.outputs, out._inputs = list(state["outputs"]), list(state["inputs"])
        out._entries = [tuple(e) for e in state["entries"]]
        return out


class GradientCapture(ResultViews, Mapping):
    """The scope :func:`capture` returns: a read-only mapping ``path -> Captured``.

    Hooks are registered on ``__enter__`` and every one of them (module forward hooks,
    forward pre-hooks, hooks on output tensors) is removed on ``__exit__``, exceptions
    included. A scope is entered once.
    """

    def __init__(
        self,
        model: nn.Module,
        paths: Union[str, Iterable[str]],
        inputs: bool = False,
        grad_edits: Optional[Dict[str, GradEdit]] = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        paths = [paths] if isinstance(paths, str) else list(paths)
        grad_edits = dict(grad_edits or {})
        for path, fn in grad_edits.items():
            if not callable(fn):
                raise TypeError(f"grad_edits[{path!r}] must be a callable grad -> grad, got {type(fn).__name__}")
        paths = list(dict.fromkeys([*paths, *grad_edits]))
        self._modules = {p: _resolve(model, p) for p in paths}
        self._records = {p: Captured(p, bool(inputs)) for p in paths}
        self._edits = grad_edits
        self._inputs = bool(inputs)
        self._handles: list = []
        self._entered = False

    # mapping
    def __getitem__(self, path: str) -> Captured:
        try:
            return self._records[path]
        except KeyError:
            raise KeyError(f"{path!r} is not captured here; captured: {list(self._records)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    @property
    def paths(self) -> List[str]:
        return list(self._records)

    def _pyattr_state(self) -> dict:
        return {"records": self._records, "inputs": self._inputs}

    @classmethod
    def _pyattr_restore(cls, state: dict) -> "GradientCapture":
        out = cls.__new__(cls)  # the records alone: no model, no hooks, not enterable
        out._records, out._inputs = dict(state["records"]), state["inputs"]
        out._modules, out._edits, out._handles, out._entered = {}, {}, [], True
        return out

    def __repr__(self) -> str:
        return f"GradientCapture({list(self._records.values())})"

    # scope
    def __enter__(self) -> "GradientCapture":
        if self._entered:
            raise RuntimeError("a capture scope can be entered once; call pyattr.capture again")
        self._entered = True
        try:
            for path, mod in self._modules.items():
                rec = self._records[path]
                if self._inputs:
                    order = _arg_order(mod)
                    self._handles.append(mod.register_forward_pre_hook(self._pre_hook(rec, order), with_kwargs=True))
                self._handles.append(mod.register_forward_hook(self._forward_hook(rec, self._edits.get(path))))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _remove(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        for rec in self._records.values():
            rec._pending.clear()

    # hooks
    def _pre_hook(self, rec: Captured, order: List[str]):
        def hook(module, args, kwargs):
            if _task_id() != -1:  # a recomputation during a backward (checkpointing)
                return None
            x = _first_tensor_arg(args, kwargs, order)
            rec._pending.append(None if x is None else x.detach().clone())
            return None

        return hook

    def _forward_hook(self, rec: Captured, edit: Optional[GradEdit]):
        def hook(module, args, output):
            if _task_id() != -1:  # a recomputation during a backward (checkpointing)
                return None
            if self._inputs:
                rec._inputs.append(rec._pending.pop() if rec._pending else None)
            rec.outputs.append(_detached_clone(output))
            t = _first_tensor(output)
            if t is not None and t.requires_grad:
                self._handles.append(t.register_hook(self._grad_hook(rec, len(rec.outputs) - 1, edit)))
            return None  # observe only: the output stays the module's own object

        return hook

    @staticmethod
    def _grad_hook(rec: Captured, call: int, edit: Optional[GradEdit]):
        def hook(grad: torch.Tensor):
            rec._entries.append((_task_id(), call, _vmap.physical_copy(grad)))
            if edit is None:
                return None
            new = edit(grad)
            if not isinstance(new, torch.Tensor):
                raise TypeError(f"grad_edits[{rec.path!r}] must return a Tensor, got {type(new).__name__}")
            if new.shape != grad.shape:
                raise ValueError(
                    f"grad_edits[{rec.path!r}] returned a gradient of shape {tuple(new.shape)}; "
                    f"the gradient at the output has shape {tuple(grad.shape)}"
                )
            if new.dtype != grad.dtype or new.device != grad.device:
                raise ValueError(
                    f"grad_edits[{rec.path!r}] returned a gradient of dtype {new.dtype} on {new.device}; "
                    f"the gradient at the output is {grad.dtype} on {grad.device}"
                )
            return new

        return hook


def capture(
    model: nn.Module,
    paths: Union[str, Iterable[str]],
    inputs: bool = False,
    grad_edits: Optional[Dict[str, GradEdit]] = None,
) -> GradientCapture:
    """Record, for each named module, every call's output (and input), and the gradient
    reaching its output in each backward pass, for the length of a ``with`` block.

    Args:
        model (nn.Module): any module; Hugging Face models included.
        paths (str or list[str]): dotted module paths as in ``model.named_modules()``
            (``"model.layers.3.mlp"``); duplicates are recorded once.
        inputs (bool, optional): also record each call's first tensor argument
            (positional, else keyword such as ``hidden_states``). Default: False.
        grad_edits (dict[str, callable], optional): ``{path: fn}``; during every backward
            in the scope, ``fn(grad) -> Tensor`` replaces the gradient at that module's
            output (its first tensor; of every call), as nnsight's ``.grad`` assignment
            and tdhook's ``output_grad_callbacks`` do: zero it to cut every relevance
            flowing only through the module, scale it to scale that share. ``fn`` must
            return a tensor of the gradient's shape, dtype and device and should not edit
            its argument in place. A path given only here is captured too. Default: None.

    Returns:
        GradientCapture: a mapping ``path -> Captured`` (see :class:`Captured`): per call
        ``.outputs`` / ``.output`` (and ``.inputs`` / ``.input``), per backward pass
        ``.grads`` / ``.grad`` (gradient as it arrived, before ``grad_edits``) and
        ``.call_grads``.

    What is stored: detached clones of every tensor of every call's output (and of the
    first tensor argument with ``inputs=True``) and of every gradient reaching an output,
    so in-place modules (``nn.ReLU(inplace=True)``), later hooks or ops editing the output
    in place never change a record (Captum clones layer outputs for the same reason).
    Memory: one copy of each recorded tensor, held until the result is dropped; non-tensor
    parts of an output (a KV cache object) are kept by reference.

    Behaviour:
        - The capture only observes: its forward hooks return nothing, so it composes with
          :func:`pyattr.use_relevance_rules` in any nesting order without a
          ``RelevanceRuleConflictError``; under rules the recorded gradients are the
          rule-modified ones. An ``act_fn`` inside a gated MLP is bypassed by the gated
          rule, so capturing it under that rule raises the scope's conflict error.
        - A pass is one ``backward()`` / ``autograd.grad`` call; several with
          ``retain_graph=True`` give one ``.grads`` entry each.
        - A forward under ``torch.no_grad()`` / ``inference_mode()`` records outputs but no
          gradient can reach them: ``.grads`` stays empty.
        - Forwards run during a backward (activation-checkpoint recomputations) are not
          recorded again. With non-reentrant checkpointing every gradient is captured; with
          reentrant checkpointing the block's own output is, but modules inside the block
          ran their recorded forward without autograd and get no ``.grads``.
        - Forward hooks registered after the capture's that replace the output are not
          seen by it.

    Raises:
        TypeError: ``model`` not a module, a path not a string, a ``grad_edits`` value not
            callable; during a backward, an edit returning a non-tensor.
        ValueError: a path that names no module (the message lists the nearest paths);
            during a backward, an edit returning another shape, dtype or device (the
            message names the path and both shapes). All hooks are removed when the
            ``with`` block exits, so none is left behind.

    Examples::

        with pyattr.capture(model, ["model.layers.1.mlp", "model.norm"], inputs=True) as cap:
            logits = model(ids).logits
            logits[:, -1, a].sum().backward(retain_graph=True)
            logits[:, -1, b].sum().backward()
        cap["model.layers.1.mlp"].grads      # [grad for a, grad for b], each (batch, seq, hidden)

        with pyattr.capture(model, [], grad_edits={"model.layers.1.mlp": torch.zeros_like}):
            ...                                # no gradient flows through that MLP
    """
    model = unwrap(model)
    return GradientCapture(model, paths, inputs=inputs, grad_edits=grad_edits)
