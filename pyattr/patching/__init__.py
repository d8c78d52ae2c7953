"""Circuit discovery by patching: how much does each component's activation matter for a
metric, when it is taken from a corrupted input instead of the clean one?

- :func:`activation_patching` measures it (the ground truth): one clean forward per node
  with that node's activation replaced by the corrupt run's, several patched runs batched
  into one forward.
- :func:`attribution_patching` estimates it for every node at once from two forwards and
  one backward: ``(a_corrupt − a_clean) · ∂metric/∂a`` at the clean run. With
  ``method="atp"`` the gradient is the plain one (attribution patching, Nanda 2022;
  Kramár et al., arXiv 2403.00745); with ``method="relp"`` it is the LRP-modified one
  under the relevance rules (RelP, Jafari et al., arXiv 2508.21258); ``method="atp*"``
  adds AtP*'s exact recomputation of the attention pattern for residual-stream nodes
  (Kramár et al., arXiv 2403.00745, §3.1.1; the formula is in ``pyattr/patching/atp_star.py``);
  ``method="blockwise"`` gives exact patching's effects computed from the clean run block by
  block (:mod:`pyattr.patching.blockwise`): the blocks before each node are not run again,
  the node's own block and every later block are, exactly, on the change before them.
- :func:`edge_attribution` scores every edge of the model's graph (EAP, EAP-IG, RelP, or
  exactly block by block); :func:`circuit_faithfulness` runs circuits of edges or of nodes
  exactly (MIB's CPR and CMD); :func:`circuit_search` finds node circuits greedily by the
  exact metric.

Nodes, per layer and token position (``"heads"`` and ``"neurons"`` add a last dimension):

- ``"residual"``: the residual stream at the block's input;
- ``"attention"``: the attention block's output after its output projection (BERT: the
  ``attention.output.dense`` output, before the residual add and the LayerNorm);
- ``"heads"``: each head's slice of the output projection's input (``o_proj`` / ``c_proj``
  / ``dense`` input, ``(batch, seq, heads·head_dim)`` split per head). Patching the slice
  patches the head's whole contribution; for a bias-free projection this equals patching
  the head's term after it;
- ``"mlp"``: the MLP block's output (BERT: ``output.dense``, before the residual add);
- ``"neurons"``: the MLP hidden activation (``act(g)·u`` for gated MLPs, ``act(x)``
  otherwise), one node per hidden unit.

The effect of a node is ``metric(clean run with the node patched) − metric(clean run)``.
Both functions run the model in eval mode (dropout off), so identical clean and corrupt
inputs give effects of exactly 0.
"""

from pyattr.patching.activation import activation_patching
from pyattr.patching.attribution import METHODS, PATCHING_RULES, attribution_patching
from pyattr.patching.circuit import CircuitFaithfulness, circuit_faithfulness, edge_effects
from pyattr.patching.edges import EDGE_METHODS, EDGE_RULES, EdgeAttributionResult, edge_attribution
from pyattr.patching.node_circuit import CIRCUIT_NODES, circuit_search
from pyattr.patching.nodes import NODES
from pyattr.patching.result import PatchingResult

__all__ = ["CIRCUIT_NODES", "CircuitFaithfulness", "EDGE_METHODS", "EDGE_RULES", "EdgeAttributionResult", "METHODS", "NODES", "PATCHING_RULES",
           "PatchingResult", "activation_patching", "attribution_patching", "circuit_faithfulness", "circuit_search", "edge_attribution",
           "edge_effects"]
