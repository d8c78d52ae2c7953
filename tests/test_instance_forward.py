"""A forward replaced on the instance (issue 45 §3): ablation and steering tools, and kernel
libraries, set one module's ``forward`` on the instance. pyattr reads what a module computes
from the forward it runs now (the instance's), so an instance patch is never silently
undone: a rebuilt form it no longer has is refused, an activation it masks keeps its mask
(the Identity-rule of what it computes), a norm is observed to compute its formula. The
oracles are the patched model's own forward, conservation, and the same ablation written
into the weights."""

import types

import pytest
import torch
import torch.nn.functional as F

import pyattr
from models import VOCAB, tiny_causal_lm
from pyattr import RelevanceRules, RelevanceRuleUnsupportedError, use_relevance_rules

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
MASK = (torch.arange(48) % 2 == 0).double()  # 24 of the 48 MLP neurons ablated


def _llama():
    return tiny_causal_lm("llama", dtype=torch.float64)


def _ablated_forward(mlp):
    def forward(x):
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x) * MASK)

    return forward


def test_an_mlp_forward_replaced_on_the_instance_is_refused_never_undone():
    m = _llama()
    mlp = m.model.layers[0].mlp
    mlp.forward = _ablated_forward(mlp)
    with torch.no_grad():
        own = m(IDS).logits[:, -1, 5]
    with pytest.raises(RelevanceRuleUnsupportedError, match=r"'model\.layers\.0\.mlp': the forward replaced on this "
                       r"LlamaMLP instance \(.*_ablated_forward\.<locals>\.forward\) is not the plain"):
        pyattr.relevance(m, IDS, target=5)
    # rules that leave the MLP alone explain the patched model: its own logit, conserved
    r = pyattr.relevance(m, IDS, target=5, rules=RelevanceRules(normalization=True, attention=True))
    torch.testing.assert_close(r.target, own, rtol=0, atol=1e-12)
    assert "forward" in mlp.__dict__  # the instance keeps its forward after the scopes


def test_the_class_forward_rebound_on_the_instance_is_the_plain_form():
    m = _llama()
    ref = pyattr.relevance(m, IDS, target=5)
    for layer in m.model.layers:
        layer.mlp.forward = types.MethodType(type(layer.mlp).forward, layer.mlp)
    got = pyattr.relevance(m, IDS, target=5)
    assert torch.equal(got.relevance, ref.relevance)


def test_an_activation_masked_on_the_instance_keeps_its_mask_in_the_rules():
    """act_fn.forward masks 24 neurons: the gated rule computes act(gate)·up with that
    forward and the Identity-rule of what it computes (φ = act(x)/x, 0 where masked); the
    same ablation written into down_proj's weight columns is the oracle."""
    patched, edited = _llama(), _llama()
    for lp, le in zip(patched.model.layers, edited.model.layers):
        act = lp.mlp.act_fn
        act.forward = lambda x: F.silu(x) * MASK
        with torch.no_grad():
            le.mlp.down_proj.weight.mul_(MASK)
    with torch.no_grad():
        torch.testing.assert_close(patched(IDS).logits, edited(IDS).logits, rtol=1e-12, atol=1e-12)
    got = pyattr.relevance(patched, IDS, target=5)
    want = pyattr.relevance(edited, IDS, target=5)
    torch.testing.assert_close(got.target, want.target, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.relevance, want.relevance, rtol=1e-5, atol=1e-6)
    assert float(got.conservation_delta.abs().max()) < 1e-5 * float(got.target.abs().max())
    assert "silu" not in got.coverage.reasons.get("model.layers.0.mlp", "")


def test_a_norm_forward_replaced_on_the_instance_is_observed():
    m = _llama()
    norm = m.model.layers[1].post_attention_layernorm
    ref = pyattr.relevance(m, IDS, target=5)

    def same(x):  # what a kernel library installs: the same RMSNorm, its own code
        x32 = x.to(torch.float32) if x.dtype != torch.float64 else x
        return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)

    norm.forward = same
    got = pyattr.relevance(m, IDS, target=5)
    torch.testing.assert_close(got.relevance, ref.relevance, rtol=1e-5, atol=1e-6)
    norm.forward = lambda x: x * 2.0  # not a norm: the LN-rule's backward would be another gradient
    with pytest.raises(RelevanceRuleUnsupportedError, match=r"'model\.layers\.1\.post_attention_layernorm': the forward "
                       r"replaced on this LlamaRMSNorm instance .* does not compute the rms norm"):
        pyattr.relevance(m, IDS, target=5)


