"""ProphetNet: a decoder that appends ``ngram`` predicting streams after the tokens at its
entry (inputs: an n-gram embedding plus the next position's embedding, no token), reads its
logits from the first of them, and adds a position bias that is a projection of the hidden
states to its attention logits. Relevance of the tokens and of the streams against a float64
oracle written here with hooks; conservation over both; the methods that read positions
inside the decoder refuse by name."""

import pytest
import torch

import pyattr
from pyattr import RelevanceRules
from models import tiny_seq2seq
from test_seq2seq import _oracle_hooks

pytestmark = pytest.mark.usefixtures("one_thread")

ENTRY = "prophetnet.decoder.embeddings_layer_norm"


def _causal(biases: bool = True, dtype=torch.float64):
    """ProphetNetForCausalLM (the decoder alone): 2 layers, hidden 16, 2 predicting streams."""
    import transformers as T

    torch.manual_seed(11)
    cfg = T.ProphetNetConfig(vocab_size=96, hidden_size=16, decoder_ffn_dim=24, encoder_ffn_dim=24,
                             num_decoder_layers=2, num_encoder_layers=2, num_decoder_attention_heads=4,
                             num_encoder_attention_heads=4, ngram=2, num_buckets=8, relative_max_distance=16,
                             max_position_embeddings=64, init_std=0.3, is_decoder=True, add_cross_attention=False,
                             is_encoder_decoder=False, pad_token_id=0)
    model = T.ProphetNetForCausalLM(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64) if biases else torch.zeros_like(p))
    return model


def _oracle(model, ids, rules, token):
    """(token relevance, stream relevance (streams − 1, seq), value) by plain autograd with
    the rules written as detaches, the entry's input split into the tokens' stream and the
    appended ones, both made leaves."""
    hooks, leaves = _oracle_hooks(model, rules), {}

    def pre(mod, args):
        if leaves:
            return None
        seq = ids.shape[1]
        leaves["x"] = args[0][:, :seq].detach().requires_grad_(True)
        leaves["tail"] = args[0][:, seq:].detach().requires_grad_(True)
        return (torch.cat([leaves["x"], leaves["tail"]], 1), *args[1:])

    hooks.append(model.get_submodule(ENTRY).register_forward_pre_hook(pre))
    try:
        with torch.enable_grad():
            value = model(ids, use_cache=False).logits[0, -1, token]
            gx, gt = torch.autograd.grad(value, [leaves["x"], leaves["tail"]])
    finally:
        for h in hooks:
            h.remove()
    tail = (leaves["tail"] * gt).sum(-1).detach()
    return (leaves["x"] * gx).sum(-1).detach()[0], tail.reshape(-1, ids.shape[1]), value.detach()


@pytest.mark.parametrize("rules", ["none", "all", "attnlrp"])
def test_decoder_alone_equals_the_hooks_oracle_on_tokens_and_streams(rules):
    model = _causal()
    ids = torch.tensor([[5, 9, 17, 33, 8, 41]])
    tok, streams, value = _oracle(model, ids, rules, token=7)
    r = pyattr.relevance(model, ids, target=7, rules=RelevanceRules() if rules == "none" else rules)
    assert torch.allclose(r.target, value.reshape(1), rtol=1e-12, atol=0)
    # the decoder path's relevance is float32 per hidden dimension, summed: its rounding is
    # relative to Σ |x·g| over hidden, which a token's sum may cancel far below
    scale = max(r.relevance.double().abs().sum(-1).max().item(), streams.abs().max().item())
    assert (r.token_relevance[0].double() - tok).abs().max() <= 1e-6 * scale
    assert r.stream_relevance.shape == (1, 2, 6)
    assert (r.stream_relevance[0].double() - streams).abs().max() <= 1e-6 * scale
    # the position bias carries the logit path's rule: without it the AH-rule would differ
    if rules == "all":
        plain = _oracle(model, ids, "none", token=7)[0]
        assert (r.token_relevance[0].double() - plain).abs().max() > 1e-3 * scale


