"""A padded row gives what the row gives alone, and a method's answer depends neither on
the other rows nor on earlier calls: caller caches, position conventions, read-outs at
fixed positions, batch-dependent forwards (issue 22). Every oracle here is the model's
own forward (on the row alone, or on the whole sequence for a cache) or plain autograd."""

import json

import pytest
import torch

import pyattr
from pyattr import RelevanceRules, targets
from pyattr.patching import activation_patching, attribution_patching
from models import VOCAB, WordIdTokenizer, minilm, pad_rows, tiny_causal_lm, tiny_encoder, tiny_rope_scaled

pytestmark = pytest.mark.usefixtures("one_thread")

PLAIN = RelevanceRules()




def _real(mask, i):
    return mask[i].bool()


# --------------------------------------------------------------------------- 1. caller state


@pytest.fixture(scope="module")
def cached():
    """A tiny Llama, a 6-token prefix in a DynamicCache, 4 new tokens (the issue's case)."""
    m = tiny_causal_lm("llama")
    g = torch.Generator().manual_seed(3)
    past = torch.randint(1, VOCAB, (1, 6), generator=g)
    new = torch.randint(1, VOCAB, (1, 4), generator=g)
    with torch.no_grad():
        cache = m(past, use_cache=True).past_key_values
    return m, past, new, cache


def _full_embeds(m, past, new):
    emb = m.get_input_embeddings()
    with torch.no_grad():
        return emb(past), emb(new)


def _logit(m, e_past, e_new, token):
    return m(inputs_embeds=torch.cat([e_past, e_new], 1)).logits[0, -1, token]


