"""Bad and unusual inputs to text in / words out and to the result views: each a clear
error naming the argument and what was expected, or the exact value (DESIGN §10, §11).

Every case here failed (a silent wrong answer, a misleading error, a raw exception from
deep inside) before the fix that came with it, unless marked as a guard."""

from __future__ import annotations

import io
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

import pyattr
import pyattr.evaluate as E
import pyattr.toy
from pyattr.patching import attribution_patching

TEXT = "cat dog owl fox cat dog"


@pytest.fixture(scope="module")
def bpe():
    from bpe import byte_bpe_tokenizer, tiny_gpt2

    tok = byte_bpe_tokenizer()
    return tok, tiny_gpt2(tok, seed=0)


def _metric(out):
    return out.logits[:, -1, 5]


# ---------------------------------------------------------------------------- text in


def test_text_with_an_attention_mask_is_refused(toy):
    # before: the given mask silently replaced the tokenizer's (other values, no error)
    tok, model = toy
    with pytest.raises(ValueError, match=r"^attention_mask: the inputs argument is text, whose attention mask the "
                                         r"tokenizer gives; pass attention_mask= only with token ids$"):
        pyattr.relevance(model, "cat dog", attention_mask=torch.tensor([[1, 1, 0]]), tokenizer=tok)
    with pytest.raises(ValueError, match=r"^corrupt_attention_mask: the corrupt argument is text, whose attention "
                                         r"mask the tokenizer gives; pass corrupt_attention_mask= only with token ids$"):
        attribution_patching(model, TEXT, "cat dog bee fox cat dog", _metric, tokenizer=tok,
                             corrupt_attention_mask=torch.ones(1, 7, dtype=torch.long))


def test_errors_on_the_corrupt_text_name_corrupt(toy):
    # before: "inputs: text 0 is empty" for the corrupt argument
    tok, model = toy
    with pytest.raises(ValueError, match=r"^corrupt: text 0 is empty$"):
        attribution_patching(model, TEXT, "  ", _metric, tokenizer=tok)
    with pytest.raises(ValueError, match=r"^clean: text 1 is empty$"):
        attribution_patching(model, [TEXT, ""], [TEXT, TEXT], _metric, tokenizer=tok)


def test_a_tokenizer_of_another_model_is_named(toy, bpe):
    # before: "inputs: token ids must be in [0, 50) ..." (no word of the tokenizer); for a text
    # continuation the same, from deep inside generation
    _, model = toy
    btok, _ = bpe
    top = max(btok("the sea sky ship")["input_ids"])
    assert top >= 50
    with pytest.raises(ValueError, match=rf"^inputs: the tokenizer reads the text as ids up to {top}, but "
                                         r"LlamaForCausalLM's input embedding has 50 rows \(ids 0\.\.49\); is "
                                         r"tokenizer= this model's tokenizer\?$"):
        pyattr.relevance(model, "the sea sky ship", tokenizer=btok)
    with pytest.raises(ValueError, match=r"^inputs: the tokenizer reads the text as ids up to \d+, but "
                                         r"LlamaForCausalLM's input embedding has 50 rows"):
        pyattr.generation_relevance(model, "the cat", continuation="sea", tokenizer=btok)


def test_an_empty_word_target(toy, bpe):
    # before: "it splits into 0 tokens, not one; to explain each token of a continuation, use
    # pyattr.generation_relevance" (there is no continuation to explain)
    tok, model = toy
    with pytest.raises(ValueError, match=r"^target: the word is empty \(''\); a word target names a token, "
                                         r"e.g. target='Paris'$"):
        pyattr.relevance(model, TEXT, target="", tokenizer=tok)
    for word in (" ", "\n"):
        with pytest.raises(ValueError, match=rf"^target: the tokenizer reads the word {re.escape(repr(word))} as no "
                                             r"token; a word target names a token, e.g. target='Paris'$"):
            pyattr.relevance(model, TEXT, target=word, tokenizer=tok)
    # guard: where the tokenizer has a token for it (byte-level 'Ċ'), a line break is a target
    btok, bmodel = bpe
    r = pyattr.relevance(bmodel, "the cat", target="\n", tokenizer=btok)
    assert btok.convert_ids_to_tokens([int(r.target_ids[0])]) == ["Ċ"]


