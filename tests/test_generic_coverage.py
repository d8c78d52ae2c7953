"""``generic=True`` coverage grown from refusals (issue 48): q/k/v projections read off the
module graph by their names' stems (MPNet's ``q``/``k``/``v``, DeBERTa-v2's
``query_proj``/…, CTRL's ``Wq``/…), each against a float64 oracle written here with hooks
(LN-rule: σ held at the module's value; Identity-rule: act(x)/x held; AH-rule: the q and k
projections' outputs detached), and a relative position bias computed from trainable
parameters (a constant for the input's gradient, not a leak)."""

import pytest
import torch
from torch import nn

import pyattr
from pyattr.architectures.blocks import qkv_names
from pyattr.methods._core.inputs import entry_module

pytestmark = pytest.mark.usefixtures("one_thread")

T = pytest.importorskip("transformers")


class _Attn(nn.Module):
    def __init__(self, *names, extra=()):
        super().__init__()
        for n in names + tuple(extra):
            setattr(self, n, nn.Linear(4, 4))


@pytest.mark.parametrize("names", [("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q_lin", "k_lin", "v_lin"),
                                   ("q", "k", "v"), ("query_proj", "key_proj", "value_proj"), ("Wq", "Wk", "Wv"),
                                   ("q_head", "k_head", "v_head")])
def test_qkv_names_are_read_by_their_stems(names):
    assert qkv_names(_Attn(*names, extra=("o", "dense"))) == names


def test_qkv_names_need_exactly_one_of_each():
    assert qkv_names(_Attn("q", "k")) is None  # no value projection
    assert qkv_names(_Attn("q", "q_proj", "k", "v")) is None  # two query candidates: not guessed
    m = _Attn("q", "k")
    m.v = nn.Dropout()  # a child without parameters is no projection
    assert qkv_names(m) is None


def _tiny(name):
    torch.manual_seed(0)
    if name == "mpnet":
        cfg = T.MPNetConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=64, initializer_range=0.2)
        m = T.MPNetForMaskedLM(cfg)
    elif name == "ctrl":
        m = T.CTRLLMHeadModel(T.CTRLConfig(vocab_size=96, n_embd=32, dff=48, n_layer=2, n_head=4, n_positions=64,
                                           initializer_range=0.2))
    else:
        cfg = T.DebertaV2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=64, initializer_range=0.2,
                                relative_attention=True, pos_att_type=["c2p", "p2c"], position_buckets=8)
        m = T.DebertaV2ForMaskedLM(cfg)
    m = m.to(torch.float64).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.rsplit(".", 1)[-1] == "bias":
                p.zero_()
    return m


def _ids():
    return torch.randint(5, 90, (1, 7), generator=torch.Generator().manual_seed(1))


