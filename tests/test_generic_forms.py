"""``generic=True`` on the forms issue 32 found wrong or crashing: each on a minimal module
and on a real transformers class built tiny (float64, seeded, biases zeroed), asserting
values (conservation Σ x·∂ = target in float64) or the exact refusal.

- norms inside attention told apart by what they normalise (ALBERT's post-LN, DiffLlama's
  group norm, Gemma 4's ``v_norm``, BitNet's ``attn_sub_norm`` get the LN-rule; q/k norms
  by name stay q/k norms);
- L2 / parameter-free norms with their true scale (Dory), norms of another width;
- q/k/v projections that are not plain linear maps (I-BERT's QuantLinear) refused;
- several residual streams (DeepSeek-V4's hyper-connections; a 4-D entry) refused;
- accurate reasons: RoBERTa-PreLayerNorm (a container class is not a norm), Reformer (its
  blocks run inside a custom autograd Function);
- the entry honoured as discovered (GIT), ``position_ids`` only where the forward names it.
"""

import pytest
import torch
from torch import nn

import pyattr
import pyattr.architectures as A
from pyattr.architectures.blocks import is_norm_like, is_qk_norm
from pyattr.architectures.discover import discover
from pyattr.architectures.forms import classify_norm
from pyattr.integration.generic import plan_generic
from pyattr.integration.structural import structural_norm_forward
from pyattr.methods._core.inputs import accepts, entry_module

pytestmark = pytest.mark.usefixtures("one_thread")

T = pytest.importorskip("transformers")
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              initializer_range=0.2)


def _tiny(cls, cfg):
    """Seeded, float64, eval, biases zeroed, parameters frozen (as the methods' own passes
    freeze them: a parameter that requires grad turns a product with it, Dory's logit scale
    or DiffLlama's λ, into a gate of two inputs for the functional rules)."""
    torch.manual_seed(0)
    m = cls(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.rsplit(".", 1)[-1] == "bias":
                p.zero_()
            p.requires_grad_(False)
    return m


def _ids(seq=7, seed=1):
    return torch.randint(5, 90, (1, seq), generator=torch.Generator().manual_seed(seed))


def _conservation(m, ids):
    """(target, Σ x·∂) in float64 under the generic rules: x is the discovered entry's
    input, the target the last position's top logit."""
    entry, where = entry_module(m, generic=True)
    assert where == "input"
    xs = []

    def grab(mod, args, kwargs):
        if xs:  # the first call only (ALBERT runs one shared layer group at every depth)
            return None
        if args:
            x = args[0].detach().requires_grad_(True)
            xs.append(x)
            return (x,) + tuple(args[1:]), kwargs
        key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point())
        xs.append(kwargs[key].detach().requires_grad_(True))
        return args, {**kwargs, key: xs[-1]}

    with pyattr.use_relevance_rules(m, generic=True):
        h = entry.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            logits = m(ids).logits
        finally:
            h.remove()
        target = logits[0, -1].max()
        (g,) = torch.autograd.grad(target, xs[:1])
    return float(target.detach()), float((xs[0].detach() * g).sum())


def _installed(m, rules=None):
    pl = plan_generic(m, rules or pyattr.RelevanceRules.all())
    return {s.path: s.value for s in pl.steps}, pl.cov


# --------------------------------------------------------------------------- norms inside attention


class ToyAttention(nn.Module):
    """q/k/v projections, a per-head q norm, and a post-LN over the residual stream."""

    def __init__(self, d=16):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.q_norm = nn.LayerNorm(4)
        self.LayerNorm = nn.LayerNorm(d)
        self.sub_norm = nn.RMSNorm(d, elementwise_affine=False)

    def forward(self, x):
        q = self.q_norm(self.q_proj(x).unflatten(-1, (4, 4))).flatten(-2)
        a = torch.softmax(q @ self.k_proj(x).transpose(-1, -2), -1)
        return self.LayerNorm(x + self.o_proj(self.sub_norm(a @ self.v_proj(x))))


def test_qk_norms_by_name():
    for n in ("q_norm", "k_norm", "query_norm", "key_norm", "q_layernorm", "k_layernorm", "q_ln", "norm_k",
              "self_attn.q_a_layernorm"):
        assert is_qk_norm(n), n
    for n in ("LayerNorm", "groupnorm", "v_norm", "attn_sub_norm", "subln", "kv_a_layernorm", "norm"):
        assert not is_qk_norm(n), n