def test_a_target_list_mixing_words_and_ids(toy):
    # before: "target: token ids must be integers, got ['owl', 5]" (the word read as a bad id)
    tok, model = toy
    with pytest.raises(TypeError, match=r"^target: a list mixes words and other targets \(\['owl', 5\]\); give one "
                                        r"word per row or one token id per row, not both$"):
        pyattr.relevance(model, [TEXT, "red blue red"], target=["owl", 5], tokenizer=tok)
    # before: torch's "too many dimensions 'str'"
    with pytest.raises(TypeError, match=r"^target: words in nested lists \(\[\['owl', 'fox'\]\]\) are not read; give one "
                                        r"word per row, or k targets per row as token ids \(LongTensor\[batch, k\]\)$"):
        pyattr.relevance(model, TEXT, target=[["owl", "fox"]], tokenizer=tok)


def test_class_labels_one_per_row(toy):
    # before: "expected one token id per batch row, shape (2,) or (2, 1), got shape (3,)"
    model, _ = pyattr.toy.load_squares()
    torch.manual_seed(0)
    pixels = torch.rand(2, 3, 32, 32)
    with pytest.raises(ValueError, match=r"^target: 3 labels for 2 input rows \(one label per row\)$"):
        pyattr.relevance(model, pixels, target=["red", "blue", "green"])


def test_a_text_continuation_needs_a_text_prompt(toy):
    # before: TypeError "continuation must be token ids: ..." (text continuations are taken,
    # with a text prompt)
    tok, model = toy
    ids = torch.tensor([tok("cat dog owl")["input_ids"]])
    with pytest.raises(ValueError, match=r"^continuation: a text continuation is tokenized together with its prompt, "
                                         r"so inputs must be text too \(got Tensor\); pass the prompt as a string, or "
                                         r"the continuation as token ids$"):
        pyattr.generation_relevance(model, ids, continuation="fox", tokenizer=tok)
    with pytest.raises(TypeError, match=r"^continuation: a list mixes texts and token ids \(\['fox', \[5\]\]\); give "
                                        r"one text per prompt or one id list per prompt, not both$"):
        pyattr.generation_relevance(model, ["cat dog", "owl fox"], continuation=["fox", [5]], tokenizer=tok)


def test_an_empty_prompt_before_a_text_continuation(toy):
    # before: the empty prompt was explained (the continuation's first token after <s> alone)
    tok, model = toy
    with pytest.raises(ValueError, match=r"^inputs: text 0 is empty$"):
        pyattr.generation_relevance(model, " ", continuation="fox", tokenizer=tok)


def test_text_for_a_named_model_without_a_tokenizer():
    # before: "pass tokenizer= (the model's tokenizer)" although the model came by name
    with pytest.raises(ValueError, match=r"^relevance\(\): inputs are text, but the model 'squares' came without a "
                                         r"tokenizer \(ViTForImageClassification\); pass tokenizer=, or the inputs the "
                                         r"model reads \(pixel_values for an image model\)$"):
        pyattr.relevance("squares", "a red square")


# ---------------------------------------------------------------------------- a model by name


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/model", "~/no-such-model-dir", Path("no-such-dir")])
def test_a_path_that_does_not_exist_is_not_sent_to_the_hub(name, monkeypatch):
    # before: "... so the Hugging Face hub was tried (offline) and failed: Repo id must be in
    # the form 'repo_name' or 'namespace/repo_name'"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=rf"^model directory {re.escape(repr(str(name)))} does not exist(; did you "
                                         r"mean .*)?$"):
        pyattr.relevance(name, TEXT)


def test_a_file_and_a_broken_config_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = os.path.join(pyattr.toy.INDUCTION_DIR, "config.json")
    with pytest.raises(ValueError, match=rf"^model path {re.escape(repr(cfg))} is not a directory$"):
        pyattr.relevance(cfg, TEXT)
    (tmp_path / "config.json").write_text("{not json")
    # before: "not a bundled model ... nor a local directory, so the Hugging Face hub was tried"
    with pytest.raises(ValueError, match=rf"^cannot load model from {re.escape(repr(str(tmp_path)))}: "):
        pyattr.relevance(str(tmp_path), TEXT)
    # before: '' is the working directory ("directory '' has no config.json")
    with pytest.raises(ValueError, match=r"^the model name is empty: give a bundled name \(minilm, induction, "
                                         r"squares, translation\), a local directory or a Hugging Face Hub id$"):
        pyattr.relevance("", TEXT)


def test_a_path_object_and_a_home_path_load(toy, tmp_path, monkeypatch):
    # before: "~/induction-copy" was sent to the hub ("Repo id must use alphanumeric chars"); a Path loads
    import shutil

    tok, model = toy
    home = tmp_path / "home"
    shutil.copytree(pyattr.toy.INDUCTION_DIR, home / "induction-copy")
    monkeypatch.setenv("HOME", str(home))
    ref = pyattr.relevance(model, TEXT, target="owl", tokenizer=tok)
    for name in (Path(pyattr.toy.INDUCTION_DIR), "~/induction-copy"):
        r = pyattr.relevance(name, TEXT, target="owl")
        assert torch.equal(r.token_relevance, ref.token_relevance)


