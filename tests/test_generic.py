"""``generic=True``: structural rule installation on architectures without a rule map.

Named here: Cohere (its own bias-free ``CohereLayerNorm``, parallel attention and MLP),
OLMo (a parameter-free ``OlmoLayerNorm``), Arcee (a non-gated ReLU² MLP), Granite and
OLMo 3 (q/k norms inside attention). Each: bit-identical forward, conservation in float64
with all rules, and a coverage report that names what was found and what was not.
"""

import pytest
import torch
from torch import nn

import pyattr
from models import UNMAPPED_COMMON
from pyattr.architectures import ARCHITECTURES

pytestmark = pytest.mark.usefixtures("one_thread")

def _model(name, dtype=torch.float64, **extra):
    from models import tiny_unmapped

    return tiny_unmapped(name, dtype, **extra)


UNMAPPED = ["CohereConfig", "OlmoConfig", "ArceeConfig", "GraniteConfig", "Olmo3Config"]


def _ids():
    return torch.randint(3, 96, (3, 11), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", UNMAPPED)
def test_unmapped_architecture_forward_and_conservation(name):
    m = _model(name)
    assert m.config.model_type not in ARCHITECTURES
    ids = _ids()
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError, match=f"model type {m.config.model_type!r}"):
        pyattr.relevance(m, ids)
    ref = m(ids).logits
    with pyattr.use_relevance_rules(m, generic=True):
        assert torch.equal(m(ids).logits, ref)
    r = pyattr.relevance(m, ids, generic=True)
    assert (r.target.abs() > 1e-3).all()
    assert (r.conservation_delta.abs() <= 1e-4 * r.target.abs()).all(), (r.target, r.conservation_delta)
    # and the rules carry it: the plain gradient does not conserve
    plain = pyattr.relevance(m, ids, rules=pyattr.RelevanceRules())
    assert (plain.conservation_delta.abs() > 1e-3 * plain.target.abs()).any()


