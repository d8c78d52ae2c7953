"""The command line reads text as the tokenizer reads it (DESIGN §10): a continuation is
the joint text's tokens, a prompt never ends in an end-of-text marker the tokenizer
appends, words come from the tokenizer's decoding (line breaks included), and every
command refuses a text longer than the model reads. The oracles are the tokenizer's own
joint tokenization and offsets, and transformers' forward."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import pyattr
from bpe import byte_bpe_tokenizer, save_bpe_gpt2, tiny_gpt2
from conftest import run_cli
from pyattr.methods._core.tokens import continuation_ids

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT, CONT = "dog owl fish bee dog", "owl fish"


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return save_bpe_gpt2(tmp_path_factory.mktemp("bpe-gpt2"))


@pytest.fixture(scope="module")
def eos_dir(tmp_path_factory):
    return save_bpe_gpt2(tmp_path_factory.mktemp("bpe-gpt2-eos"), eos_appended=True)


def _joint(tok, text, cont):
    """Oracle: the joint text's ids, split at the first token whose offset starts in the
    continuation."""
    enc = tok(text + " " + cont, return_offsets_mapping=True)
    split = next(i for i, (s, _) in enumerate(enc["offset_mapping"]) if s >= len(text))
    return enc["input_ids"][:split], enc["input_ids"][split:]


def test_continuation_ids_are_the_joint_tokenization():
    tok = byte_bpe_tokenizer()
    prompt, cont = continuation_ids(tok, TEXT, CONT)
    assert (prompt, cont) == tuple(_joint(tok, TEXT, CONT))
    assert tok.convert_ids_to_tokens(cont) == ["Ġowl", "Ġfish"]  # apart: ['owl', 'Ġfish']
    assert continuation_ids(tok, TEXT + " ", CONT) == continuation_ids(tok, TEXT, " " + CONT)
    p, c = continuation_ids(tok, "the owl\n", "fish")  # whitespace at the join is kept, not doubled
    assert tok.decode(p + c) == "the owl\nfish"
    with pytest.raises(ValueError, match="continuation has no tokens"):
        continuation_ids(tok, TEXT, "")


def test_generate_continuation_equals_the_api_on_the_joint_text(bpe_dir):
    r = run_cli("generate", "--model", str(bpe_dir), "--text", TEXT, "--continuation", CONT, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    tok = AutoTokenizer.from_pretrained(bpe_dir)
    model = AutoModelForCausalLM.from_pretrained(bpe_dir).eval()
    prompt, cont = _joint(tok, TEXT, CONT)
    assert doc["tokens"] == tok.convert_ids_to_tokens(prompt + cont)
    api = pyattr.generation_relevance(model, torch.tensor([prompt]), continuation=torch.tensor([cont]))
    assert doc["target_values"] == pytest.approx(api.target[0].tolist(), rel=1e-5)
    with torch.no_grad():  # transformers' own logits of the joint sequence
        logits = model(torch.tensor([prompt + cont])).logits[0]
    want = [float(logits[len(prompt) - 1 + t, cont[t]]) for t in range(len(cont))]
    assert doc["target_values"] == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_patch_reads_the_prompt_as_explain_does(eos_dir, tmp_path):
    clean, corrupt = "the cat is on the", "the dog is on the"
    tok = AutoTokenizer.from_pretrained(eos_dir)
    assert tok(clean)["input_ids"][-1] == tok.eos_token_id  # this tokenizer appends an end-of-text marker
    r = run_cli("patch", "--model", str(eos_dir), "--clean", clean, "--corrupt", corrupt, "--nodes", "residual",
                "--json", str(tmp_path / "patch.json"))
    assert r.returncode == 0, r.stderr
    patch = json.loads((tmp_path / "patch.json").read_text())
    e = run_cli("explain", "--model", str(eos_dir), "--text", clean, "--json")
    assert e.returncode == 0, e.stderr
    explain = json.loads(e.stdout)
    model = AutoModelForCausalLM.from_pretrained(eos_dir).eval()
    ids = tok(clean, add_special_tokens=False)["input_ids"]  # the text's own tokens
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    assert explain["target"] == pytest.approx(float(logits.max()), rel=1e-5)
    assert patch["clean_metric"] == pytest.approx(float(logits.max()), rel=1e-5)


def test_words_follow_the_tokenizers_decoding_across_line_breaks():
    tok = byte_bpe_tokenizer()
    model = tiny_gpt2(tok)
    text, cont = "user: the ship\nassistant:", "the owl\nfish"
    prompt, c = continuation_ids(tok, text, cont)
    r = pyattr.generation_relevance(model, torch.tensor([prompt]), continuation=torch.tensor([c]))
    words, agg = r.aggregate("word", tok)
    joint = tok.decode(prompt + c)
    assert words == joint.split()  # ['user:', 'the', 'ship', 'assistant:', 'the', 'owl', 'fish']
    # oracle: the tokenizer's offsets of the joint text; a whitespace-only token joins the next word
    enc = tok(joint, return_offsets_mapping=True)
    assert enc["input_ids"] == prompt + c
    starts = [i for i, ch in enumerate(joint) if not ch.isspace() and (i == 0 or joint[i - 1].isspace())]
    word_of = []
    for s, e in enc["offset_mapping"]:
        first = next((k for k in range(s, e) if not joint[k].isspace()), None)
        word_of.append(None if first is None else max(w for w, st in enumerate(starts) if st <= first))
    for i in range(len(word_of) - 2, -1, -1):
        if word_of[i] is None:
            word_of[i] = word_of[i + 1]
    want = torch.stack([r.token_relevance[0][:, [i for i, w in enumerate(word_of) if w == k]].sum(-1)
                        for k in range(len(starts))], -1)
    torch.testing.assert_close(agg, want)


@pytest.mark.parametrize("command", ["generate", "explain", "patch"])
def test_every_command_refuses_a_text_longer_than_the_model_reads(bpe_dir, command):
    long = " ".join(["the cat"] * 40)  # 80 tokens, 64 positions
    args = {"generate": ["--text", long, "--max-new-tokens", "2"], "explain": ["--text", long],
            "patch": ["--clean", long, "--corrupt", long.replace("cat", "dog")]}[command]
    r = run_cli(command, "--model", str(bpe_dir), *args)
    assert r.returncode == 2, r.stdout
    assert "is 80 tokens long; the model reads at most 64" in r.stderr


def test_generate_refuses_a_prompt_that_generation_carries_past_the_limit(bpe_dir):
    text = " ".join(["the cat"] * 30)  # 60 tokens + 8 generated > 64
    r = run_cli("generate", "--model", str(bpe_dir), "--text", text, "--max-new-tokens", "8")
    assert r.returncode == 2, r.stdout
    assert ("--text is 60 tokens and --max-new-tokens adds 8: the model would read 67 positions (all but the last "
            "token); it reads at most 64") in r.stderr
    ok = run_cli("generate", "--model", str(bpe_dir), "--text", text, "--max-new-tokens", "5", "--json")
    assert ok.returncode == 0, ok.stderr  # 60 + 5 - 1 = 64 positions read: exactly the limit


def test_a_target_word_is_the_token_that_follows_the_text(bpe_dir, tmp_path):
    """On byte-level BPE the word after a prompt is 'Ġfish'; the vocabulary's bare 'fish'
    (the word tokenized apart) is another token with another logit."""
    from pyattr.methods._core.tokens import target_token_id

    tok = AutoTokenizer.from_pretrained(bpe_dir)
    text = "dog owl"
    spaced = tok.convert_tokens_to_ids("Ġfish")
    assert target_token_id(tok, "fish", len(tok), text) == spaced != tok.convert_tokens_to_ids("fish")
    assert target_token_id(tok, "fish", len(tok)) == tok.convert_tokens_to_ids("fish")  # no text: the spelling
    assert target_token_id(tok, "Ġfish", len(tok), text) == spaced  # a vocabulary spelling stays itself
    e = run_cli("explain", "--model", str(bpe_dir), "--text", text, "--target", "fish", "--json")
    assert e.returncode == 0, e.stderr
    model = AutoModelForCausalLM.from_pretrained(bpe_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tok(text)["input_ids"]])).logits[0, -1]
    assert json.loads(e.stdout)["target"] == pytest.approx(float(logits[spaced]), rel=1e-5)
    r = run_cli("patch", "--model", str(bpe_dir), "--clean", text, "--corrupt", "dog cat", "--target", "fish",
                "--nodes", "residual", "--json", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "p.json").read_text())["clean_metric"] == pytest.approx(float(logits[spaced]),
                                                                                         rel=1e-5)


@pytest.mark.parametrize("text, cont, joint", [
    ("the cat", ", the owl", "the cat, the owl"),         # punctuation follows without a space
    ("the cat is on the sea", ".", "the cat is on the sea."),
    ("我喜欢", "猫", "我喜欢猫"),                           # a script written without spaces
    ("the owl", "fish", "the owl fish"),
    ("the owl\n", "fish", "the owl\nfish"),
])
def test_the_joint_text_is_the_one_a_writer_would_type(text, cont, joint):
    tok = byte_bpe_tokenizer()
    p, c = continuation_ids(tok, text, cont)
    assert tok.decode(p + c) == joint
    assert p + c == tok(joint)["input_ids"]  # the tokenizer's own reading of it


def test_only_the_markers_the_tokenizer_appends_are_dropped(eos_dir):
    """A marker the user typed is part of the prompt in every command; the one the
    tokenizer appends covers no character of the text (its offsets are empty)."""
    from pyattr.methods._core.tokens import prompt_ids

    tok = AutoTokenizer.from_pretrained(eos_dir)
    eos = tok.eos_token_id
    assert prompt_ids(tok, "the cat") == tok("the cat")["input_ids"][:-1]
    typed = prompt_ids(tok, "the cat<|endoftext|>")
    assert typed[-1] == eos and typed == tok("the cat<|endoftext|>")["input_ids"][:-1]
    assert continuation_ids(tok, "the cat<|endoftext|>", "owl")[0] == typed


def test_words_of_multi_byte_characters_and_punctuation_with_line_breaks():
    """A character split across byte-level tokens is one character of one word; a token
    that ends in a line break ('.ĊĊ' in Llama 3's vocabulary) ends its word."""
    from pyattr.methods._core.words import words

    tok = byte_bpe_tokenizer()
    for text in ["café owl", "the 🐟 fish", "猫 the 喜欢", "a  b\tc\n\nd", "user: the ship\nassistant: the"]:
        ids = torch.tensor(tok(text)["input_ids"])
        rel = torch.randn(3, len(ids), generator=torch.Generator().manual_seed(0))
        labels, agg = words(ids, torch.ones_like(ids), rel, tok)
        assert labels == text.split(), (text, labels)
        torch.testing.assert_close(agg.sum(-1), rel.sum(-1))
    tok = byte_bpe_tokenizer(punctuation_with_line_breaks=True)
    text = "the cat.\n\nthe dog.\nthe owl"
    ids = tok(text)["input_ids"]
    assert any(t.startswith(".") and t.endswith("Ċ") for t in tok.convert_ids_to_tokens(ids))
    ids = torch.tensor(ids)
    labels, _ = words(ids, torch.ones_like(ids), torch.zeros(1, len(ids)), tok)
    assert labels == text.split()


def test_patch_reads_a_one_word_prompt_of_an_eos_appending_tokenizer(eos_dir, tmp_path):
    r = run_cli("patch", "--model", str(eos_dir), "--clean", "the", "--corrupt", "a", "--nodes", "residual",
                "--json", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "p.json").read_text())["clean_tokens"] == ["the"]