def test_a_norm_inside_attention_that_is_not_on_the_qk_path_gets_the_ln_rule():
    toy = nn.Module()
    toy.attn = ToyAttention()
    steps, cov = _installed(toy)
    assert steps["attn.LayerNorm"] == ("layer_norm", 0.0)
    assert steps["attn.sub_norm"] == ("structural", "rms_norm")
    assert cov.reasons["attn.q_norm"].startswith("norm inside attention (a q/k norm)")
    # under AttnLRP the q/k norm carries the LN-rule too
    steps, _ = _installed(toy, pyattr.RelevanceRules.all(attention="attnlrp"))
    assert steps["attn.q_norm"] == ("layer_norm", 0.0)


def _albert():
    cfg = T.AlbertConfig(embedding_size=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                         classifier_dropout_prob=0.0, max_position_embeddings=64, **COMMON)
    return _tiny(T.AlbertForMaskedLM, cfg)


def test_albert_post_ln_inside_attention_conserves():
    """ALBERT's attention.LayerNorm normalises the residual stream: left native as a "q/k
    norm" it destroyed all relevance (Σ 3e-8 for a target of 2.19); with the LN-rule Σ x·∂
    equals the target in float64."""
    m = _albert()
    steps, _ = _installed(m)
    assert steps["albert.encoder.albert_layer_groups.0.albert_layers.0.attention.LayerNorm"] == ("layer_norm", 0.0)
    target, total = _conservation(m, _ids())
    assert abs(target) > 0.1
    assert abs(total - target) <= 1e-10 * abs(target), (target, total)
    r = pyattr.relevance(m, _ids(), generic=True)  # float32 relevance: to its precision
    assert abs(float(r.conservation_delta[0])) <= 1e-6 * abs(float(r.target[0]))


def test_diffllama_group_norm_conserves():
    cfg = T.DiffLlamaConfig(num_key_value_heads=2, **COMMON)
    m = _tiny(T.DiffLlamaForCausalLM, cfg)
    steps, _ = _installed(m)
    assert steps["model.layers.0.self_attn.groupnorm"] == ("structural", "rms_norm")
    target, total = _conservation(m, _ids())
    # its RMSNorms compute in float32 whatever the model's dtype: float64 conserves to that
    assert abs(target) > 0.1 and abs(total - target) <= 1e-8 * abs(target), (target, total)


def test_gemma4_v_norm_and_bitnet_attn_sub_norm_get_the_ln_rule():
    g4 = T.Gemma4TextConfig(num_key_value_heads=2, head_dim=8, global_head_dim=8, max_position_embeddings=64,
                            layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                            vocab_size_per_layer_input=96, hidden_size_per_layer_input=8, **COMMON)
    steps, cov = _installed(_tiny(T.Gemma4ForCausalLM, g4))
    assert steps["model.layers.0.self_attn.v_norm"] == ("structural", "rms_norm")
    assert cov.reasons["model.layers.0.self_attn.q_norm"].startswith("q/k norm left native (AH-rule")
    bit = _tiny(T.BitNetForCausalLM, T.BitNetConfig(num_key_value_heads=2, **COMMON))
    steps, _ = _installed(bit)
    assert steps["model.layers.0.self_attn.attn_sub_norm"] == ("rms_norm", 0.0)


# --------------------------------------------------------------------------- L2 / parameter-free norms


class L2Norm(nn.Module):
    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + self.eps)


def test_l2_norm_keeps_its_true_scale_and_conserves():
    norm = L2Norm()
    kind, (w, offset) = classify_norm(norm, 32)
    assert kind == "rms_norm" and offset == 0.0 and w.dim() == 0
    assert abs(float(w) - 32 ** -0.5) < 1e-3 * 32 ** -0.5  # x/‖x‖ = x/rms · 1/√n
    fwd = structural_norm_forward(kind, (w, offset), 1e-6)(norm, type("S", (), {"native": norm.forward})())
    g = torch.Generator().manual_seed(0)
    for width in (32, 8):  # a parameter-free norm applies at any width (per head too)
        x = torch.randn(3, 5, width, generator=g, dtype=torch.float64, requires_grad=True)
        dy = torch.randn(3, 5, width, generator=g, dtype=torch.float64)
        y = fwd(x)
        assert torch.equal(y, norm(x))
        (gx,) = torch.autograd.grad(y, x, dy)
        # the LN-rule: the denominator ‖x‖ held constant
        torch.testing.assert_close(gx, dy * torch.rsqrt(x.detach().pow(2).sum(-1, keepdim=True) + 1e-6),
                                   rtol=1e-12, atol=0)
        torch.testing.assert_close((x * gx).sum(), (y * dy).sum(), rtol=1e-12, atol=0)


