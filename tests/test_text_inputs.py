"""Text in, words out (DESIGN §11): a string or list of strings with ``tokenizer=``, a word
as the target, ``rules=`` shorthands and a model by name give exactly what the token-id
call gives; the result carries each token as the tokenizer's decoding spells it."""

from __future__ import annotations

import pytest
import torch

import pyattr
import pyattr.toy
from pyattr import RelevanceRules
from pyattr.patching import activation_patching, attribution_patching

TEXT = "cat dog owl fox cat dog"


def _ids(tok, text):
    return torch.tensor([tok(text)["input_ids"]])


def test_text_equals_ids_and_tokens_are_the_decoding(toy):
    tok, model = toy
    by_text = pyattr.relevance(model, TEXT, tokenizer=tok)
    by_ids = pyattr.relevance(model, _ids(tok, TEXT))
    assert torch.equal(by_text.token_relevance, by_ids.token_relevance)
    assert torch.equal(by_text.target, by_ids.target)
    assert by_text.tokens == [["<s>", "cat", " dog", " owl", " fox", " cat", " dog"]]
    assert by_ids.tokens is None  # no tokenizer given: no strings
    assert by_text.target_tokens == [" owl"]  # the target as the decoding spells it after the text


def test_word_target_is_the_next_token_of_the_joint_text(toy):
    tok, model = toy
    joint = tok(TEXT + " owl")["input_ids"]
    by_word = pyattr.relevance(model, TEXT, target="owl", tokenizer=tok)
    by_id = pyattr.relevance(model, _ids(tok, TEXT), target=joint[-1])
    assert int(by_word.target_ids[0]) == joint[-1]
    assert torch.equal(by_word.token_relevance, by_id.token_relevance)
    # a word target with token-id inputs reads the ids' decoded text
    by_ids_word = pyattr.relevance(model, _ids(tok, TEXT), target="owl", tokenizer=tok)
    assert torch.equal(by_ids_word.token_relevance, by_id.token_relevance)


def test_list_of_texts_is_padded_and_each_row_equals_its_own_call(toy):
    tok, model = toy
    texts = [TEXT, "red blue king red"]
    both = pyattr.relevance(model, texts, target=["owl", "blue"], tokenizer=tok)
    assert both.tokens[1][:2] == [None, None]  # the toy tokenizer pads on the left
    for row, (text, word) in enumerate(zip(texts, ["owl", "blue"])):
        alone = pyattr.relevance(model, text, target=word, tokenizer=tok)
        seq = alone.token_relevance.shape[1]
        torch.testing.assert_close(both.token_relevance[row, -seq:], alone.token_relevance[0], atol=1e-5, rtol=1e-5)
        assert both.tokens[row][-seq:] == alone.tokens[0]
        assert int(both.target_ids[row]) == int(alone.target_ids[0])


@pytest.mark.parametrize("short, rules", [
    ("all", RelevanceRules.all()), ("attnlrp", RelevanceRules.all("attnlrp")),
    ("ln", RelevanceRules(normalization=True)), ("none", RelevanceRules()), ("AttnLRP", RelevanceRules.all("attnlrp")),
])
def test_rules_shorthands(toy, short, rules):
    tok, model = toy
    a = pyattr.relevance(model, TEXT, rules=short, tokenizer=tok)
    b = pyattr.relevance(model, TEXT, rules=rules, tokenizer=tok)
    assert torch.equal(a.token_relevance, b.token_relevance)


