"""Encoder–decoder models (T5, T5 v1.1, BART, mBART, Marian, M2M100, Pegasus): relevance of a
decoder-side target over the source and the target prefix, against float64 oracles written
here with hooks (independent of pyattr's rule forwards), conservation, padding, refusals."""

import dataclasses
import math

import pytest
import torch
from torch import nn

import pyattr
from pyattr import RelevanceRules, RelevanceRuleUnsupportedError
from models import SEQ2SEQ_ARCHS, tiny_seq2seq

pytestmark = pytest.mark.usefixtures("one_thread")

#: where each stack's residual stream enters its first block (written from the modeling files)
ENTRIES = {
    "t5": ("encoder.block.0", "decoder.block.0"),
    "t5_gated": ("encoder.block.0", "decoder.block.0"),
    "bart": ("model.encoder.layernorm_embedding", "model.decoder.layernorm_embedding"),
    "mbart": ("model.encoder.layernorm_embedding", "model.decoder.layernorm_embedding"),
    "marian": ("model.encoder.layers.0", "model.decoder.layers.0"),
    "m2m_100": ("model.encoder.layers.0", "model.decoder.layers.0"),
    "pegasus": ("model.encoder.layers.0", "model.decoder.layers.0"),
    "umt5": ("encoder.block.0", "decoder.block.0"),
    "mvp": ("model.encoder.layernorm_embedding", "model.decoder.layernorm_embedding"),
    "plbart": ("model.encoder.layernorm_embedding", "model.decoder.layernorm_embedding"),
    "blenderbot": ("model.encoder.layers.0", "model.decoder.layers.0"),
    "t5gemma": ("model.encoder.layers.0", "model.decoder.layers.0"),
    "t5gemma2": ("model.encoder.text_model.layers.0", "model.decoder.layers.0"),
    "bigbird_pegasus": ("model.encoder.layers.0", "model.decoder.layers.0"),
    "prophetnet": ("prophetnet.encoder.embeddings_layer_norm", "prophetnet.decoder.embeddings_layer_norm"),
}
#: the decoders whose entry appends streams after the tokens (ProphetNet: 1 + ngram streams)
STREAMS = {"prophetnet": 3}
ACT_LIMIT = {"ReLU": 0.0}  # φ(0) = act(x)/x at 0: 0 for ReLU, ½ for the GELUs


def _ids(arch, seed=0, batch=2, src=7, tgt=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 90, (batch, src), generator=g), torch.randint(3, 90, (batch, tgt), generator=g)


def _ln_rule(mod, args, out):
    """The LN-rule's gradient (σ, or T5's root mean square, constant) at the module's own
    value: T5's norm computes its variance in float32 even in a float64 model."""
    x = args[0]
    if isinstance(mod, nn.LayerNorm):
        mu = x.mean(-1, keepdim=True)
        sigma = ((x - mu) ** 2).mean(-1, keepdim=True).add(mod.eps).sqrt().detach()
        rule = (x - mu) / sigma * mod.weight + mod.bias
    elif type(mod).__name__ in ("T5GemmaRMSNorm", "T5Gemma2RMSNorm"):  # Gemma's (1 + w), its variance in float32 too
        rms = x.pow(2).mean(-1, keepdim=True).add(mod.eps).sqrt().detach()
        rule = (1.0 + mod.weight) * (x / rms)
    else:
        rms = x.pow(2).mean(-1, keepdim=True).add(mod.variance_epsilon).sqrt().detach()  # T5: no mean, no bias
        rule = mod.weight * (x / rms)
    return out.detach() + (rule - rule.detach())


def _identity_rule(mod, args, out):
    x = args[0]
    safe = torch.where(x == 0, torch.ones_like(x), x)
    phi = torch.where(x == 0, torch.full_like(x, ACT_LIMIT.get(type(mod).__name__, 0.5)), out / safe)
    return x * phi.detach()


def _half_rule_gated(mod, args, out):
    """T5 v1.1's wo(act(wi_0 x) · wi_1 x) (T5Gemma's down(act(gate x) · up x)): each factor
    of the product gets half."""
    x = args[0]
    if hasattr(mod, "wi_0"):
        a, u, down = mod.act(mod.wi_0(x)), mod.wi_1(x), mod.wo
    else:
        a, u, down = mod.act_fn(mod.gate_proj(x)), mod.up_proj(x), mod.down_proj
    return down(0.5 * a * u.detach() + 0.5 * a.detach() * u)


def _scaled(s):
    def hook(mod, args, out):
        return out * s + (out * (1 - s)).detach()
    return hook


def _oracle_hooks(model, rules):
    """Forward hooks that write ``rules`` ("none", "all", "attnlrp") as detaches."""
    hooks = []
    attn = {"none": None, "all": (0.0, 0.0, 1.0), "attnlrp": (0.25, 0.25, 0.5)}[rules]
    for name, mod in model.named_modules():
        cls, last = type(mod).__name__, name.rsplit(".", 1)[-1]
        if rules != "none" and (isinstance(mod, nn.LayerNorm) or cls in ("T5LayerNorm", "UMT5LayerNorm",
                                                                           "T5GemmaRMSNorm", "T5Gemma2RMSNorm")):
            hooks.append(mod.register_forward_hook(_ln_rule))
        elif rules != "none" and cls in ("ReLU", "GELUActivation", "NewGELUActivation", "GELUTanh",
                                         "PytorchGELUTanh"):
            hooks.append(mod.register_forward_hook(_identity_rule))
        elif rules != "none" and cls in ("T5DenseGatedActDense", "UMT5DenseGatedActDense", "T5GemmaMLP", "T5Gemma2MLP"):
            hooks.append(mod.register_forward_hook(_half_rule_gated))
        elif attn is not None and isinstance(mod, nn.Linear) and last in ("q", "k", "v", "q_proj", "k_proj", "v_proj",
                                                                          "query", "key", "value", "query_proj",
                                                                          "key_proj", "value_proj"):
            hooks.append(mod.register_forward_hook(_scaled(attn["qkv".index(last[0])])))
        elif attn is not None and last == "relative_pos_embeddings":
            # ProphetNet's position bias, a projection of the hidden states added to the
            # logits: the logits' share, q·k's twice over (AH-rule 0, AttnLRP ½)
            hooks.append(mod.register_forward_hook(_scaled(2 * attn[0])))
    return hooks


