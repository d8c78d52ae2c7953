"""AtP*'s fix for saturated attention (Kramár et al., "AtP*: An efficient and scalable
method for localizing LLM behaviour to components", arXiv 2403.00745, §3.1.1), for
residual-stream nodes.

Attribution patching linearises the metric through every attention softmax. Where the
clean pattern is saturated (one key takes nearly all the probability) the softmax's
gradient is near 0 and a patch that moves the pattern a long way gets an estimate near 0.
AtP* recomputes the pattern exactly instead. Patching the residual stream at the input of
block ``l`` at position ``p`` changes that block's attention input only at ``p`` (the
norm and the q/k projections act per position), so the patched pattern of block ``l``
is the clean one with query row ``p`` and key column ``p`` computed from the corrupt
run. The estimate of that node becomes

    Δr·g − Δr·g_pattern + Σ_{heads, s, t} (A′ − A)_{st} · ∂metric/∂A_{st}

with ``g`` the plain gradient at the node, ``g_pattern`` its part that flows through
block ``l``'s attention pattern (one vector-Jacobian product from ``∂metric/∂A``),
and ``A′`` block ``l``'s pattern recomputed by calling its attention module on the clean
input with position ``p`` replaced (all positions of a row batched). The later blocks'
softmaxes stay linearised, as in the paper's fix for a node's own queries and keys.
GradDrop (the paper's second fix) is not applied.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

import pyattr.architectures as A
from pyattr.patching.calls import RecordedCalls


def use_eager(model) -> None:
    """Switch a loaded Hugging Face model to eager attention (which returns the attention
    probabilities that ``method="atp*"`` needs)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    else:  # older transformers
        model.config._attn_implementation = "eager"


class AttentionCalls(RecordedCalls):
    """Records, per block, the attention module's call (args, kwargs), its first tensor
    input and the attention probabilities it returns."""

    caller = "method='atp*'"

    def __init__(self, model: nn.Module, blocks: List[str], generic: bool = False):
        arch = A.arch_of(model, generic)
        if arch is not None:
            A.require(arch, "attention_core", model, "method='atp*'")
        rel = arch.attention_core if arch is not None else None
        if rel is None:
            raise ValueError(
                f"method='atp*': {type(model).__name__} (model_type {A.model_type(model)!r}) has no attention module "
                "in the architecture table that returns its attention probabilities, which AtP* recomputes; "
                "use method='atp' or 'relp'"
            )
        super().__init__([model.get_submodule(f"{b}.{rel}") for b in blocks])
        self.model = model
        self.weights: List[Optional[torch.Tensor]] = [None] * len(blocks)

    def output(self, i: int, out) -> None:
        w = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        self.weights[i] = w if isinstance(w, torch.Tensor) else None

    def check(self) -> None:
        if any(w is None for w in self.weights):
            raise ValueError(
                f"method='atp*' recomputes the attention pattern and needs the attention probabilities, "
                f"which {type(self.model).__name__} returns only with eager attention (attn_implementation="
                f"{getattr(self.model.config, '_attn_implementation', None)!r}); load the model with "
                "attn_implementation='eager'"
            )

    def pattern_terms(self, inputs_x: List[torch.Tensor], d_weights: List[Optional[torch.Tensor]],
                      valid: torch.Tensor, budget: int = 1 << 24) -> torch.Tensor:
        """``Σ (A′ − A) · ∂metric/∂A`` per (batch, block, position): float32 (batch, layer, seq).

        ``A`` is recomputed from unpatched copies in the same batch shape as the patched
        ones, so identical clean and corrupt inputs give exactly 0. ``budget`` caps the
        elements of the patterns of one call (copies × heads × seq²)."""
        batch, seq = valid.shape
        out = torch.zeros(batch, len(self.modules), seq, dtype=torch.float64)
        with torch.no_grad():
            for layer, (mod, dA) in enumerate(zip(self.modules, d_weights)):
                if dA is None:
                    continue
                x_c = self.inputs[layer].detach()
                heads, q, k = dA.shape[1:]
                n_max = max(1, budget // max(1, heads * q * k))
                for b in range(batch):
                    positions = valid[b].nonzero().flatten().tolist()
                    ref: Dict[int, torch.Tensor] = {}
                    for start in range(0, len(positions), n_max):
                        ps = positions[start:start + n_max]
                        n = len(ps)
                        x = x_c[b:b + 1].expand(n, *x_c.shape[1:]).clone()
                        if n not in ref:
                            ref[n] = self._call(layer, b, x, batch)
                        idx = torch.tensor(ps, device=x.device)
                        x[torch.arange(n, device=x.device), idx] = inputs_x[layer][b, idx].to(x.dtype)
                        w = self._call(layer, b, x, batch)
                        term = ((w - ref[n]).double() * dA[b].double()).flatten(1).sum(1)
                        out[b, layer, ps] = term.cpu()
        return out.float()

    def _call(self, layer: int, row: int, x: torch.Tensor, batch: int) -> torch.Tensor:
        idx = torch.full((x.shape[0],), row, dtype=torch.long)
        return self.rerun(layer, idx, x, batch)[1]