def test_conservation_over_tokens_and_streams_without_biases():
    model = _causal(biases=False)
    ids = torch.tensor([[5, 9, 17, 33, 8, 41], [12, 3, 77, 5, 6, 90]])
    r = pyattr.relevance(model, ids)
    total = r.token_relevance.double().sum(-1) + r.stream_relevance.double().sum(dim=(-2, -1))
    assert torch.allclose(total, r.target, rtol=1e-6, atol=0)
    assert (r.conservation_delta.abs() <= 1e-6 * r.target.abs()).all()
    # the streams' share is part of the sum: leaving it out breaks conservation
    assert (r.stream_relevance.double().sum(dim=(-2, -1)).abs() > 1e-4 * r.target.abs()).all()
    # k targets per row: each equals its own call
    k = pyattr.relevance(model, ids, target=torch.tensor([[3, 4], [5, 6]]))
    one = pyattr.relevance(model, ids, target=torch.tensor([4, 6]))
    assert torch.allclose(k.stream_relevance[1], one.stream_relevance, rtol=1e-5, atol=1e-7)
    assert torch.allclose(k.token_relevance[1], one.token_relevance, rtol=1e-5, atol=1e-7)


def test_a_baseline_leaves_the_streams_as_they_are():
    model = _causal(biases=False)
    ids = torch.tensor([[5, 9, 17, 33, 8, 41]])
    r = pyattr.relevance(model, ids, baseline="zeros")
    assert torch.equal(r.stream_relevance, torch.zeros_like(r.stream_relevance))
    # the delta is taken against the tokens' relevance alone (the streams' share is 0)
    delta = r.target - r.baseline_target - r.relevance.double().sum(dim=(-2, -1))
    assert torch.allclose(r.conservation_delta, delta, rtol=1e-9, atol=1e-12)


def test_a_right_padded_source_equals_each_row_alone_in_float32():
    """In float64 ProphetNet's own attention masks add two float64 minima to -inf (NaN logits
    with any attention mask); float32 is its working dtype. Its decoder's logits depend on
    the decoder input's length (below), so the decoder's inputs are of one length here."""
    model = tiny_seq2seq("prophetnet", dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    src, dec = torch.randint(3, 90, (2, 7), generator=g), torch.randint(3, 90, (2, 4), generator=g)
    smask = torch.ones(2, 7, dtype=torch.long)
    smask[1, 5:] = 0
    r = pyattr.relevance(model, {"input_ids": src, "attention_mask": smask}, decoder_input_ids=dec, target=9)
    alone = pyattr.relevance(model, src[1:, :5], decoder_input_ids=dec[1:], target=9)
    assert torch.allclose(r.source_relevance[1, :5], alone.source_relevance[0], atol=1e-5, rtol=1e-4)
    assert torch.allclose(r.target_relevance[1], alone.target_relevance[0], atol=1e-5, rtol=1e-4)
    assert torch.allclose(r.stream_relevance[1], alone.stream_relevance[0], atol=1e-5, rtol=1e-4)
    assert r.source_relevance[1, 5:].abs().max() < 1e-6


def test_generation_is_refused_because_the_logits_depend_on_the_length():
    model = _causal(dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 33, 20, 21]])
    with torch.no_grad():  # the model's own behaviour: a later token changes earlier logits
        assert (model(ids).logits[0, :4] - model(ids[:, :4]).logits[0]).abs().max() > 1e-2
    with pytest.raises(ValueError, match=r"generation_relevance\(\): ProphetNetForCausalLM's logits at a position "
                                         "depend on the length"):
        pyattr.generation_relevance(model, ids[:, :4], max_new_tokens=2)
    with pytest.raises(ValueError, match="ProphetNetForConditionalGeneration's logits at a position depend"):
        pyattr.generation_relevance(tiny_seq2seq("prophetnet"), torch.tensor([[5, 9, 17]]), max_new_tokens=2)


def test_a_non_finite_output_of_an_encoder_decoder_step_is_refused():
    model = tiny_seq2seq("bart")
    model.lm_head.register_forward_hook(lambda mod, args, out: out * float("nan"))
    with pytest.raises(ValueError, match=r"output is not finite \(NaN or inf\) at row 0, step 0"):
        pyattr.generation_relevance(model, torch.tensor([[5, 9, 17]]), max_new_tokens=2)


