"""Context attribution on encoder–decoder models: sources in the source (the encoder's input),
the response on the decoder side; ablations against a loop over the model written here,
relevance methods against gradient × input read with hooks, cross-attention weights against
the model's own, and the bundled translation toy's known alignment."""

import pytest
import torch

import pyattr
from models import tiny_seq2seq
from test_seq2seq import ENTRIES

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ["t5", "bart", "marian", "mbart", "m2m_100"]


def _source(seed=0, n=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 90, (n,), generator=g).tolist()


def _logprob(model, src, dec, response):
    """Σ_t log p(response_t | source, decoder inputs before it), float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([dec]), use_cache=False).logits
    lp = logits[0].double().log_softmax(-1)
    first = len(dec) - len(response) + 1 - 1
    return sum(float(lp[first + t, tok]) for t, tok in enumerate(response))


def _dec(model, response):
    """The decoder's inputs as the model's own shift makes them from the response."""
    labels = torch.tensor([response])
    if hasattr(model, "prepare_decoder_input_ids_from_labels"):
        return model.prepare_decoder_input_ids_from_labels(labels=labels)[0].tolist()
    from transformers.models.m2m_100.modeling_m2m_100 import shift_tokens_right  # M2M100 shifts in its forward

    return shift_tokens_right(labels, model.config.pad_token_id, model.config.decoder_start_token_id)[0].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_leave_one_out_is_the_models_drop_per_source(arch):
    model = tiny_seq2seq(arch)
    src, response = _source(1), [11, 12, 13]
    ranges = [(0, 2), (2, 5), (6, 8)]          # token 5 in no source: always kept
    r = pyattr.context_attribution(model, torch.tensor(src), ranges, response=response, method="loo")
    dec = _dec(model, response)
    full = _logprob(model, src, dec, response)
    assert abs(float(r.value[0]) - full) <= 1e-10 * max(1.0, abs(full))
    for s, (a, b) in enumerate(ranges):
        dropped = _logprob(model, src[:a] + src[b:], dec, response)
        assert abs(float(r.scores[0, s]) - (full - dropped)) <= 1e-10 * max(1.0, abs(full))
    assert r.ablations == 1 + len(ranges) and r.response_ids == [response]


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_ablations_in_one_padded_batch_equal_each_alone(arch):
    """The ablated sources differ in length: right-padded with the mask, each row = the row alone."""
    model = tiny_seq2seq(arch)
    src = _source(2, 9)
    ranges = [(0, 1), (1, 4), (4, 6), (6, 8)]            # the last token (9th) in no source
    kw = dict(response=[20, 21], method="foldover", spans="tokens")
    one = pyattr.context_attribution(model, torch.tensor(src), ranges, batch_size=1, **kw)
    many = pyattr.context_attribution(model, torch.tensor(src), ranges, batch_size=64, **kw)
    assert torch.allclose(one.scores, many.scores, rtol=0, atol=1e-9)
    assert one.ablations == 1 + 2 ** 4


def _grad_x_input(model, arch, src, dec, response):
    """(response, source) gradient × input at the encoder's entry of each response token's
    log-probability, written with a hook (rules off)."""
    xs = {}

    def pre(mod, args):
        xs["x"] = args[0].detach().requires_grad_(True)
        return (xs["x"], *args[1:])

    h = model.get_submodule(ENTRIES[arch][0]).register_forward_pre_hook(pre)
    try:
        with torch.enable_grad():
            logits = model(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([dec]), use_cache=False).logits
            lp = logits[0].double().log_softmax(-1)
            rows = []
            for t, tok in enumerate(response):
                g, = torch.autograd.grad(lp[t, tok], xs["x"], retain_graph=True)
                rows.append((xs["x"] * g)[0].sum(-1).detach())
    finally:
        h.remove()
    return torch.stack(rows).double()


@pytest.mark.parametrize("arch", ["t5", "marian", "m2m_100"])
def test_gradient_method_is_gradient_times_input_at_the_encoder(arch):
    model = tiny_seq2seq(arch)
    src, response = _source(3), [30, 31, 32]
    ranges = [(0, 3), (3, 7)]
    r = pyattr.context_attribution(model, torch.tensor(src), ranges, response=response, method="gradient",
                                   spans="tokens")
    tok = _grad_x_input(model, arch, src, _dec(model, response), response)
    want = torch.stack([tok[:, a:b].sum(-1) for a, b in ranges], -1)
    assert (r.scores[0] - want).abs().max() <= 1e-6 * want.abs().max()
    assert r.ablations == 0


@pytest.mark.parametrize("method", ["relevance", "attnlrp"])
def test_relevance_methods_sum_seq2seq_relevance_per_source(method):
    model = tiny_seq2seq("bart")
    src, response = _source(4), [40, 41]
    ranges = [(0, 4), (4, 8)]
    r = pyattr.context_attribution(model, torch.tensor(src), ranges, response=response, method=method)
    rules = "attnlrp" if method == "attnlrp" else "all"
    dec = torch.tensor([_dec(model, response)])
    total = torch.zeros(len(ranges), dtype=torch.float64)
    for t, tok in enumerate(response):
        one = pyattr.relevance(model, torch.tensor([src]), target=pyattr.targets.LogProb(tok, t),
                               decoder_input_ids=dec, rules=rules)
        total += torch.stack([one.source_relevance[0, a:b].sum() for a, b in ranges]).double()
    assert torch.allclose(r.scores[0], total, rtol=1e-9, atol=1e-12)


def test_attention_method_averages_cross_attention():
    model = tiny_seq2seq("bart")
    model.set_attn_implementation("eager")
    src, response = _source(5), [50, 51, 52]
    ranges = [(0, 2), (2, 8)]
    r = pyattr.context_attribution(model, torch.tensor(src), ranges, response=response, method="attention",
                                   spans="tokens")
    with torch.no_grad():
        out = model(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([_dec(model, response)]),
                    output_attentions=True)
    att = torch.stack([a[0] for a in out.cross_attentions]).mean((0, 1))      # (decoder, source)
    want = torch.stack([att[:, a:b].sum(-1) for a, b in ranges], -1)
    assert torch.allclose(r.scores[0], want.double(), atol=1e-12)
    sdpa = tiny_seq2seq("bart")
    sdpa.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="method='attention': the model returned no cross-attention weights"):
        pyattr.context_attribution(sdpa, torch.tensor(src), ranges, response=response, method="attention")


def test_translation_toy_cites_the_aligned_source_word():
    """Each target word's source is known (the toy reverses the sentence): the relevance
    methods and cross-attention put each step's largest score on its aligned source word.
    Ablations do not (measured, docs/tutorials/encoder-decoder.md): dropping a word moves
    every later word, and the toy's reversed translation fails on the whole response."""
    from pyattr.toy import translation as TR

    model, tok = TR.load()
    model.set_attn_implementation("eager")
    g = torch.Generator().manual_seed(5)
    sentences = TR.sentences(g, 12)
    hits = {m: [0, 0] for m in ("attnlrp", "relevance", "attention")}
    for words in sentences:
        for m in hits:
            r = pyattr.context_attribution(model, " ".join(words), "word", response=" ".join(TR.translate(words)),
                                           tokenizer=tok, method=m, spans="tokens")
            assert r.sources[0] == list(words) and r.scores.shape == (1, len(words) + 1, len(words))
            n = len(words)
            best = r.scores[0, :n].argmax(-1).tolist()
            hits[m][0] += sum(best[t] == n - 1 - t for t in range(n))
            hits[m][1] += n
    for m, (h, n) in hits.items():
        assert h / n >= 0.95, (m, h, n)