def _oracle(model, arch, src, dec, rules, token=None, smask=None, dmask=None):
    """(source relevance, target-prefix relevance, value) by plain autograd with the rules
    written as detaches; the explained value is the logit of ``token`` (top-1 if None) at
    the last real decoder position."""
    hooks, leaves = _oracle_hooks(model, rules), {}
    for side, path in zip(("source", "target"), ENTRIES[arch]):
        def pre(mod, args, side=side):
            if side in leaves:
                return None
            n = STREAMS.get(arch, 1) if side == "target" else 1
            x = args[0][:, :args[0].shape[1] // n]  # the tokens' stream; the appended ones stay constants
            leaves[side] = x.detach().requires_grad_(True)
            return (torch.cat([leaves[side], args[0][:, x.shape[1]:]], 1), *args[1:])
        hooks.append(model.get_submodule(path).register_forward_pre_hook(pre))
    try:
        with torch.enable_grad():
            out = model(input_ids=src, attention_mask=smask, decoder_input_ids=dec, decoder_attention_mask=dmask,
                        use_cache=False)
            last = (dmask.sum(-1) - 1) if dmask is not None else torch.full((dec.shape[0],), dec.shape[1] - 1)
            logits = out.logits[torch.arange(dec.shape[0]), last]
            tok = logits.argmax(-1) if token is None else torch.as_tensor(token).expand(dec.shape[0])
            value = logits.gather(-1, tok[:, None])[:, 0]
            gs, gt = torch.autograd.grad(value.sum(), [leaves["source"], leaves["target"]])
    finally:
        for h in hooks:
            h.remove()
    return (leaves["source"] * gs).sum(-1).detach(), (leaves["target"] * gt).sum(-1).detach(), value.detach()


def _check(r, oracle, tol):
    s, t, v = oracle
    scale = max(s.abs().max().item(), t.abs().max().item())
    assert torch.allclose(r.target, v, atol=0, rtol=1e-12)
    assert (r.source_relevance - s).abs().max().item() <= tol * scale
    assert (r.target_relevance - t).abs().max().item() <= tol * scale


@pytest.mark.parametrize("arch", SEQ2SEQ_ARCHS)
def test_rules_off_is_plain_gradient_times_input_on_both_sides(arch):
    model = tiny_seq2seq(arch)
    src, dec = _ids(arch)
    r = pyattr.relevance(model, src, rules=RelevanceRules(), decoder_input_ids=dec)
    assert r.source_relevance.dtype == torch.float64 and r.source_relevance.shape == (2, 7)
    assert r.target_relevance.shape == (2, 5)
    _check(r, _oracle(model, arch, src, dec, "none"), 1e-10)


@pytest.mark.parametrize("rules", ["all", "attnlrp"])
@pytest.mark.parametrize("arch", SEQ2SEQ_ARCHS)
def test_rules_on_equal_a_hand_written_float64_oracle(arch, rules):
    model = tiny_seq2seq(arch)
    src, dec = _ids(arch, seed=1)
    r = pyattr.relevance(model, src, rules=rules, decoder_input_ids=dec, target=11)
    # T5Gemma's norm computes in float32 even in a float64 model (x.float()): its rule to that
    _check(r, _oracle(model, arch, src, dec, rules, token=11), 1e-6 if arch.startswith("t5gemma") else 1e-9)
    # the oracle differs from plain gradients: the rules act on both stacks and the cross-attention
    plain = _oracle(model, arch, src, dec, "none", token=11)
    assert (r.source_relevance - plain[0]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", SEQ2SEQ_ARCHS)
def test_conservation_over_source_and_target_prefix_without_biases(arch):
    model = tiny_seq2seq(arch, biases=False)
    src, dec = _ids(arch, seed=2)
    r = pyattr.relevance(model, src, decoder_input_ids=dec)
    total = r.source_relevance.sum(-1) + r.target_relevance.sum(-1)
    if arch in STREAMS:  # the appended streams take their share, reported apart
        assert r.stream_relevance.shape == (2, STREAMS[arch] - 1, 5) and r.stream_relevance.abs().sum() > 0
        total = total + r.stream_relevance.sum(dim=(-2, -1))
    else:
        assert r.stream_relevance is None
    # T5's own norm computes its variance in float32 (even in a float64 model): its output
    # is w·x/rms up to float32 rounding, and conservation holds to that
    tol = 1e-6 if "t5" in arch else 1e-10  # T5 and T5Gemma norms compute in float32
    assert torch.allclose(total, r.target, rtol=tol, atol=0)
    assert (r.conservation_delta.abs() <= tol * r.target.abs()).all()
    assert r.source_relevance.abs().sum() > 1e-3 * r.target.abs().sum()  # the source gets its share
    with_biases = pyattr.relevance(tiny_seq2seq(arch), src, decoder_input_ids=dec)
    if "t5" not in arch:  # T5 has no biases: it conserves either way
        assert with_biases.conservation_delta.abs().max() > 1e-4


def test_coverage_names_cross_attention_and_both_stacks():
    model = tiny_seq2seq("bart")
    with pyattr.use_relevance_rules(model) as cov:
        pass
    installed = set(cov.installed) if not isinstance(cov.installed, dict) else set(cov.installed)
    flat = " ".join(sorted(map(str, installed)))
    for path in ("model.encoder.layers.1.self_attn.q_proj", "model.decoder.layers.0.encoder_attn.k_proj",
                 "model.decoder.layers.1.encoder_attn_layer_norm", "model.encoder.layernorm_embedding",
                 "model.decoder.layers.1.activation_fn"):
        assert path in flat


@pytest.mark.parametrize("arch", ["t5", "bart", "m2m_100"])
def test_right_padding_of_source_and_target_equals_each_row_alone(arch):
    model = tiny_seq2seq(arch)
    src, dec = _ids(arch, seed=4)
    pad_s = torch.cat([src, torch.full((2, 3), 5)], 1)
    pad_d = torch.cat([dec, torch.full((2, 2), 6)], 1)
    smask = torch.cat([torch.ones(2, 7), torch.zeros(2, 3)], 1).long()
    dmask = torch.cat([torch.ones(2, 5), torch.zeros(2, 2)], 1).long()
    smask[1, 5:] = 0
    dmask[1, 3:] = 0
    r = pyattr.relevance(model, {"input_ids": pad_s, "attention_mask": smask}, decoder_input_ids=pad_d,
                         decoder_attention_mask=dmask)
    for row in range(2):
        ns, nd = int(smask[row].sum()), int(dmask[row].sum())
        alone = pyattr.relevance(model, src[row:row + 1, :ns], decoder_input_ids=dec[row:row + 1, :nd])
        assert torch.allclose(r.source_relevance[row, :ns], alone.source_relevance[0], atol=1e-10, rtol=1e-8)
        assert torch.allclose(r.target_relevance[row, :nd], alone.target_relevance[0], atol=1e-10, rtol=1e-8)
        assert torch.equal(r.target_ids[row], alone.target_ids[0])
        assert r.source_relevance[row, ns:].abs().max() < 1e-12
        assert r.target_relevance[row, nd:].abs().max() < 1e-12


def test_left_padded_source_on_t5_equals_the_row_alone_and_bart_refuses_it():
    model = tiny_seq2seq("t5")
    src, dec = _ids("t5", seed=5, batch=1)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), src], 1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 7)], 1).long()
    r = pyattr.relevance(model, {"input_ids": padded, "attention_mask": mask}, decoder_input_ids=dec)
    alone = pyattr.relevance(model, src, decoder_input_ids=dec)
    assert torch.allclose(r.source_relevance[0, 3:], alone.source_relevance[0], atol=1e-10, rtol=1e-8)
    assert torch.allclose(r.target_relevance, alone.target_relevance, atol=1e-10, rtol=1e-8)
    bart = tiny_seq2seq("bart")
    with pytest.raises(ValueError, match=r"attention_mask: a 0 before a 1 \(left padding, or a hole\) on "
                                         "BartForConditionalGeneration"):
        pyattr.relevance(bart, {"input_ids": padded, "attention_mask": mask}, decoder_input_ids=dec)
    with pytest.raises(ValueError, match=r"decoder_attention_mask: a 0 before a 1"):
        pyattr.relevance(bart, src, decoder_input_ids=dec, decoder_attention_mask=torch.tensor([[0, 1, 1, 1, 1]]))


