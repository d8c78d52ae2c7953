"""What an encoder–decoder result has in place of a decoder-only result's one-sequence
attributes: reading ``tokens``, ``token_relevance`` or ``token_attribution`` names the
two-stack attributes that hold them (a bare AttributeError there sent users to the
source), and generation's :meth:`top_sources` lists a step's source tokens as the
decoder-only result lists its prompt's."""

from __future__ import annotations

from typing import List

import torch

#: the one-sequence attribute → where an encoder–decoder result holds it
_SPLIT = {
    "tokens": "source_tokens and decoder_tokens (sequence_tokens after generation_relevance)",
    "token_relevance": "source_relevance (the encoder's input) and target_relevance (the decoder's)",
    "token_attribution": "source_attribution (the encoder's input) and target_attribution (the decoder's)",
}


class TwoStacks:
    """Mixin of the encoder–decoder results."""

    def __getattr__(self, name):
        if name in _SPLIT:
            raise AttributeError(f"{type(self).__name__} has no {name!r}: an encoder–decoder's result is split "
                                 f"between its two stacks, see {_SPLIT[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class SourcesOfSteps(TwoStacks):
    """:meth:`top_sources` for :class:`~pyattr.methods.seq2seq_generation.Seq2SeqGenerationResult`."""

    def top_sources(self, step: int, k: int = 5, row: int = 0) -> List:
        """The ``k`` source tokens with the largest relevance for generated step ``step`` of
        row ``row``: ``[TopSource(column, token, relevance), …]``, largest first, as
        :meth:`pyattr.GenerationRelevanceResult.top_sources` lists a prompt's (``column``: the
        position in ``source_ids``; ``token`` its text with ``tokenizer=`` (padding then never
        listed), else its id; ``[]`` for a step that does not exist, see ``step_mask``).
        Errors as the decoder-only result's."""
        import pyattr.methods._core as core
        from pyattr.methods._core.top import TopSource, index_in as _index

        batch, steps = self.step_mask.shape
        step, row = _index(step, -steps, steps, "step") % steps, _index(row, 0, batch, "row")
        k = core.check_count("k", k, allow_none=False)
        if not bool(self.step_mask[row, step]):
            return []
        names = self.source_tokens[row] if self.source_tokens is not None else None
        cols = [c for c in range(self.source_ids.shape[1]) if names is None or names[c] is not None]
        vals = self.source_relevance[row, step, cols]
        order = torch.argsort(vals, descending=True, stable=True)[:k]
        return [TopSource(cols[i], names[cols[i]] if names is not None else int(self.source_ids[row, cols[i]]),
                          float(vals[i])) for i in order.tolist()]