# ---------------------------------------------------------------------------- views


def _hi_end(page: str) -> float:
    return float(re.search(r'-hi">([^<]*)<', page).group(1))


def test_nan_and_inf_in_a_token_view(bpe):
    # before: a NaN token was drawn in the deepest red (as the largest positive value), and
    # one inf made the scale ±inf: every other token white
    tok, model = bpe
    r = pyattr.relevance(model, "the cat is on the", tokenizer=tok)
    r.token_relevance[0, 1] = float("nan")
    r.token_relevance[0, 2] = float("inf")
    page = r._repr_html_()
    assert ('<span class="tok nan" title="position 1 · &#x27; cat&#x27; · relevance +nan"> cat</span>' in page)
    assert re.search(r'<span class="tok" style="background: rgb\(255, 0, 0\); color: #000" '
                     r'title="position 2 · &#x27; is&#x27; · relevance \+inf"> is</span>', page)
    finite = [abs(v) for v in r.token_relevance[0].tolist() if math.isfinite(v)]
    assert _hi_end(page) == float(f"{max(finite):.3g}")
    df = r.to_pandas()
    assert math.isnan(df.relevance[1]) and df.relevance[2] == math.inf and len(df) == 5
    fig = r.plot()
    fig.savefig(io.BytesIO(), format="png")
    assert [t.get_text() for t in fig.axes[0].texts] == ["nan"]  # the NaN cell is labelled


def test_a_nan_inside_a_generation_step_is_not_shown_as_outside_it(toy):
    # before: a NaN relevance inside a step's context was drawn hatched "not applicable" and
    # left out of to_pandas(), like the cells after the step
    tok, model = toy
    g = pyattr.generation_relevance(model, "cat dog owl fox cat", continuation="dog owl", tokenizer=tok)
    g.token_relevance[0, 0, 2] = float("nan")
    page = g._repr_html_()
    assert page.count('class="nan"') == 1 and "nan</td>" in page
    assert 'title="step 0:  dog · token &#x27; dog&#x27; · relevance nan"' in page
    df = g.to_pandas()
    step0 = df[df.step_index == 0]
    assert list(step0.token_index) == list(range(g.prompt_width))  # every context column, the NaN one too
    assert math.isnan(float(step0[step0.token_index == 2].relevance.iloc[0]))
    assert 'class="na"' in page  # the cells after the step stay "not applicable"


def test_views_say_which_rows_they_draw_and_to_pandas_has_every_row(toy):
    # before: the views drew 8 of 10 rows without a word, and to_pandas() (said to hold every
    # row) returned 8 rows as well
    tok, model = toy
    r = pyattr.relevance(model, [TEXT] * 10, tokenizer=tok)
    note = "the first 8 of 10 rows are drawn; to_pandas() and the tensors hold all 10"
    page = r._repr_html_()
    assert f"<div class='note'>{note}</div>" in page and page.count("<h4>") == 8
    df = r.to_pandas()
    assert sorted(df.panel.unique()) == list(range(10)) and len(df) == 10 * 7
    torch.testing.assert_close(torch.tensor(df[df.panel == 9].relevance.to_numpy()), r.token_relevance[9].double())
    assert note in r.to_html()
    fig = r.plot()
    assert note in " ".join(fig._suptitle.get_text().split())  # wrapped to the figure's width
    lay = pyattr.layer_relevance(model, [TEXT] * 10, "residual", target="owl", tokenizer=tok)
    assert "the first 8 of 10 rows are drawn" in lay._repr_html_()
    assert lay.to_pandas().panel.nunique() == 10


def test_every_row_of_curves_and_patching_in_to_pandas(toy):
    tok, model = toy
    torch.manual_seed(0)
    curve = E.perturbation_curve(model, [TEXT] * 10, torch.randn(10, 7), target="owl", steps=2, tokenizer=tok)
    df = curve.to_pandas()
    assert sorted(df.series.unique()) == sorted([f"row {i} (AUC {float(curve.auc[i]):.4g})" for i in range(10)]
                                                + ["mean"])
    assert "the first 8 of 10 rows are drawn" in curve._repr_html_()
    p = attribution_patching(model, [TEXT] * 3, ["cat dog bee fox cat dog"] * 3, _metric,
                             nodes=("residual", "attention"), method="relp", tokenizer=tok)
    page = p._repr_html_()
    assert "residual: the first 2 of 3 rows are drawn" in page and "attention: the first 2 of 3 rows" in page
    df = p.to_pandas()
    assert df.panel.nunique() == 6  # 3 rows × 2 nodes


