"""Text that already carries its special tokens (issue 45 §1): a chat template's output
begins with the BOS the tokenizer would add again. Every method explains the ids the
model sees for that text, the tokenizer's own template ids
(``apply_chat_template(..., tokenize=True)``), and takes those ids as they come (a list,
a ``BatchEncoding`` of lists or of tensors)."""

import pytest
import torch

import pyattr
from bpe import chat_tokenizer, tiny_chat_llama
from pyattr.methods._core.tokens import continuation_ids, encoded_ids, prompt_ids

pytestmark = pytest.mark.usefixtures("one_thread")

MSGS = [{"role": "user", "content": "the cat is on the ship"}]
OTHER = [{"role": "user", "content": "the dog is on the ship"}]


@pytest.fixture(scope="module")
def chat():
    tok = chat_tokenizer()
    return tok, tiny_chat_llama(tok)


def _template(tok, msgs, **kw):
    return tok.apply_chat_template(msgs, add_generation_prompt=True, **kw)


def test_template_text_reads_as_the_template_ids(chat):
    tok, _ = chat
    text = _template(tok, MSGS, tokenize=False)
    want = list(_template(tok, MSGS, tokenize=True, return_dict=False))
    assert text.startswith(tok.bos_token) and want.count(tok.bos_token_id) == 1
    assert encoded_ids(tok, text) == want == prompt_ids(tok, text)
    # a text without the marker still gets it from the tokenizer, once
    assert encoded_ids(tok, "the cat is on the ship") == [tok.bos_token_id] + tok.encode(
        "the cat is on the ship", add_special_tokens=False)
    # the joint text of a template and a reply: one BOS too (how the template's last "\n\n"
    # and the reply split is the tokenizer's own joint reading)
    prompt, cont = continuation_ids(tok, text, "the dog")
    assert prompt[:4] == want[:4] and prompt.count(tok.bos_token_id) == 1 and cont


def test_relevance_of_template_text_and_of_every_form_of_its_ids(chat):
    tok, model = chat
    text = _template(tok, MSGS, tokenize=False)
    ids = torch.tensor([_template(tok, MSGS, tokenize=True, return_dict=False)])
    ref = pyattr.relevance(model, ids, target=7, tokenizer=tok)
    forms = {"text": text,
             "list": _template(tok, MSGS, tokenize=True, return_dict=False),
             "BatchEncoding of lists": _template(tok, MSGS, tokenize=True),
             "BatchEncoding of tensors": _template(tok, MSGS, tokenize=True, return_tensors="pt"),
             "rows as lists": [ids[0].tolist()]}
    for name, form in forms.items():
        got = pyattr.relevance(model, form, target=7, tokenizer=tok)
        assert got.tokens == ref.tokens, name
        assert torch.equal(got.relevance, ref.relevance), name
        assert torch.equal(got.target, ref.target), name


def test_ragged_rows_of_ids_are_padded_as_the_tokenizer_would(chat):
    tok, model = chat
    a = _template(tok, MSGS, tokenize=True, return_dict=False)
    b = _template(tok, [{"role": "user", "content": "the cat"}], tokenize=True, return_dict=False)
    both = pyattr.relevance(model, [a, b], target=7, tokenizer=tok)
    for row, ids in enumerate((a, b)):
        alone = pyattr.relevance(model, [ids], target=7, tokenizer=tok)
        real = both.tokens[row].index(tok.bos_token) if tok.padding_side == "left" else 0
        got = both.token_relevance[row, real:real + len(ids)]
        torch.testing.assert_close(got, alone.token_relevance[0], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"inputs: rows of token ids of different lengths \(\[13, 17\]\); pass tokenizer="):
        pyattr.relevance(model, [a, b], target=7)


