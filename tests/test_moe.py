"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE with a shared expert and a dense layer,
Qwen3-MoE): the routing rule, the gated rules on the experts' 3-D weights through the
fused op, and the bar every architecture meets (bit-identical forwards, coverage by
position, conservation, scope hygiene)."""

import pytest
import torch

import pyattr
from models import VOCAB, _cfg, tiny_causal_lm
from pyattr.integration.install import state_of

pytestmark = pytest.mark.usefixtures("one_thread")

MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]
ALL = pyattr.RelevanceRules.all()


def _ids(batch=3, seq=13, seed=0):
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _moe(arch, impl="grouped_mm", dtype=torch.float32, attn="eager"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(_cfg(arch, attn), attn_implementation=attn, experts_implementation=impl)
    return m.to(dtype).eval()


# bit-identical forwards with float32 eager / sdpa, both attention modes:
# tests/test_architectures_more.py::test_forward_bit_identical


@pytest.mark.parametrize("arch", MOE)
def test_forward_bit_identical_bfloat16(arch):
    m = tiny_causal_lm(arch, dtype=torch.bfloat16)
    ids = _ids(1, 9)
    ref = m(ids).logits
    with pyattr.use_relevance_rules(m):
        assert torch.equal(m(ids).logits, ref)


def _expected(arch):
    out = ["model.norm"]
    for i in range(2):
        L = f"model.layers.{i}"
        out += [f"{L}.input_layernorm", f"{L}.post_attention_layernorm", f"{L}.self_attn.q_proj", f"{L}.self_attn.k_proj"]
        if arch == "qwen2_moe" and i == 1:  # mlp_only_layers=[1]: a dense gated MLP
            out.append(f"{L}.mlp")
            continue
        out += [f"{L}.mlp.gate", f"{L}.mlp.experts"]
        if arch == "qwen2_moe":
            out += [f"{L}.mlp.shared_expert", f"{L}.mlp.shared_expert_gate"]
    return sorted(out)


@pytest.mark.parametrize("arch", MOE)
def test_coverage_paths_exact(arch):
    m = tiny_causal_lm(arch)
    with pyattr.use_relevance_rules(m) as cov:
        assert sorted(cov.installed) == _expected(arch)
        routing = ["model.layers.0.mlp.gate"] + (["model.layers.0.mlp.shared_expert_gate"] if arch == "qwen2_moe"
                                                 else ["model.layers.1.mlp.gate"])
        assert sorted(cov.by_kind["routing"]) == sorted(routing)
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(routing=False)) as cov:
        assert "routing" not in cov.by_kind
        assert cov.reasons["model.layers.0.mlp.gate"] == "routing rule off"


@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_conservation_float32(arch, attn):
    m = tiny_causal_lm(arch, attn)
    r = pyattr.relevance(m, _ids())
    assert (r.target.abs() > 1e-3).all()
    assert (r.conservation_delta.abs() <= 1e-4 * r.target.abs()).all(), (r.target, r.conservation_delta)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_conservation_float64_batched_experts(arch):
    """float64 through experts_implementation="batched_mm" (CPU grouped_mm has no float64):
    Σ relevance = target up to the float32 rounding of the relevance fields."""
    m = _moe(arch, "batched_mm", torch.float64)
    r = pyattr.relevance(m, _ids())
    assert (r.conservation_delta.abs() <= 1e-6 * r.target.abs()).all(), r.conservation_delta


@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("rules", ["all", "attnlrp"])
def test_generic_on_a_renamed_twin_equals_the_map(arch, rules):
    """generic=True on the same model under a model type the table does not map (a renamed
    twin): the router's outputs held constant, the experts' gate through the fused op, a
    shared expert found as any gated MLP — equal to the mapped plan's relevance, itself
    checked against the oracles above (float64, batched experts)."""
    import copy

    m = _moe(arch, "batched_mm", torch.float64)
    twin = copy.deepcopy(m)
    twin.config.model_type = f"{arch}_renamed"
    ids = _ids(2, 9)
    want = pyattr.relevance(m, ids, rules=rules)
    have = pyattr.relevance(twin, ids, rules=rules, generic=True)
    assert torch.allclose(have.relevance.double(), want.relevance.double(), rtol=1e-5, atol=1e-7 * float(
        want.relevance.abs().max()))
    with pyattr.use_relevance_rules(twin, generic=True) as cov:
        assert "model.layers.0.mlp.gate" in cov.by_kind["routing"]
        assert "model.layers.0.mlp.experts" in cov.by_kind["activation"]
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError, match="no rule map"):
        pyattr.relevance(twin, ids)


@pytest.mark.parametrize("arch", MOE)
def test_each_rule_is_load_bearing(arch):
    """Without the routing rule, gradient also flows through the routing weights into the
    router and relevance is no longer conserved; the same without the gated rules."""
    m = tiny_causal_lm(arch)
    ids = _ids()
    for rules in (pyattr.RelevanceRules.all(routing=False), pyattr.RelevanceRules(True, False, False, True, "frozen")):
        r = pyattr.relevance(m, ids, rules=rules)
        assert (r.conservation_delta.abs() > 1e-3 * r.target.abs()).any(), rules


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_frozen_routing_stops_the_router_gradient_only(arch):
    """Under the routing rule no gradient reaches the router's weight (nor the shared-expert
    gate's); the experts' weights still get theirs, equal to the plain ones when only the
    routing rule is on (the routing weights are the same numbers, held constant)."""
    m = tiny_causal_lm(arch)
    # the last block with a router: no later router whose rule would change its incoming gradient
    block = m.model.layers[1 if arch == "mixtral" else 0].mlp
    ws = [block.gate.weight, block.experts.down_proj] + ([block.shared_expert_gate.weight] if arch == "qwen2_moe" else [])
    ids = _ids(2, 7)

    def grads(rules):
        with pyattr.use_relevance_rules(m, rules):
            gs = torch.autograd.grad(m(ids).logits[:, -1, 5].sum(), ws, allow_unused=True)
        return [torch.zeros_like(w) if g is None else g for g, w in zip(gs, ws)]

    plain = grads(pyattr.RelevanceRules.none())
    frozen = grads(pyattr.RelevanceRules(routing=True))
    assert plain[0].abs().max() > 0 and torch.equal(frozen[0], torch.zeros_like(frozen[0]))
    torch.testing.assert_close(frozen[1], plain[1])
    if arch == "qwen2_moe":
        assert plain[2].abs().max() > 0 and torch.equal(frozen[2], torch.zeros_like(frozen[2]))


def test_eager_experts_and_custom_gates_are_refused():
    m = _moe("mixtral", "eager")
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError,
                       match=r"'model.layers.0.mlp.experts': experts_implementation 'eager': the eager one computes "
                             r"act\(gate\)·up inline"):
        with pyattr.use_relevance_rules(m):
            pass
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules(normalization=True, routing=True)) as cov:
        assert "model.layers.0.mlp.gate" in cov.installed  # the gated rules off: nothing to refuse
    m = tiny_causal_lm("mixtral")
    experts = m.model.layers[1].mlp.experts

    class Gated(type(experts)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate) * up * 2

    experts.__class__ = Gated
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError, match=r"'model.layers.1.mlp.experts': Gated has its own _apply_gate"):
        with pyattr.use_relevance_rules(m):
            pass


def test_scope_hygiene_and_routing_values():
    m, other = tiny_causal_lm("qwen2_moe"), tiny_causal_lm("qwen2_moe")
    ids = _ids(2, 7)
    ref = other(ids).logits
    with pyattr.use_relevance_rules(m):
        m(ids)
        assert all(state_of(mod) is None for mod in other.modules())
        assert "_apply_gate" not in m.model.layers[0].mlp.experts.__dict__  # only while the experts run
    for mod in m.modules():
        assert "forward" not in mod.__dict__ and state_of(mod) is None and "_apply_gate" not in mod.__dict__
    assert torch.equal(m(ids).logits, ref)
    with pytest.raises(ValueError, match=r"RelevanceRules.routing must be False, True or 'frozen', got 'half'"):
        pyattr.RelevanceRules(routing="half")
    assert pyattr.RelevanceRules.all().routing == "frozen" and pyattr.RelevanceRules(routing=True).routing == "frozen"
    assert pyattr.RelevanceRules(routing=True).any() and not pyattr.RelevanceRules().any()


@pytest.mark.parametrize("arch", MOE)
def test_layer_relevance_and_patching_nodes(arch):
    """Residual and sublayer nodes are found; the residual stream conserves at every block
    input; 'neurons' is refused with a reason (hidden units belong to experts)."""
    from pyattr import patching as P
    from pyattr import targets as T

    m = tiny_causal_lm(arch)
    ids = _ids(2, 9)
    res = pyattr.layer_relevance(m, ids, layers=["residual", "mlp"])
    assert len(res.paths) == 5
    for p in ("model.layers.0", "model.layers.1", "model.norm"):
        assert (res[p].conservation_delta.abs() <= 1e-4 * res.target.abs()).all(), p
    for call in (lambda: pyattr.layer_relevance(m, ids, layers="neurons"),
                 lambda: P.attribution_patching(m, ids, _ids(2, 9, seed=1), T.Logit(3), nodes="neurons")):
        with pytest.raises(ValueError, match=r"is a mixture-of-experts model; its MLP hidden units belong to each expert"):
            call()
    est = P.attribution_patching(m, ids, _ids(2, 9, seed=1), T.Logit(3), nodes=("residual", "mlp", "heads"))
    assert est["heads"].shape == (2, 2, 9, 4)
    same = P.activation_patching(m, ids, ids.clone(), T.Logit(3), nodes=("residual", "mlp"), progress=False)
    assert torch.equal(same["mlp"], torch.zeros_like(same["mlp"]))


@pytest.mark.parametrize("arch", MOE)
def test_one_cli_run(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from conftest import run_cli
    from models import minilm

    tok = minilm()[0]
    cfg = _cfg(arch, "sdpa")
    cfg.vocab_size = len(tok)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    r = run_cli("explain", "--model", tmp_path, "--text", "the cat sat on the mat", "--json")
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout)
    assert out["rules"]["routing"] == "frozen"
    assert abs(out["conservation_delta"]) <= 1e-4 * abs(out["target"])
    r = run_cli("explain", "--model", tmp_path, "--text", "the cat sat on the mat", "--json", "--no-routing-rule")
    assert json.loads(r.stdout)["rules"]["routing"] is False


def test_modified_blocks_and_experts_are_refused():
    """Reported: a block recomputing its routing weights from the router logits, or experts
    with a forward of their own (never calling _apply_gate), were reported installed while
    the rules never applied (|delta|/|target| 0.06 and 0.44)."""
    from transformers.models.mixtral import modeling_mixtral as MM

    class OwnSoftmax(MM.MixtralSparseMoeBlock):
        def forward(self, hidden_states):
            b, s, h = hidden_states.shape
            x = hidden_states.view(-1, h)
            logits, _, idx = self.gate(x)
            w = torch.softmax(logits, -1).gather(-1, idx)
            return self.experts(x, idx, w / w.sum(-1, keepdim=True)).reshape(b, s, h)

    class OwnExperts(MM.MixtralExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return super().forward(hidden_states, top_k_index, top_k_weights) * 1.0

    m = tiny_causal_lm("mixtral")
    m.model.layers[0].mlp.__class__ = OwnSoftmax
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError,
                       match=r"'model.layers.0.mlp': OwnSoftmax.forward is not the MixtralSparseMoeBlock forward"):
        pyattr.relevance(m, _ids())
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules()):  # nothing to place: fine
        pass
    m = tiny_causal_lm("mixtral")
    m.model.layers[1].mlp.experts.__class__ = OwnExperts
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError,
                       match=r"'model.layers.1.mlp.experts': OwnExperts.forward is its own"):
        pyattr.relevance(m, _ids())