def test_norms_of_unknown_classes_are_recognised_by_what_they_compute():
    """CohereLayerNorm (weight, no bias, its own formula) and OlmoLayerNorm (no parameters)
    get the LN-rule beside their own forward; the bias-free weight keeps its gradient."""
    from pyattr.integration.structural import classify_norm

    cohere, olmo = _model("CohereConfig"), _model("OlmoConfig")
    kind, (w, offset) = classify_norm(cohere.model.layers[0].input_layernorm, 32)
    assert kind == "layer_norm" and w is cohere.model.layers[0].input_layernorm.weight and offset == 0.0
    kind, (w, offset) = classify_norm(olmo.model.norm, 32)  # parameter-free: its fitted scale, ones
    assert kind == "layer_norm" and w.dim() == 0 and abs(float(w) - 1.0) < 1e-6 and offset == 0.0
    with pyattr.use_relevance_rules(cohere, generic=True) as cov:
        assert "model.layers.0.input_layernorm" in cov.by_kind["normalization"]
        x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
        norm = cohere.model.layers[0].input_layernorm
        y = norm(x)
        dy = torch.randn_like(y)
        gx, gw = torch.autograd.grad(y, [x, norm.weight], dy)
    # oracle: (x − μ)/σ·w with σ constant, in float64
    c = x.detach() - x.detach().mean(-1, keepdim=True)
    sigma = torch.sqrt(c.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    g = dy * norm.weight.detach() / sigma
    torch.testing.assert_close(gx, g - g.mean(-1, keepdim=True))
    torch.testing.assert_close(gw, (dy * c / sigma).sum((0, 1)))


def test_qk_norms_inside_attention_are_never_residual_norms():
    """Cohere with use_qk_norm: its q/k LayerNorms sit inside attention and are left native,
    with the reason; the residual-stream norms of the same class are mounted."""
    m = _model("CohereConfig", use_qk_norm=True)
    with pyattr.use_relevance_rules(m, generic=True) as cov:
        for n in ("q_norm", "k_norm"):
            p = f"model.layers.0.self_attn.{n}"
            assert p in cov.skipped and p not in cov.installed
            assert cov.reasons[p].startswith("norm inside attention (a q/k norm)")
        assert "model.layers.1.input_layernorm" in cov.installed


class _MixingAct(nn.Module):
    """An activation-like module with a parameter that mixes features (not element-wise)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return x + self.w * (torch.exp(0.3 * x.mean(-1, keepdim=True)) - 1.0)  # exp: no rule covers it


def test_what_cannot_be_classified_is_reported():
    """Apertus' xIELU activation has parameters but acts element by element (probed): the
    Identity-rule's general form φ = act(x)/x, and it conserves. An activation-like module
    with a parameter that mixes features has no known form: left native with the reason,
    and since the probe measures relevance lost there, generic=True refuses, naming the
    module, its class and the reason; generic="partial" runs and warns."""
    m = _model("ApertusConfig")
    with pyattr.use_relevance_rules(m, generic=True) as cov:
        assert "model.layers.0.mlp.act_fn" in cov.by_kind["activation"]
    r = pyattr.relevance(m, _ids(), generic=True)
    assert (r.conservation_delta.abs() <= 1e-4 * r.target.abs()).all()
    for layer in m.model.layers:
        layer.mlp.act_fn = _MixingAct()
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError,
                       match=r"'model.layers.0.mlp.act_fn' \(_MixingAct\) loses [-0-9.e]+: generic: "
                             r"activation-like module with parameters .* Pass generic='partial'"):
        with pyattr.use_relevance_rules(m, generic=True):
            pass
    with pytest.warns(pyattr.PartialRelevanceWarning, match=r"'model.layers.1.mlp.act_fn' \(_MixingAct\)") as w:
        with pyattr.use_relevance_rules(m, generic="partial") as cov:
            p = "model.layers.0.mlp.act_fn"
            assert p in cov.skipped and p not in cov.installed
            assert cov.reasons[p].startswith("generic: activation-like module with parameters")
    assert w[0].filename == __file__  # the warning points at the caller's line


def test_rms_norm_offset_is_probed_not_guessed_from_the_class_name():
    """Reported: a *RMSNorm class computing x/r·(1 + w) without "Gemma" in its name (as
    Qwen3-Next's) got offset 0 and |delta|/|target| = 0.99, with nothing reported."""
    from torch import nn

    class OffsetRMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.randn(dim) * 0.3)

        def forward(self, x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).type_as(x)

    m = _model("GraniteConfig", dtype=torch.float32)
    for mod in list(m.modules()):
        for cn, ch in list(mod.named_children()):
            if type(ch).__name__.endswith("RMSNorm"):
                setattr(mod, cn, OffsetRMSNorm(32))
    ids = _ids()
    with pyattr.use_relevance_rules(m, generic=True) as cov:
        assert "model.norm" in cov.by_kind["normalization"]
    r = pyattr.relevance(m, ids, generic=True)
    assert (r.conservation_delta.abs() <= 1e-4 * r.target.abs()).all(), r.conservation_delta


def test_reported_reasons_are_true():
    """GLM's fused gate_up MLP (Phi-3's form) gets the gated rules and conserves; a gated MLP
    with an extra step (Seed-OSS: dropout) and a mixture-of-experts block (OLMoE) are
    named as left native with why, not as having "no multiplicative gate"."""
    base = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, head_dim=8)
    glm = _model("GlmConfig", dtype=torch.float32, **base)
    r = pyattr.relevance(glm, _ids(), generic=True)
    assert (r.conservation_delta.abs() <= 1e-4 * r.target.abs()).all()
    with pyattr.use_relevance_rules(glm, generic=True) as cov:
        assert "model.layers.0.mlp" in cov.by_kind["multiplicative_gate"]
    seed = _model("SeedOssConfig", dtype=torch.float32, attention_bias=False, **base)
    with pyattr.use_relevance_rules(seed, generic=True) as cov:
        assert cov.reasons["model.layers.0.mlp"].startswith("generic: multiplies its activation 'act_fn' by another tensor")
    import transformers as T

    torch.manual_seed(0)
    cfg = T.OlmoeConfig(**{**UNMAPPED_COMMON, "intermediate_size": 24}, num_experts=4, num_experts_per_tok=2, **base)
    # eager experts compute act(gate)·up inline, where no rule reaches: left native, refused
    olmoe = T.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").eval()
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError,
                       match=r"'model.layers.0.mlp' \(OlmoeSparseMoeBlock\) loses [-0-9.e]+: generic: mixture-of-experts "
                             r"block whose router or experts have no form .*experts_implementation 'eager'"):
        pyattr.relevance(olmoe, _ids(), generic=True)
    with pytest.warns(pyattr.PartialRelevanceWarning, match="mixture-of-experts block"):
        with pyattr.use_relevance_rules(olmoe, generic="partial") as cov:
            assert cov.reasons["model.layers.0.mlp"].startswith("generic: mixture-of-experts block whose router")
        assert not any(p.startswith("model.layers.0.mlp.") for p in cov.installed)
    # transformers' dispatched experts: the routing and gated rules, and it conserves
    olmoe = T.AutoModelForCausalLM.from_config(cfg, experts_implementation="batched_mm").eval()
    with pyattr.use_relevance_rules(olmoe, generic=True) as cov:
        assert "model.layers.0.mlp.gate" in cov.by_kind["routing"]
        assert "model.layers.0.mlp.experts" in cov.by_kind["multiplicative_gate"]
    r = pyattr.relevance(olmoe, _ids(), generic=True)
    assert (r.conservation_delta.abs() <= 1e-4 * r.target.abs()).all()
