"""The last block's MLP at the metric's positions only, for blockwise patching.

Blockwise patching (:mod:`pyattr.patching.blockwise`, nodes; :mod:`pyattr.patching.edges_blockwise`,
edges) re-runs the last block for every patched node or edge, and the output head reads it
at the metric's positions only (``logits_to_keep``: the positions the logit targets read).
Every other position of the last block's output is computed and thrown away; the MLP is
position-wise and most of a block's arithmetic (two or three ``hidden × intermediate``
matmuls per position against attention's four ``hidden × hidden`` ones), so the last block
runs its MLP at the kept positions only, its output there exact, elsewhere the MLP's output
0 (read by nothing). Attention still runs at every position: its keys and values are every
position's.

Read off the module, then observed: the cut is made only for an MLP whose forward, as it
runs now, does nothing but chain its own position-wise children (linear maps, known
activations, dropout) with elementwise products and sums (:func:`positionwise`: a gated
MLP, GPT-2's; not a mixture of experts, whose routing code is not read here, nor an MLP
with a token capacity or any other step across positions, nor one with hooks on it or its
children), where the last block with it gives the recorded clean output at the kept
positions, where the model's head runs at the metric's positions (a language-model head
that takes ``logits_to_keep``, every target a logit), and where what follows the last block
reads those positions alone: the metric is unchanged, bit for bit, when the last block's
output changes at every other position (a final norm, or a hook on it, that mixes positions
fails that; :meth:`pyattr.patching.blockwise.BlockCalls.cut_last_mlp`). Elsewhere the block
runs whole.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
from typing import Optional, Tuple

import torch
from torch import nn

from pyattr._module_forward import forward_of, global_hooks, replaced_on_instance
from pyattr.architectures.forms import function_def
from pyattr.patching.calls import first_input, first_output as _first, hooks_around, replace_input
from pyattr.patching.calls import with_first_output as _with_first


@contextlib.contextmanager
def mlp_at(mlp: nn.Module, positions: torch.Tensor):
    """While open, ``mlp`` computes at ``positions`` (LongTensor[k], sorted) of its input's
    sequence dimension (dim 1) only; its output is 0 at every other position.

    The hooks go first on the module: a forward hook registered earlier (a patching tap on
    the MLP's output) sees the full-length output; pre-hooks registered earlier (a changed
    input) have run before the cut."""
    length = []

    def pre(mod, args, kwargs):
        x = first_input(args, kwargs)
        length.append(x.shape[1])
        return replace_input(args, kwargs, x[:, positions.to(x.device)], "mlp_at")

    def post(mod, args, kwargs, out):
        y = _first(out)
        full = y.new_zeros((y.shape[0], length.pop(), *y.shape[2:]))
        full[:, positions.to(y.device)] = y
        return _with_first(out, full)

    with hooks_around(mlp, pre, post):
        yield


#: children an MLP may call for its forward to be position-wise: their class's own forward
_POSITIONWISE = (nn.Linear, nn.Dropout, nn.Identity)


def _positionwise_child(mod: nn.Module) -> bool:
    from pyattr.activations import _kind_of_module
    from pyattr.integration.install import has_hooks

    if has_hooks(mod) or replaced_on_instance(mod) or any(True for _ in mod.children()):
        return False
    if _kind_of_module(mod) is not None:   # a known activation, its forward observed
        return True
    classes = _POSITIONWISE + _conv1d()
    return any(type(mod).forward is c.forward for c in classes if isinstance(mod, c))


def _conv1d() -> tuple:
    """transformers' Conv1D (GPT-2's linear map with transposed weights), where installed."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency of every model here
        return ()
    return (Conv1D,)