def test_generation_of_template_text_continues_the_template_ids(chat):
    tok, model = chat
    text = _template(tok, MSGS, tokenize=False)
    ids = torch.tensor([_template(tok, MSGS, tokenize=True, return_dict=False)])
    res = pyattr.generation_relevance(model, text, tokenizer=tok, max_new_tokens=3)
    with torch.no_grad():
        oracle = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                pad_token_id=tok.pad_token_id)
    assert res.sequences[0].tolist() == oracle[0].tolist()
    assert int(res.prompt_length[0]) == ids.shape[1]


def test_patching_template_texts_equals_patching_their_ids(chat):
    tok, model = chat
    clean, corrupt = _template(tok, MSGS, tokenize=False), _template(tok, OTHER, tokenize=False)
    ci = torch.tensor([_template(tok, MSGS, tokenize=True, return_dict=False)])
    xi = torch.tensor([_template(tok, OTHER, tokenize=True, return_dict=False)])
    metric = pyattr.targets.Logit(7)
    got = pyattr.patching.attribution_patching(model, clean, corrupt, metric, nodes=("residual",), tokenizer=tok)
    want = pyattr.patching.attribution_patching(model, ci, xi, metric, nodes=("residual",))
    assert torch.equal(got["residual"], want["residual"])


def test_context_attribution_of_template_text_equals_its_ids(chat):
    tok, model = chat
    msgs = [{"role": "user", "content": "the cat is on the ship. the dog is on the sea. the owl"}]
    text = _template(tok, msgs, tokenize=False)
    ids = _template(tok, msgs, tokenize=True)  # a BatchEncoding: one prompt
    got = pyattr.context_attribution(model, text, "sentence", response=" sky", tokenizer=tok, method="loo")
    assert len(got.sources[0]) == 2  # the sentences of the user turn, read off the template text's offsets
    ranges = [tuple(r) for r in got.source_ranges[0]]
    resp = continuation_ids(tok, text, " sky")[1]
    want = pyattr.context_attribution(model, ids, ranges, response=resp, method="loo")
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got.value, want.value, rtol=1e-9, atol=1e-9)


def test_a_template_that_writes_no_bos_is_read_as_written(chat):
    """A template that writes no BOS (Zephyr's), on a tokenizer that prepends one: its text
    holds the tokenizer's special tokens, so it is markup read as it is, as
    apply_chat_template(..., tokenize=True) reads it (pyattr added the BOS before)."""
    tok, model = chat
    tok = chat_tokenizer()
    tok.chat_template = tok.chat_template.replace("{{ bos_token }}", "")
    text = _template(tok, MSGS, tokenize=False)
    want = list(_template(tok, MSGS, tokenize=True, return_dict=False))
    assert not text.startswith(tok.bos_token) and tok.bos_token_id not in want
    assert encoded_ids(tok, text) == want
    got = pyattr.relevance(model, text, target=7, tokenizer=tok)
    with torch.no_grad():
        own = model(torch.tensor([want])).logits[0, -1, 7]
    assert float(got.target[0]) == pytest.approx(float(own), abs=1e-12)
    # a plain prompt, no special token in it: the tokenizer's BOS as always
    assert encoded_ids(tok, "the cat is on the ship")[0] == tok.bos_token_id


def test_a_word_target_after_ids_ending_in_a_special_token_is_read_after_it(chat):
    """The same template as text and as ids names the same word target: the ids are decoded
    with their special tokens (a generation prompt ending in ``<|end_header_id|>``)."""
    tok, model = chat
    tok = chat_tokenizer()
    tok.chat_template = tok.chat_template.replace("assistant<|end_header_id|>\n\n", "assistant\n<|end_header_id|>")
    text = _template(tok, MSGS, tokenize=False)
    assert text.endswith("<|end_header_id|>")
    by_text = pyattr.relevance(model, text, tokenizer=tok, target="owl")
    for ids in (_template(tok, MSGS, tokenize=True, return_dict=False), _template(tok, MSGS, tokenize=True)):
        by_ids = pyattr.relevance(model, ids if hasattr(ids, "keys") else [ids], tokenizer=tok, target="owl")
        assert by_ids.target_ids.tolist() == by_text.target_ids.tolist()