def test_a_norm_of_another_width_is_classified_at_its_own():
    per_head = T.models.llama.modeling_llama.LlamaRMSNorm(8)
    with torch.no_grad():
        per_head.weight.normal_(generator=torch.Generator().manual_seed(0))
    kind, (w, offset) = classify_norm(per_head, 32)
    assert kind == "rms_norm" and w is per_head.weight and offset == 0.0
    kind, (w, _) = classify_norm(nn.RMSNorm(8, elementwise_affine=False), 32)
    assert kind == "rms_norm" and float(w) == pytest.approx(1.0, abs=1e-4)


def test_dory_l2_norms_conserve():
    """Dory's parameter-free L2 norms: with the scale dropped the backward was √hidden too
    large at every norm (the plan check measured 4.8e4 lost of 1.6e6 at the first)."""
    cfg = T.DoryConfig(num_key_value_heads=2, **COMMON)
    m = _tiny(T.DoryForCausalLM, cfg)
    steps, _ = _installed(m)
    assert steps["model.layers.0.input_layernorm"] == ("structural", "rms_norm")
    target, total = _conservation(m, _ids())
    # DoryL2Norm and DoryLMHead compute in float32 (x.float()): the logits are float32
    assert abs(target) > 0.1 and abs(total - target) <= 2e-7 * abs(target), (target, total)


# --------------------------------------------------------------------------- q/k/v projections that are not linear maps


class TupleLinear(nn.Linear):
    def forward(self, x, scale=None):
        return super().forward(x), scale


def test_a_projection_returning_a_tuple_is_refused():
    toy = nn.Module()
    toy.attn = ToyAttention()
    toy.attn.k_proj = TupleLinear(16, 16)
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError,
                       match=r"'attn.k_proj' \(TupleLinear\) returns a tuple, not a tensor .*no attention rule can be "
                             r"placed on 'attn'"):
        plan_generic(toy, pyattr.RelevanceRules.all())
    plan_generic(toy, pyattr.RelevanceRules.all(attention=False))  # no attention rule: nothing to wrap


def test_ibert_quant_linear_is_refused_with_the_reason():
    cfg = T.IBertConfig(max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        **COMMON)
    m = _tiny(T.IBertForMaskedLM, cfg)
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError,
                       match=r"'ibert.encoder.layer.0.attention.self.query' \(QuantLinear\) returns a tuple"):
        pyattr.relevance(m, _ids(), generic=True)


# --------------------------------------------------------------------------- several residual streams


