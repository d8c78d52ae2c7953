"""Rule scopes on every supported architecture: bit-identical forwards, exact coverage,
conservation, and the attention rules' gradient scaling."""

import pytest
import torch

import pyattr
from models import VOCAB, minilm, tiny_causal_lm

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt2", "gpt_neox"]
ATTN = ["eager", "sdpa"]
ALL_MODES = [True, "attnlrp"]


def _cases():
    for a in ARCHS:
        for impl in ATTN:
            if a == "gemma2" and impl == "sdpa":
                continue  # transformers itself refuses sdpa for Gemma2 (logit soft-capping)
            yield a, impl


@pytest.mark.parametrize("arch,impl", list(_cases()))
@pytest.mark.parametrize("attention", ALL_MODES)
def test_forward_bit_identical_all_rules(arch, impl, attention):
    m = tiny_causal_lm(arch, impl)
    ids = torch.randint(0, VOCAB, (2, 11))
    ref = m(ids).logits
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention=attention)):
        out = m(ids).logits
    assert torch.equal(ref, out)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_bit_identical_half_precision(arch, dtype):
    m = tiny_causal_lm(arch, "eager", dtype=dtype)
    ids = torch.randint(0, VOCAB, (1, 9))
    ref = m(ids).logits
    with pyattr.use_relevance_rules(m):
        out = m(ids).logits
    assert torch.equal(ref, out)


def _llama_like(prefix, n, extra_norms=()):
    installed = []
    for i in range(n):
        L = f"{prefix}.layers.{i}"
        installed += [f"{L}.input_layernorm", f"{L}.post_attention_layernorm"]
        installed += [f"{L}.{p}" for p in extra_norms]
        installed += [f"{L}.self_attn.q_proj", f"{L}.self_attn.k_proj", f"{L}.mlp"]
    return installed + [f"{prefix}.norm"]


EXPECTED = {
    "llama": _llama_like("model", 2),
    "mistral": _llama_like("model", 2),
    "qwen2": _llama_like("model", 2),
    "qwen3": _llama_like("model", 2),
    "gemma2": _llama_like("model", 2, ("pre_feedforward_layernorm", "post_feedforward_layernorm")),
    "gpt2": [
        p
        for i in range(2)
        for p in (f"transformer.h.{i}.ln_1", f"transformer.h.{i}.ln_2", f"transformer.h.{i}.attn.c_attn", f"transformer.h.{i}.mlp.act")
    ]
    + ["transformer.ln_f"],
    "gpt_neox": [
        p
        for i in range(2)
        for p in (
            f"gpt_neox.layers.{i}.input_layernorm",
            f"gpt_neox.layers.{i}.post_attention_layernorm",
            f"gpt_neox.layers.{i}.attention.query_key_value",
            f"gpt_neox.layers.{i}.mlp.act",
        )
    ]
    + ["gpt_neox.final_layer_norm"],
}


@pytest.mark.parametrize("arch", ARCHS)
def test_coverage_paths_exact(arch):
    m = tiny_causal_lm(arch)
    with pyattr.use_relevance_rules(m) as cov:
        assert sorted(cov.installed) == sorted(EXPECTED[arch])
        names = dict(m.named_modules())
        assert all(p in names for p in cov.installed + cov.skipped)
    if arch == "qwen3":
        for i in range(2):
            for n in ("q_norm", "k_norm"):
                p = f"model.layers.{i}.self_attn.{n}"
                assert p in cov.skipped
                assert cov.reasons[p] == (
                    "q/k norm left native (AH-rule: no gradient reaches q/k; the LN-rule applies here under attnlrp)"
                )
                assert p not in cov.installed
    if arch in ("llama", "qwen3"):
        assert cov.by_kind["multiplicative_gate"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
        assert cov.reasons["model.layers.0.self_attn.v_proj"] == "value path stays native under the AH-rule"


def test_coverage_when_rules_off():
    m = tiny_causal_lm("llama")
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules(activation=True, multiplicative_gate=True, attention="attnlrp")) as cov:
        assert "model.norm" in cov.skipped and cov.reasons["model.norm"] == "normalization rule off"
        assert "model.layers.0.self_attn.v_proj" in cov.installed
        assert "model.layers.0.input_layernorm" not in cov.installed
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.none()) as cov:
        assert cov.installed == []


