"""use_relevance_rules: instance patching, refcounted nesting, restoration, conflicts."""

import re

import pytest
import torch

import pyattr
from models import VOCAB, tiny_causal_lm
from pyattr.integration.install import state_of


def _patched(m):
    return [n for n, mod in m.named_modules() if "forward" in mod.__dict__ or state_of(mod) is not None]


def _input_grad(m, ids):
    emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
    out = m(inputs_embeds=emb).logits[:, -1, 3].sum()
    (g,) = torch.autograd.grad(out, emb)
    return g


def test_restored_after_exit_and_gradients_native_again():
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 6))
    native = _input_grad(m, ids)
    hooks_before = sum(len(mod._forward_hooks) for mod in m.modules())
    with pyattr.use_relevance_rules(m):
        assert len(_patched(m)) == 11
        ruled = _input_grad(m, ids)
    assert not torch.allclose(ruled, native)
    assert _patched(m) == []
    assert sum(len(mod._forward_hooks) for mod in m.modules()) == hooks_before
    assert torch.equal(_input_grad(m, ids), native)


def test_nested_scopes_refcounted():
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 6))
    with pyattr.use_relevance_rules(m):
        outer = _input_grad(m, ids)
        with pyattr.use_relevance_rules(m):
            assert torch.equal(_input_grad(m, ids), outer)
        # the inner exit must not remove the outer scope's rules
        assert len(_patched(m)) == 11
        assert torch.equal(_input_grad(m, ids), outer)
        with pyattr.use_relevance_rules(m, pyattr.RelevanceRules(False, False, True, False)):
            st = state_of(m.model.layers[0].mlp)
            assert st.counts == {"activation": 1, "multiplicative_gate": 2}
    assert _patched(m) == []


def test_nested_scope_adds_a_rule_for_its_length_only():
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 6))
    act_only = pyattr.RelevanceRules(False, True, False, False)
    with pyattr.use_relevance_rules(m, act_only):
        a = _input_grad(m, ids)
        with pyattr.use_relevance_rules(m, pyattr.RelevanceRules(False, False, True, False)):
            b = _input_grad(m, ids)
        assert torch.equal(_input_grad(m, ids), a)
    assert not torch.allclose(a, b)


def test_restored_on_exception():
    m = tiny_causal_lm("gpt2")
    with pytest.raises(KeyError, match="boom"):
        with pyattr.use_relevance_rules(m):
            assert _patched(m)
            raise KeyError("boom")
    assert _patched(m) == []


def test_other_instances_untouched():
    m1, m2 = tiny_causal_lm("llama", seed=0), tiny_causal_lm("llama", seed=0)
    ids = torch.randint(0, VOCAB, (1, 6))
    native = _input_grad(m2, ids)
    with pyattr.use_relevance_rules(m1):
        assert _patched(m2) == []
        assert torch.equal(_input_grad(m2, ids), native)
        assert not torch.allclose(_input_grad(m1, ids), native)


def test_pre_existing_instance_forward_is_restored():
    m = tiny_causal_lm("llama")
    norm = m.model.norm
    custom = norm.forward  # a bound method stored on the instance, as other tools do
    norm.forward = custom
    with pyattr.use_relevance_rules(m):
        assert norm.forward is not custom
    assert norm.__dict__["forward"] is custom


def test_conflicting_attention_modes_in_nested_scopes():
    m = tiny_causal_lm("llama")
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention="frozen")):
        with pytest.raises(pyattr.RelevanceRuleConflictError, match="already carries the attention rule"):
            with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention="attnlrp")):
                pass
        # the failed inner scope released what it had taken; the outer one is intact
        assert state_of(m.model.layers[0].mlp).counts == {"activation": 1, "multiplicative_gate": 1}
        assert state_of(m.model.layers[0].self_attn.q_proj).counts == {"attention": 1}
    assert _patched(m) == []


def test_hook_replacing_rule_output_raises():
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 5))
    # recomputed from the input (a function of the output is taken: test_hook_replacing_a_rule_modules_output)
    h = m.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda mod, a, out: torch.nn.functional.linear(a[0], mod.weight, mod.bias))
    try:
        m(ids)  # no scope: fine
        with pyattr.use_relevance_rules(m):
            with pytest.raises(pyattr.RelevanceRuleConflictError, match=r"'model.layers.0.self_attn.q_proj'"):
                m(ids)
    finally:
        h.remove()
    # a hook that only reads the value is fine
    seen = []
    h = m.model.norm.register_forward_hook(lambda mod, a, out: seen.append(out.shape))
    with pyattr.use_relevance_rules(m):
        m(ids)
    h.remove()
    assert seen == [torch.Size([1, 5, 32])]