def test_generated_response_and_text_views():
    from pyattr.toy import translation as TR

    model, tok = TR.load()
    r = pyattr.context_attribution(model, ["sun cat red", "dog sun"], "word", max_new_tokens=6, tokenizer=tok)
    enc = tok(["sun cat red", "dog sun"], return_tensors="pt", padding=True)
    gen = model.generate(**enc, max_new_tokens=6, do_sample=False)
    for row in range(2):
        want = [t for t in gen[row, 1:].tolist() if t != tok.pad_token_id]
        assert r.response_ids[row] == want
        assert r.response[row] == tok.decode(want)
    assert r.scores.shape == (2, 3) and torch.isnan(r.scores[1, 2])
    assert r.top(1, row=1)[0][0] in ("dog", "sun")


def test_encoder_decoders_refusals_name_the_argument():
    from transformers import BartConfig, BartForSequenceClassification

    model = tiny_seq2seq("bart")
    src = torch.tensor(_source(6))
    with pytest.raises(ValueError, match="query: scores a sentence-embedding model's match"):
        pyattr.context_attribution(model, src, [(0, 2)], query=[3, 4])
    with pytest.raises(ValueError, match=r"response\[0\]: a text response needs tokenizer="):
        pyattr.context_attribution(model, src, [(0, 2)], response="a b")
    with pytest.raises(ValueError, match=r"response\[0\]: token ids must be in"):
        pyattr.context_attribution(model, src, [(0, 2)], response=[500])
    with pytest.raises(ValueError, match="give response= .* or max_new_tokens="):
        pyattr.context_attribution(model, src, [(0, 2)])
    cls = BartForSequenceClassification(BartConfig(vocab_size=96, d_model=16, encoder_layers=1, decoder_layers=1,
                                                   encoder_attention_heads=2, decoder_attention_heads=2,
                                                   encoder_ffn_dim=16, decoder_ffn_dim=16))
    with pytest.raises(ValueError, match="BartForSequenceClassification is an encoder–decoder model without a "
                                         "language-model head"):
        pyattr.context_attribution(cls, src, [(0, 2)], response=[3])