@pytest.mark.parametrize("arch,impl", [c for c in _cases() if c[0] in ("llama", "mistral", "qwen3", "gemma2")])
def test_conservation_bias_free_decoders(arch, impl):
    m = tiny_causal_lm(arch, impl)
    ids = torch.randint(0, VOCAB, (3, 13))
    r = pyattr.relevance(m, ids)
    assert (r.target.abs() > 1e-3).all()
    assert (r.conservation_delta.abs() <= 1e-4 * r.target.abs()).all(), (r.target, r.conservation_delta)
    # token_relevance holds float32 sums over the hidden size: they round at float32's eps of
    # the terms' magnitudes, which cancel in the total (DESIGN §13)
    scale = r.relevance.double().abs().flatten(1).sum(1)
    gap = r.token_relevance.double().sum(1) - (r.target - r.conservation_delta)
    assert (gap.abs() <= 4 * torch.finfo(torch.float32).eps * scale).all(), (gap, scale)


def test_llama_without_attention_rule_does_not_conserve():
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (3, 13))
    r = pyattr.relevance(m, ids, rules=pyattr.RelevanceRules(True, True, True, False))
    assert (r.conservation_delta.abs() > 1e-3 * r.target.abs()).any(), r.conservation_delta


def _single_layer(arch):
    m = tiny_causal_lm(arch)
    layers = m.base_model.h if arch == "gpt2" else m.base_model.layers
    del layers[1:]
    m.config.num_hidden_layers = 1
    return m


def _attn_weight_grads(m, arch, rules, ids):
    blk = m.base_model.h[0].attn if arch == "gpt2" else m.base_model.layers[0].self_attn if arch == "llama" else m.base_model.layers[0].attention
    ws = [blk.c_attn.weight] if arch == "gpt2" else [blk.q_proj.weight, blk.k_proj.weight, blk.v_proj.weight] if arch == "llama" else [blk.query_key_value.weight]
    with pyattr.use_relevance_rules(m, rules):
        out = m(ids).logits[:, -1, 5].sum()
        gs = torch.autograd.grad(out, ws, allow_unused=True)
    return [torch.zeros_like(w) if g is None else g for g, w in zip(gs, ws)]


@pytest.mark.parametrize("mode,scales", [("frozen", (0.0, 0.0, 1.0)), ("attnlrp", (0.25, 0.25, 0.5))])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_attention_rules_scale_q_k_v_gradients(arch, mode, scales):
    m = _single_layer(arch)
    only_attn = pyattr.RelevanceRules(False, False, False, mode)
    ids = torch.randint(0, VOCAB, (2, 7))
    got = _attn_weight_grads(m, arch, only_attn, ids)
    ref = _attn_weight_grads(m, arch, pyattr.RelevanceRules.none(), ids)
    if arch == "llama":
        for g, r, s in zip(got, ref, scales):
            torch.testing.assert_close(g, r * s)
            assert r.abs().max() > 0
    elif arch == "gpt2":  # Conv1D weight (in, 3·hidden): q | k | v column blocks
        c = torch.tensor(scales).repeat_interleave(32)
        torch.testing.assert_close(got[0], ref[0] * c)
    else:  # Linear weight (3·hidden, in), rows interleaved per head: [q k v] × heads
        hs = 32 // 4
        c = torch.tensor(scales).repeat_interleave(hs).repeat(4)
        torch.testing.assert_close(got[0], ref[0] * c[:, None])


def test_bert_minilm_forward_and_coverage():
    tok, m = minilm()
    enc = tok(["pyattr explains models", "a second, longer sentence here"], padding=True, return_tensors="pt")
    ref = m(**enc)
    with pyattr.use_relevance_rules(m) as cov:
        out = m(**enc)
    assert torch.equal(ref.last_hidden_state, out.last_hidden_state)
    assert torch.equal(ref.pooler_output, out.pooler_output)
    n = m.config.num_hidden_layers
    # embedding LN, 2 LNs, q+k, act per layer, and the pooler's tanh
    assert len(cov.installed) == 1 + n * 2 + n * 2 + n + 1 and cov.installed[-1] == "pooler.activation"
    assert cov.installed[0] == "embeddings.LayerNorm"
    assert "encoder.layer.0.intermediate.intermediate_act_fn" in cov.by_kind["activation"]
    assert cov.reasons["encoder.layer.0.intermediate"] == "no multiplicative gate in this MLP"
