"""Calls written against TransformerLens' relevance-rule names behave as they do there:
every ``RelevanceRules`` field defaults to off; ``RelevanceRules.all()`` is the four rules;
``relevance()`` keeps all four as its own default."""

import pytest
import torch

import pyattr
from models import VOCAB, tiny_causal_lm
from pyattr import RelevanceRules, use_relevance_rules

NORMS = [f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
NORMS += ["model.norm"]


@pytest.fixture(scope="module")
def llama():
    return tiny_causal_lm("llama")


def test_defaults_are_off():
    r = RelevanceRules()
    assert (r.normalization, r.activation, r.multiplicative_gate, r.attention) == (False, False, False, False)
    assert not r.any()
    assert RelevanceRules() == RelevanceRules.none()
    a = RelevanceRules.all()
    assert (a.normalization, a.activation, a.multiplicative_gate, a.attention) == (True, True, True, "frozen")
    assert RelevanceRules.all(attention="attnlrp").attention == "attnlrp"


def test_ln_rule_alone_installs_only_norms(llama):
    with use_relevance_rules(llama, RelevanceRules(normalization=True)) as cov:
        assert cov.installed == NORMS
        assert set(cov.by_kind) == {"normalization"}
        assert cov.reasons["model.layers.0.mlp"] == "activation rule off"
        assert cov.reasons["model.layers.0.self_attn.q_proj"] == "attention rule off"
        # the MLP runs the fused gated op with the ordinary gradient (for its memory), not a rule
        from pyattr.integration.install import state_of

        assert set(state_of(llama.model.layers[0].mlp).counts) == {"gated_memory"}
        assert "forward" not in llama.model.layers[0].self_attn.q_proj.__dict__


def test_ln_rule_alone_gradient(llama):
    """LN-rule alone: the gradient equals a hand-built model where only the norms hold r constant."""
    ids = torch.randint(0, VOCAB, (1, 6))

    def grad(scope=None, hooks=False):
        hs = []
        if hooks:
            def norm_hook(mod, args, out):
                x = args[0]
                r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon)
                return mod.weight * (x * r.detach())

            hs = [m.register_forward_hook(norm_hook) for n, m in llama.named_modules() if n in NORMS]
        emb = llama.get_input_embeddings()(ids).detach().requires_grad_(True)
        try:
            if scope is not None:
                with use_relevance_rules(llama, scope):
                    out = llama(inputs_embeds=emb).logits[0, -1, 3]
            else:
                out = llama(inputs_embeds=emb).logits[0, -1, 3]
            (g,) = torch.autograd.grad(out, emb)
        finally:
            for h in hs:
                h.remove()
        return g

    ln_only = grad(RelevanceRules(normalization=True))
    torch.testing.assert_close(ln_only, grad(hooks=True), atol=1e-6, rtol=1e-5)
    assert (ln_only - grad(RelevanceRules.all())).abs().max() > 1e-4


def test_all_off_scope_installs_nothing(llama):
    with use_relevance_rules(llama, RelevanceRules()) as cov:
        assert cov.installed == []
        assert set(cov.skipped) >= set(NORMS)


def test_relevance_default_is_all_four(llama):
    ids = torch.randint(0, VOCAB, (2, 7))
    d = pyattr.relevance(llama, ids, target=3)
    a = pyattr.relevance(llama, ids, target=3, rules=RelevanceRules.all())
    torch.testing.assert_close(d.relevance, a.relevance, atol=0, rtol=0)
    assert (d.conservation_delta.abs() <= 1e-4 * d.target.abs()).all()
    assert sorted(d.coverage.by_kind) == ["activation", "attention", "multiplicative_gate", "normalization"]
    # the plain gradient (every rule off) does not conserve on this model
    off = pyattr.relevance(llama, ids, target=3, rules=RelevanceRules())
    assert off.coverage.installed == []
    assert (off.conservation_delta.abs() > 1e-3 * off.target.abs()).any()


def test_scope_without_rules_argument_is_all_four(llama):
    with use_relevance_rules(llama) as cov:
        assert sorted(cov.by_kind) == ["activation", "attention", "multiplicative_gate", "normalization"]


@pytest.mark.parametrize("kind", ["activation", "multiplicative_gate"])
def test_coverage_one_gated_rule_is_exact(llama, kind):
    rules = RelevanceRules(**{kind: True})
    with use_relevance_rules(llama, rules) as cov:
        mlps = ["model.layers.0.mlp", "model.layers.1.mlp"]
        assert cov.installed == mlps and cov.by_kind == {kind: mlps}
        assert not set(cov.installed) & set(cov.skipped)
        assert all(p not in cov.reasons for p in cov.installed)