def test_methods_reading_the_decoders_positions_refuse_by_name():
    from pyattr.patching import activation_patching, attribution_patching

    model = _causal(dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 33, 8, 41]])
    with pytest.raises(ValueError, match=r"layers: 'prophetnet.decoder.layers.0' holds 3 streams of 6 positions"):
        pyattr.layer_relevance(model, ids, "residual")
    with pytest.raises(ValueError, match="logits come from its predicting streams"):
        pyattr.context_attribution(model, ids[0], sources=[(1, 3), (3, 5)], response=torch.tensor([5, 6]),
                                   method="attention")
    s2s = tiny_seq2seq("prophetnet", dtype=torch.float32)
    src, cor, dec = torch.tensor([[5, 9, 17, 33]]), torch.tensor([[5, 9, 18, 33]]), torch.tensor([[2, 7, 8]])
    with pytest.raises(ValueError, match=r"nodes: 'decoder.residual': .* predicting streams after the tokens'"):
        attribution_patching(s2s, src, cor, metric=5, decoder_input_ids=dec)
    with pytest.raises(ValueError, match="layers: 'prophetnet.decoder.layers.1' holds 3 streams of 3 positions"):
        pyattr.layer_relevance(s2s, src, ["prophetnet.decoder.layers.1"], decoder_input_ids=dec)
    with pytest.raises(ValueError, match="cross-attention has 6 rows for 2 decoder positions"):
        pyattr.context_attribution(s2s, src[0], sources=[(0, 2)], response=torch.tensor([7, 8]), method="attention")
    # the encoder's positions are the tokens': its nodes and layers are read as on any model
    exact = activation_patching(s2s, src, cor, metric=5, nodes="encoder.residual", decoder_input_ids=dec)
    assert exact.effects["encoder.residual"].shape[-1] == 4 and exact.effects["encoder.residual"].abs().max() > 0
    lr = pyattr.layer_relevance(s2s, src, ["prophetnet.encoder.layers.1"], decoder_input_ids=dec)
    assert lr["prophetnet.encoder.layers.1"].relevance.shape == (1, 4, 16)


def test_views_show_the_streams_share_beside_the_tokens():
    s2s = tiny_seq2seq("prophetnet", dtype=torch.float32)
    r = pyattr.relevance(s2s, torch.tensor([[5, 9, 17, 33]]), decoder_input_ids=torch.tensor([[2, 7, 8]]))
    df = r.to_pandas()
    streams = df[df["stream_input"].notna()]
    assert len(streams) == 2 * 3 and streams["stream_input"].iloc[0] == "stream 1 · 0"
    # the panels' sums add up to the target but for the conservation delta
    total = float(df["relevance"].sum())
    assert total == pytest.approx(float(r.target[0] - r.conservation_delta[0]), rel=1e-5)
    assert "predicting streams (inputs without a token" in r.to_html()
    one = pyattr.relevance(_causal(dtype=torch.float32), torch.tensor([[5, 9, 17, 33]]))
    assert "predicting streams (inputs without a token" in one.to_html()
    assert float(one.to_pandas()["relevance"].sum()) == pytest.approx(float(one.target[0] - one.conservation_delta[0]),
                                                                     rel=1e-5)