def test_bad_rules_and_text_errors(toy):
    tok, model = toy
    with pytest.raises(ValueError, match=r"^rules: expected a RelevanceRules or one of 'all', 'attnlrp', 'ln', "
                                         r"'none', got 'lrp'$"):
        pyattr.relevance(model, TEXT, rules="lrp", tokenizer=tok)
    with pytest.raises(TypeError, match=r"^rules must be a RelevanceRules or one of .*, got int$"):
        pyattr.relevance(model, TEXT, rules=3, tokenizer=tok)
    with pytest.raises(ValueError, match=r"^relevance\(\): inputs are text; pass tokenizer= \(the model's tokenizer\)"):
        pyattr.relevance(model, TEXT)
    with pytest.raises(ValueError, match=r"^inputs: text 1 is empty$"):
        pyattr.relevance(model, [TEXT, "  "], tokenizer=tok)
    with pytest.raises(TypeError, match=r"^inputs: a list of texts must hold only strings$"):
        pyattr.relevance(model, [TEXT, 3], tokenizer=tok)
    with pytest.raises(TypeError, match=r"^target must be None, a token id, a list of ids, a word \(with tokenizer=\)"):
        pyattr.relevance(model, _ids(tok, TEXT), target="owl")
    with pytest.raises(ValueError, match=r"^target: target token 'cowbell' is not in the vocabulary \(the tokenizer "
                                         r"maps it to its unknown token '<unk>'\)$"):
        pyattr.relevance(model, TEXT, target="cowbell", tokenizer=tok)
    with pytest.raises(ValueError, match=r"^target: 1 words for 2 input rows \(one word per row\)$"):
        pyattr.relevance(model, [TEXT, TEXT], target=["owl"], tokenizer=tok)


def test_several_token_word_names_the_continuation_route():
    from bpe import byte_bpe_tokenizer, tiny_gpt2

    tok = byte_bpe_tokenizer()
    model = tiny_gpt2(tok)
    assert len(tok(" sunship", add_special_tokens=False)["input_ids"]) > 1
    with pytest.raises(ValueError, match=r"^target: target token 'sunship' is not in the vocabulary \(it splits into "
                                         r"\d tokens after the text, not one\); to explain each token of a continuation, "
                                         r"use pyattr.generation_relevance\(model, text, continuation=\.\.\., "
                                         r"tokenizer=tok\)$"):
        pyattr.relevance(model, "the cat is on the", target="sunship", tokenizer=tok)
    # byte-level BPE: the word after the text is its 'Ġ' form, not the bare spelling
    r = pyattr.relevance(model, "the cat is on the", target="sea", tokenizer=tok)
    assert tok.convert_ids_to_tokens([int(r.target_ids[0])]) == ["Ġsea"]
    assert r.tokens == [["the", " cat", " is", " on", " the"]]


def test_encoder_text_keeps_its_special_tokens():
    from models import minilm

    tok, model = minilm()
    text = "A man is playing a guitar."
    target = pyattr.targets.ModuleOutput("pooler") if hasattr(model, "pooler") and model.pooler is not None else None
    target = (lambda out: out.last_hidden_state[:, 0].sum(-1)) if target is None else target
    by_text = pyattr.relevance(model, text, target=target, tokenizer=tok)
    enc = tok(text, return_tensors="pt")
    by_ids = pyattr.relevance(model, enc, target=target)
    assert torch.equal(by_text.token_relevance, by_ids.token_relevance)
    assert by_text.tokens[0][0] == "[CLS]" and by_text.tokens[0][-1] == "[SEP]"
    with pytest.raises(ValueError, match=r"^target='guitar': a word names a next-token logit or a class label, but "
                                         r"BertModel has no language-model head$"):
        pyattr.relevance(model, text, target="guitar", tokenizer=tok)


def test_model_by_bundled_name_and_directory(toy):
    tok, model = toy
    ref = pyattr.relevance(model, TEXT, target="owl", tokenizer=tok)
    for name in ("induction", str(pyattr.toy.INDUCTION_DIR)):
        r = pyattr.relevance(name, TEXT, target="owl")  # the tokenizer comes with the model
        assert torch.equal(r.token_relevance, ref.token_relevance)
        assert r.tokens == ref.tokens


def test_model_name_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"^model 'no-such-org/no-such-model' is not a local directory or a bundled "
                                         r"model \(minilm, induction, squares, translation\), so it was looked up on the Hugging "
                                         r"Face Hub: offline mode is on \(HF_HUB_OFFLINE=1\) and .* To load a model "
                                         r"from disk, pass its directory"):
        pyattr.relevance("no-such-org/no-such-model", TEXT)
    with pytest.raises(ValueError, match=r"^model directory '.*' has no config.json$"):
        pyattr.relevance(str(tmp_path), TEXT)