def test_labels_are_shifted_by_the_model_itself():
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=6)
    labels = dec.clone()
    r = pyattr.relevance(model, {"input_ids": src, "labels": labels}, target=9)
    shifted = model.prepare_decoder_input_ids_from_labels(labels=labels)
    assert shifted[0, 0].item() == model.config.decoder_start_token_id
    alone = pyattr.relevance(model, src, decoder_input_ids=shifted, target=9)
    # separately computed: equal up to rounding on any CPU (DESIGN §13)
    assert torch.allclose(r.source_relevance, alone.source_relevance, atol=1e-12, rtol=1e-10)
    assert torch.allclose(r.target_relevance, alone.target_relevance, atol=1e-12, rtol=1e-10)


def test_several_targets_per_row_equal_one_call_each():
    model = tiny_seq2seq("t5_gated")
    src, dec = _ids("t5_gated", seed=8)
    tgt = torch.tensor([[3, 17], [40, 5]])
    r = pyattr.relevance(model, src, target=tgt, decoder_input_ids=dec)
    assert r.source_relevance.shape == (2, 2, 7)
    for k in range(2):
        one = pyattr.relevance(model, src, target=tgt[:, k].tolist(), decoder_input_ids=dec)
        assert torch.allclose(r.source_relevance[k], one.source_relevance, atol=1e-12, rtol=1e-9)
        assert torch.allclose(r.target_relevance[k], one.target_relevance, atol=1e-12, rtol=1e-9)


def test_a_norm_the_map_does_not_cover_is_refused():
    model = tiny_seq2seq("marian")
    model.model.encoder.layers[0].extra_norm = nn.LayerNorm(16).double()
    with pytest.raises(RelevanceRuleUnsupportedError, match=r"'model.encoder.layers.0.extra_norm' \(LayerNorm\) is a norm "
                       "or activation the marian rule map does not cover"):
        pyattr.relevance(model, *_ids("marian")[:1], decoder_input_ids=_ids("marian")[1])
    r = pyattr.relevance(model, *_ids("marian")[:1], decoder_input_ids=_ids("marian")[1], rules="none")
    assert torch.isfinite(r.source_relevance).all()


def test_bad_inputs_are_refused_by_name():
    model = tiny_seq2seq("t5")
    src, dec = _ids("t5")
    with pytest.raises(ValueError, match="is an encoder–decoder model that does not make its decoder.s inputs from the source: pass the target prefix as decoder_input_ids"):
        pyattr.relevance(model, src)
    with pytest.raises(ValueError, match="decoder_input_ids has 1 rows, the source"):
        pyattr.relevance(model, src, decoder_input_ids=dec[:1])
    with pytest.raises(TypeError, match="decoder_input_ids must be an integer tensor"):
        pyattr.relevance(model, src, decoder_input_ids=dec.double())
    with pytest.raises(ValueError, match=r"decoder_input_ids: token ids must be in \[0, 96\)"):
        pyattr.relevance(model, src, decoder_input_ids=dec + 200)
    with pytest.raises(ValueError, match=r"decoder_attention_mask of shape \(2, 3\) must match"):
        pyattr.relevance(model, src, decoder_input_ids=dec, decoder_attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"baseline: on encoder–decoder models one of \['zeros', 'pad'\]"):
        pyattr.relevance(model, src, decoder_input_ids=dec, baseline=torch.zeros(2, 7, 16))


