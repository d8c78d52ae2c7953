"""The bundled translation toy (a Marian encoder–decoder, :mod:`pyattr.toy.translation`):
it translates, and the relevance of each output word lands on its aligned source word."""

import pytest
import torch

import pyattr
import pyattr.toy as toy
from pyattr.toy import translation as tr

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_shipped_model_translates_fresh_sentences_exactly():
    model, tok = toy.load_translation()
    assert tr.accuracy(model, count=64, seed=3) == 1.0
    enc = tok("sun cat red", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert tok.decode(out[0], skip_special_tokens=True) == "RED CAT SUN"


def _alignment(rules, count=30, seed=5):
    model, tok = toy.load_translation()
    hits = total = 0
    for words in tr.sentences(torch.Generator().manual_seed(seed), count):
        n = len(words)
        r = pyattr.generation_relevance(model, " ".join(words), tokenizer=tok, max_new_tokens=n + 1, rules=rules)
        # tokens as decoded within the row (the decoder-only results' convention): a space before all but the first
        assert r.sequence_tokens[0][1:n + 1] == [w if i == 0 else " " + w for i, w in enumerate(tr.translate(words))]
        for t in range(n):  # target word t is source word n - 1 - t; every source token (</s> too) competes
            hits += int(r.source_relevance[0, t].argmax()) == n - 1 - t
            total += 1
    return hits / total


def test_each_output_words_largest_source_relevance_is_its_aligned_source_word():
    """The issue's bar: ≥ 95 % of steps under the default rules. Gradient × input is
    measured beside it (far below: it is the reason the rules exist)."""
    rules_on = _alignment("all")
    plain = _alignment("none")
    assert rules_on >= 0.95, rules_on
    assert plain < rules_on - 0.3, (plain, rules_on)


def test_text_in_both_sides_and_word_targets():
    model, tok = toy.load_translation()
    r = pyattr.relevance(model, ["sun cat red", "dog owl fox bee"], tokenizer=tok,
                         decoder_input_ids=["RED CAT", "BEE"], target=["SUN", "FOX"])
    assert r.source_tokens == [["sun", " cat", " red", "</s>", None], ["dog", " owl", " fox", " bee", "</s>"]]
    assert r.decoder_tokens == [["<pad>", "RED", " CAT"], ["<pad>", "BEE", None]]
    assert r.target_ids.tolist() == [tok.convert_tokens_to_ids("SUN"), tok.convert_tokens_to_ids("FOX")]
    assert r.source_relevance[0].argmax() == 0 and r.source_relevance[1].argmax() == 2  # sun; fox
    ids = pyattr.relevance(model, tok("sun cat red", return_tensors="pt")["input_ids"],
                           decoder_input_ids=torch.tensor([[0, tok.convert_tokens_to_ids("RED"),
                                                            tok.convert_tokens_to_ids("CAT")]]),
                           target=tok.convert_tokens_to_ids("SUN"))
    assert torch.allclose(ids.source_relevance, r.source_relevance[:1, :4], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="target='SUN CAT' is 2 tokens as the tokenizer reads it in a target text"):
        pyattr.relevance(model, "sun cat red", tokenizer=tok, decoder_input_ids="RED", target="SUN CAT")
    with pytest.raises(ValueError, match="decoder_input_ids: expected one non-empty target text, or one per source row"):
        pyattr.relevance(model, ["sun cat", "dog owl"], tokenizer=tok, decoder_input_ids=["RED"])


def test_views_show_both_sides_and_results_save_and_load(tmp_path, capsys):
    model, tok = toy.load_translation()
    r = pyattr.relevance(model, ["sun cat red", "dog owl fox bee"], tokenizer=tok,
                         decoder_input_ids=["RED CAT", "BEE"], target=["SUN", "FOX"])
    g = pyattr.generation_relevance(model, "sun cat red fox", tokenizer=tok, max_new_tokens=5)
    a = pyattr.integrated_gradients(model, "sun cat red", tokenizer=tok, decoder_input_ids="RED CAT", target="SUN",
                                    n_steps=8)
    assert r.target_tokens == ["SUN", "FOX"] and a.target_tokens == ["SUN"]
    r.show()
    text = capsys.readouterr().out
    assert "row 0 · target 'SUN'" in text and "source (Σ" in text and "target prefix (Σ" in text
    assert "fox(+" in text
    g.show()
    text = capsys.readouterr().out
    assert "each generated token (rows) over the source" in text and "3:  SUN" in text
    df = r.to_pandas()
    src_rows = df[(df.row == 1) & df.source_token.notna()]
    assert src_rows.source_token.tolist() == ["dog", " owl", " fox", " bee", "</s>"]
    assert df[(df.row == 1) & df.decoder_token.notna()].decoder_token.tolist() == ["<pad>", "BEE"]
    assert torch.allclose(torch.tensor(src_rows.relevance.tolist(), dtype=torch.float32), r.source_relevance[1])
    assert "<table" in g.to_html() or "<svg" in g.to_html()
    for res in (r, g, a):
        back = pyattr.load(res.save(tmp_path / f"{type(res).__name__}.safetensors"))
        assert type(back) is type(res) and torch.equal(back.target, res.target)
        first = res.source_relevance if hasattr(res, "source_relevance") else res.source_attribution
        again = back.source_relevance if hasattr(back, "source_relevance") else back.source_attribution
        assert torch.equal(first, again)


def test_generate_command_explains_a_translation_model():
    import json

    from conftest import run_cli

    r = run_cli("generate", "--model", "translation", "--text", "sun cat red fox", "--max-new-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["generated_text"] == "FOX RED CAT SUN"
    assert doc["tokens"][:6] == ["sun", "cat", "red", "fox", "</s>", "<pad>"] and doc["prompt_tokens"] == 6
    assert doc["source_tokens"] == 5   # the source's columns; the decoder's start follows
    shown = run_cli("generate", "--model", "translation", "--text", "sun cat red fox", "--max-new-tokens", "5")
    assert "source     sun cat red fox </s>\ndecoder start <pad>\n" in shown.stdout
    assert "source 3 'fox'" in shown.stdout and "decoder 0 '<pad>'" in shown.stdout
    m = torch.tensor(doc["token_relevance"])
    model, tok = toy.load_translation()
    api = pyattr.generation_relevance(model, "sun cat red fox", tokenizer=tok, max_new_tokens=5)
    torch.testing.assert_close(m[:, :5], api.source_relevance[0])  # the source columns
    torch.testing.assert_close(m[:, 5:10], api.target_relevance[0])  # the decoder's inputs
    assert [int(row[:5].argmax()) for row in m[:4]] == [3, 2, 1, 0]  # FOX <- fox, RED <- red, …
    r = run_cli("generate", "--model", "translation", "--text", "sun cat red fox", "--target", "logprob", "--json")
    assert r.returncode == 0, r.stderr
    lp = pyattr.generation_relevance(model, "sun cat red fox", tokenizer=tok, max_new_tokens=5, target="logprob")
    torch.testing.assert_close(torch.tensor(json.loads(r.stdout)["target_values"], dtype=torch.float64), lp.target[0, :5],
                               rtol=1e-5, atol=1e-6)


def test_the_bundled_name_loads_the_model_and_its_tokenizer():
    r = pyattr.relevance("translation", "sun cat red", decoder_input_ids="RED CAT", target="SUN")
    assert r.source_tokens == [["sun", " cat", " red", "</s>"]] and r.target_tokens == ["SUN"]
    assert int(r.source_relevance[0].argmax()) == 0


def test_text_sources_are_not_left_padded_and_text_continuations_are_target_text():
    model, tok = toy.load_translation()
    g = pyattr.generation_relevance(model, ["sun cat red fox", "dog owl fox"], max_new_tokens=6, tokenizer=tok)
    assert g.source_tokens == [["sun", " cat", " red", " fox", "</s>"], ["dog", " owl", " fox", "</s>", None]]
    alone = pyattr.generation_relevance(model, "dog owl fox", max_new_tokens=6, tokenizer=tok)
    assert g.sequence_tokens[1][:5] == alone.sequence_tokens[0][:5] == ["<pad>", "FOX", " OWL", " DOG", "</s>"]
    c = pyattr.generation_relevance(model, ["sun cat red", "dog owl fox"], continuation=["RED CAT SUN", "FOX OWL"],
                                    tokenizer=tok)
    assert c.sequence_tokens[0] == ["<pad>", "RED", " CAT", " SUN", "</s>"]
    assert c.sequence_tokens[1] == ["<pad>", "FOX", " OWL", "</s>", None] and c.step_mask[1].tolist() == [1, 1, 1, 0]
    ids = pyattr.generation_relevance(model, tok("sun cat red", return_tensors="pt")["input_ids"],
                                      continuation=tok(text_target="RED CAT SUN")["input_ids"])
    assert torch.allclose(c.target[0], ids.target[0], rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="target token 'zebra' is not in the vocabulary"):
        pyattr.relevance(model, "sun cat red", target="zebra", decoder_input_ids="RED CAT", tokenizer=tok)


def test_two_stack_results_name_their_attributes_and_generation_lists_top_sources():
    """Reported by a new user: ``token_relevance`` on an encoder–decoder result was a bare
    AttributeError, and generation's result had no ``top_sources``."""
    model, tok = toy.load_translation()
    r = pyattr.relevance(model, "sun cat red", tokenizer=tok, decoder_input_ids="RED CAT", target="SUN")
    with pytest.raises(AttributeError, match=r"Seq2SeqRelevanceResult has no 'token_relevance': .*source_relevance"):
        r.token_relevance
    assert getattr(r, "tokens", None) is None and not hasattr(r, "token_attribution")
    g = pyattr.generation_relevance(model, ["sun cat red fox", "dog owl"], tokenizer=tok, max_new_tokens=5)
    top = g.top_sources(0, k=3)
    assert [t.token for t in top][0] == " fox" and [t.column for t in top][0] == 3  # FOX comes from fox
    vals = g.source_relevance[0, 0]
    assert [t.relevance for t in top] == sorted(vals.tolist(), reverse=True)[:3]
    second = g.top_sources(1, row=1)  # row 1's source is padded: its padding is never listed
    assert second[0].token == " owl" and all(t.token is not None for t in second) and len(second) == 3
    assert g.top_sources(4, row=1) == []  # the row finished earlier: that step does not exist
    with pytest.raises(IndexError, match=r"step must be an int in \[-5, 5\)"):
        g.top_sources(5)