def _oracle(m, ids, token):
    """Σ-over-hidden relevance at the discovered entry, by autograd with the rules written
    as hooks: every LayerNorm's σ held, every activation module's act(x)/x held, the head's
    functional GELU (MPNet: gelu between ``dense`` and ``layer_norm``) likewise, and the
    outputs of the q and k projections of every attention module detached."""
    hooks, leaf, h = [], {}, {}

    def ln(mod, args, out):
        x = args[0]
        mu = x.mean(-1, keepdim=True)
        sigma = ((x - mu) ** 2).mean(-1, keepdim=True).add(mod.eps).sqrt().detach()
        rule = (x - mu) / sigma * mod.weight + mod.bias
        return out.detach() + (rule - rule.detach())

    def identity(mod, args, out):
        x = args[0]
        return x * (out / torch.where(x == 0, torch.ones_like(x), x)).detach()

    for name, mod in m.named_modules():
        names = qkv_names(mod)
        if names:
            for p in names[:2]:
                hooks.append(getattr(mod, p).register_forward_hook(lambda mod, a, out: out.detach()))
        if isinstance(mod, nn.LayerNorm):
            hooks.append(mod.register_forward_hook(ln))
        elif type(mod).__name__ in ("GELUActivation", "ReLU"):
            hooks.append(mod.register_forward_hook(identity))
    head = getattr(m, "lm_head", None)
    if head is not None and isinstance(getattr(head, "dense", None), nn.Module):  # MPNet: gelu as a function
        hooks.append(head.dense.register_forward_hook(lambda mod, a, out: h.__setitem__("h", out)))
        hooks.append(head.layer_norm.register_forward_pre_hook(lambda mod, a: (h["h"] * (a[0] / h["h"]).detach(),)))
    entry, _ = entry_module(m, generic=True)

    def pre(mod, args, kwargs):
        if "x" in leaf:
            return None
        if args:
            leaf["x"] = args[0].detach().requires_grad_(True)
            return (leaf["x"],) + tuple(args[1:]), kwargs
        key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point())
        leaf["x"] = kwargs[key].detach().requires_grad_(True)
        return args, {**kwargs, key: leaf["x"]}

    hooks.append(entry.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        value = m(ids).logits[0, -1, token]
        (g,) = torch.autograd.grad(value, leaf["x"])
    finally:
        for hk in hooks:
            hk.remove()
    return (leaf["x"] * g).sum(-1).detach(), float(value.detach())


@pytest.mark.parametrize("name", ["mpnet", "ctrl"])
def test_attention_under_other_qkv_names_equals_the_oracle(name):
    m = _tiny(name)
    ids = _ids()
    r = pyattr.relevance(m, ids, target=11, generic=True)
    want, value = _oracle(m, ids, 11)
    assert float(r.target[0]) == pytest.approx(value, rel=1e-12)
    assert (r.token_relevance.double() - want).abs().max() <= 1e-6 * want.abs().max()
    assert r.conservation_delta.abs().max() <= 1e-6 * r.target.abs().max()
    plain = pyattr.relevance(m, ids, target=11, generic=True, rules=pyattr.RelevanceRules())
    assert (plain.token_relevance.double() - want).abs().max() > 1e-3 * want.abs().max()  # the rules act


def test_deberta_v2_query_proj_names_conserve_with_its_relative_position_terms():
    """DeBERTa-v2's disentangled attention projects the relative position embeddings with
    the same key_proj / query_proj: under the AH-rule those are constants too."""
    m = _tiny("deberta-v2")
    with pyattr.use_relevance_rules(m, generic=True) as cov:
        assert "deberta.encoder.layer.0.attention.self.query_proj" in cov.by_kind["attention"]
    r = pyattr.relevance(m, _ids(), target=11, generic=True)
    assert r.conservation_delta.abs().max() <= 1e-6 * r.target.abs().max()


def test_a_relative_position_bias_from_trainable_parameters_is_not_a_leak():
    """MPNet's relative_attention_bias is an Embedding of positions: with the parameters
    trainable (as loaded) its output carries gradient but does not depend on the input;
    the plan check does not count it, and the user's own scope equals pyattr.relevance."""
    m = _tiny("mpnet")
    ids = _ids()
    assert all(p.requires_grad for p in m.parameters())
    r = pyattr.relevance(m, ids, target=11, generic=True)
    entry, _ = entry_module(m, generic=True)
    xs = []

    def pre(mod, args, kwargs):
        if not xs:
            xs.append(args[0].detach().requires_grad_(True))
            return (xs[0],) + tuple(args[1:]), kwargs
        return None

    with pyattr.use_relevance_rules(m, generic=True):
        h = entry.register_forward_pre_hook(pre, with_kwargs=True)
        try:
            m(ids).logits[0, -1, 11].backward()
        finally:
            h.remove()
    have = (xs[0] * xs[0].grad).sum(-1).detach()
    assert (have - r.token_relevance.double()).abs().max() <= 1e-6 * have.abs().max()


def _deepseek_v3(dense=True):
    torch.manual_seed(0)
    cfg = T.DeepseekV3Config(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                             n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                             first_k_dense_replace=2 if dense else 1, max_position_embeddings=64,
                             initializer_range=0.2, attn_implementation="eager")
    m = T.DeepseekV3ForCausalLM(cfg).to(torch.float64).eval()
    m.config.model_type = "deepseek_v3_unmapped"  # (it is not mapped: kept explicit)
    return m


def test_multi_head_latent_attention_roles_are_observed_column_by_column():
    """DeepSeek-V3's attention: q_a_proj and the compressed part of kv_a_proj_with_mqa feed
    the next projection (pass-through), q_b_proj is all query, kv_a_proj's rotary part is
    key, and kv_b_proj is per head k_nope (key) then v (value) — found by observation, not
    by these names."""
    from pyattr.integration.fused_qkv import QK, THROUGH, VALUE, column_roles

    m = _deepseek_v3()
    roles, why = column_roles(m, m.model.layers[0].self_attn)
    assert why == ""
    assert set(roles) == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}
    assert bool((roles["q_a_proj"] == THROUGH).all()) and bool((roles["q_b_proj"] == QK).all())
    assert roles["kv_a_proj_with_mqa"].tolist() == [THROUGH] * 16 + [QK] * 4
    assert roles["kv_b_proj"].tolist() == ([QK] * 8 + [VALUE] * 8) * 4