@pytest.mark.parametrize("method", ["edge_attribution", "circuit_search"])
def test_one_stack_methods_refuse_encoder_decoders(method):
    model = tiny_seq2seq("bart")
    src, _ = _ids("bart", batch=1)
    call = getattr(pyattr.patching, method)
    with pytest.raises(ValueError, match=f"{method}\\(\\): BartForConditionalGeneration is an encoder–decoder model"):
        call(model, src, src.flip(-1), 5)


def test_decoder_input_ids_on_a_decoder_only_model_are_refused():
    from models import tiny_causal_lm

    model = tiny_causal_lm("llama")
    with pytest.raises(ValueError, match="LlamaForCausalLM is not an encoder–decoder model"):
        pyattr.relevance(model, torch.tensor([[3, 4, 5]]), decoder_input_ids=torch.tensor([[3]]))


def test_t5_tied_head_rescale_is_observed_not_rederived():
    """T5 with tied embeddings scales the decoder output by d_model**-0.5 before the head:
    the explained logit is the model's own (equal to its forward's logits)."""
    model = tiny_seq2seq("t5")
    assert model.config.tie_word_embeddings
    src, dec = _ids("t5")
    r = pyattr.relevance(model, src, decoder_input_ids=dec)
    with torch.no_grad():
        logits = model(input_ids=src, decoder_input_ids=dec).logits[:, -1]
    assert torch.allclose(r.target, logits.max(-1).values.double(), rtol=1e-12, atol=0)
    assert (r.conservation_delta.abs() <= 1e-6 * r.target.abs()).all()  # float32 variance in T5's norm


@pytest.mark.parametrize("arch", ["t5_gated", "bart", "marian"])
def test_generation_relevance_equals_the_per_step_loop(arch):
    model = tiny_seq2seq(arch)
    src, _ = _ids(arch, seed=9, src=6)
    r = pyattr.generation_relevance(model, src, max_new_tokens=4)
    w = r.prefix_width
    assert w == 1 and r.sequences.shape == (2, 5) and r.step_mask.all()
    with torch.no_grad():
        again = model.generate(input_ids=src, max_new_tokens=4, do_sample=False)
    assert torch.equal(r.sequences, again)  # what generate itself returned
    for b in range(2):
        for t in range(4):
            one = pyattr.relevance(model, src[b:b + 1], decoder_input_ids=r.sequences[b:b + 1, :w + t],
                                   target=int(r.sequences[b, w + t]))
            assert torch.allclose(r.source_relevance[b, t], one.source_relevance[0], atol=1e-10, rtol=1e-9)
            assert torch.allclose(r.target_relevance[b, t, :w + t], one.target_relevance[0], atol=1e-10, rtol=1e-9)
            assert (r.target_relevance[b, t, w + t:] == 0).all()
            assert torch.allclose(r.target[b, t], one.target[0], rtol=1e-12, atol=0)
    given = pyattr.generation_relevance(model, src, continuation=r.sequences[:, w:])
    assert torch.equal(given.sequences, r.sequences)
    assert torch.allclose(given.source_relevance, r.source_relevance, atol=1e-12, rtol=1e-10)


def test_generation_stops_where_generate_stopped_each_row():
    model = tiny_seq2seq("marian")
    src, _ = _ids("marian", seed=9, src=6)
    first = pyattr.generation_relevance(model, src, max_new_tokens=4)
    stop = int(first.sequences[0, 2])  # row 0's second generated token ends row 0 when it is the eos id
    r = pyattr.generation_relevance(model, src, max_new_tokens=4, generate_kwargs={"eos_token_id": stop})
    k = int(r.step_mask[0].sum())
    assert k == 2 and not r.step_mask[0, 2:].any()
    assert torch.isnan(r.target[0, k:]).all() and r.source_relevance[0, k:].abs().max() == 0
    assert torch.allclose(r.source_relevance[0, :k], first.source_relevance[0, :k], atol=1e-12, rtol=1e-10)


def test_generation_arguments_not_supported_on_encoder_decoders_are_refused():
    model = tiny_seq2seq("t5")
    src, _ = _ids("t5", batch=1)
    with pytest.raises(ValueError, match=r"baseline: on encoder–decoder models one of \['zeros', 'pad'\]"):
        pyattr.generation_relevance(model, src, max_new_tokens=2, baseline=torch.zeros(1, 7, 16))
    with pytest.raises(ValueError, match="batch_targets"):
        pyattr.generation_relevance(model, src, max_new_tokens=2, batch_targets=0)
    with pytest.raises(ValueError, match=r"contrast of shape \(1, 3\): expected \(batch, generated\) = \(1, 2\)"):
        pyattr.generation_relevance(model, src, max_new_tokens=2, contrast=torch.tensor([4, 5, 6]))


@pytest.mark.parametrize("kind", ["logprob", "prob"])
def test_generation_log_probability_and_contrast_targets_equal_relevance_per_step(kind):
    import pyattr.targets as T

    model = tiny_seq2seq("bart")
    src, _ = _ids("bart", seed=15, src=6)
    r = pyattr.generation_relevance(model, src, max_new_tokens=3, target=kind, contrast=torch.tensor([7, 8, 9]))
    w = r.prefix_width
    for b in range(2):
        for t in range(3):
            tgt = T.LogProb(int(r.sequences[b, w + t]), position=w + t - 1, contrast=7 + t, prob=kind == "prob")
            one = pyattr.relevance(model, src[b:b + 1], decoder_input_ids=r.sequences[b:b + 1, :w + t], target=tgt)
            assert torch.allclose(r.source_relevance[b, t], one.source_relevance[0], atol=1e-10, rtol=1e-8)
            assert torch.allclose(r.target[b, t], one.target[0], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="max_new_tokens: expected an int >= 1"):
        pyattr.generation_relevance(model, src, max_new_tokens=0)