@pytest.mark.parametrize("arch", ["mbart", "m2m_100", "bart"])
def test_teacher_forced_decoder_inputs_are_the_models_own_shift(arch):
    """A given continuation's decoder inputs are the model's teacher-forcing shift of it
    (mBART wraps the last token, its language code, to the front; M2M100 shifts in its
    forward and has no method for it), in generation_relevance as in context_attribution."""
    model = tiny_seq2seq(arch)
    src, cont = torch.tensor([_source(7)]), [21, 22, 23, 4]
    r = pyattr.generation_relevance(model, src, continuation=torch.tensor([cont]))
    assert r.sequences[0, :-1].tolist() == _dec(model, cont)
    assert r.sequences[0, 1:].tolist() == cont
    c = pyattr.context_attribution(model, src[0], [(0, 3)], response=cont, method="loo")
    assert abs(float(c.value[0]) - _logprob(model, src[0].tolist(), _dec(model, cont), cont)) <= 1e-10 * 50
    with torch.no_grad():
        logits = model(input_ids=src, decoder_input_ids=torch.tensor([_dec(model, cont)]), use_cache=False).logits[0]
    want = torch.stack([logits[t, tok] for t, tok in enumerate(cont)]).double()
    assert torch.allclose(r.target[0], want, rtol=1e-10, atol=1e-12)


