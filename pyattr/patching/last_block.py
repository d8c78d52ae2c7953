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

Observed, not assumed: the cut is kept only where the last block with it gives the
recorded clean output at the kept positions (a mixture of experts with a token capacity, an
MLP that mixes positions or takes its input in another layout fails that, and runs whole),
and only where the model's head runs at the metric's positions (a language-model head that
takes ``logits_to_keep``, every target a logit).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
from torch import nn

from pyattr.patching.calls import first_input, first_output as _first, replace_input
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

    handles = [mlp.register_forward_pre_hook(pre, with_kwargs=True),
               mlp.register_forward_hook(post, with_kwargs=True, prepend=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def kept_positions(model: nn.Module, targets, prep) -> Optional[torch.Tensor]:
    """The positions the output head runs at for ``targets`` (as
    :func:`pyattr.methods._core.forward.run_model` cuts it), or None where it runs at every
    position (a target that is not a logit, a model without a language-model head that takes
    ``logits_to_keep``, a caller's own ``logits_to_keep`` or ``labels``)."""
    import pyattr.targets as T
    from pyattr.methods._core.forward import _lm_head
    from pyattr.methods._core.inputs import accepts

    if "logits_to_keep" in prep.kwargs or "labels" in prep.kwargs:
        return None
    kept = T.logit_positions(targets, prep.input_ids, prep.attention_mask)
    if kept is None or not accepts(model, "logits_to_keep", by_name=True) or not _lm_head(model):
        return None
    return kept.cpu()


def checked_cut(calls, mlp: nn.Module, positions: Optional[torch.Tensor], batch: int) -> Optional[Tuple]:
    """``(mlp, positions)`` when the last block with its MLP cut to ``positions`` gives the
    recorded clean output there (to float rounding: another matmul shape); else None."""
    last = len(calls.blocks) - 1
    if mlp is None or positions is None or calls.y[last] is None or calls.y[last].dim() != 3:
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