@pytest.mark.parametrize("rules", ["all", "attnlrp"])
def test_one_stack_of_an_encoder_decoder_type_is_planned_from_its_decoder_map(rules):
    """BartForCausalLM is BART's decoder alone (model type 'bart', no encoder, the blocks'
    cross-attention unused): it is planned as a decoder-only model from the decoder half
    of the map, and equals the hooks oracle at the decoder's entry; it conserves without
    biases."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.BartConfig(vocab_size=96, d_model=16, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=64,
                       init_std=0.3)
    m = T.BartForCausalLM(cfg).to(torch.float64).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    hooks, leaf = _oracle_hooks(m, rules), {}

    def pre(mod, args):
        leaf["x"] = args[0].detach().requires_grad_(True)
        return (leaf["x"], *args[1:])

    hooks.append(m.get_submodule("model.decoder.layernorm_embedding").register_forward_pre_hook(pre))
    try:
        value = m(ids, use_cache=False).logits[0, -1, 11]
        (g,) = torch.autograd.grad(value, leaf["x"])
    finally:
        for h in hooks:
            h.remove()
    want = (leaf["x"] * g).sum(-1).detach()
    r = pyattr.relevance(m, ids, target=11, rules=rules)
    # a decoder-only result is float32 (the decoder path rounds what it computed in float64)
    assert (r.token_relevance.double() - want).abs().max() <= 1e-6 * want.abs().max()
    assert torch.allclose(r.target, value.detach().reshape(1), rtol=1e-12, atol=0)
    assert "model.decoder.layers.1.self_attn.q_proj" in " ".join(map(str, r.coverage.installed))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.zero_()
    r0 = pyattr.relevance(m, ids, target=11, rules=rules)
    if rules == "all":  # AttnLRP's softmax share is not conserved (its bias term), as on any decoder
        assert r0.conservation_delta.abs().max() <= 1e-6 * r0.target.abs().max()


@pytest.mark.parametrize("arch", ["bart", "t5"])
def test_sequence_classifier_equals_the_oracle_with_the_heads_tanh_under_the_identity_rule(arch):
    """BartForSequenceClassification / T5ForSequenceClassification: the decoder's inputs are
    the model's own shift of the source (read back, not re-derived), the class logit is
    explained over both, the head's functional torch.tanh gets the Identity-rule
    (tanh(h)/h held constant), and relevance is conserved without biases."""
    import transformers as T

    base = tiny_seq2seq(arch, biases=False)
    cfg = base.config
    cfg.num_labels = 3
    cls = T.BartForSequenceClassification if arch == "bart" else T.T5ForSequenceClassification
    torch.manual_seed(5)
    m = cls(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.zero_()
            elif "classification_head" in n:
                p.mul_(4.0)  # leave tanh's linear regime
    src = _ids(arch, seed=9, batch=1)[0]
    src[0, -1] = cfg.eos_token_id  # the head reads the state at the last end-of-text token
    hooks, leaves, h = _oracle_hooks(m, "all"), {}, {}
    for side, path in zip(("source", "target"), ENTRIES[arch]):
        prefix = "model." if arch == "bart" else "transformer."
        path = prefix + path.split(".", 1)[1] if arch == "bart" else prefix + path

        def pre(mod, args, side=side):
            leaves[side] = args[0].detach().requires_grad_(True)
            return (leaves[side], *args[1:])
        hooks.append(m.get_submodule(path).register_forward_pre_hook(pre))
    head = m.classification_head
    hooks.append(head.dense.register_forward_hook(lambda mod, a, out: h.__setitem__("h", out)))
    hooks.append(head.out_proj.register_forward_pre_hook(
        lambda mod, a: (h["h"] * (a[0] / h["h"]).detach(),)))
    try:
        logits = m(input_ids=src, use_cache=False).logits
        value = logits[0, 2]
        gs, gt = torch.autograd.grad(value, [leaves["source"], leaves["target"]])
    finally:
        for hk in hooks:
            hk.remove()
    r = pyattr.relevance(m, src, target=2)
    # class labels in the inputs are the classifier's (its loss's), not a target text
    with_labels = pyattr.relevance(m, {"input_ids": src, "labels": torch.tensor([1])}, target=2)
    assert torch.equal(with_labels.target, r.target)
    s, t = (leaves["source"] * gs).sum(-1).detach(), (leaves["target"] * gt).sum(-1).detach()
    scale = max(s.abs().max().item(), t.abs().max().item())
    assert torch.allclose(r.target, value.detach().reshape(1), rtol=1e-12, atol=0)
    assert (r.source_relevance - s).abs().max() <= 1e-9 * scale
    assert (r.target_relevance - t).abs().max() <= 1e-9 * scale
    # T5's norm takes its variance in float32 (even in a float64 model): conservation to that
    tol = 1e-6 if arch == "t5" else 1e-10
    total = r.source_relevance.abs().sum() + r.target_relevance.abs().sum()
    assert r.conservation_delta.abs().max() <= tol * total
    assert "classification_head" in " ".join(map(str, r.coverage.installed))


def test_decoder_inputs_the_model_makes_from_the_source_are_read_back():
    """BART explained as a denoiser (the source alone): its decoder's inputs are its own
    shift of the source, read from the forward; T5 makes none and is refused by name."""
    from transformers.models.bart.modeling_bart import shift_tokens_right

    model = tiny_seq2seq("bart")
    src, _ = _ids("bart", seed=12)
    r = pyattr.relevance(model, src)
    dec = shift_tokens_right(src, model.config.pad_token_id, model.config.decoder_start_token_id)
    want = pyattr.relevance(model, src, decoder_input_ids=dec)
    assert r.target_relevance.shape == dec.shape
    assert torch.allclose(r.source_relevance, want.source_relevance, rtol=1e-12, atol=1e-15)
    assert torch.allclose(r.target_relevance, want.target_relevance, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder–decoder model that does not make"):
        pyattr.relevance(tiny_seq2seq("t5"), src)
    # a right-padded source: the derived decoder inputs are masked by the source's mask (the
    # shift keeps the length), so the padded row is explained at its last real position
    padded = torch.cat([src, torch.full((2, 2), model.config.pad_token_id)], 1)
    mask = torch.cat([torch.ones(2, 7), torch.zeros(2, 2)], 1).long()
    mask[1, 5:] = 0
    padded[1, 5:] = model.config.pad_token_id
    rp = pyattr.relevance(model, {"input_ids": padded, "attention_mask": mask})
    for row, n in ((0, 7), (1, 5)):
        alone = pyattr.relevance(model, src[row:row + 1, :n])
        assert torch.equal(rp.target_ids[row], alone.target_ids[0])
        assert torch.allclose(rp.target[row], alone.target[0], rtol=1e-10, atol=0)
        assert torch.allclose(rp.source_relevance[row, :n], alone.source_relevance[0], rtol=1e-8, atol=1e-12)
        assert torch.allclose(rp.target_relevance[row, :n], alone.target_relevance[0], rtol=1e-8, atol=1e-12)
        assert rp.target_relevance[row, n:].abs().max() < 1e-12


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_the_users_own_backward_inside_the_scope_equals_relevance(arch):
    """DESIGN §12: the scope opened around the user's own forward and backward (embeddings
    passed as inputs_embeds / decoder_inputs_embeds, parameters left trainable) gives what
    relevance gives: x · grad at each stack's entry, and the same gradient at the token
    embeddings (the entry is their sum with the positions, where the model adds any)."""
    model = tiny_seq2seq(arch)
    src, dec = _ids(arch, seed=12)
    emb = model.get_input_embeddings()
    xs = emb(src).detach().requires_grad_(True)
    xd = emb(dec).detach().requires_grad_(True)
    seen = []

    def keep(mod, args):
        args[0].retain_grad()
        seen.append(args[0])

    hooks = [model.get_submodule(p).register_forward_pre_hook(keep) for p in ENTRIES[arch]]
    try:
        with pyattr.use_relevance_rules(model):
            out = model(inputs_embeds=xs, decoder_inputs_embeds=xd, use_cache=False)
            out.logits[:, -1, 11].sum().backward()
    finally:
        for h in hooks:
            h.remove()
    assert model.lm_head.weight.grad is not None  # parameters left trainable: the user's own backward reached them
    ref = pyattr.relevance(model, src, decoder_input_ids=dec, target=11)
    assert torch.allclose((seen[0] * seen[0].grad).sum(-1), ref.source_relevance, atol=1e-10, rtol=1e-8)
    assert torch.allclose((seen[1] * seen[1].grad).sum(-1), ref.target_relevance, atol=1e-10, rtol=1e-8)
    assert torch.allclose(xs.grad, seen[0].grad, atol=1e-12, rtol=1e-10)
    assert torch.allclose(xd.grad, seen[1].grad, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_baselines_take_relevance_against_the_entries_of_the_pad_sequence(arch):
    """(x − x₀) · g with x₀ what both entries receive for an all-pad source and target (or
    0), and f(x₀) the model's own value there."""
    model = tiny_seq2seq(arch)
    src, dec = _ids(arch, seed=16)
    plain = pyattr.relevance(model, src, decoder_input_ids=dec, target=5, rules="none")
    zero = pyattr.relevance(model, src, decoder_input_ids=dec, target=5, rules="none", baseline="zeros")
    assert torch.allclose(zero.source_relevance, plain.source_relevance, atol=1e-12, rtol=1e-10)
    r = pyattr.relevance(model, src, decoder_input_ids=dec, target=5, rules="none", baseline="pad")
    pad = model.config.pad_token_id
    x0 = {}

    def keep(i):
        def pre(mod, args):
            x0.setdefault(i, args[0].detach())
        return pre

    hooks = [model.get_submodule(p).register_forward_pre_hook(keep(i)) for i, p in enumerate(ENTRIES[arch])]
    try:
        with torch.no_grad():
            f0 = model(input_ids=torch.full_like(src, pad), decoder_input_ids=torch.full_like(dec, pad)).logits[:, -1, 5]
    finally:
        for h in hooks:
            h.remove()
    assert torch.allclose(r.baseline_target, f0.double(), rtol=1e-10, atol=1e-12)
    x, g = _entry_and_gradient(model, arch, src, dec, 5)
    assert torch.allclose(r.source_relevance, ((x[0] - x0[0]) * g[0]).sum(-1), atol=1e-10, rtol=1e-8)
    assert torch.allclose(r.target_relevance, ((x[1] - x0[1]) * g[1]).sum(-1), atol=1e-10, rtol=1e-8)
    assert torch.allclose(r.conservation_delta, r.target - r.baseline_target - r.source_relevance.sum(-1)
                          - r.target_relevance.sum(-1), atol=1e-10, rtol=0)