def test_cite_command_on_an_encoder_decoder(capsys):
    """pyattr cite loads an encoder–decoder checkpoint as its own class: the translation
    toy's words, each target word's source first under AttnLRP (per-token scores summed)."""
    import json

    from pyattr.cli import main

    assert main(["cite", "--model", "translation", "--text", "sun cat red fox", "--split", "word", "--response",
                 "FOX RED CAT SUN", "--method", "attnlrp", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["method"] == "attnlrp" and doc["response"] == "FOX RED CAT SUN"
    assert sorted(s["text"] for s in doc["sources"]) == ["cat", "fox", "red", "sun"]
    assert main(["cite", "--model", "translation", "--text", "sun cat red", "--split", "word", "--max-new-tokens",
                 "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "response: 'RED CAT SUN </s>'  (method foldover, 9 forwards)"
    # --per-token: each translated word's own sources, its aligned source word first
    assert main(["cite", "--model", "translation", "--text", "sun cat red fox", "--split", "word", "--response",
                 "FOX RED CAT SUN", "--method", "attnlrp", "--per-token", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(t["token"].strip(), t["sources"][0]["text"]) for t in doc["tokens"][:4]] == [
        ("FOX", "fox"), ("RED", "red"), ("CAT", "cat"), ("SUN", "sun")]
    assert main(["cite", "--text", "a b", "--query", "q", "--per-token"]) == 2
    assert "--per-token splits a response into its tokens" in capsys.readouterr().err


@pytest.mark.parametrize("command,says", [
    (["explain", "--model", "translation", "--text", "sun cat"], "pyattr explain reads one stack; pyattr generate"),
    (["patch", "--model", "translation", "--clean", "sun cat", "--corrupt", "sun dog"],
     "pyattr patch runs causal LMs; patch it from Python with pyattr.patching.attribution_patching"),
    (["run", "--model", "translation", "--data", "prompts.jsonl", "--out", "out"],
     "pyattr run explains causal LMs' prompts"),
])
def test_one_stack_commands_name_the_encoder_decoder_before_loading(command, says, capsys, tmp_path):
    from pyattr.cli import main

    (tmp_path / "prompts.jsonl").write_text('{"text": "sun cat"}\n')
    command = [str(tmp_path / c) if c in ("prompts.jsonl", "out") else c for c in command]
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pyattr {command[0]}: error: --model translation is an encoder–decoder (MarianMTModel): ")
    assert says in err


@pytest.mark.parametrize("arch", ["bart", "mbart"])
def test_gradient_method_is_refused_where_the_source_enters_through_a_layernorm(arch):
    """BART's source relevance is read at its embedding LayerNorm's input, where x · ∂f/∂x is
    0 token by token (no token's own scale changes the norm's output): noise, refused."""
    model = tiny_seq2seq(arch)
    with pytest.raises(ValueError, match="method='gradient': gradient × input is zero on .*'s source up to rounding"):
        pyattr.context_attribution(model, torch.tensor(_source(8)), [(0, 2), (2, 5)], response=[11, 12],
                                   method="gradient")


def test_relevance_methods_read_float64_log_probabilities_on_a_float64_model():
    model = tiny_seq2seq("marian")
    src, ranges, resp = torch.tensor(_source(9)), [(0, 3), (3, 6)], [11, 12, 13]
    loo = pyattr.context_attribution(model, src, ranges, response=resp, method="loo")
    lrp = pyattr.context_attribution(model, src, ranges, response=resp, method="attnlrp")
    assert abs(float(loo.value[0]) - float(lrp.value[0])) <= 1e-12 * abs(float(loo.value[0]))


def test_a_generation_config_context_attribution_cannot_run_is_named():
    model = tiny_seq2seq("bart")
    model.generation_config.num_beams = 3
    with pytest.raises(ValueError, match=r"max_new_tokens: context_attribution generates one greedy sequence with the "
                                         r"model's generation config, and it cannot here \(one sequence per prompt"):
        pyattr.context_attribution(model, torch.tensor(_source(10)), [(0, 2)], max_new_tokens=2, method="loo")


def test_block_sparse_bigbird_ablations_are_each_source_alone_and_leave_the_model_as_it_was():
    """BigBird-Pegasus' block-sparse encoder computes a padded row otherwise than the row
    alone, and switches itself to full attention on a short source: the ablated sources run
    one at a time, each as the model runs it fresh, and the model keeps its attention."""
    from test_seq2seq import _bigbird_sparse

    model = _bigbird_sparse()
    g = torch.Generator().manual_seed(4)
    src = torch.randint(3, 90, (16,), generator=g)
    ranges, resp = [(0, 4), (4, 8), (8, 12)], [11, 12, 13]
    res = pyattr.context_attribution(model, src, ranges, response=resp, method="loo", batch_size=64)
    assert model.model.encoder.attention_type == "block_sparse"
    dec = model.prepare_decoder_input_ids_from_labels(labels=torch.tensor([resp]))

    def logprob(ids):
        fresh = _bigbird_sparse()   # the model as loaded: no earlier call switched it
        with torch.no_grad():
            lp = fresh(input_ids=ids[None], decoder_input_ids=dec).logits[0].double().log_softmax(-1)
        return sum(float(lp[t, tok]) for t, tok in enumerate(resp))

    full = logprob(src)
    for s, (a, b) in enumerate(ranges):
        want = full - logprob(torch.cat([src[:a], src[b:]]))
        assert abs(float(res.scores[0, s]) - want) <= 1e-9 * max(1.0, abs(full))
    with pytest.raises(ValueError, match="attention_mask: BigBirdPegasusForConditionalGeneration's encoder runs "
                                         "block-sparse attention, whose output on a padded row is not the row alone"):
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 12:] = 0
        pyattr.relevance(model, src.expand(2, -1), attention_mask=mask, target=5,
                         decoder_input_ids=torch.tensor([[2, 11], [2, 12]]))
    assert model.model.encoder.attention_type == "block_sparse"


def test_per_token_spans_are_named_by_their_tokens_in_the_views(tmp_path):
    from pyattr.toy import translation as TR

    model, tok = TR.load()
    c = pyattr.context_attribution(model, "sun cat red fox", "word", response="FOX RED CAT SUN", tokenizer=tok,
                                   spans="tokens", method="relevance")
    assert c.response_tokens == [["FOX", " RED", " CAT", " SUN", "</s>"]]
    titles = [p.title for p in c._panels()]
    assert "response tokens 0:1 'FOX'" in titles[0] and f"log-probability {float(c.value[0, 0]):.4g}" in titles[0]
    assert "response tokens 4:5 '</s>'" in titles[4]
    back = pyattr.load(c.save(tmp_path / "c.safetensors"))
    assert back.response_tokens == c.response_tokens
