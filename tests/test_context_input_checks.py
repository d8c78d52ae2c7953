"""Inputs context attribution (and text continuations) used to take silently, reported by a
new-user pass: a prompt past the model's positions under the ablation methods, a response the
tokenizer reads as its unknown token, a source string inside a longer word, a model by name,
and a keyword argument a method lacks."""

import pytest
import torch

import pyattr
import pyattr.toy as toy
from models import minilm


@pytest.fixture(scope="module")
def toy_model():
    m, tk, _ = toy.load()
    return m, tk


@pytest.mark.parametrize("method", ["loo", "foldover", "contextcite", "relevance", "attention"])
def test_prompt_past_the_position_table_is_refused_by_every_method(toy_model, method):
    m, tk = toy_model
    words = tk.convert_ids_to_tokens(list(range(3, 50)))
    prompt = " ".join(words + words[:25])
    assert len(tk(prompt)["input_ids"]) > m.config.max_position_embeddings
    sources = [" ".join(words[:10]), " ".join(words[10:20])]
    with pytest.raises(ValueError, match=rf"inputs: row 0 is \d+ positions long.* reads at most "
                                         rf"{m.config.max_position_embeddings}"):
        pyattr.context_attribution(m, prompt, sources, response="cat", tokenizer=tk, method=method)


def test_response_the_tokenizer_reads_as_unknown_is_refused(toy_model):
    m, tk = toy_model
    prompt = "sun cat red dog fish owl bee tea key fish"
    for response in ("zebra", "owl zebra"):
        with pytest.raises(ValueError, match=rf"response: the tokenizer reads part of {response!r} as its unknown "
                                             r"token '<unk>'"):
            pyattr.context_attribution(m, prompt, ["sun cat red", "dog fish owl"], response=response, tokenizer=tk)
    with pytest.raises(ValueError, match=r"continuation 'zebra': continuation: the tokenizer reads part of 'zebra'"):
        pyattr.generation_relevance(m, prompt, tokenizer=tk, continuation="zebra")
    mt, tt = toy.load_translation()
    with pytest.raises(ValueError, match=r"response\[0\]: the tokenizer reads part of 'ZEBRA CAT' as its unknown"):
        pyattr.context_attribution(mt, "sun cat", "word", tokenizer=tt, response="ZEBRA CAT")
    # a known response still runs
    r = pyattr.context_attribution(m, prompt, ["sun cat red", "dog fish owl"], response="owl", tokenizer=tk,
                                   method="loo")
    assert r.scores.shape == (1, 2) and torch.isfinite(r.scores).all()


def test_source_inside_a_longer_word():
    tok, model = minilm()
    passage = "The category was unclear. A cat sat on the mat."
    r = pyattr.context_attribution(model, passage, ["cat"], query="a cat on a mat", tokenizer=tok, method="loo")
    assert r.sources == [["cat"]]  # the whole word, not "category"
    (a, b), = r.source_ranges[0]
    assert tok.convert_ids_to_tokens(tok(passage)["input_ids"])[a:b] == ["cat"]
    with pytest.raises(ValueError, match=r"sources\[1\]: 'cat' does not occur in the prompt after the previous"):
        pyattr.context_attribution(model, passage, ["cat", "cat"], query="a cat", tokenizer=tok, method="loo")
    with pytest.raises(ValueError, match=r"sources\[0\]: 'ategor' is part of 'category', which the tokenizer reads"):
        pyattr.context_attribution(model, passage, ["ategor"], query="a cat", tokenizer=tok, method="loo")


def test_context_attribution_takes_a_model_name(toy_model):
    m, tk = toy_model
    prompt = "sun cat red dog fish owl bee tea key fish"
    by_name = pyattr.context_attribution("induction", prompt, ["sun cat red", "dog fish owl"], response="owl",
                                         method="loo")
    given = pyattr.context_attribution(m, prompt, ["sun cat red", "dog fish owl"], response="owl", tokenizer=tk,
                                       method="loo")
    # loaded by name the attention implementation may differ from toy.load()'s: float32 rounding apart
    torch.testing.assert_close(by_name.scores, given.scores, rtol=1e-4, atol=1e-6)
    assert by_name.response_tokens == given.response_tokens


def test_unexpected_keyword_names_the_function(toy_model):
    m, tk = toy_model
    with pytest.raises(TypeError, match=r"^edge_attribution\(\) got an unexpected keyword argument 'decoder_input_ids'"):
        pyattr.patching.edge_attribution(m, "sun cat red", "sun dog red", 3, tokenizer=tk, decoder_input_ids="x")


def test_one_token_id_response_and_empty_sources(toy_model):
    m, tk = toy_model
    ids = tk("sun cat red dog fish owl", return_tensors="pt")["input_ids"][0]
    owl = tk.convert_tokens_to_ids("owl")
    one = pyattr.context_attribution(m, ids, [(1, 3), (3, 5)], response=owl, method="loo")
    listed = pyattr.context_attribution(m, ids, [(1, 3), (3, 5)], response=[owl], method="loo")
    torch.testing.assert_close(one.scores, listed.scores, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^sources: expected at least one \(a text span of the prompt, or a token"):
        pyattr.context_attribution(m, "sun cat red dog fish owl", [], response="owl", tokenizer=tk)
