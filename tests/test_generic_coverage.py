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
