"""AttnLRP mode against a float64 AttnLRP reference written here, on models with and without
per-head q/k norms (Qwen3): the LN-rule reaches q_norm/k_norm under AttnLRP only."""

import pytest
import torch

import pyattr
from models import VOCAB, tiny_causal_lm


def _keep_value(o, c):
    """``o`` in the forward, ``c·dy`` in the backward."""
    return o.detach() + c * (o - o.detach())


def _attnlrp_reference(m, ids, tid):
    """Token relevance under AttnLRP written with detach tricks and forward hooks (float64):
    the LN-rule on every RMSNorm (q/k norms included), the Identity- and Half-rule in the
    gated MLP, q/k gradients ×¼ and v gradients ×½."""
    hooks = []

    def norm_hook(mod, args, out):
        # Hugging Face's RMSNorm normalises in float32 even for a float64 model: the same here,
        # so that the forward values agree; the rule is r.detach()
        x = args[0]
        x32 = x.to(torch.float32)
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon)
        return mod.weight * (x32 * r.detach()).to(x.dtype)

    def mlp_hook(mod, args, out):
        x = args[0]
        g, u = mod.gate_proj(x), mod.up_proj(x)
        a = mod.act_fn(g)
        a_rule = g * (a / g).detach()  # Identity-rule: d a / d g = a/g
        h = 0.5 * (a_rule * u.detach()) + 0.5 * (a_rule.detach() * u)  # Half-rule
        return mod.down_proj(h)

    for name, mod in m.named_modules():
        if type(mod).__name__.endswith("RMSNorm"):
            hooks.append(mod.register_forward_hook(norm_hook))
        elif name.endswith(".mlp"):
            hooks.append(mod.register_forward_hook(mlp_hook))
        elif name.endswith(("q_proj", "k_proj")):
            hooks.append(mod.register_forward_hook(lambda mod, a, o: _keep_value(o, 0.25)))
        elif name.endswith("v_proj"):
            hooks.append(mod.register_forward_hook(lambda mod, a, o: _keep_value(o, 0.5)))
    try:
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        out = m(inputs_embeds=emb).logits[0, -1, tid]
        (g,) = torch.autograd.grad(out, emb)
    finally:
        for h in hooks:
            h.remove()
    return (emb * g).sum(-1)[0].detach(), float(out.detach())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_attnlrp_matches_float64_reference(arch):
    m = tiny_causal_lm(arch, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    ref, target = _attnlrp_reference(m, ids, 7)
    r = pyattr.relevance(m, ids, target=7, rules=pyattr.RelevanceRules.all(attention="attnlrp"))
    torch.testing.assert_close(r.target[0].item(), target, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(r.token_relevance[0].double(), ref, atol=1e-6 * ref.abs().max().item(), rtol=1e-5)


def test_qk_norms_change_the_qwen3_attnlrp_relevance():
    """Without the LN-rule on q/k norms the reference differs (the reported 19 %): the test above
    can tell the two apart."""
    m = tiny_causal_lm("qwen3", dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    ref, _ = _attnlrp_reference(m, ids, 7)
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention="attnlrp")):
        for i in range(2):
            for n in ("q_norm", "k_norm"):
                assert "forward" in m.model.layers[i].self_attn.get_submodule(n).__dict__
    # the same rules with the q/k norms left native, by hand: scale only
    native = pyattr.RelevanceRules.all(attention="attnlrp")
    import pyattr.architectures as A

    saved = A.ARCHITECTURES["qwen3"]
    A.ARCHITECTURES["qwen3"] = A.ARCHITECTURES["qwen2"]
    try:
        r = pyattr.relevance(m, ids, target=7, rules=native)
    finally:
        A.ARCHITECTURES["qwen3"] = saved
    rel = (r.token_relevance[0].double() - ref).norm() / ref.norm()
    assert rel > 1e-3, rel


def test_qk_norm_coverage_per_mode():
    m = tiny_causal_lm("qwen3")
    q0, k1 = "model.layers.0.self_attn.q_norm", "model.layers.1.self_attn.k_norm"
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention="attnlrp")) as cov:
        assert q0 in cov.installed and k1 in cov.by_kind["normalization"]
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all()) as cov:
        assert q0 not in cov.installed and q0 in cov.skipped
        assert cov.reasons[q0].startswith("q/k norm left native (AH-rule: no gradient reaches q/k")
        assert "forward" not in m.model.layers[0].self_attn.q_norm.__dict__
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules(attention="attnlrp")) as cov:
        assert q0 in cov.skipped and cov.reasons[q0] == "normalization rule off"
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules(normalization=True)) as cov:
        assert q0 in cov.skipped and "attention rule off" in cov.reasons[q0]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_qwen3_attnlrp_forward_bit_identical(impl):
    m = tiny_causal_lm("qwen3", impl)
    ids = torch.randint(0, VOCAB, (2, 10))
    ref = m(ids).logits
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention="attnlrp")):
        assert torch.equal(m(ids).logits, ref)


def test_generic_mode_mounts_qk_norms_under_attnlrp():
    m = tiny_causal_lm("qwen3")
    m.config.model_type = "qwen3_unmapped"
    try:
        with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention="attnlrp"), generic=True) as cov:
            assert "model.layers.0.self_attn.q_norm" in cov.by_kind["normalization"]
            assert "model.layers.0.self_attn.k_norm" in cov.by_kind["normalization"]
        with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(), generic=True) as cov:
            assert "model.layers.0.self_attn.q_norm" not in cov.installed
    finally:
        m.config.model_type = "qwen3"