def test_generic_an_inline_quick_gelu_gate_is_not_taken_for_silu():
    """A renamed twin under generic=True with one MLP's forward replaced by an inline
    QuickGELU gate: the rules follow what it computes (the functional rules' gate and
    Half-rule), not act_fn's SiLU. Oracle: the same MLP with a QuickGELU act_fn module on
    the mapped model."""
    from transformers.activations import QuickGELUActivation

    twin, mapped = _llama(), _llama()
    twin.config.model_type = "llama_twin"
    mlp = twin.model.layers[0].mlp

    def inline(x):
        g = mlp.gate_proj(x)
        return mlp.down_proj(g * torch.sigmoid(1.702 * g) * mlp.up_proj(x))

    mlp.forward = inline
    mapped.model.layers[0].mlp.act_fn = QuickGELUActivation()
    with torch.no_grad():
        torch.testing.assert_close(twin(IDS).logits, mapped(IDS).logits, rtol=1e-12, atol=1e-12)
    got = pyattr.relevance(twin, IDS, target=5, generic=True)
    want = pyattr.relevance(mapped, IDS, target=5)
    torch.testing.assert_close(got.target, want.target, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.relevance, want.relevance, rtol=1e-5, atol=1e-6)


def test_an_activation_class_named_like_a_known_one_is_observed():
    """transformers' activation classes are known by name; one that computes something
    else under that name is a custom activation (its own output gives φ), not the named kind."""
    from pyattr.activations import _kind_of_module

    class SiLUActivation(torch.nn.Module):  # the name of a known kind, GELU's values
        def forward(self, x):
            return F.gelu(x)

    assert _kind_of_module(SiLUActivation()) is None
    m = _llama()
    for layer in m.model.layers:
        layer.mlp.act_fn = SiLUActivation()
    r = pyattr.relevance(m, IDS, target=5)
    assert float(r.conservation_delta.abs().max()) < 1e-5 * float(r.target.abs().max())
    gelu = _llama()
    for layer in gelu.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    torch.testing.assert_close(r.relevance, pyattr.relevance(gelu, IDS, target=5).relevance, rtol=1e-5, atol=1e-6)


def test_a_rebuilt_forward_that_differs_from_the_modules_own_is_refused(monkeypatch):
    """The first call of a scope runs the rebuilt forward and the module's own on two rows;
    they must agree bit for bit (here the rebuild is made off by one part in 1e7)."""
    import pyattr.integration.forwards as fw
    import pyattr.integration.gated_plan as planner

    real = fw.gated_forward

    def off(kind, path, names=fw._GATED_NAMES):
        make = real(kind, path, names)

        def make_off(mlp, state):
            f = make(mlp, state)
            return lambda x: f(x) * (1 + 1e-7)

        return make_off

    monkeypatch.setattr(planner, "gated_forward", off)
    m = _llama()
    with pytest.raises(RelevanceRuleUnsupportedError, match=r"'model\.layers\.0\.mlp': the forward pyattr rebuilt to "
                       r"carry the rules does not compute what LlamaMLP\.forward computes \(max \|difference\| "):
        with use_relevance_rules(m):
            m(IDS)
    for mod in m.modules():
        assert "forward" not in mod.__dict__  # the scope undid itself


def test_the_check_leaves_hooks_and_captures_alone():
    """The check's two extra rows reach no hook of the MLP's submodules: a capture records
    the one call the model made."""
    m = _llama()
    with use_relevance_rules(m), pyattr.capture(m, ["model.layers.0.mlp.gate_proj"]) as cap:
        m(IDS).logits[:, -1, 5].sum().backward()
    assert len(cap["model.layers.0.mlp.gate_proj"].outputs) == 1
    assert cap["model.layers.0.mlp.gate_proj"].output.shape == (2, 9, 48)