@functools.lru_cache(maxsize=256)
def _chain_of_children(code) -> Optional[frozenset]:
    """The ``self.<name>`` attributes a forward calls, when its body is only assignments to
    names, calls of ``self.<name>(...)`` on names and such calls, elementwise ``*`` ``+`` ``-``
    ``/`` and a return (a docstring allowed); None for anything else (an index, a method of
    a tensor, a reduction, a loop: any of them could mix positions), and for a forward that
    takes anything besides its input (another tensor, cut or not, could carry other positions)."""
    parsed = function_def(code)
    if parsed is None or not isinstance(parsed[0], ast.FunctionDef):
        return None
    sig = parsed[0].args
    if sig.vararg or sig.kwarg or sig.kwonlyargs or len(sig.posonlyargs) + len(sig.args) != 2:
        return None
    body = parsed[1]
    called = set()

    def expr(e) -> bool:
        if isinstance(e, ast.Name):
            return True
        if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Mult, ast.Add, ast.Sub, ast.Div)):
            return expr(e.left) and expr(e.right)
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and isinstance(e.func.value, ast.Name) \
                and e.func.value.id == "self" and not e.keywords and len(e.args) == 1:
            called.add(e.func.attr)
            return expr(e.args[0])
        return False

    for st in body:
        if isinstance(st, ast.Assign) and all(isinstance(t, ast.Name) for t in st.targets):
            ok = expr(st.value)
        elif isinstance(st, ast.Return) and st.value is not None:
            ok = expr(st.value)
        else:
            ok = False
        if not ok:
            return None
    return frozenset(called)


def positionwise(mlp: nn.Module) -> bool:
    """True when ``mlp`` computes each position from that position alone, as read off the
    forward it runs now (module docstring): every statement chains its position-wise
    children, none has hooks, nor the MLP itself, and no hook is registered for every
    module; a decorated forward is not read (the decorator could mix positions)."""
    from pyattr.integration.install import has_hooks

    fn = forward_of(mlp)
    code = getattr(fn, "__code__", None)
    if inspect.ismethod(fn) or code is None or inspect.unwrap(fn) is not fn or has_hooks(mlp) or global_hooks():
        return False
    called = _chain_of_children(code)
    children = dict(mlp.named_children())
    return bool(called) and all(n in children and _positionwise_child(children[n]) for n in called)


def checked_cut(calls, mlp: nn.Module, positions: Optional[torch.Tensor], batch: int) -> Optional[Tuple]:
    """``(mlp, positions)`` when the last block with its MLP cut to ``positions`` gives the
    recorded clean output there (to float rounding: another matmul shape); else None."""
    last = len(calls.blocks) - 1
    if mlp is None or not positionwise(mlp) or positions is None or calls.y[last] is None or calls.y[last].dim() != 3:
        return None
    if positions.numel() == calls.y[last].shape[1]:
        return None        # every position is read: nothing to cut
    idx = torch.arange(batch, device=calls.x[last].device)
    want = calls.y[last].detach()[:, positions.to(idx.device)]
    try:
        with mlp_at(mlp, positions):
            got = _first(calls.rerun(last, idx, calls.x[last].detach(), batch))[:, positions.to(idx.device)]
    except (IndexError, RuntimeError, TypeError, ValueError):
        return None        # an MLP whose input is not (batch, sequence, ...): it runs whole
    if got.shape != want.shape:
        return None
    scale = float(want.abs().max()) if want.numel() else 0.0
    # another matmul shape rounds differently: a few units in the last place of the largest
    # value (a bfloat16 output a few of its own), far below what a position mixed in moves
    tol = min(64 * torch.finfo(want.dtype).eps, 0.03) * max(scale, 1.0)
    return (mlp, positions) if float((got - want).abs().max()) <= tol else None


def last_mlp(model: nn.Module, generic: bool) -> Optional[nn.Module]:
    """The last block's MLP module (the patching nodes' ``mlp`` site), or None where the
    architecture names none."""
    from pyattr.patching.nodes import node_sites

    try:
        return node_sites(model, ["mlp"], generic)["mlp"][-1].module
    except ValueError:
        return None