def test_control_characters_in_tokens_do_not_reach_the_terminal(bpe, capsys):
    # before: show() printed a token's ESC and carriage return as they are (the terminal ran
    # the escape sequence; the line was overwritten)
    tok, model = bpe
    r = pyattr.relevance(model, "the\x1b[31m cat\r\n the", tokenizer=tok)
    assert any("\x1b" in t for t in r.tokens[0]) and any("\r" in t for t in r.tokens[0])
    r.show()
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out
    assert "\\x1b(" in out and "␍(" in out
    from pyattr.results.panels import label

    assert [label(t) for t in ["\u3000", "\xa0", "\u200b", "a\u202eb", " the"]] == ["␣", "␣", "\\u200b", "a\\u202eb",
                                                                                   " the"]


def test_plot_draws_dollar_signs_as_written(bpe):
    # before: a token "$$" made savefig fail (matplotlib's mathtext), "$x$" drew an italic x
    tok, model = bpe
    r = pyattr.relevance(model, "the cat is", tokenizer=tok)
    r.tokens = [["$$", "$x$", " is"]]
    fig = r.plot()
    fig.savefig(io.BytesIO(), format="png")
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [r"\$\$", r"\$x\$", " is"]


def test_plot_leaves_the_users_backend_alone(bpe):
    # before: plot() outside a notebook switched matplotlib to Agg (a user's plt.show() then
    # showed nothing)
    import matplotlib

    tok, model = bpe
    r = pyattr.relevance(model, "the cat", tokenizer=tok)
    before = matplotlib.get_backend()
    try:
        matplotlib.use("pdf")
        r.plot().savefig(io.BytesIO(), format="png")
        assert matplotlib.get_backend() == "pdf"
    finally:
        matplotlib.use(before)


def test_html_escapes_tokens(bpe):
    # guard: a token is text, never markup (a notebook view of untrusted text)
    tok, model = bpe
    r = pyattr.relevance(model, "the cat is", tokenizer=tok)
    r.tokens = [["<script>alert(1)</script>", '" onmouseover="alert(1)', "&amp;"]]
    page = r._repr_html_()
    assert "<script" not in page and 'onmouseover="' not in page
    assert ">&lt;script&gt;alert(1)&lt;/script&gt;</span>" in page and ">&amp;amp;</span>" in page


# ---------------------------------------------------------------------------- save / load


@pytest.fixture()
def saved(bpe, tmp_path):
    from safetensors import safe_open

    tok, model = bpe
    r = pyattr.relevance(model, "the cat is on the", tokenizer=tok)
    path = r.save(tmp_path / "r")
    with safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    return r, meta, tensors


def _write(tmp_path, name, tensors, meta):
    from safetensors.torch import save_file

    path = str(tmp_path / f"{name}.safetensors")
    save_file(tensors, path, metadata=meta)
    return path