def test_hook_on_bypassed_activation_raises_before_patching():
    m = tiny_causal_lm("llama")
    h = m.model.layers[1].mlp.act_fn.register_forward_hook(lambda *a: None)
    with pytest.raises(pyattr.RelevanceRuleConflictError, match=r"'model.layers.1.mlp.act_fn' has hooks"):
        with pyattr.use_relevance_rules(m):
            pass
    assert _patched(m) == []
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules(normalization=True, attention=True)):
        pass
    h.remove()


def _tiny_opt():
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                    word_embed_proj_dim=32, max_position_embeddings=64)
    return OPTForCausalLM(cfg).eval()


def test_unknown_architecture_raises_and_generic_fallback_works():
    m = _tiny_opt()
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError, match=r"model type 'opt' \(OPTForCausalLM\) has no rule map"):
        with pyattr.use_relevance_rules(m):
            pass
    assert _patched(m) == []
    ids = torch.randint(2, VOCAB, (1, 7))
    ref = m(ids).logits
    with pyattr.use_relevance_rules(m, generic=True) as cov:
        assert torch.equal(m(ids).logits, ref)
    assert cov.model_type == "generic"
    assert "model.decoder.layers.0.self_attn_layer_norm" in cov.by_kind["normalization"]
    assert "model.decoder.final_layer_norm" in cov.by_kind["normalization"]
    assert "model.decoder.layers.0.activation_fn" in cov.by_kind["activation"]
    assert "model.decoder.layers.0.self_attn.q_proj" in cov.by_kind["attention"]
    assert _patched(m) == []


def test_model_and_rules_type_errors():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        with pyattr.use_relevance_rules("llama"):
            pass
    with pytest.raises(TypeError, match="rules must be a RelevanceRules"):
        with pyattr.use_relevance_rules(tiny_causal_lm("llama"), {"attention": True}):
            pass


def test_malformed_mount_is_unsupported_before_patching():
    m = tiny_causal_lm("llama")
    del m.model.layers[1].mlp.up_proj
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError, match=r"'model.layers.1.mlp': a gated MLP needs .*up_proj is missing"):
        with pyattr.use_relevance_rules(m):
            pass
    assert _patched(m) == []


def test_hook_registered_inside_scope_is_checked_too():
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 5))
    with pyattr.use_relevance_rules(m):
        # recomputed from the input: its gradient goes around the rule's backward
        h = m.model.layers[0].self_attn.q_proj.register_forward_hook(
            lambda mod, a, out: torch.nn.functional.linear(a[0], mod.weight, mod.bias))
        try:
            with pytest.raises(pyattr.RelevanceRuleConflictError, match="replaced the output .* around the rule"):
                m(ids)
        finally:
            h.remove()
        h = m.model.layers[0].mlp.act_fn.register_forward_hook(lambda *a: None)
        try:
            with pytest.raises(pyattr.RelevanceRuleConflictError, match="would bypass them"):
                m(ids)
        finally:
            h.remove()


def test_deepcopy_inside_scope_raises_and_outside_works():
    import copy

    m = tiny_causal_lm("llama")
    with pyattr.use_relevance_rules(m):
        with pytest.raises(pyattr.RelevanceRuleConflictError, match=r"cannot copy 'model\.layers\.0\..*' while relevance rules are installed"):
            copy.deepcopy(m)
    c = copy.deepcopy(m)
    assert _patched(c) == []


def test_pickle_inside_scope_raises_with_the_reason_and_outside_works():
    import pickle

    m = tiny_causal_lm("llama")
    with pyattr.use_relevance_rules(m):
        with pytest.raises(pyattr.RelevanceRuleConflictError,
                           match=r"cannot pickle LlamaForCausalLM while relevance rules are installed on it; save"):
            pickle.dumps(m)
        with pytest.raises(pyattr.RelevanceRuleConflictError,
                           match=r"cannot pickle 'model\.norm' while relevance rules are installed on it"):
            pickle.dumps(m.model.norm)
    c = pickle.loads(pickle.dumps(m))
    assert _patched(c) == []


def test_relevance_inside_a_scope_with_other_rules_raises():
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 5))
    with pyattr.use_relevance_rules(m) as outer:
        with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.none()) as inner:
            assert inner.installed == []
            assert inner.inherited["model.norm"] == ["normalization"]
        with pytest.raises(pyattr.RelevanceRuleConflictError, match="keeps other rules on"):
            pyattr.relevance(m, ids, rules=pyattr.RelevanceRules.none())
        same = pyattr.relevance(m, ids)  # the same rules nest without conflict
    plain = pyattr.relevance(m, ids)
    torch.testing.assert_close(same.relevance, plain.relevance)


