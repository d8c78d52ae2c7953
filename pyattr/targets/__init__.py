"""What an attribution explains: one target vocabulary for every method.

A target turns a forward pass into the explained value, one per batch row
(``Tensor[batch]``): tdhook's ``init_attr_targets``, Captum's ``target`` and neuron
selector. Every method (:func:`pyattr.relevance`, :func:`pyattr.layer_relevance`,
:func:`pyattr.integrated_gradients`) accepts:

- ``Logit(token_id, position=-1)``: a next-token logit; ``LogitDiff(a, b)``: ``logit[a] − logit[b]``;
  ``LogProb(token_id, position=-1, contrast=None, prob=False)``: its log-probability (or
  probability), optionally minus a contrast token's;
- ``ModuleOutput(path, select=None)``: a module's output (a neuron with ``select``);
- ``Cosine(reference)``: the cosine similarity of the mean-pooled sentence embedding with a
  fixed reference embedding (sentence-transformers models);
- ``None`` (the top-1 next token at each row's last real position), a token id, one id
  per row (list / 1-d tensor / ``(batch, 1)``), or any callable ``f(output) → Tensor[batch]``
  or ``Tensor[]``;
- k targets per row: a ``LongTensor[batch, k]`` or a list of k target objects.

Positions count each row's real tokens under the attention mask, so a padded row explains
the token the row alone explains: ``-1`` is each row's last real token, ``p ≥ 0`` each
row's ``p``-th real token (the absolute position ``p`` for unpadded and right-padded rows).
"""

from pyattr.targets.base import Target, Forward, real_positions, token_ids  # noqa: F401
from pyattr.targets.logits import Logit, LogitDiff, LogProb, logit_positions  # noqa: F401
from pyattr.targets.modules import Cosine, ModuleOutput  # noqa: F401
from pyattr.targets.vocabulary import module_paths, normalize  # noqa: F401

__all__ = ["Cosine", "Logit", "LogitDiff", "LogProb", "ModuleOutput", "Target"]
