"""DESIGN §12, TransformerLens 4: the rule scope on a ``TransformerBridge``, under the
user's own forward, backward, hooks and ``run_with_cache(incl_bwd=True)``.

Two oracles, both outside pyattr's scope code: ``pyattr.relevance`` on a copy of the same
Hugging Face model without the bridge (the bridge's eager attention and loss differ from
Hugging Face's in float rounding: 1e-5 relative), and the rules written by hand with TL's
own hooks on the same bridge (the LN-rule: ``hook_scale`` detached; the AH-rule:
``hook_pattern`` detached; the Identity-rule: the activation's output as
``x · (act(x)/x)`` with the ratio detached) — the same computation, so 1e-10 where both
take the same norm path."""

import copy
import warnings

import pytest
import torch
from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

import pyattr
from models import VOCAB, tiny_causal_lm
from pyattr import RelevanceRuleConflictError, RelevanceRuleUnsupportedError, RelevanceRules, use_relevance_rules
from pyattr.bench.frameworks import rules_as_tl_hooks

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning:transformer_lens"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

IDS = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
TOKEN = 5
HAND = RelevanceRules(normalization=True, attention=True, activation=True)  # what the hand oracle writes


def bridged(arch, dtype=torch.float64):
    """(bridge, a copy of the Hugging Face model made before the bridge was built)."""
    m = tiny_causal_lm(arch, dtype=dtype)
    ref = copy.deepcopy(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_bridge_from_module(m, type(m).__name__, hf_config=m.config), ref


def _layers(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def hf_relevance(model, rules, loss=False):
    """Gradient × input where the residual stream enters block 0 of the plain Hugging Face
    model, under the rules: the logit TOKEN at the last position summed over rows, or the
    language-model loss."""
    kept = {}
    h = _layers(model)[0].register_forward_pre_hook(
        lambda mod, a, k: kept.__setitem__("x", a[0] if a else k["hidden_states"]), with_kwargs=True)
    try:
        with use_relevance_rules(model, rules):
            out = model(IDS, labels=IDS).loss if loss else model(IDS).logits[:, -1, TOKEN].sum()
            (g,) = torch.autograd.grad(out, kept["x"])
    finally:
        h.remove()
    return (kept["x"] * g).sum(-1).detach()


def bridge_relevance(bridge, rules=None, hand=False):
    """The same on the bridge at ``blocks.0.hook_resid_pre``: under ``use_relevance_rules(bridge)``
    when ``rules`` is given, or with the rules written by hand with TL's hooks (``hand``)."""
    kept = {}
    bridge.hook_dict["blocks.0.hook_resid_pre"].add_hook(lambda t, hook: kept.__setitem__("x", t))
    handles = rules_as_tl_hooks(bridge) if hand else []
    try:
        if rules is not None:
            with use_relevance_rules(bridge, rules):
                out = bridge(IDS)[:, -1, TOKEN].sum()
                (g,) = torch.autograd.grad(out, kept["x"])
        else:
            out = bridge(IDS)[:, -1, TOKEN].sum()
            (g,) = torch.autograd.grad(out, kept["x"])
    finally:
        bridge.reset_hooks()
        for h in handles:
            h.remove()
    return (kept["x"] * g).sum(-1).detach()


def close(got, want, rtol):
    torch.testing.assert_close(got, want, rtol=0, atol=rtol * float(want.abs().max()))


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_the_scope_on_a_bridge_gives_the_rules_of_the_hugging_face_model(arch):
    bridge, ref = bridged(arch)
    with torch.no_grad():
        plain = bridge(IDS)
    got = bridge_relevance(bridge, RelevanceRules.all())
    close(got, hf_relevance(ref, RelevanceRules.all()), 1e-5)
    for rules in (HAND, RelevanceRules(normalization=True), RelevanceRules(attention=True),
                  RelevanceRules(activation=True), RelevanceRules()):
        close(bridge_relevance(bridge, rules), hf_relevance(ref, rules), 1e-5)
    # by hand, an RMS norm's held scale makes TL rebuild the output in float64, where the
    # Hugging Face RMS norm (the scope's path without hooks) computes in float32
    close(bridge_relevance(bridge, HAND), bridge_relevance(bridge, hand=True), 1e-10 if arch == "gpt2" else 1e-6)
    # the rules are not a no-op here, and the bridge's forward is its own, bit for bit
    assert float((got - bridge_relevance(bridge, RelevanceRules())).abs().max()) > 1e-3 * float(got.abs().max())
    with torch.no_grad(), use_relevance_rules(bridge):
        assert torch.equal(bridge(IDS), plain)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_run_with_cache_with_backward_sees_the_rule_gradients(arch):
    """``run_with_cache(incl_bwd=True)`` puts backward hooks on every hook point, which
    moves TL's norms to their python path: the LN-rule stays (it dropped 0.12-0.15 off
    before), and the held scale and pattern still get their gradients in the cache."""
    bridge, ref = bridged(arch)
    with use_relevance_rules(bridge, HAND):
        loss, cache = bridge.run_with_cache(IDS, return_type="loss", incl_bwd=True)
    got = (cache["blocks.0.hook_resid_pre"] * cache["blocks.0.hook_resid_pre_grad"]).sum(-1)
    close(got, hf_relevance(ref, HAND, loss=True), 1e-5)
    for name in ("blocks.0.ln1.hook_scale_grad", "blocks.0.ln1.hook_normalized_grad", "blocks.0.attn.hook_pattern_grad"):
        assert name in cache and torch.isfinite(cache[name]).all() and cache[name].abs().max() > 0, name
    # against the rules by hand on the same bridge, with the same cache call
    handles = rules_as_tl_hooks(bridge)
    try:
        _, hand = bridge.run_with_cache(IDS, return_type="loss", incl_bwd=True,
                                        names_filter=lambda n: n.startswith("blocks.0.hook_resid_pre"))
    finally:
        bridge.reset_hooks()
        for h in handles:
            h.remove()
    close(got, (hand["blocks.0.hook_resid_pre"] * hand["blocks.0.hook_resid_pre_grad"]).sum(-1), 1e-10)


def test_relevance_takes_the_bridge_and_coverage_names_its_mounts():
    bridge, ref = bridged("llama")
    got = pyattr.relevance(bridge, IDS, target=pyattr.targets.Logit(TOKEN))
    want = pyattr.relevance(ref, IDS, target=pyattr.targets.Logit(TOKEN))
    close(got.token_relevance.double(), want.token_relevance.double(), 1e-5)
    # text, read with the bridge's own tokenizer
    import pyattr.toy as toy
    from transformer_lens.model_bridge import TransformerBridge

    model, tok, _ = toy.load()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        booted = TransformerBridge.boot_transformers(str(toy.INDUCTION_DIR), device="cpu")
    text = pyattr.relevance(booted, "sun cat red tree sun")
    assert text.tokens == pyattr.relevance(model, "sun cat red tree sun", tokenizer=tok).tokens
    close(text.token_relevance.double(),
          pyattr.relevance(model, "sun cat red tree sun", tokenizer=tok).token_relevance.double(), 1e-6)
    with use_relevance_rules(bridge) as cov:
        pass
    assert cov.mounts["model.layers.0.input_layernorm"] == "blocks.0.ln1"
    assert cov.mounts["model.layers.1.post_attention_layernorm"] == "blocks.1.ln2"
    assert cov.mounts["model.layers.0.mlp"] == "blocks.0.mlp"
    assert cov.mounts["model.norm"] == "ln_final"
    assert set(cov.mounts) <= set(cov.installed)
    # the LN-rule alone: the MLP's memory mount is not a rule, so no mount name either
    with use_relevance_rules(bridge, RelevanceRules(normalization=True)) as cov:
        pass
    assert "model.layers.0.mlp" not in cov.mounts and "model.layers.0.mlp" not in cov.installed
    assert set(cov.mounts) <= set(cov.installed) and cov.mounts["model.norm"] == "ln_final"


def test_a_users_hook_editing_the_normalized_value_keeps_the_ln_rule():
    """A forward hook that edits ``hook_normalized`` (an ablation) under the scope: TL rebuilds
    the output from the edited value, and the scale in it stays a constant."""
    bridge, _ = bridged("llama")

    def ablate(t, hook):
        return t * (torch.arange(t.shape[-1]) % 3 != 0)

    def run(rules=None, hand=False):
        bridge.hook_dict["blocks.1.ln2.hook_normalized"].add_hook(ablate, is_permanent=True)
        try:
            return bridge_relevance(bridge, rules, hand=hand)
        finally:
            bridge.reset_hooks(including_permanent=True)

    # the other norms: float32 (Hugging Face's RMS norm) in the scope, float64 by hand
    close(run(HAND), run(hand=True), 1e-6)
    assert float((run(HAND) - run(RelevanceRules())).abs().max()) > 1e-3


def test_compatibility_mode_matches_the_rules_by_hand():
    """TL's compatibility mode (folded norms, processed weights): the scope's rules are the
    hand-written ones on the same processed bridge."""
    bridge, _ = bridged("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge.enable_compatibility_mode()
    close(bridge_relevance(bridge, HAND), bridge_relevance(bridge, hand=True), 1e-10)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attnlrp_on_the_bridges_own_attention(arch):
    """AttnLRP's rule sits in the q, k and v projections (×¼, ×¼, ×½; the softmax's rule is
    its own gradient): the bridge's attention calls them, so its numbers are AttnLRP's."""
    bridge, ref = bridged(arch)
    rules = RelevanceRules.all(attention="attnlrp")
    got = bridge_relevance(bridge, rules)
    close(got, hf_relevance(ref, rules), 1e-5)
    assert float((got - bridge_relevance(bridge, RelevanceRules.all())).abs().max()) > 1e-3 * float(got.abs().max())


def test_attnlrp_on_projections_the_bridge_split_off_is_refused():
    """GPT-2's bridge computes attention on q/k/v Linears it split off ``c_attn``: AttnLRP's
    scaled gradients on ``c_attn`` would never run, so its first forward raises."""
    bridge, _ = bridged("gpt2")
    with pytest.raises(RelevanceRuleUnsupportedError,
                       match=r"'transformer\.h\.0\.attn': the TransformerLens JointQKVAttentionBridge computed this "
                             r"mount without calling the module that carries its attention rule"):
        with use_relevance_rules(bridge, RelevanceRules.all(attention="attnlrp")):
            bridge(IDS)


def test_a_component_that_computes_its_mount_without_the_rule_is_refused():
    """Phi-3's bridge rebuilds the gated MLP from split gate/up projections and a functional
    activation: the Identity- and Half-rules cannot reach it, so the first forward under
    the scope raises (it answered 180 % off before); with those rules off it runs."""
    bridge, ref = bridged("phi3")
    with pytest.raises(RelevanceRuleUnsupportedError,
                       match=r"'model\.layers\.0\.mlp': the TransformerLens JointGateUpMLPBridge computed this mount "
                             r"without calling the module that carries its \w+ rule"):
        with use_relevance_rules(bridge):
            bridge(IDS)
    ln = RelevanceRules(normalization=True)
    close(bridge_relevance(bridge, ln), hf_relevance(ref, ln), 1e-5)


def test_a_bridge_built_inside_an_open_scope_is_refused():
    """The scope opened on the Hugging Face model, then the bridge built: its components
    replaced the rule-carrying modules after the scope placed the rules (GPT-2 answered
    0.24 off, coverage saying installed)."""
    m = tiny_causal_lm("gpt2", dtype=torch.float64)
    with use_relevance_rules(m):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bridge = build_bridge_from_module(m, type(m).__name__, hf_config=m.config)
        with pytest.raises(RelevanceRuleConflictError, match=r"'transformer\.h\.0\.ln_1': another module took its place"):
            bridge(IDS)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_mixture_of_experts_bridges(arch):
    """Sparse blocks under a bridge (float32: CPU grouped_mm has no float64): the routing and
    gated rules of the experts, as on the Hugging Face model."""
    bridge, ref = bridged(arch, dtype=torch.float32)
    for rules in (RelevanceRules.all(), RelevanceRules(normalization=True)):
        close(bridge_relevance(bridge, rules), hf_relevance(ref, rules), 1e-5)