def _entry_and_gradient(model, arch, src, dec, token):
    """Both entries' inputs and the plain gradient of the last position's ``token`` logit there."""
    leaves = {}

    def pre(i):
        def hook(mod, args):
            if i not in leaves:
                leaves[i] = args[0].detach().requires_grad_(True)
                return (leaves[i], *args[1:])
        return hook

    hooks = [model.get_submodule(p).register_forward_pre_hook(pre(i)) for i, p in enumerate(ENTRIES[arch])]
    try:
        with torch.enable_grad():
            f = model(input_ids=src, decoder_input_ids=dec).logits[:, -1, token].sum()
            g = torch.autograd.grad(f, [leaves[0], leaves[1]])
    finally:
        for h in hooks:
            h.remove()
    return (leaves[0].detach(), leaves[1].detach()), g


def test_an_enclosing_scope_with_other_rules_is_refused_not_obeyed():
    """Plain gradients asked for inside a scope that keeps the rules on would get the rules'
    numbers: every method refuses, as on decoder-only models."""
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart")
    calls = [lambda: pyattr.relevance(model, src, target=7, decoder_input_ids=dec, rules="none"),
             lambda: pyattr.integrated_gradients(model, src, target=7, decoder_input_ids=dec, n_steps=2),
             lambda: pyattr.generation_relevance(model, src, max_new_tokens=2, rules="none"),
             lambda: pyattr.layer_relevance(model, src, "residual", target=7, decoder_input_ids=dec, rules="none")]
    with pyattr.use_relevance_rules(model):
        for call in calls:
            with pytest.raises(pyattr.RelevanceRuleConflictError, match="runs inside a use_relevance_rules scope"):
                call()
        inside = pyattr.relevance(model, src, target=7, decoder_input_ids=dec)  # the same rules: allowed
    outside = pyattr.relevance(model, src, target=7, decoder_input_ids=dec)
    assert torch.allclose(inside.source_relevance, outside.source_relevance, atol=1e-12, rtol=1e-10)