class Streams(nn.Module):
    """A block over two residual streams (batch, seq, 2, hidden): the wrapped block on
    their mean, added to each; the last block collapses them."""

    def __init__(self, block, last=False):
        super().__init__()
        self.block, self.last = block, last

    def forward(self, hidden_states, *args, **kwargs):
        out = self.block(hidden_states.mean(2), *args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        h = hidden_states + (out - hidden_states.mean(2)).unsqueeze(2)
        return h.mean(2) if self.last else h


def test_a_four_dimensional_entry_is_refused_naming_the_layout():
    from models import tiny_unmapped

    m = tiny_unmapped("GraniteConfig")
    layers = m.model.layers
    for i in range(len(layers)):
        layers[i] = Streams(layers[i], last=i == len(layers) - 1)

    def expand(mod, args, kwargs):
        if args:
            return (torch.stack([args[0], args[0]], 2),) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": torch.stack([kwargs["hidden_states"]] * 2, 2)}

    layers[0].register_forward_pre_hook(expand, with_kwargs=True)
    with pytest.raises(ValueError, match=r"carry hidden states shaped \(1, 7, 2, 32\), \(batch, position, 2, hidden\): "
                                         r"several residual streams"):
        pyattr.relevance(m, _ids(), generic="partial")


def test_hyper_connections_refuse_the_entry():
    cfg = T.DeepseekV4Config(**{**COMMON, "num_hidden_layers": 2})
    for k, v in dict(num_key_value_heads=1, head_dim=8, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                     n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16).items():
        if hasattr(cfg, k):
            setattr(cfg, k, v)
    torch.manual_seed(0)
    m = T.DeepseekV4ForCausalLM(cfg).eval()
    assert dict(discover(m).refusals)["entry"].startswith("several residual streams: config.hc_mult = 4")
    with pytest.raises(ValueError, match=r"'entry' role.*DeepseekV4ForCausalLM.*several residual streams: "
                                         r"config.hc_mult = 4 \(hyper-connections\)"):
        pyattr.relevance(m, _ids(), generic=True)


# --------------------------------------------------------------------------- accurate reasons


def test_a_container_named_after_its_model_is_not_a_norm():
    class FooPreLayerNormEmbeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.word = nn.Embedding(4, 4)

    class FooLayerNorm1P(nn.Module):
        def forward(self, x):
            return x

    assert not is_norm_like(FooPreLayerNormEmbeddings()) and is_norm_like(FooLayerNorm1P())


def test_roberta_prelayernorm_conserves():
    """Its embeddings class (RobertaPreLayerNormEmbeddings) was taken for an embedding norm,
    the entry put at the token ids (the plan check: "does not depend on the entry")."""
    cfg = T.RobertaPreLayerNormConfig(max_position_embeddings=64, hidden_dropout_prob=0.0, pad_token_id=1,
                                      attention_probs_dropout_prob=0.0, **COMMON)
    m = _tiny(T.RobertaPreLayerNormForMaskedLM, cfg)
    assert discover(m).entry == ("embeddings.LayerNorm", "input")  # the norm, not the embeddings module
    target, total = _conservation(m, _ids())
    assert abs(target) > 0.1 and abs(total - target) <= 1e-10 * abs(target), (target, total)


class Reversible(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layers):
        for layer in layers:
            x = x + layer(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class RevEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([ToyAttention() for _ in range(2)])

    def forward(self, x):
        return Reversible.apply(x, self.layers)


def test_blocks_inside_a_custom_autograd_function_are_refused():
    why = dict(discover(RevEncoder()).refusals)["layers"]
    assert why.startswith("RevEncoder.forward runs its blocks 'layers' inside the custom autograd Function Reversible")
    cfg = T.ReformerConfig(vocab_size=64, hidden_size=32, num_attention_heads=2, attention_head_size=16,
                           axial_pos_shape=[4, 4], axial_pos_embds_dim=[16, 16], feed_forward_size=48,
                           attn_layers=["local", "lsh"], is_decoder=True, local_attn_chunk_length=4,
                           lsh_attn_chunk_length=4, num_buckets=2, max_position_embeddings=16, pad_token_id=0)
    m = _tiny(T.ReformerModelWithLMHead, cfg)
    with pytest.raises(ValueError, match=r"'entry' role.*ReformerEncoder.forward runs its blocks 'encoder.layers' "
                                         r"inside the custom autograd Function _ReversibleFunction"):
        pyattr.relevance(m, _ids(8), generic=True)


# --------------------------------------------------------------------------- entry, position_ids


def test_git_entry_refusal_is_honoured():
    """GIT (two stacks: its image encoder and its text decoder): discovery declares no entry;
    the raw word embeddings' output (an in-place add on a leaf crashed there) is not taken."""
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, image_size=32,
                  patch_size=16)
    cfg = T.GitConfig(vision_config=vision, max_position_embeddings=64, **COMMON)
    m = _tiny(T.GitForCausalLM, cfg)
    with pytest.raises(ValueError, match=r"needs the 'entry' role.*GitForCausalLM.*2 stacks of blocks"):
        pyattr.relevance(m, _ids(), generic=True)


def test_position_ids_only_where_the_forward_names_them():
    class KwargsOnly(nn.Module):
        def forward(self, input_ids, attention_mask=None, **kwargs):
            return input_ids

    assert accepts(KwargsOnly(), "position_ids") and not accepts(KwargsOnly(), "position_ids", by_name=True)
    cfg = T.RoFormerConfig(embedding_size=32, max_position_embeddings=64, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, **COMMON)
    m = _tiny(T.RoFormerForMaskedLM, cfg)
    assert not accepts(m, "position_ids", by_name=True)
    ids = torch.cat([_ids(), _ids(seed=2)])
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match=r"pads some rows on the left, but RoFormerForMaskedLM.forward takes no "
                                         r"position_ids"):
        pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, rules=pyattr.RelevanceRules())
    assert A.model_type(m) not in A.ARCHITECTURES
