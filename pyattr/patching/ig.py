"""Attribution patching with integrated gradients (EAP-IG, Hanna et al., "Have faith in
faithfulness", COLM 2024, §3): the gradient at every node averaged over inputs on the
straight line from the clean to the corrupt input embeddings.

At ``α`` the embeddings entering the first block are ``x_clean + α (x_corrupt − x_clean)``,
so every node's activation moves along the model's own path from its clean to its
corrupt value at once: ``steps`` forwards and backwards (run as one batch of
``steps × batch`` rows, or chunks of it) serve every node, whatever their number.
The estimate of a node is ``(a_corrupt − a_clean) · mean_k ∂metric/∂a (α_k)`` with the
midpoint rule ``α_k = (k + ½) / steps``.
"""

from __future__ import annotations

from typing import List, Optional

import torch

import pyattr.methods._core as core
from pyattr.methods._core.forward import leaf
from pyattr.patching.nodes import Site
from pyattr.patching.pairs import Pair, recording_forward

DEFAULT_STEPS = 16


def entry_embeddings(model, prep: core.Prepared) -> torch.Tensor:
    """The embeddings where they enter the first block, (batch, seq, hidden), no gradient."""
    seen = {}

    def fn(t):
        seen["x"] = t.detach()
        return None

    with torch.no_grad(), core.tap(prep.entry, prep.where, fn, once=True):
        recording_forward(model, prep, [], [], grad=False, metric="skip")
    return seen["x"]


def path_gradients(model, pair: Pair, targets, sites: List[Site], steps: int,
                   batch_size: Optional[int] = None) -> List[Optional[torch.Tensor]]:
    """Mean over the ``steps`` midpoints of the gradient of the metric at each site, in the
    clean layout (batch, seq, width); None where the metric does not reach a site."""
    x_c = entry_embeddings(model, pair.clean)
    x_x = entry_embeddings(model, pair.corrupt)
    batch = pair.clean.input_ids.shape[0]
    alphas = (torch.arange(steps, dtype=torch.float64) + 0.5) / steps
    # every (step, row) is one row of a batched forward
    order = torch.cartesian_prod(torch.arange(steps), torch.arange(batch))
    chunk = batch_size or steps * batch
    sums: List[Optional[torch.Tensor]] = [None] * len(sites)
    for part in order.split(chunk):
        k, rows = part[:, 0], part[:, 1]
        a = alphas[k].to(device=x_c.device, dtype=x_c.dtype).view(-1, 1, 1)
        dev_rows = rows.to(x_c.device)
        x = x_c[dev_rows] + a * (x_x[dev_rows] - x_c[dev_rows])
        sub = core.select_rows(pair.clean, rows.to(pair.clean.input_ids.device))
        tg = [t.rows(rows, batch) for t in targets]
        with core.tap(sub.entry, sub.where, lambda t, x=x: leaf(x.to(t.dtype)), once=True):
            value, acts, _ = recording_forward(model, sub, tg, sites, grad=True)
        grads = torch.autograd.grad(value, acts, torch.ones_like(value), allow_unused=True)
        for i, g in enumerate(grads):
            if g is None:
                continue
            # sum this chunk's rows into their row of the batch (index_add: rows repeat across steps)
            acc = torch.zeros((batch, *g.shape[1:]), dtype=torch.float64, device=g.device)
            acc.index_add_(0, dev_rows.to(g.device), g.double())
            sums[i] = acc if sums[i] is None else sums[i] + acc
    return [None if s is None else (s / steps).float() for s in sums]