def test_other_methods_take_text(toy):
    tok, model = toy
    ids = _ids(tok, TEXT)
    lr_t = pyattr.layer_relevance(model, TEXT, "residual", target="owl", tokenizer=tok)
    lr_i = pyattr.layer_relevance(model, ids, "residual", target=int(lr_t.target_ids[0]))
    for path in lr_t.paths:
        assert torch.equal(lr_t[path].relevance, lr_i[path].relevance)
    assert lr_t.tokens == [["<s>", "cat", " dog", " owl", " fox", " cat", " dog"]]
    ig_t = pyattr.integrated_gradients(model, TEXT, target="owl", n_steps=4, tokenizer=tok)
    ig_i = pyattr.integrated_gradients(model, ids, target=int(ig_t.target_ids[0]), n_steps=4)
    assert torch.equal(ig_t.attribution, ig_i.attribution)
    metric = lambda out: out.logits[:, -1, 5]  # noqa: E731
    p_t = attribution_patching(model, TEXT, "cat dog bee fox cat dog", metric, method="relp", tokenizer=tok)
    p_i = attribution_patching(model, ids, _ids(tok, "cat dog bee fox cat dog"), metric, method="relp")
    for node in p_t:
        assert torch.equal(p_t[node], p_i[node])
    assert p_t.tokens == lr_t.tokens
    a_t = activation_patching(model, TEXT, "cat dog bee fox cat dog", metric, nodes="attention", tokenizer=tok,
                              progress=False)
    assert torch.equal(a_t["attention"], activation_patching(model, ids, _ids(tok, "cat dog bee fox cat dog"), metric,
                                                             nodes="attention", progress=False)["attention"])


def test_generation_takes_text_and_text_continuations(toy):
    tok, model = toy
    g_t = pyattr.generation_relevance(model, "cat dog owl fox cat", continuation="dog owl", tokenizer=tok)
    ids = _ids(tok, "cat dog owl fox cat")
    cont = tok("cat dog owl fox cat dog owl")["input_ids"][ids.shape[1]:]
    g_i = pyattr.generation_relevance(model, ids, continuation=torch.tensor(cont))
    assert torch.equal(g_t.token_relevance, g_i.token_relevance)
    assert g_t.tokens == [["<s>", "cat", " dog", " owl", " fox", " cat", " dog", " owl"]]
    # a list of prompts is left-padded for generation, whatever the tokenizer's padding side
    tok_right = type(tok).from_pretrained(pyattr.toy.INDUCTION_DIR, padding_side="right")
    g2 = pyattr.generation_relevance(model, ["cat dog owl fox cat", "red blue red"], max_new_tokens=2,
                                     tokenizer=tok_right)
    assert g2.tokens[1][:2] == [None, None] and g2.tokens[1][2] == "<s>"


def test_class_label_target_on_an_image_classifier():
    model, processor = pyattr.toy.load_squares()
    torch.manual_seed(0)
    pixels = torch.rand(2, 3, 32, 32)
    red = model.config.label2id["red"]
    by_label = pyattr.relevance(model, pixels, target="red")
    by_id = pyattr.relevance(model, pixels, target=red)
    assert torch.equal(by_label.token_relevance, by_id.token_relevance)
    assert by_label.target_tokens == ["red", "red"] and by_id.target_tokens == ["red", "red"]  # config.id2label
    by_name = pyattr.relevance("squares", pixels, target=["red", "blue"])
    assert torch.equal(by_name.token_relevance[0], by_id.token_relevance[0])
    with pytest.raises(ValueError, match=r"^target='purple': a word names a next-token logit or a class label, but "
                                         r"ViTForImageClassification has no language-model head; its labels are "
                                         r"\['blue', 'green', 'red'\]$"):
        pyattr.relevance(model, pixels, target="purple")