def test_labels_padded_with_the_ignore_index_are_each_rows_own_labels():
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=17)
    labels = dec.clone()
    labels[1, 2:] = -100
    r = pyattr.relevance(model, {"input_ids": src, "labels": labels}, target=7)
    alone = pyattr.relevance(model, {"input_ids": src[1:], "labels": labels[1:, :2]}, target=7)
    assert torch.allclose(r.target[1], alone.target[0], rtol=1e-12, atol=0)
    assert torch.allclose(r.source_relevance[1], alone.source_relevance[0], atol=1e-10, rtol=1e-8)


def test_ragged_and_malformed_decoder_inputs():
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=18)
    r = pyattr.relevance(model, src, decoder_input_ids=[dec[0, :3].tolist(), dec[1, :2].tolist()], target=4)
    alone = pyattr.relevance(model, src[1:], decoder_input_ids=dec[1:, :2], target=4)
    assert torch.allclose(r.target_relevance[1, :2], alone.target_relevance[0], atol=1e-10, rtol=1e-8)
    assert r.target_relevance[1, 2] == 0
    with pytest.raises(TypeError, match="decoder_input_ids must be token ids"):
        pyattr.relevance(model, src, decoder_input_ids=["RED", 5])
    with pytest.raises(ValueError, match=r"inputs: 70 positions, but BartForConditionalGeneration reads at most 64"):
        pyattr.relevance(model, torch.randint(3, 90, (1, 70)), decoder_input_ids=dec[:1])
    with pytest.raises(ValueError, match=r"max_new_tokens: 101 positions, but BartForConditionalGeneration reads at "
                                         "most 64"):
        pyattr.generation_relevance(model, src, max_new_tokens=100)
    with pytest.raises(ValueError, match=r"inputs: token ids must be in \[0, 96\)"):
        pyattr.generation_relevance(model, src + 200, max_new_tokens=2)
    with pytest.raises(ValueError, match="generate_kwargs: attention_mask is given by the inputs"):
        pyattr.generation_relevance(model, src, max_new_tokens=2, generate_kwargs={"attention_mask": None})
    with pytest.raises(TypeError, match="generate_kwargs must be a dict, got list"):
        pyattr.generation_relevance(model, src, max_new_tokens=2, generate_kwargs=[1])
    with pytest.raises(ValueError, match="inputs: past_key_values is not supported on encoder–decoder models"):
        pyattr.relevance(model, {"input_ids": src, "past_key_values": object()}, decoder_input_ids=dec)
    with pytest.raises(ValueError, match=r"attention_mask: a 0 before a 1"):
        pyattr.generation_relevance(model, torch.tensor([[1, 1, 5, 6, 7]]), attention_mask=torch.tensor([[0, 0, 1, 1, 1]]),
                                    max_new_tokens=2)


def test_decoder_ids_are_checked_against_the_decoders_own_embedding():
    import transformers as T

    torch.manual_seed(0)
    cfg = T.MarianConfig(vocab_size=50, decoder_vocab_size=96, share_encoder_decoder_embeddings=False, d_model=16,
                         encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                         encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=64, pad_token_id=1,
                         eos_token_id=2, decoder_start_token_id=2)
    model = T.MarianMTModel(cfg).eval()
    src = torch.tensor([[5, 6, 7]])
    r = pyattr.relevance(model, src, decoder_input_ids=torch.tensor([[2, 70]]))  # 70: a decoder id only
    assert r.target_relevance.shape == (1, 2)
    with pytest.raises(ValueError, match=r"decoder_input_ids: token ids must be in \[0, 96\) \(the decoder's"):
        pyattr.relevance(model, src, decoder_input_ids=torch.tensor([[2, 99]]))
    with pytest.raises(ValueError, match=r"inputs: token ids must be in \[0, 50\)"):
        pyattr.relevance(model, torch.tensor([[5, 70]]), decoder_input_ids=torch.tensor([[2, 7]]))


def test_models_without_a_language_model_head_are_refused():
    import transformers as T

    base = T.BartModel(tiny_seq2seq("bart").config).eval()
    with pytest.raises(ValueError, match="BartModel has neither a language-model head nor a sequence classifier's"):
        pyattr.relevance(base, *_ids("bart")[:1], decoder_input_ids=_ids("bart")[1])


def test_t5gemma_logit_softcapping_gets_the_identity_rule():
    """T5Gemma computes cap·tanh(logits/cap) in its own forward after the LM head: the
    functional Identity-rule of the head region takes it, so relevance is conserved (and
    is not without the activation rule)."""
    import copy

    model = copy.deepcopy(tiny_seq2seq("t5gemma"))
    for cfg in (model.config, model.config.decoder):
        cfg.final_logit_softcapping = 0.5  # small: the logits leave tanh's linear regime
    src, dec = _ids("t5gemma", seed=3)
    r = pyattr.relevance(model, src, decoder_input_ids=dec)
    total = r.source_relevance.sum(-1) + r.target_relevance.sum(-1)
    assert torch.allclose(total, r.target, rtol=1e-6, atol=0)
    assert "lm_head" in " ".join(map(str, r.coverage.installed))
    off = pyattr.relevance(model, src, decoder_input_ids=dec, rules=dataclasses.replace(RelevanceRules.all(), activation=False))
    assert (off.conservation_delta.abs() > 1e-3 * off.target.abs()).any()