def test_a_norm_forward_patched_onto_the_class_is_observed(monkeypatch):
    """Kernel libraries patch the class (``LlamaRMSNorm.forward = ...``): a forward that is
    not the class body's own is observed on probe rows like an instance's; the same formula
    passes, another one is refused (it answered 172 % off before)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = _llama()
    ref = pyattr.relevance(m, IDS, target=5)

    def same(self, x):  # the formula, written elsewhere
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(LlamaRMSNorm, "forward", same)
    torch.testing.assert_close(pyattr.relevance(m, IDS, target=5).relevance, ref.relevance, rtol=1e-5, atol=1e-6)

    def tanh_gain(self, x):
        return torch.tanh(self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(LlamaRMSNorm, "forward", tanh_gain)
    with pytest.raises(RelevanceRuleUnsupportedError, match=r"'model\.layers\.0\.input_layernorm': LlamaRMSNorm\.forward "
                       r"\(.*tanh_gain, not written in the class body: patched onto the class\) does not compute the "
                       r"rms norm"):
        pyattr.relevance(m, IDS, target=5)


def test_an_activation_class_patched_after_a_first_call_is_observed_again(monkeypatch):
    """The per-class observation of an activation is keyed by its forward too: SiLU's class
    patched to GELU after a first call is a custom activation (oracle: nn.GELU modules)."""
    m = _llama()
    pyattr.relevance(m, IDS, target=5)  # observes the activation class once
    act_cls = type(m.model.layers[0].mlp.act_fn)
    monkeypatch.setattr(act_cls, "forward", lambda self, x: F.gelu(x))
    monkeypatch.setattr(torch.nn.SiLU, "forward", lambda self, x: F.gelu(x))  # torch's class too
    got = pyattr.relevance(m, IDS, target=5)
    gelu = _llama()
    for layer in gelu.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    torch.testing.assert_close(got.relevance, pyattr.relevance(gelu, IDS, target=5).relevance, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["model.layers.0.self_attn.o_proj", "lm_head", "model.layers.1"])
def test_a_replaced_forward_the_rule_map_does_not_cover_is_refused(where):
    """A mapped model's rule map is written for the architecture's own forwards: a forward
    replaced on the instance elsewhere (a tanh in o_proj, an exp in the head, a whole
    decoder layer) is refused by name where the Identity- or Half-rule is on (it answered
    34-287 % off before); with them off it keeps its native gradient, as asked."""
    m = _llama()
    mod = m.get_submodule(where)
    own = mod.forward
    if where == "model.layers.1":
        mod.forward = lambda *a, **k: own(*a, **k)
    else:
        mod.forward = lambda x: torch.tanh(own(x))
    with pytest.raises(RelevanceRuleUnsupportedError, match=rf"'{where}': the forward replaced on this \w+ instance "
                       r"\(.*<lambda>\) is not the llama forward the rule map is written for"):
        pyattr.relevance(m, IDS, target=5)
    r = pyattr.relevance(m, IDS, target=5, rules=RelevanceRules(normalization=True, attention=True))
    with torch.no_grad():
        torch.testing.assert_close(r.target, m(IDS).logits[:, -1, 5], rtol=0, atol=1e-12)


def test_a_forward_replaced_inside_an_open_scope_is_refused_and_kept():
    """A forward set on a rule-carrying module while the scope is open would run without its
    rule: the next forward raises naming the module, and the scope's exit keeps the user's
    forward (it is theirs) instead of putting the saved one back over it."""
    m = _llama()
    mlp = m.model.layers[0].mlp
    with use_relevance_rules(m):
        mlp.forward = _ablated_forward(mlp)
        with pytest.raises(pyattr.RelevanceRuleConflictError,
                           match=r"'model\.layers\.0\.mlp': its forward was replaced on the instance while a "
                                 r"use_relevance_rules scope carrying its \w+ rule was open"):
            m(IDS)
    assert mlp.forward.__name__ == "forward" and "_ablated_forward" in mlp.forward.__qualname__
    fresh = _llama()
    fresh.model.layers[0].mlp.forward = _ablated_forward(fresh.model.layers[0].mlp)
    with torch.no_grad():
        assert torch.equal(m(IDS).logits, fresh(IDS).logits)
        assert not torch.equal(m(IDS).logits, _llama()(IDS).logits)


def test_the_check_of_a_rebuilt_forward_runs_once_per_module_state(monkeypatch):
    """A check that passed holds in later scopes (on a 1B model the two-row forwards of the
    16 MLPs cost 0.2 s per call); a module whose submodules, forward or attributes changed
    is checked again, and a module freed is not kept alive by the record."""
    import gc
    import weakref

    import pyattr.integration.forwards as fw

    checks = []
    real = fw._submodule_hooks_held

    def counting(module):
        checks.append(module)
        return real(module)

    monkeypatch.setattr(fw, "_submodule_hooks_held", counting)
    m = _llama()
    first = pyattr.relevance(m, IDS, target=5)
    assert len(checks) == len(m.model.layers)  # one per MLP
    again = pyattr.relevance(m, IDS, target=5)
    assert len(checks) == len(m.model.layers)  # held
    torch.testing.assert_close(again.relevance, first.relevance, rtol=0, atol=0)
    m.model.layers[1].mlp.act_fn = torch.nn.SiLU()  # another module in the same place
    pyattr.relevance(m, IDS, target=5)
    assert checks[-1] is m.model.layers[1].mlp and len(checks) == len(m.model.layers) + 1
    m.model.layers[0].mlp.config_note = "changed"  # any other attribute
    pyattr.relevance(m, IDS, target=5)
    assert checks[-1] is m.model.layers[0].mlp and len(checks) == len(m.model.layers) + 2
    ref = weakref.ref(m.model.layers[0].mlp)
    del m, checks[:]
    gc.collect()
    assert ref() is None