def test_load_a_tampered_file(saved, tmp_path):
    # before: json.JSONDecodeError, KeyError 't0', TypeError from __init__, and a file that set
    # any attribute (a method) or held no result at all loaded without a word
    _, meta, tensors = saved
    broken = _write(tmp_path, "broken", tensors, {**meta, "pyattr": meta["pyattr"][:-5]})
    with pytest.raises(ValueError, match=r"^load\(\): '.*broken.safetensors': its pyattr metadata is not valid JSON "
                                         r"\(.*\); the file was changed after save\(\)$"):
        pyattr.load(broken)
    missing = _write(tmp_path, "missing", {k: v for k, v in tensors.items() if k != "t0"}, meta)
    with pytest.raises(ValueError, match=r"^load\(\): '.*missing.safetensors': its metadata refers to tensor 't0', "
                                         r"which the file does not hold; the file was changed after save\(\)$"):
        pyattr.load(missing)
    doc = json.loads(meta["pyattr"])
    del doc["fields"]["token_relevance"]
    nofield = _write(tmp_path, "nofield", tensors, {**meta, "pyattr": json.dumps(doc)})
    with pytest.raises(ValueError, match=r"^load\(\): '.*nofield.safetensors': it lacks fields of RelevanceResult: "
                                         r"\['token_relevance'\]; the file was changed after save\(\)$"):
        pyattr.load(nofield)
    doc = json.loads(meta["pyattr"])
    doc["fields"]["_repr_html_"] = "<script>alert(1)</script>"
    method = _write(tmp_path, "method", tensors, {**meta, "pyattr": json.dumps(doc)})
    with pytest.raises(ValueError, match=r"^load\(\): '.*method.safetensors': it gives RelevanceResult fields it does "
                                         r"not have: \['_repr_html_'\]; the file was changed after save\(\)$"):
        pyattr.load(method)
    for body in ("[1, 2]", json.dumps({"__tensor__": "t0"})):
        bare = _write(tmp_path, "bare", tensors, {**meta, "pyattr": body})
        with pytest.raises(ValueError, match=r"^load\(\): '.*bare.safetensors': its pyattr metadata holds no result "
                                             r"object; the file was changed after save\(\)$"):
            pyattr.load(bare)
    doc = json.loads(meta["pyattr"])
    doc["fields"]["tokens"] = {"__dict__": 5}
    shape = _write(tmp_path, "shape", tensors, {**meta, "pyattr": json.dumps(doc)})
    with pytest.raises(ValueError, match=r"^load\(\): '.*shape.safetensors': malformed pyattr metadata \(TypeError: "):
        pyattr.load(shape)
    newer = _write(tmp_path, "newer", tensors, {**meta, "format": "pyattr-result/9"})
    with pytest.raises(ValueError, match=r"is a safetensors file but not a pyattr result \(save\(\) writes those\) "
                                         r"\(its format is 'pyattr-result/9'; this pyattr reads 'pyattr-result/1'\)$"):
        pyattr.load(newer)


def test_save_to_a_directory_and_to_home(saved, tmp_path, monkeypatch):
    # before: save(DIR) wrote DIR.safetensors beside it, save('x.safetensors' that is a
    # directory) raised safetensors' own I/O error, and '~' was a directory named '~'
    r, _, _ = saved
    with pytest.raises(ValueError, match=rf"^save\(\): {re.escape(repr(str(tmp_path)))} is a directory; pass a file "
                                         rf"path \(e.g. {re.escape(repr(str(tmp_path / 'result')))}\)$"):
        r.save(tmp_path)
    assert not Path(str(tmp_path) + ".safetensors").exists()
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"^save\(\): '.*d.safetensors' is a directory; pass a file path"):
        r.save(tmp_path / "d.safetensors")
    monkeypatch.setenv("HOME", str(tmp_path))
    path = r.save("~/in-home")
    assert path == str(tmp_path / "in-home.safetensors")
    back = pyattr.load("~/in-home")
    assert torch.equal(back.token_relevance, r.token_relevance) and back.tokens == r.tokens


def test_round_trip_on_float64_and_bfloat16_models(bpe, tmp_path):
    # guard: the dtypes a result holds come back as they are
    from bpe import tiny_gpt2

    tok, _ = bpe
    for dtype in (torch.float64, torch.bfloat16):
        model = tiny_gpt2(tok, seed=0).to(dtype)
        r = pyattr.relevance(model, "the cat is", tokenizer=tok)
        back = pyattr.load(r.save(tmp_path / str(dtype)))
        for name in ("token_relevance", "relevance", "target", "conservation_delta", "target_ids"):
            a, b = getattr(r, name), getattr(back, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (dtype, name)
        assert back.tokens == r.tokens == [["the", " cat", " is"]]


def test_to_pandas_on_every_result_class(toy):
    # guard: every class lays out as a table
    tok, model = toy
    with pyattr.capture(model, ["model.layers.0"]) as cap:
        model(torch.tensor([tok(TEXT)["input_ids"]])).logits[0, -1, 5].backward()
    results = [
        pyattr.relevance(model, TEXT, tokenizer=tok),
        pyattr.relevance(model, TEXT, target=torch.tensor([[35, 36]]), tokenizer=tok),
        pyattr.layer_relevance(model, TEXT, "residual", target="owl", tokenizer=tok),
        pyattr.integrated_gradients(model, TEXT, target="owl", n_steps=2, tokenizer=tok),
        pyattr.generation_relevance(model, TEXT, max_new_tokens=1, tokenizer=tok),
        attribution_patching(model, TEXT, "cat dog bee fox cat dog", _metric, method="relp", tokenizer=tok),
        E.perturbation_curve(model, TEXT, torch.ones(1, 7), target="owl", steps=2, tokenizer=tok),
        pyattr.audit(model, TEXT, target="owl", tokenizer=tok),
        cap, cap["model.layers.0"],
    ]
    for r in results:
        df = r.to_pandas()
        assert len(df) > 0, type(r).__name__