@pytest.mark.parametrize("key", ["past_key_values", "cache"])
def test_two_relevance_calls_with_one_cache(cached, key):
    m, past, new, cache = cached
    before = cache.get_seq_length()
    e_past, e_new = _full_embeds(m, past, new)
    x = e_new.clone().requires_grad_(True)
    value = _logit(m, e_past, x, 5)
    (g,) = torch.autograd.grad(value, x)
    for _ in range(2):
        r = pyattr.relevance(m, {"input_ids": new, key: cache}, target=5, rules=PLAIN)
        torch.testing.assert_close(r.target[0], value.detach().double(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r.token_relevance[0], (e_new * g).sum(-1)[0], atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == before == 6


def test_relevance_zeros_baseline_with_cache(cached):
    m, past, new, cache = cached
    e_past, e_new = _full_embeds(m, past, new)
    x = e_new.clone().requires_grad_(True)
    value = _logit(m, e_past, x, 5)
    (g,) = torch.autograd.grad(value, x)
    with torch.no_grad():
        f0 = _logit(m, e_past, torch.zeros_like(e_new), 5).double()
    r = pyattr.relevance(m, {"input_ids": new, "past_key_values": cache}, target=5, rules=PLAIN, baseline="zeros")
    want_delta = (value.detach().double() - f0) - (e_new.double() * g.double()).sum()
    torch.testing.assert_close(r.baseline_target[0], f0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r.conservation_delta[0], want_delta, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == 6


def test_integrated_gradients_with_cache(cached):
    """Riemann-middle IG over the new tokens' embeddings, the cache constant, in float64
    by plain autograd on the whole sequence."""
    m, past, new, cache = cached
    n = 6
    r = pyattr.integrated_gradients(m, {"input_ids": new, "past_key_values": cache}, target=5, n_steps=n,
                                    method="riemann_middle", internal_batch_size=4)
    m64 = tiny_causal_lm("llama").double()
    e_past, e_new = _full_embeds(m64, past, new)
    total = torch.zeros_like(e_new)
    for i in range(n):
        a = (i + 0.5) / n
        x = (a * e_new).requires_grad_(True)
        (g,) = torch.autograd.grad(_logit(m64, e_past, x, 5), x)
        total += g / n
    with torch.no_grad():
        f0 = _logit(m64, e_past, torch.zeros_like(e_new), 5)
    torch.testing.assert_close(r.attribution.double(), total * e_new, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(r.baseline_target[0], f0, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 6


def test_attribution_patching_with_cache(cached):
    m, past, new, cache = cached
    corrupt = new.flip(1)
    metric = targets.Logit(5)
    r = attribution_patching(m, {"input_ids": new, "past_key_values": cache},
                             {"input_ids": corrupt, "past_key_values": cache}, metric, method="atp")
    with torch.no_grad():
        clean_v = m(torch.cat([past, new], 1)).logits[0, -1, 5].double()
        corrupt_v = m(torch.cat([past, corrupt], 1)).logits[0, -1, 5].double()
    torch.testing.assert_close(r.clean_metric[0], clean_v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r.corrupt_metric[0], corrupt_v, atol=1e-5, rtol=1e-5)
    exact = activation_patching(m, {"input_ids": new, "past_key_values": cache},
                                {"input_ids": corrupt, "past_key_values": cache}, metric, nodes="residual")
    # patching every position of block 0's input is the corrupt run itself
    torch.testing.assert_close(exact.corrupt_metric[0], corrupt_v, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 6


def test_layer_relevance_with_cache_rows_split(cached):
    """A two-row cache split into chunks: each chunk gets its own rows of the cache."""
    m, past, new, _ = cached
    past2 = torch.cat([past, past.flip(1)])
    new2 = torch.cat([new, new.flip(1)])
    with torch.no_grad():
        cache = m(past2, use_cache=True).past_key_values
    whole = pyattr.layer_relevance(m, {"input_ids": new2, "past_key_values": cache}, "residual", target=5)
    split = pyattr.layer_relevance(m, {"input_ids": new2, "past_key_values": cache}, "residual", target=5,
                                   internal_batch_size=1)
    with torch.no_grad():
        want = m(torch.cat([past2, new2], 1)).logits[:, -1, 5].double()
    torch.testing.assert_close(whole.target, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split.target, want, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 6


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cache_with_left_padded_prefix(arch):
    """A batch whose prefixes are left-padded in the cache, with the mask over cache + new
    tokens as transformers takes it: each row equals its unpadded prefix + new tokens."""
    m = tiny_causal_lm(arch)
    g = torch.Generator().manual_seed(8)
    prefixes = [torch.randint(3, VOCAB, (n,), generator=g) for n in (2, 5)]
    new = torch.randint(3, VOCAB, (2, 3), generator=g)
    pids, pmask = pad_rows(prefixes, "left")
    with torch.no_grad():
        cache = m(input_ids=pids, attention_mask=pmask, position_ids=((pmask.cumsum(1) - 1).clamp_min(0)),
                  use_cache=True).past_key_values
    mask = torch.cat([pmask, torch.ones_like(new)], 1)
    r = pyattr.relevance(m, {"input_ids": new, "past_key_values": cache, "attention_mask": mask}, target=[4, 9])
    for i, (p, t) in enumerate(zip(prefixes, [4, 9])):
        with torch.no_grad():
            want = m(torch.cat([p, new[i]])[None]).logits[0, -1, t].double()
        alone = pyattr.relevance(m, torch.cat([p, new[i]])[None], target=t)
        torch.testing.assert_close(r.target[i], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r.token_relevance[i], alone.token_relevance[0, -3:], atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == 5
    with pytest.raises(ValueError, match=r"attention_mask of shape \(2, 7\) must match input_ids \(2, 3\) or, with "
                                         r"the 5 cached positions, \(2, 8\)"):
        pyattr.relevance(m, {"input_ids": new, "past_key_values": cache, "attention_mask": mask[:, 1:]}, target=4)


def test_uncopyable_state_is_refused():
    m = tiny_causal_lm("llama")

    class Opaque:
        def __deepcopy__(self, memo):
            raise TypeError("no copies")

    with pytest.raises(ValueError, match=r"inputs: 'past_key_values' is a Opaque that a forward may change in place"):
        pyattr.relevance(m, {"input_ids": torch.tensor([[3, 4]]), "past_key_values": Opaque()}, target=1)


# --------------------------------------------------------------------------- 2. positions


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("rules", [None, PLAIN], ids=["rules", "plain"])
def test_roberta_left_padding_positions(attn, rules):
    m = tiny_causal_lm("roberta", attn=attn)
    g = torch.Generator().manual_seed(5)
    row = torch.randint(3, VOCAB, (6,), generator=g)
    ids, mask = pad_rows([row, torch.randint(3, VOCAB, (9,), generator=g)], "left", pad_id=1)
    r = pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=7, rules=rules)
    alone = pyattr.relevance(m, row[None], target=7, rules=rules)
    with torch.no_grad():
        hf_padded = m(input_ids=ids, attention_mask=mask).logits[0, -1, 7].double()
        hf_alone = m(input_ids=row[None]).logits[0, -1, 7].double()
    torch.testing.assert_close(hf_padded, hf_alone, atol=1e-5, rtol=1e-5)  # transformers' own convention
    torch.testing.assert_close(r.target[0], hf_alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r.token_relevance[0, _real(mask, 0)], alone.token_relevance[0], atol=1e-5, rtol=1e-4)


def test_roberta_pad_baseline_keeps_positions():
    m = tiny_causal_lm("roberta")
    row = torch.tensor([[5, 9, 13, 21, 8]])
    r = pyattr.relevance(m, row, target=7, baseline="pad")
    pad = m.config.pad_token_id
    with torch.no_grad():
        f0 = m(input_ids=torch.full_like(row, pad), position_ids=torch.arange(5)[None] + pad + 1).logits[0, -1, 7]
    torch.testing.assert_close(r.baseline_target[0], f0.double(), atol=1e-5, rtol=1e-5)
    ig = pyattr.integrated_gradients(m, row, target=7, baseline="pad", n_steps=2)
    torch.testing.assert_close(ig.baseline_target[0], f0.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["xlm-roberta", "camembert"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_unmapped_roberta_family_positions(kind, side):
    """Rules off work on any architecture: the position convention is found structurally."""
    m = tiny_encoder(kind)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, VOCAB, (n,), generator=g) for n in (4, 7)]
    ids, mask = pad_rows(rows, side, pad_id=1)
    r = pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=[4, 9], rules=PLAIN)
    for i, (row, t) in enumerate(zip(rows, [4, 9])):
        with torch.no_grad():
            want = m(input_ids=row[None]).logits[0, -1, t].double()
        alone = pyattr.relevance(m, row[None], target=t, rules=PLAIN)
        torch.testing.assert_close(r.target[i], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r.token_relevance[i, _real(mask, i)], alone.token_relevance[0], atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- 3. read-outs


def test_cosine_cls_pooling_under_left_padding():
    tok, model = minilm()
    texts = ["a man is playing a guitar", "music on stage tonight with friends and a band"]
    ref = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    tok.padding_side = "left"
    try:
        enc = tok(texts, return_tensors="pt", padding=True)
    finally:
        tok.padding_side = "right"
    target = targets.Cosine(ref, pooling="cls")
    r = pyattr.relevance(model, enc, target=target)
    mask = enc["attention_mask"]
    for i, text in enumerate(texts):
        one = tok(text, return_tensors="pt")
        alone = pyattr.relevance(model, one, target=target)
        with torch.no_grad():
            h = model(**one).last_hidden_state[0, 0]
        want = torch.nn.functional.cosine_similarity(h, ref, dim=0).double()
        torch.testing.assert_close(r.target[i], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r.token_relevance[i, _real(mask, i)], alone.token_relevance[0], atol=1e-5, rtol=1e-4)
        assert float(r.token_relevance[i, ~_real(mask, i)].abs().sum()) == 0.0


def test_cosine_cls_patching_metric_under_left_padding():
    tok, model = minilm()
    ref = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    metric = targets.Cosine(ref, pooling="cls")
    clean, corrupt = "the cat sat on the mat", "the dog sat on the rug"
    alone = attribution_patching(model, tok(clean, return_tensors="pt"), tok(corrupt, return_tensors="pt"),
                                 metric, nodes="residual")
    ids_c = tok(clean, return_tensors="pt")["input_ids"]
    ids_x = tok(corrupt, return_tensors="pt")["input_ids"]
    pad = torch.zeros(1, 3, dtype=torch.long)
    ones = torch.ones_like(ids_c)
    mask = torch.cat([pad, ones], 1)
    padded = attribution_patching(model, {"input_ids": torch.cat([pad, ids_c], 1), "attention_mask": mask},
                                  {"input_ids": torch.cat([pad, ids_x], 1), "attention_mask": mask}, metric, nodes="residual")
    torch.testing.assert_close(padded.clean_metric, alone.clean_metric, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded["residual"][..., 3:], alone["residual"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta"])
def test_classifier_cls_readout_under_left_padding(kind):
    """BERT's pooler and RoBERTa's classification head read position 0: they read each
    row's first real token instead during a pass."""
    m = tiny_encoder(kind, head="cls")
    pad = m.config.pad_token_id
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(3, VOCAB, (n,), generator=g) for n in (4, 8)]
    ids, mask = pad_rows(rows, "left", pad_id=pad)
    rules = None if kind in ("bert", "roberta") else PLAIN  # rules need a mapped architecture
    r = pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=2, rules=rules)
    for i, row in enumerate(rows):
        with torch.no_grad():
            want = m(input_ids=row[None]).logits[0, 2].double()
        alone = pyattr.relevance(m, row[None], target=2, rules=rules)
        torch.testing.assert_close(r.target[i], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r.token_relevance[i, _real(mask, i)], alone.token_relevance[0], atol=1e-5, rtol=1e-4)


def test_model_forward_reading_position_zero_refuses_left_padding():
    m = tiny_encoder("distilbert", head="cls")
    ids, mask = pad_rows([[5, 6, 7], [5, 6, 7, 8, 9]], "left")
    with pytest.raises(ValueError, match=r"relevance\(\): attention_mask pads row 0 on the left, and "
                                         r"DistilBertForSequenceClassification.forward reads position 0"):
        pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=1)
    ids, mask = pad_rows([[5, 6, 7], [5, 6, 7, 8, 9]], "right")
    r = pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=1)
    with torch.no_grad():
        want = m(input_ids=torch.tensor([[5, 6, 7]])).logits[0, 1].double()
    torch.testing.assert_close(r.target[0], want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- 4. batch-dependent forwards


def _mixed(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in (5, 12, 7, 10)]


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_batch_dependent_rope_rows_equal_alone(kind, side):
    m = tiny_rope_scaled(kind)
    rows = _mixed()
    ids, mask = pad_rows(rows, side)
    before = {n: b.clone() for n, b in m.named_buffers()}
    r = pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=[3, 4, 5, 6])
    ig = pyattr.integrated_gradients(m, {"input_ids": ids, "attention_mask": mask}, target=[3, 4, 5, 6], n_steps=3,
                                     baseline="pad", internal_batch_size=5)
    lr = pyattr.layer_relevance(m, {"input_ids": ids, "attention_mask": mask}, "residual", target=[3, 4, 5, 6])
    for i, (row, t) in enumerate(zip(rows, [3, 4, 5, 6])):
        fresh = tiny_rope_scaled(kind)  # the row's own forward on an untouched model
        with torch.no_grad():
            want = fresh(row[None]).logits[0, -1, t].double()
        torch.testing.assert_close(r.target[i], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ig.target[i], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lr.target[i], want, atol=1e-5, rtol=1e-5)
        alone = pyattr.relevance(m, row[None], target=t)
        torch.testing.assert_close(r.token_relevance[i, _real(mask, i)], alone.token_relevance[0], atol=1e-5, rtol=1e-4)
        ig1 = pyattr.integrated_gradients(m, row[None], target=t, n_steps=3, baseline="pad")
        torch.testing.assert_close(ig.token_attribution[i, _real(mask, i)], ig1.token_attribution[0], atol=1e-5, rtol=1e-4)
    # the caller's model is left as it was (dynamic-NTK rewrites its frequencies)
    for n, b in m.named_buffers():
        assert torch.equal(b, before[n]), n


def test_batch_dependent_rope_patching_mixed_is_refused():
    m = tiny_rope_scaled("longrope")
    ids, mask = pad_rows(_mixed()[:2], "left")
    with pytest.raises(ValueError, match=r"attribution_patching: the rows of clean have lengths for which"):
        attribution_patching(m, {"input_ids": ids, "attention_mask": mask}, {"input_ids": ids, "attention_mask": mask},
                             targets.Logit(3))


def test_pyattr_run_groups_batch_dependent_rows(tmp_path):
    import pandas as pd

    m = tiny_rope_scaled("longrope")
    rows = _mixed()
    data = [{"id": str(i), "text": " ".join(str(int(v)) for v in r)} for i, r in enumerate(rows)]
    pyattr.run(m, data, tmp_path / "out", tokenizer=WordIdTokenizer(), max_tokens_per_batch=4096)
    df = pd.read_parquet(tmp_path / "out").set_index("id")
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert "longrope (threshold 8 positions)" in manifest["batch_dependence"]
    for i, row in enumerate(rows):
        with torch.no_grad():
            logits = tiny_rope_scaled("longrope")(row[None]).logits[0, -1]
        assert pd.isna(df.loc[str(i), "error"])
        assert int(df.loc[str(i), "target_id"]) == int(logits.argmax())
        assert abs(df.loc[str(i), "target"] - float(logits.max())) < 1e-5


# --------------------------------------------------------------------------- 5. smaller items


@pytest.mark.parametrize("baseline", ["zeros", "tensor"])
def test_layer_ig_at_embeddings_equals_ig(baseline):
    m = tiny_causal_lm("llama")
    ids = torch.tensor([[5, 9, 13, 21], [7, 8, 30, 2]])
    base = "zeros" if baseline == "zeros" else torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    ig = pyattr.integrated_gradients(m, ids, target=3, baseline=base, n_steps=8)
    layer = pyattr.integrated_gradients(m, ids, target=3, baseline=base, n_steps=8, layer="model.embed_tokens")
    torch.testing.assert_close(layer.attribution, ig.attribution, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(layer.baseline_target, ig.baseline_target, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(layer.convergence_delta, ig.convergence_delta, atol=1e-6, rtol=1e-5)


def test_wrapper_prefixed_paths_are_accepted():
    m = tiny_causal_lm("llama")
    ids = torch.tensor([[5, 9, 13, 21]])
    plain = pyattr.layer_relevance(m, ids, "model.layers.1", target=3)
    wrapped = pyattr.layer_relevance(torch.nn.DataParallel(m), ids, "module.model.layers.1", target=3)
    torch.testing.assert_close(wrapped["module.model.layers.1"].relevance, plain["model.layers.1"].relevance)
    t = pyattr.relevance(m, ids, target=targets.ModuleOutput("module.model.layers.1", select=(slice(None), 0)))
    u = pyattr.relevance(m, ids, target=targets.ModuleOutput("model.layers.1", select=(slice(None), 0)))
    torch.testing.assert_close(t.target, u.target)
    ig = pyattr.integrated_gradients(m, ids, target=3, layer="module.model.layers.0", n_steps=2)
    ig0 = pyattr.integrated_gradients(m, ids, target=3, layer="model.layers.0", n_steps=2)
    torch.testing.assert_close(ig.attribution, ig0.attribution)
    with pyattr.capture(m, ["module.model.layers.0"]) as cap:
        m(ids)
    assert cap["module.model.layers.0"].output is not None


# --------------------------------------------------------------------------- from the adversarial review


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_caller_position_ids_decide_the_rotary_regime(kind):
    """Transformers reads max(position_ids) + 1 over the batch: rows with the caller's
    position ids in two regimes run apart, each as its own forward with its ids."""
    m = tiny_rope_scaled(kind)
    ids = torch.tensor([[5, 9, 13, 21, 8], [7, 3, 30, 12, 4]])
    pos = torch.stack([torch.arange(5), torch.arange(10, 15)])
    r = pyattr.relevance(m, {"input_ids": ids, "position_ids": pos}, target=[3, 4])
    for i, t in enumerate([3, 4]):
        fresh = tiny_rope_scaled(kind)
        with torch.no_grad():
            want = fresh(input_ids=ids[i:i + 1], position_ids=pos[i:i + 1]).logits[0, -1, t].double()
        alone = pyattr.relevance(m, {"input_ids": ids[i:i + 1], "position_ids": pos[i:i + 1]}, target=t)
        torch.testing.assert_close(r.target[i], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r.token_relevance[i], alone.token_relevance[0], atol=1e-5, rtol=1e-4)


def test_cache_with_a_mask_over_the_new_tokens_only_is_refused(cached):
    m, past, new, cache = cached
    with pytest.raises(ValueError, match=r"attention_mask of shape \(1, 4\) covers the new tokens only, but the inputs "
                                         r"hold a key/value cache of 6 positions: .* shape \(1, 10\)"):
        pyattr.relevance(m, {"input_ids": new, "past_key_values": cache, "attention_mask": torch.ones_like(new)})


def test_base_model_forward_reading_position_zero_refuses_left_padding():
    """ALBERT's base model pools ``sequence_output[:, 0]`` in its own forward."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                         num_hidden_layers=2, max_position_embeddings=32, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, num_labels=3, pad_token_id=0)
    m = T.AlbertForSequenceClassification(cfg).eval()
    ids, mask = pad_rows([[5, 6, 7], [5, 6, 7, 8, 9]], "left")
    with pytest.raises(ValueError, match=r"integrated_gradients\(\): attention_mask pads row 0 on the left, and "
                                         r"AlbertModel.forward reads position 0"):
        pyattr.integrated_gradients(m, {"input_ids": ids, "attention_mask": mask}, target=1, n_steps=2)
    ids, mask = pad_rows([[5, 6, 7], [5, 6, 7, 8, 9]], "right")
    r = pyattr.integrated_gradients(m, {"input_ids": ids, "attention_mask": mask}, target=1, n_steps=2)
    with torch.no_grad():
        want = m(input_ids=torch.tensor([[5, 6, 7]])).logits[0, 1].double()
    torch.testing.assert_close(r.target[0], want, atol=1e-5, rtol=1e-5)


def test_clip_text_eos_pooling_refuses_left_padding():
    """CLIP's text tower pools at the first end-of-text token found in the ids: under
    left padding with pad == eos that is a pad token."""
    import transformers as T

    cfg = T.CLIPTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                           num_hidden_layers=2, max_position_embeddings=32, initializer_range=0.2,
                           eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1, bos_token_id=VOCAB - 2)
    torch.manual_seed(0)
    m = T.CLIPTextModel(cfg).eval()
    w = torch.randn(32, generator=torch.Generator().manual_seed(2))
    rows = [[VOCAB - 2, 5, 6, VOCAB - 1], [VOCAB - 2, 5, 6, 7, 8, VOCAB - 1]]
    ids, mask = pad_rows(rows, "left", pad_id=VOCAB - 1)
    with pytest.raises(ValueError, match=r"CLIPTextModel.forward pools at the first end-of-sequence token"):
        pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=lambda out: out.pooler_output @ w)
    ids, mask = pad_rows(rows, "right", pad_id=VOCAB - 1)
    r = pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=lambda out: out.pooler_output @ w)
    for i, row in enumerate(rows):
        with torch.no_grad():
            want = (m(input_ids=torch.tensor([row])).pooler_output[0] @ w).double()
        torch.testing.assert_close(r.target[i], want, atol=1e-5, rtol=1e-5)


def test_last_non_pad_classifier_pad_baseline_under_left_padding():
    """A decoder sequence classifier reads the last non-pad token of the ids; the all-pad
    baseline has none. Right padding gives the row alone's f(x0); left padding is refused."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=2, initializer_range=0.2, pad_token_id=0, num_labels=3)
    m = T.LlamaForSequenceClassification(cfg).eval()
    with torch.no_grad():
        m.get_input_embeddings().weight[0].normal_()  # a trained pad row (pad = eos in many checkpoints)
    rows = [[5, 6, 7], [5, 6, 7, 8, 9]]
    ids, mask = pad_rows(rows, "right")
    r = pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=1, baseline="pad")
    for i, row in enumerate(rows):
        alone = pyattr.relevance(m, torch.tensor([row]), target=1, baseline="pad")
        torch.testing.assert_close(r.baseline_target[i], alone.baseline_target[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r.conservation_delta[i], alone.conservation_delta[0], atol=1e-4, rtol=1e-4)
    ids, mask = pad_rows(rows, "left")
    with pytest.raises(ValueError, match=r"baseline: 'pad' on a batch that pads row 0 on the left, and "
                                         r"LlamaForSequenceClassification.forward reads the last token"):
        pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=1, baseline="pad")


# --------------------------------------------------------------------------- second review


def test_explain_pair_with_a_left_padding_tokenizer(tmp_path):
    from pyattr.apps.explain import explain_pair

    tok, model = minilm()
    right = explain_pair("a cat", "a dog sleeps on the warm sofa")
    tok.padding_side = "left"
    try:
        tok.save_pretrained(tmp_path)
    finally:
        tok.padding_side = "right"
    model.save_pretrained(tmp_path)
    left = explain_pair("a cat", "a dog sleeps on the warm sofa", model_dir=tmp_path)
    for a, b in zip(left.segments, right.segments):
        assert a.tokens == b.tokens and "[PAD]" not in a.tokens
        torch.testing.assert_close(torch.tensor(a.relevance), torch.tensor(b.relevance), atol=1e-6, rtol=1e-5)
    assert abs(left.target - right.target) < 1e-6


def test_run_reads_beyond_max_positions_with_dynamic_ntk_and_roberta_limit(tmp_path):
    import pandas as pd

    from pyattr.methods._core import max_positions as _max_positions

    assert _max_positions(tiny_rope_scaled("dynamic")) is None  # rescaled beyond max_position_embeddings
    assert _max_positions(tiny_causal_lm("roberta")) == 64 - 1 - 1  # positions start at padding_idx + 1


    m = tiny_rope_scaled("dynamic")
    rows = _mixed(1)
    data = [{"id": str(i), "text": " ".join(str(int(v)) for v in r)} for i, r in enumerate(rows)]
    pyattr.run(m, data, tmp_path / "out", tokenizer=WordIdTokenizer())
    df = pd.read_parquet(tmp_path / "out").set_index("id")
    for i, row in enumerate(rows):
        with torch.no_grad():
            logits = tiny_rope_scaled("dynamic")(row[None]).logits[0, -1]
        assert pd.isna(df.loc[str(i), "error"]), df.loc[str(i), "error"]
        assert abs(df.loc[str(i), "target"] - float(logits.max())) < 1e-5


@pytest.mark.parametrize("pos,exc,msg", [
    (torch.arange(3).expand(2, 3), ValueError, r"inputs: position_ids of shape \(2, 3\) must be \(2, 4\) or \(1, 4\)"),
    (torch.arange(4).expand(3, 4), ValueError, r"inputs: position_ids of shape \(3, 4\) must be \(2, 4\) or \(1, 4\)"),
    (torch.zeros(2, 4, 1, dtype=torch.long), ValueError, r"inputs: position_ids of shape \(2, 4, 1\)"),
    (torch.zeros(2, 4), TypeError, r"inputs: position_ids must be an integer tensor"),
])
@pytest.mark.parametrize("arch", ["llama", "dynamic"])
def test_bad_position_ids(arch, pos, exc, msg):
    m = tiny_rope_scaled(arch) if arch == "dynamic" else tiny_causal_lm(arch)
    ids = torch.tensor([[5, 9, 13, 21], [7, 3, 30, 12]])
    with pytest.raises(exc, match=msg):
        pyattr.relevance(m, {"input_ids": ids, "position_ids": pos}, target=3)


def test_cache_batch_must_match_the_inputs(cached):
    m, past, new, cache = cached
    with pytest.raises(ValueError, match=r"inputs: 'cache' holds a cache of 1 rows for input_ids of 2 rows"):
        pyattr.integrated_gradients(m, {"input_ids": new.expand(2, -1), "cache": cache}, target=3, n_steps=2)


def test_cache_built_with_autograd_on_is_copied_detached(cached):
    m, past, new, _ = cached
    emb = m.get_input_embeddings()(past).detach().requires_grad_(True)
    cache = m(inputs_embeds=emb, use_cache=True).past_key_values  # non-leaf tensors in the cache
    r = pyattr.relevance(m, {"input_ids": new, "past_key_values": cache}, target=5)
    with torch.no_grad():
        want = m(torch.cat([past, new], 1)).logits[0, -1, 5].double()
    torch.testing.assert_close(r.target[0], want, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 6