def test_multi_head_latent_attention_equals_an_oracle_with_its_key_columns_detached():
    """The AH-rule on DeepSeek-V3's attention written from its modeling file — queries
    detached, kv_b_proj's k_nope columns and kv_a_proj's rotary key columns detached,
    values and the compressed latent kept — with the LN-rule on every RMSNorm (σ held;
    they compute in float32) and the gated MLP's Identity- and Half-rules."""
    m = _deepseek_v3()
    ids = _ids()
    r = pyattr.relevance(m, ids, target=11, generic=True)
    hooks, leaf = [], {}

    def keep(mask):
        def hook(mod, a, out):
            mk = mask.to(out.dtype)
            return out * mk + (out * (1 - mk)).detach()
        return hook

    def rms(mod, args, out):
        x = args[0]
        s = x.pow(2).mean(-1, keepdim=True).add(mod.variance_epsilon).sqrt().detach()
        rule = mod.weight * (x / s)
        return out.detach() + (rule - rule.detach())

    def gated(mod, args, out):
        x = args[0]
        g, u = mod.gate_proj(x), mod.up_proj(x)
        a = g * (mod.act_fn(g) / torch.where(g == 0, torch.ones_like(g), g)).detach()
        return mod.down_proj(0.5 * a * u.detach() + 0.5 * a.detach() * u)

    for layer in m.model.layers:
        at = layer.self_attn
        hooks.append(at.q_b_proj.register_forward_hook(keep(torch.zeros(at.q_b_proj.out_features))))
        hooks.append(at.kv_a_proj_with_mqa.register_forward_hook(keep(torch.tensor([1.0] * 16 + [0.0] * 4))))
        hooks.append(at.kv_b_proj.register_forward_hook(keep(torch.tensor(([0.0] * 8 + [1.0] * 8) * 4))))
        hooks.append(layer.mlp.register_forward_hook(gated))
    for name, mod in m.named_modules():
        if type(mod).__name__ == "DeepseekV3RMSNorm" and not name.endswith("q_a_layernorm"):
            hooks.append(mod.register_forward_hook(rms))

    def pre(mod, args, kwargs):
        leaf["x"] = kwargs["hidden_states"].detach().requires_grad_(True) if "hidden_states" in kwargs else None
        if leaf["x"] is None:
            leaf["x"] = args[0].detach().requires_grad_(True)
            return (leaf["x"],) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": leaf["x"]}

    hooks.append(m.model.layers[0].register_forward_pre_hook(pre, with_kwargs=True))
    try:
        value = m(ids).logits[0, -1, 11]
        (g,) = torch.autograd.grad(value, leaf["x"])
    finally:
        for hk in hooks:
            hk.remove()
    want = (leaf["x"] * g).sum(-1).detach()
    assert (r.token_relevance.double() - want).abs().max() <= 1e-5 * want.abs().max()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.zero_()
    r0 = pyattr.relevance(m, ids, target=11, generic=True)
    assert r0.conservation_delta.abs().max() <= 1e-6 * r0.target.abs().max()


def test_linear_attention_without_a_softmax_is_refused_not_guessed():
    """An attention whose output is linear in every projected column (no softmax: a
    linear-attention form) has no query or key to detach: refused with that reason."""
    from pyattr.integration.fused_qkv import column_roles

    class Linear(nn.Module):
        def __init__(self):
            super().__init__()
            self.a_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.o_proj(self.a_proj(x))

    class Model(nn.Module):
        main_input_name = "input_ids"

        def __init__(self):
            super().__init__()
            self.embed, self.attn = nn.Embedding(30, 8), Linear()

        def get_input_embeddings(self):
            return self.embed

        def forward(self, input_ids, attention_mask=None):
            return self.attn(self.embed(input_ids))

    m = Model()
    roles, why = column_roles(m, m.attn)
    assert roles is None and "no query or key found" in why


def test_the_replay_runs_no_user_hook_and_an_uncopyable_module_is_refused_cleanly():
    """The column observation replays a hook-free copy of the attention module: a user's
    forward hook runs only for the model's own calls; a module that cannot be copied (a
    non-leaf tensor attribute) leaves the projection native with the reason, and the plan
    check refuses the model by name."""
    torch.manual_seed(0)
    m = T.BloomForCausalLM(T.BloomConfig(vocab_size=96, hidden_size=16, n_layer=2, n_head=4)).double().eval()
    calls = []
    handles = [layer.self_attention.register_forward_hook(lambda mod, a, out: calls.append(out[0].dtype))
               for layer in m.transformer.h]
    pyattr.relevance(m, _ids(), target=5, generic=True)
    for h in handles:
        h.remove()
    # the plan check's probe forward and the explained forward, two blocks each: no replay
    # (hundreds of calls before the copy dropped the hooks)
    assert len(calls) == 4
    p = nn.Parameter(torch.ones(3, dtype=torch.float64))
    torch.manual_seed(0)  # a fresh model: what was observed is kept per model
    m = T.BloomForCausalLM(T.BloomConfig(vocab_size=96, hidden_size=16, n_layer=2, n_head=4)).double().eval()
    for layer in m.transformer.h:
        layer.self_attention.cached = p * 2
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError, match="could not be observed .*could not be replayed"):
        pyattr.relevance(m, _ids(), target=5, generic=True)


def test_two_candidates_for_one_projection_are_named_not_guessed():
    from pyattr.architectures.blocks import _layers

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = _Attn("q", "k", "v", "value", extra=("o",))

    base = nn.Module()
    base.layers = nn.ModuleList([Block(), Block()])
    path, why = _layers(base)
    assert path is None
    assert "'layers.0.attn' has several children named as its v projection ('v', 'value'), which is not guessed" in why