def test_a_padded_decoder_input_is_refused_because_a_padded_row_is_not_the_row_alone():
    model = _causal(dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 33, 8, 41], [12, 3, 77, 5, 6, 90]])
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    with torch.no_grad():  # the model's own: the padded row's logits are not the row alone's
        padded = model(ids, attention_mask=mask).logits[1, 3]
        alone = model(ids[1:, :4]).logits[0, 3]
    assert (padded - alone).abs().max() > 1e-2
    with pytest.raises(ValueError, match=r"attention_mask: relevance\(\) on ProphetNetForCausalLM with padding"):
        pyattr.relevance(model, {"input_ids": ids, "attention_mask": mask})
    s2s = tiny_seq2seq("prophetnet", dtype=torch.float32)
    dec, dmask = torch.tensor([[2, 7, 8, 9], [2, 11, 12, 13]]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with pytest.raises(ValueError, match="decoder_attention_mask: relevance.* with padding"):
        pyattr.relevance(s2s, torch.tensor([[5, 9, 17], [6, 7, 8]]), decoder_input_ids=dec, decoder_attention_mask=dmask)
    # an all-ones mask is no padding
    full = pyattr.relevance(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, target=7)
    torch.testing.assert_close(full.token_relevance, pyattr.relevance(model, ids, target=7).token_relevance)


def test_citation_ablations_run_rows_of_one_length_together():
    """Leave-one-out drops sources of different lengths: on ProphetNet the ablated prompts are
    not padded into one batch (a padded row is not the row alone), so the scores do not depend
    on batch_size and equal the ablations run one by one."""
    model = _causal(dtype=torch.float32)
    prompt, resp = torch.tensor([5, 9, 17, 33, 8, 41, 12]), torch.tensor([5, 6])
    sources = [(1, 2), (2, 5), (5, 6)]
    scores = [pyattr.context_attribution(model, prompt, sources=sources, response=resp, method="loo",
                                         batch_size=b).scores for b in (64, 1)]
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-5, atol=1e-6)

    def logprob(ids):
        with torch.no_grad():
            lp = model(torch.cat([ids, resp])[None]).logits[0].double().log_softmax(-1)
        n = len(ids)
        return float(lp[n - 1, resp[0]] + lp[n, resp[1]])

    full = logprob(prompt)
    for s, (a, b) in enumerate(sources):
        want = full - logprob(torch.cat([prompt[:a], prompt[b:]]))
        assert float(scores[0][0, s]) == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_non_finite_outputs_are_refused_not_returned_as_nan():
    """ProphetNet's float64 output with any attention mask is NaN (transformers'): every
    method that would return NaN says so (a mask pyattr adds itself included)."""
    s2s = tiny_seq2seq("prophetnet")
    src = torch.tensor([[5, 9, 17, 33]])
    with pytest.raises(ValueError, match=r"relevance\(\): the model's output is not finite \(NaN or inf\) at row 0"):
        pyattr.relevance(s2s, {"input_ids": src, "labels": torch.tensor([[7, 8, 9]])})
    with pytest.raises(ValueError, match="log-probability of the response is not finite"):
        pyattr.context_attribution(s2s, src[0], sources=[(0, 1), (1, 2)], response=torch.tensor([7, 8]), method="loo")
    # without a mask its float64 output is finite, and so are the results
    assert bool(torch.isfinite(pyattr.relevance(s2s, src, decoder_input_ids=torch.tensor([[2, 7, 8]])).target).all())


def test_audit_counts_the_streams_as_inputs_of_the_entry():
    model = _causal(biases=False)
    ids = torch.tensor([[5, 9, 17, 33, 8, 41]])
    r = pyattr.relevance(model, ids, target=7)
    a = pyattr.audit(model, ids, target=7)
    assert not a.leaks and abs(a.gap) <= 1e-9 * abs(a.target)
    streams = float(r.stream_relevance.double().sum())
    assert a.entry_relevance == pytest.approx(float(r.token_relevance.double().sum()) + streams, rel=1e-5)


def test_layer_integrated_gradients_and_generated_citations_refuse_by_name():
    model = _causal(dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 33, 8, 41]])
    with pytest.raises(ValueError, match=r"layer: 'prophetnet.decoder.layers.0' holds 3 streams of 6 positions"):
        pyattr.integrated_gradients(model, ids, target=7, layer="prophetnet.decoder.layers.0")
    # at the entry's input the layer is the tokens' stream
    lig = pyattr.integrated_gradients(model, ids, target=7, layer=ENTRY, attribute_to_layer_input=True)
    assert lig.token_attribution.shape == (1, 6)
    with pytest.raises(ValueError, match=r"context_attribution\(\): ProphetNetForCausalLM's logits at a position"):
        pyattr.context_attribution(model, ids[0], sources=[(1, 3)], response=torch.tensor([5, 6]), method="attnlrp")
    s2s = tiny_seq2seq("prophetnet", dtype=torch.float32)
    with pytest.raises(ValueError, match="max_new_tokens: ProphetNetForConditionalGeneration's logits depend"):
        pyattr.context_attribution(s2s, ids[0], sources=[(1, 3)], max_new_tokens=2, method="relevance")