def _bigbird_sparse():
    import transformers as T

    torch.manual_seed(0)
    cfg = T.BigBirdPegasusConfig(vocab_size=96, d_model=16, encoder_layers=2, decoder_layers=2,
                                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=24,
                                 decoder_ffn_dim=24, attention_type="block_sparse", block_size=2, num_random_blocks=1,
                                 max_position_embeddings=64, init_std=0.3)
    model = T.BigBirdPegasusForConditionalGeneration(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    return model


def test_bigbird_pegasus_block_sparse_source_is_explained_and_kept_sparse():
    """BigBird-Pegasus' block-sparse encoder (16 source tokens, blocks of 2): rules off =
    gradient × input read with hooks, all rules conserve; pyattr's short probes must not
    switch the model to full attention (its own forward does that on a short input); a
    source it would pad itself to whole blocks is refused by name."""
    model = _bigbird_sparse()
    g = torch.Generator().manual_seed(4)
    src, dec = torch.randint(3, 90, (1, 16), generator=g), torch.randint(3, 90, (1, 3), generator=g)
    off = pyattr.relevance(model, src, target=5, decoder_input_ids=dec, rules="none")
    assert model.model.encoder.attention_type == "block_sparse"
    s, t, _ = _oracle(model, "bigbird_pegasus", src, dec, "none", token=5)
    assert torch.allclose(off.source_relevance, s, rtol=1e-9, atol=1e-10)
    assert torch.allclose(off.target_relevance, t, rtol=1e-9, atol=1e-10)
    on = pyattr.relevance(model, src, target=5, decoder_input_ids=dec)
    assert on.conservation_delta.abs().max() < 1e-9 * on.target.abs().max()
    with pytest.raises(ValueError, match=r"relevance\(\): BigBirdPegasusForConditionalGeneration's encoder runs on 18 "
                                         r"positions for a source of 17 tokens"):
        pyattr.relevance(model, torch.randint(3, 90, (1, 17), generator=g), target=5, decoder_input_ids=dec)


def test_t5gemma2_vision_tower_refuses_to_run_under_the_rules():
    """T5Gemma 2's encoder holds a vision tower the text rule map does not cover: text
    inputs never run it; an image would, and is refused rather than explained without its
    rules. Its decoder attends to the encoder in its self-attention: no cross-attention
    nodes to patch."""
    model = tiny_seq2seq("t5gemma2")
    src, dec = _ids("t5gemma2", batch=1)
    src[0, 1] = model.config.image_token_index
    pixels = torch.zeros(1, 3, 16, 16, dtype=torch.float64)
    with pytest.raises(RelevanceRuleUnsupportedError, match=r"'model.encoder.vision_tower' is not on the text path "
                                                            r"the t5gemma2 rule map covers"):
        pyattr.relevance(model, {"input_ids": src, "pixel_values": pixels}, decoder_input_ids=dec)
    cov = pyattr.relevance(model, src, decoder_input_ids=dec).coverage
    assert "model.encoder.vision_tower" in cov.skipped
    with pytest.raises(ValueError, match="nodes: 'decoder.cross_heads': T5Gemma2ForConditionalGeneration's decoder "
                                         "attends to the encoder in its self-attention"):
        pyattr.patching.attribution_patching(model, src, src, 5, nodes="cross_heads", decoder_input_ids=dec)


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_generation_batch_targets_chunk_the_steps_backward_to_the_same_numbers(arch):
    """batch_targets: each row's steps run as backwards of at most that many steps over the
    row's one forward; the same relevance as all steps in one batched backward."""
    model = tiny_seq2seq(arch)
    src, _ = _ids(arch, batch=2, seed=5)
    cont = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    whole = pyattr.generation_relevance(model, src, continuation=cont)
    for k in (1, 2, 5):
        part = pyattr.generation_relevance(model, src, continuation=cont, batch_targets=k)
        assert torch.allclose(part.source_relevance, whole.source_relevance, rtol=1e-10, atol=1e-12)
        assert torch.allclose(part.target_relevance, whole.target_relevance, rtol=1e-10, atol=1e-12)
        assert torch.equal(part.target, whole.target)


@pytest.mark.parametrize("baseline", ["zeros", "pad"])
def test_generation_with_a_baseline_is_relevance_with_that_baseline_per_step(baseline):
    model = tiny_seq2seq("bart", biases=False)
    src, _ = _ids("bart", batch=1, seed=6)
    cont = torch.tensor([[11, 12, 13]])
    g = pyattr.generation_relevance(model, src, continuation=cont, baseline=baseline)
    seq = g.sequences
    for t in range(3):
        one = pyattr.relevance(model, src, decoder_input_ids=seq[:, :1 + t], target=int(cont[0, t]), baseline=baseline)
        assert torch.allclose(g.source_relevance[0, t], one.source_relevance[0], rtol=1e-9, atol=1e-12)
        assert torch.allclose(g.baseline_target[0, t], one.baseline_target[0], rtol=1e-12)
    # completeness against f(x) - f(x0): Σ relevance + delta
    total = g.source_relevance.sum(-1) + g.target_relevance.sum(-1) + g.conservation_delta
    assert torch.allclose(total, g.target - g.baseline_target, rtol=1e-9, atol=1e-9)


def test_generation_refuses_inputs_its_explained_forward_would_drop():
    """generation_relevance explains each step from the ids alone: an image in the inputs,
    or a forward input in generate_kwargs (which would condition what is generated), would
    be explained without it; refused on encoder–decoders and decoders alike."""
    from models import tiny_causal_lm

    model = tiny_seq2seq("t5gemma2")
    src, _ = _ids("t5gemma2", batch=1)
    pixels = torch.zeros(1, 3, 16, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="inputs: pixel_values is not read by generation_relevance"):
        pyattr.generation_relevance(model, {"input_ids": src, "pixel_values": pixels}, max_new_tokens=2)
    with pytest.raises(ValueError, match="generate_kwargs: pixel_values is an input of "
                                         "T5Gemma2ForConditionalGeneration's forward"):
        pyattr.generation_relevance(model, src, max_new_tokens=2, generate_kwargs={"pixel_values": pixels})
    lm = tiny_causal_lm("llama")
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="inputs: position_ids is not read by generation_relevance"):
        pyattr.generation_relevance(lm, {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2]])},
                                    max_new_tokens=2)
    zeros = pyattr.generation_relevance(lm, {"input_ids": ids, "token_type_ids": torch.zeros_like(ids)},
                                        max_new_tokens=2)
    assert torch.equal(zeros.token_relevance, pyattr.generation_relevance(lm, ids, max_new_tokens=2).token_relevance)