class _ScaledMLP(torch.nn.Module):
    """A gated MLP that is not the plain form: an extra multiplier on the product."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)


def test_non_plain_gated_mlp_unsupported_or_skipped_in_generic():
    m = tiny_causal_lm("llama")
    m.model.layers[0].mlp = _ScaledMLP(m.model.layers[0].mlp)
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError, match=r"'model.layers.0.mlp': _ScaledMLP.forward is not the plain"):
        with pyattr.use_relevance_rules(m):
            pass
    ids = torch.randint(0, VOCAB, (1, 6))
    ref = m(ids).logits
    m.config.model_type = "llama-variant"  # unknown type: class-based mounting
    with pyattr.use_relevance_rules(m, generic=True) as cov:
        assert torch.equal(m(ids).logits, ref)
    assert "model.layers.0.mlp" in cov.skipped and "model.layers.1.mlp" in cov.installed


@pytest.mark.parametrize("kind", ["clone", "scaled", "leaf", "recomputed", "recomputed_plus_output"])
def test_hook_replacing_a_rule_modules_output(kind):
    """Reported: Captum's layer methods (their hook returns ``output.clone()``) were refused on
    a norm. A replacement that is a function of the rule's output, or a new leaf, keeps the
    rule on every path to the input and is taken; one whose gradient reaches the input by
    another path is refused."""
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    norm = m.model.layers[1].input_layernorm

    def rms(mod, h):
        return mod.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon)

    seen = {}
    hooks = {
        "clone": lambda mod, a, out: out.clone(),
        "scaled": lambda mod, a, out: out * 2.0,
        "leaf": lambda mod, a, out: seen.setdefault("leaf", out.detach().clone().requires_grad_()),
        "recomputed": lambda mod, a, out: rms(mod, a[0]),
        "recomputed_plus_output": lambda mod, a, out: out + 0 * rms(mod, a[0]),
    }
    emb = m.get_input_embeddings()(ids).detach().requires_grad_()
    with pyattr.use_relevance_rules(m):
        want_out = m(inputs_embeds=emb).logits[0, -1, 5]
        want_out.backward()
        want = emb.grad.clone()
        emb.grad = None
        h = norm.register_forward_hook(hooks[kind])
        try:
            if kind.startswith("recomputed"):
                with pytest.raises(pyattr.RelevanceRuleConflictError, match=r"'model.layers.1.input_layernorm'.*around"):
                    m(inputs_embeds=emb)
                return
            y = m(inputs_embeds=emb).logits[0, -1, 5]
            y.backward()
        finally:
            h.remove()
    if kind == "clone":
        torch.testing.assert_close(emb.grad, want, rtol=0, atol=0)
    elif kind == "leaf":  # the upstream blocks get their gradient around the norm's output no more
        assert seen["leaf"].grad is not None and seen["leaf"].grad.abs().sum() > 0
    else:
        assert emb.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["from_what_the_input_was_made_of", "pre_hook_copy", "mlp_recomputed"])
def test_hook_replacements_made_from_earlier_tensors_are_refused(kind):
    """Reported: a replacement recomputed from tensors the input was made of (captured by other
    hooks), or from the input before a pre-hook's copy, passed the check (it only stopped at the
    input's own node); and the gated MLP's output was not checked at all."""
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    layer = m.model.layers[0]
    norm = layer.post_attention_layernorm
    kept, handles = {}, []

    def rms(mod, h):
        return mod.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon)

    if kind == "from_what_the_input_was_made_of":
        handles.append(layer.self_attn.register_forward_hook(lambda mod, a, out: kept.__setitem__("attn", out[0])))
        handles.append(layer.input_layernorm.register_forward_pre_hook(lambda mod, a: kept.__setitem__("res", a[0])))
        handles.append(norm.register_forward_hook(lambda mod, a, out: rms(mod, kept["res"] + kept["attn"])))
        path = "model.layers.0.post_attention_layernorm"
    elif kind == "pre_hook_copy":
        handles.append(norm.register_forward_pre_hook(lambda mod, a: (kept.__setitem__("x", a[0]), (a[0] * 1.0,))[1]))
        handles.append(norm.register_forward_hook(lambda mod, a, out: rms(mod, kept["x"])))
        path = "model.layers.0.post_attention_layernorm"
    else:
        mlp = layer.mlp
        handles.append(mlp.register_forward_hook(
            lambda mod, a, out: mod.down_proj(mod.act_fn(mod.gate_proj(a[0])) * mod.up_proj(a[0]))))
        path = "model.layers.0.mlp"
    try:
        ref = m(ids).logits
        with pyattr.use_relevance_rules(m):
            with pytest.raises(pyattr.RelevanceRuleConflictError, match=rf"{re.escape(repr(path))} replaced the output"):
                m(ids)
        torch.testing.assert_close(m(ids).logits, ref, rtol=0, atol=0)  # outside the scope: as before
    finally:
        for h in handles:
            h.remove()
