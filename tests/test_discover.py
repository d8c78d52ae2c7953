"""Structural discovery (:func:`pyattr.architectures.discover`): the :class:`Arch` entry of a
model the table does not map, read off its module graph, which every method reads with
``generic=True``.

(a) On every mapped architecture, the discovered entry equals the table's on every role
it claims to find, and declares exactly the refusals expected (with reasons); (b) on a
renamed twin (same modules and weights, a model_type the table misses), ``generic=True``
gives the mapped model's relevance, layer relevance and patching results; (c) on
architectures the table does not map, the methods work through the discovered roles,
and a role discovery could not find is refused naming the role and the reason. The
matrix of discovered entries × methods is in test_architecture_table.py.
"""

import copy
import dataclasses
import re

import pytest
import torch

import pyattr
from models import UNMAPPED_COMMON
import pyattr.architectures as A
from pyattr.patching import activation_patching, attribution_patching
from test_architecture_table import _model

pytestmark = pytest.mark.usefixtures("one_thread")

#: the refusals discovery declares on the mapped architectures (all others: none)
EXPECTED_REFUSALS = {
    **{a: {"attention"} for a in ("phi3", "gpt2", "gpt_neox", "modernbert")},  # fused q|k|v: split unknown
    **{a: {"neurons", "moe_block"} for a in ("mixtral", "qwen2_moe", "qwen3_moe")},
}
#: roles only the rule planner reads, which discovery does not look for
PLANNER_ONLY = ("head_forward", "unruled_heads", "gated_extra")
#: (arch, role): the table and discovery name different modules of the same tensor
SAME_TENSOR = {("distilbert", "attention_out"), ("distilbert", "neurons")}
#: the table leaves AtP* off there; discovery finds the eager attention module (the matrix runs it)
CORE_ONLY_DISCOVERED = ("clip_text_model", "clip_vision_model", "vit", "distilbert", "modernbert")


def _ids(batch=2, seq=6, seed=1):
    return torch.randint(3, 96, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _tensor_at(model, inputs, module_path, where):
    """The first tensor at a module's input or output on one forward."""
    seen = {}
    mod = model.get_submodule(module_path)

    def hook(m, args, out):
        t = args[0] if where == "input" else out
        seen["t"] = (t[0] if isinstance(t, tuple) else t).detach().clone()

    h = mod.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(input_ids=inputs) if inputs.dtype == torch.long else model(pixel_values=inputs)
    finally:
        h.remove()
    return seen["t"]


@pytest.mark.parametrize("arch", sorted(A.ARCHITECTURES))
def test_discovered_entry_equals_the_table_entry(arch):
    m, inputs, _ = _model(arch)
    table, found = A.ARCHITECTURES[arch], A.discover(m)
    assert {r for r, _ in found.refusals} == EXPECTED_REFUSALS.get(arch, set()), found.refusals
    assert all(isinstance(why, str) and len(why) > 20 for _, why in found.refusals)
    prefix = A.base_prefix(m)
    for f in dataclasses.fields(A.Arch):
        if f.name in ("refusals",) + PLANNER_ONLY:
            continue
        d, t = getattr(found, f.name), getattr(table, f.name)
        if found.refusal(f.name):
            assert d is None, (f.name, d)
            continue
        if f.name in ("head_norms", "head_acts"):  # the table's, where this instance has the head
            t = tuple(p for p in t if A.get_submodule(m, p) is not None)
        if f.name == "base_acts":
            t = tuple(p for p in t if A.get_submodule(m, A.join(prefix, p)) is not None)
        if f.name == "attention_core" and t is None:
            assert arch in CORE_ONLY_DISCOVERED and d == found.heads.rsplit(".", 1)[0], d
            continue
        if (arch, f.name) in SAME_TENSOR:
            (dp, dw), (tp, tw) = ((d, "output"), (t, "output")) if f.name == "attention_out" else (d, t)
            for b in A.layer_paths(m, table):
                assert torch.equal(_tensor_at(m, inputs, f"{b}.{dp}", dw), _tensor_at(m, inputs, f"{b}.{tp}", tw))
            continue
        assert d == t, (f.name, d, t)


def test_the_entry_a_method_reads():
    llama = _model("llama")[0]
    assert A.arch_of(llama) is A.ARCHITECTURES["llama"] and A.arch_of(llama, generic=True) is A.ARCHITECTURES["llama"]
    twin = copy.deepcopy(llama)
    twin.config.model_type = "llama_twin"
    assert A.arch_of(twin) is None
    assert A.arch_of(twin, generic=True) == dataclasses.replace(A.ARCHITECTURES["llama"])


# --------------------------------------------------------------------------- (b) renamed twins


def _twin(arch, dtype=torch.float64):
    m = copy.deepcopy(_model(arch)[0]).to(dtype)
    twin = copy.deepcopy(m)
    twin.config.model_type = f"{arch}_twin"
    return m, twin


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "olmo2", "phi", "bert"])
def test_generic_on_a_renamed_twin_equals_the_mapped_model(arch):
    m, twin = _twin(arch)
    ids, target, metric = _ids(), 5, pyattr.targets.Logit(5)
    ref, got = pyattr.relevance(m, ids, target=target), pyattr.relevance(twin, ids, target=target, generic=True)
    assert torch.equal(got.relevance, ref.relevance) and torch.equal(got.token_relevance, ref.token_relevance)
    layers = ["residual", "attention", "mlp", "neurons"]
    ref = pyattr.layer_relevance(m, ids, layers, target=target)
    got = pyattr.layer_relevance(twin, ids, layers, target=target, generic=True)
    assert got.paths == ref.paths
    for p in ref.paths:
        assert torch.equal(got[p].relevance, ref[p].relevance), p
    nodes = ("residual", "attention", "heads", "mlp", "neurons")
    for method in ("relp", "atp*"):
        ref = attribution_patching(m, ids, ids.flip(0), metric, nodes=nodes, method=method)
        got = attribution_patching(twin, ids, ids.flip(0), metric, nodes=nodes, method=method, generic=True)
        for n in nodes:
            assert torch.equal(got[n], ref[n]), (method, n)
    ref = activation_patching(m, ids[:1], ids[1:], metric, nodes=("residual", "heads"), progress=False)
    got = activation_patching(twin, ids[:1], ids[1:], metric, nodes=("residual", "heads"), progress=False, generic=True)
    assert torch.equal(got["heads"], ref["heads"]) and torch.equal(got["residual"], ref["residual"])


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "phi3", "modernbert"])
@pytest.mark.parametrize("rules", ["all", "attnlrp"])
def test_a_fused_qkv_projection_gets_the_attention_rule_by_its_observed_value_columns(arch, rules):
    """GPT-2's c_attn (q | k | v), GPT-NeoX's per-head query_key_value, Phi-3's GQA
    qkv_proj, ModernBERT's Wqkv: under generic=True the value columns are observed on the
    attention module (linear in them), and the renamed twin equals the mapped model, whose
    fused layouts are written from the modeling files and tested against oracles."""
    m, twin = _twin(arch)
    ids = _ids()
    ref = pyattr.relevance(m, ids, target=5, rules=rules)
    got = pyattr.relevance(twin, ids, target=5, rules=rules, generic=True)
    assert torch.allclose(got.relevance, ref.relevance, rtol=1e-4, atol=1e-6 * float(ref.relevance.abs().max()))
    with pyattr.use_relevance_rules(twin, generic=True) as cov:
        assert any(p.endswith(("c_attn", "query_key_value", "qkv_proj", "Wqkv")) for p in cov.by_kind["attention"])


def test_fused_value_columns_are_observed_in_any_layout():
    """A toy attention whose fused projection is laid out q | v | k per chunk (CodeGen's
    form): the observed value columns are the middle third of each chunk."""
    from torch import nn

    from pyattr.integration.fused_qkv import value_columns

    class Chunked(nn.Module):
        head_dim = 4

        def __init__(self):
            super().__init__()
            self.qkv_proj = nn.Linear(16, 48, bias=False)
            self.out_proj = nn.Linear(16, 16, bias=False)

        def forward(self, x):
            chunks = self.qkv_proj(x).reshape(*x.shape[:-1], 2, 24)
            q, v, k = chunks.split(8, dim=-1)
            q, v, k = (t.flatten(-2) for t in (q, v, k))
            a = torch.softmax(q @ k.transpose(-1, -2), -1)
            return self.out_proj(a @ v)

    class Model(nn.Module):
        main_input_name = "input_ids"

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(30, 16)
            self.attn = Chunked()

        def get_input_embeddings(self):
            return self.embed

        def forward(self, input_ids, attention_mask=None):
            return self.attn(self.embed(input_ids))

    torch.manual_seed(0)
    model = Model()
    mask, why = value_columns(model, model.attn, "qkv_proj")
    assert why == ""
    want = torch.zeros(48, dtype=torch.bool)
    want[8:16] = want[32:40] = True
    assert torch.equal(mask, want)


def test_without_generic_the_twin_is_refused():
    _, twin = _twin("llama")
    with pytest.raises(ValueError, match=r"shorthand 'mlp' needs a mapped architecture.*or generic=True"):
        pyattr.layer_relevance(twin, _ids(), "mlp", target=5, rules=pyattr.RelevanceRules())
    with pytest.raises(ValueError, match=r"patching needs a mapped architecture.*generic=True"):
        attribution_patching(twin, _ids(), _ids(seed=2), pyattr.targets.Logit(5), method="atp")


# --------------------------------------------------------------------------- (c) unmapped architectures

def _unmapped(name, dtype=torch.float64, **extra):
    from models import tiny_unmapped

    m = tiny_unmapped(name, dtype, **extra)
    assert A.model_type(m) not in A.ARCHITECTURES
    return m


def test_unmapped_gqa_decoder_through_the_discovered_entry():
    """Granite (GQA, bias-free): every shorthand, layer-wise conservation on the residual
    stream, and per-head estimates that add up to the attention output's (o_proj is
    linear and bias-free)."""
    m = _unmapped("GraniteConfig")
    ids = _ids(seq=7)
    r = pyattr.layer_relevance(m, ids, ["residual", "attention", "mlp", "neurons"], target=5, generic=True)
    assert r.paths == [f"model.layers.{i}{p}" for i in (0, 1) for p in ("", ".self_attn", ".mlp", ".mlp.down_proj")] + [
        "model.norm"]
    assert r["model.layers.0.mlp.down_proj"].where == "input" and r["model.layers.0.mlp.down_proj"].activation.shape[-1] == 48
    for p in ("model.layers.0", "model.layers.1", "model.norm"):
        assert (r[p].conservation_delta.abs() <= 1e-6 * r.target.abs()).all(), (p, r[p].conservation_delta)
    e = attribution_patching(m, ids, ids.flip(0), pyattr.targets.Logit(5), nodes=("attention", "heads"), method="atp",
                             generic=True)
    assert e["heads"].shape == (2, 2, 7, 4)
    torch.testing.assert_close(e["heads"].sum(-1), e["attention"], rtol=1e-5, atol=1e-6)


def test_unmapped_block_without_an_mlp_module():
    """OPT: fc1, the activation and fc2 are the block's own children, and its final norm is
    registered before its blocks: the entry is the first block's input, not that norm."""
    import transformers as T

    cfg = T.OPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                      max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0)
    torch.manual_seed(0)
    m = T.OPTForCausalLM(cfg).to(torch.float64).eval()
    found = A.discover(m)
    assert found.entry == ("decoder.layers.0", "hidden_states") and found.outer_norms == ("decoder.final_layer_norm",)
    assert (found.mlp, found.mlp_out, found.neurons) == (("act", "activation_fn"), "fc2", ("fc2", "input"))
    ids = _ids()
    rel = pyattr.relevance(m, ids, target=5, generic=True)
    lay = pyattr.layer_relevance(m, ids, ["residual", "neurons"], target=5, generic=True)
    torch.testing.assert_close(rel.token_relevance, lay["model.decoder.layers.0"].relevance.sum(-1),
                               rtol=1e-5, atol=1e-7)
    assert lay["model.decoder.layers.1.fc2"].activation.shape == (12, 64)  # OPT flattens the rows for its MLP


def test_a_role_discovery_cannot_find_is_refused_naming_it():
    """Each method that needs a role discovery declared missing raises ValueError with the
    role and the reason: two stacks of blocks (T5; the methods refuse an encoder–decoder first), experts (OLMoE), an attention module
    that does not return its probabilities; a gated MLP in an unknown form (Seed-OSS)
    refuses only the MLP rule's role, and its contribution and hidden units still work."""
    import transformers as T

    t5 = T.T5ForConditionalGeneration(T.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4))
    # an encoder–decoder is refused by every method that reads one stack, before discovery
    with pytest.raises(ValueError, match=r"layer_relevance\(\): T5ForConditionalGeneration is an encoder–decoder "
                                         r"model that does not make its decoder's inputs"):
        pyattr.layer_relevance(t5, _ids(), "residual", generic=True)
    with pytest.raises(ValueError, match=r"attribution_patching\(\): T5ForConditionalGeneration is an encoder–decoder "
                                         r"model that does not make its decoder's inputs"):
        attribution_patching(t5, _ids(), _ids(seed=2), pyattr.targets.Logit(5), method="atp", generic=True)
    with pytest.raises(ValueError, match=r"2 stacks of blocks \('encoder.block', 'decoder.block'\)"):
        A.require(A.discover(t5), "layers", t5, "'residual'")

    base = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, head_dim=8)
    olmoe = _unmapped("OlmoeConfig", torch.float32, **{**base, "intermediate_size": 24}, num_experts=4,
                      num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"'neurons': needs the 'neurons' role.*mixture-of-experts block 'mlp'"):
        pyattr.layer_relevance(olmoe, _ids(), "neurons", target=5, generic=True)
    with pytest.raises(ValueError, match=r"nodes: 'neurons': needs the 'neurons' role"):
        attribution_patching(olmoe, _ids(), _ids(seed=2), pyattr.targets.Logit(5), nodes="neurons", method="atp",
                             generic=True)
    # the block's rules are placed (router held constant, dispatched experts): its layer works
    r = pyattr.layer_relevance(olmoe, _ids(), "mlp", target=5, generic=True)
    assert r.paths == ["model.layers.0.mlp", "model.layers.1.mlp"]

    seed = _unmapped("SeedOssConfig", attention_bias=False, **base)
    assert "multiplies its activation" in A.discover(seed).refusal("mlp")
    r = pyattr.layer_relevance(seed, _ids(), ["mlp", "neurons"], target=5, generic=True)
    assert r.paths[:2] == ["model.layers.0.mlp", "model.layers.0.mlp.down_proj"]

    _, twin = _twin("llama")
    cls = type(twin.model.layers[0].self_attn)

    class NoProbabilities(cls):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            return (out[0], None)

    for layer in twin.model.layers:
        layer.self_attn.__class__ = NoProbabilities
    why = A.discover(twin).refusal("attention_core")
    assert why.startswith("NoProbabilities.forward does not return (output, attention probabilities)")
    with pytest.raises(ValueError, match=r"method='atp\*': needs the 'attention_core' role.*" + re.escape(why)):
        attribution_patching(twin, _ids(), _ids(seed=2), pyattr.targets.Logit(5), method="atp*", generic=True)
    r = attribution_patching(twin, _ids(), _ids(seed=2), pyattr.targets.Logit(5), nodes="heads", method="atp",
                             generic=True)
    assert r["heads"].shape == (2, 2, 6, 4)


@pytest.mark.parametrize("name", ["CohereConfig", "OlmoConfig", "ArceeConfig", "GraniteConfig", "Olmo3Config"])
def test_the_rule_planner_and_discovery_agree(name):
    """``generic=True`` installs its rules where the discovered entry places the roles:
    every residual-stream norm and q/k projection of every block, nothing refused."""
    m = _unmapped(name)
    found = A.discover(m)
    assert not found.refusals, found.refusals
    with pyattr.use_relevance_rules(m, generic=True) as cov:
        for b in A.layer_paths(m, found):
            for p in found.layer_norms:
                assert f"{b}.{p}" in cov.by_kind["normalization"], p
            for p in found.attention[1:3]:
                assert f"{b}.{p}" in cov.by_kind["attention"], p
            assert f"{b}.{found.attention[3]}" in cov.skipped  # v stays native under the AH-rule
        for p in found.outer_norms:
            assert A.join(A.base_prefix(m), p) in cov.by_kind["normalization"]


# --------------------------------------------------------------------------- (d) review: wrong roles caught


def _built(name, dtype=torch.float64, **cfg):
    """An unmapped model from a config class of transformers, eager attention."""
    import transformers as T

    c = getattr(T, name)(**cfg)
    c._attn_implementation = "eager"
    torch.manual_seed(0)
    auto = T.AutoModelForMaskedLM if name == "AlbertConfig" else T.AutoModelForCausalLM
    m = auto.from_config(c).to(dtype).eval()
    assert A.model_type(m) not in A.ARCHITECTURES
    return m


def _residual_steps(m, r):
    """(block input, next block input) pairs of a layer_relevance result over 'residual'."""
    blocks = A.layer_paths(m, A.discover(m))
    return [(b, r[b].activation, r[n].activation) for b, n in zip(blocks, blocks[1:])]


@pytest.mark.parametrize("name,cfg,attention_out", [
    ("BloomConfig", dict(vocab_size=96, hidden_size=32, n_layer=3, n_head=4), "self_attention.dense"),
    ("MptConfig", dict(vocab_size=96, d_model=32, n_layers=3, n_heads=4), "attn"),
])
def test_a_module_that_adds_the_residual_is_not_the_contribution(name, cfg, attention_out):
    """BLOOM's attention and MLP and MPT's MLP take the residual stream as an argument and
    add it inside: their output is the residual stream, not what they add to it. The
    contributions are the output projections (before the add): on these pre-norm models
    each block's input plus its attention and MLP contributions is the next block's input."""
    m = _built(name, **cfg)
    found = A.discover(m)
    assert found.attention_out == attention_out and found.mlp_out == found.neurons[0], found
    ids = _ids(seq=7)
    r = pyattr.layer_relevance(m, ids, ["residual", "attention", "mlp"], target=5, rules=pyattr.RelevanceRules(),
                               generic=True)
    for b, x, nxt in _residual_steps(m, r):
        step = r[f"{b}.{found.attention_out}"].activation + r[f"{b}.{found.mlp_out}"].activation
        torch.testing.assert_close(x + step, nxt, rtol=1e-5, atol=1e-6)
    e = attribution_patching(m, ids, ids.flip(0), pyattr.targets.Logit(5), nodes=("attention", "mlp"), method="atp",
                             generic=True)
    assert torch.isfinite(e["attention"]).all() and torch.isfinite(e["mlp"]).all()


def test_bloom_attention_core_is_refused_with_its_reason():
    """BLOOM's attention takes its ALiBi bias folded with the batch (batch × heads rows),
    which AtP*'s per-row recomputation cannot split: refused, naming the role."""
    m = _built("BloomConfig", vocab_size=96, hidden_size=32, n_layer=2, n_head=4)
    assert "alibi" in A.discover(m).refusal("attention_core")
    with pytest.raises(ValueError, match=r"method='atp\*': needs the 'attention_core' role.*alibi"):
        attribution_patching(m, _ids(), _ids(seed=2), pyattr.targets.Logit(5), method="atp*", generic=True)


def test_albert_post_norm_contributions():
    """ALBERT (unshared groups): the attention module adds its input and applies the
    residual LayerNorm inside, and the activation's module is the whole layer (attention
    included): the contributions are the attention's dense projection and the MLP's
    ffn_output, as a hand-written hook reads them."""
    m = _built("AlbertConfig", vocab_size=96, hidden_size=32, embedding_size=16, intermediate_size=48,
               num_hidden_layers=2, num_hidden_groups=2, num_attention_heads=4)
    found = A.discover(m)
    assert (found.attention_out, found.mlp_out) == ("albert_layers.0.attention.dense", "albert_layers.0.ffn_output")
    ids = _ids()
    r = pyattr.layer_relevance(m, ids, ["attention", "mlp"], target=5, rules=pyattr.RelevanceRules(), generic=True)
    for i in range(2):
        layer = f"albert.encoder.albert_layer_groups.{i}.albert_layers.0"
        for role, sub in (("attention", "attention.dense"), ("mlp", "ffn_output")):
            want = _tensor_at(m, ids, f"{layer}.{sub}", "output")
            torch.testing.assert_close(r[f"{layer}.{sub}"].activation, want.float())


def test_an_output_edited_in_place_downstream_is_refused():
    """Falcon's parallel block adds the attention output into the MLP's output tensor in
    place (``mlp_output += attention_output``): the recorded MLP activation would silently
    be MLP + attention. layer_relevance and patching refuse, naming the layer."""
    m = _built("FalconConfig", vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    ids = _ids()
    with pytest.raises(ValueError, match=r"layers: 'transformer\.h\.0\.mlp'.*changed in place"):
        pyattr.layer_relevance(m, ids, "mlp", target=5, rules=pyattr.RelevanceRules(), generic=True)
    with pytest.raises(ValueError, match=r"nodes: 'transformer\.h\.0\.mlp'.*changed in place"):
        attribution_patching(m, ids, ids.flip(0), pyattr.targets.Logit(5), nodes="mlp", method="atp", generic=True)
    r = pyattr.layer_relevance(m, ids, ["residual", "attention"], target=5, rules=pyattr.RelevanceRules(), generic=True)
    assert r.paths[0] == "transformer.h.0"


def test_flattened_rows_are_refused_by_patching():
    """OPT runs fc1 / fc2 on (batch·seq, hidden) rows: layer_relevance gives that shape, but
    patching needs (batch, position, …) activations and says so instead of failing inside."""
    import transformers as T

    cfg = T.OPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                      max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0)
    torch.manual_seed(0)
    m = T.OPTForCausalLM(cfg).to(torch.float64).eval()
    ids = _ids()
    for node in ("mlp", "neurons"):
        for method in ("atp", "ig"):
            with pytest.raises(ValueError, match=r"nodes: 'model\.decoder\.layers\.0\.fc2' .*shape \(12, (32|64)\) at its "
                                                 r"(output|input), not \(batch 2, position 6, …\)"):
                attribution_patching(m, ids, ids.flip(0), pyattr.targets.Logit(5), nodes=node, method=method,
                                     generic=True)
        with pytest.raises(ValueError, match=r"nodes: 'model\.decoder\.layers\.0\.fc2' .*not \(batch 1, position 6"):
            activation_patching(m, ids[:1], ids[1:], pyattr.targets.Logit(5), nodes=node, progress=False, generic=True)


def test_a_layer_norm_subclass_with_its_own_forward_is_probed():
    """Nemotron's LayerNorm1P is an nn.LayerNorm whose forward multiplies by (1 + w): the
    LN-rule must use 1 + w (probed), not w. Nemotron without biases conserves."""
    m = _built("NemotronConfig", **{**UNMAPPED_COMMON, "num_key_value_heads": 2})
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.normal_() if name.endswith("weight") else p.zero_()
    found = A.discover(m)
    assert (found.norm, found.offset) == ("layer_norm", 1.0)
    r = pyattr.relevance(m, _ids(), target=5, generic=True)
    assert (r.conservation_delta.abs() <= 1e-6 * r.target.abs()).all(), r.conservation_delta
    n = m.model.layers[0].input_layernorm
    x = torch.randn(3, 32, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 32, dtype=torch.float64)
    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules(normalization=True), generic=True):
        (gx,) = torch.autograd.grad(n(x), x, dy)
    g = dy * (n.weight + 1) / (x.var(-1, unbiased=False, keepdim=True) + n.eps).sqrt()
    torch.testing.assert_close(gx, g - g.mean(-1, keepdim=True))


@pytest.mark.parametrize("name", ["DeiT", "ViTMAE"])
def test_image_tokens_that_are_not_cls_then_patches_are_refused(name):
    """DeiT adds a distillation token after [CLS], ViT-MAE keeps a random quarter of the
    patches: the blocks' tokens are not [CLS] + the patches row by row, so relevance per
    patch would be laid out on the wrong patches (or on random ones). Refused, naming the
    token counts."""
    import transformers as T

    cfg = getattr(T, f"{name}Config")(image_size=32, patch_size=8, hidden_size=32, intermediate_size=48,
                                      num_attention_heads=4, num_hidden_layers=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    m = getattr(T, f"{name}Model")(cfg).eval()
    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    n = {"DeiT": 18, "ViTMAE": 5}[name]
    for call in (lambda: pyattr.relevance(m, px, target=lambda o: o.last_hidden_state[:, 0, 1], generic=True),
                 lambda: pyattr.layer_relevance(m, px, "residual", target=lambda o: o.last_hidden_state[:, 0, 1],
                                                generic=True)):
        with pytest.raises(ValueError, match=rf"inputs: .*{name}Model.* {n} tokens per image.*\[CLS\] \+ 4×4 patches"):
            call()


def test_inputs_run_position_first_are_refused():
    """XLNet transposes its token ids to (position, batch) before the embeddings and runs
    its blocks that way: on a square batch the relevance came back transposed with no
    error. Refused, with and without generic."""
    import transformers as T

    cfg = T.XLNetConfig(vocab_size=96, d_model=32, d_inner=48, n_layer=2, n_head=4)
    torch.manual_seed(0)
    m = T.XLNetLMHeadModel(cfg).eval()
    for ids in (_ids(batch=4, seq=4), _ids(batch=2, seq=6)):
        for generic in (False, True):
            with pytest.raises(ValueError, match=r"inputs: XLNetLMHeadModel .*\(position, batch"):
                pyattr.relevance(m, ids, target=5, rules=pyattr.RelevanceRules(), generic=generic)


def test_an_mlp_adding_its_aliased_input_is_not_the_contribution():
    """An MLP that keeps its input under another name and adds it back (as Gemma 4's audio
    feed-forward does: ``residual = hidden_states; …; hidden_states += residual``) returns
    the residual stream: its contribution is the down projection's output."""
    _, twin = _twin("llama")
    cls = type(twin.model.layers[0].mlp)

    class AddsItsInput(cls):
        def forward(self, x):
            residual = x
            x = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return x + residual

    for layer in twin.model.layers:
        layer.mlp.__class__ = AddsItsInput
    found = A.discover(twin)
    assert (found.mlp_out, found.neurons) == ("mlp.down_proj", ("mlp.down_proj", "input")), found
    ids = _ids()
    r = pyattr.layer_relevance(twin, ids, "mlp", target=5, rules=pyattr.RelevanceRules(), generic=True)
    assert r.paths == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    torch.testing.assert_close(r["model.layers.0.mlp.down_proj"].activation,
                               _tensor_at(twin, ids, "model.layers.0.mlp.down_proj", "output").float())


def test_a_layer_norm_of_another_width_takes_the_ln_rule():
    """ELECTRA's embeddings and generator head normalise over embedding_size, not the hidden
    size: left native, the head's scale invariance took all relevance (conservation delta
    100 % of the target). They carry the LN-rule now, and the model conserves."""
    m = _built("ElectraConfig", vocab_size=96, hidden_size=32, embedding_size=16, intermediate_size=48,
               num_hidden_layers=2, num_attention_heads=4, is_decoder=True)
    r = pyattr.relevance(m, _ids(), target=5, generic=True)
    assert {"electra.embeddings.LayerNorm", "generator_predictions.LayerNorm"} <= set(r.coverage.by_kind["normalization"])
    assert (r.conservation_delta.abs() <= 1e-6 * r.target.abs()).all(), (r.conservation_delta, r.target)


def test_an_input_an_inplace_activation_edits_is_refused():
    """A layer read at its input, where the module itself edits that tensor in place
    (nn.ReLU(inplace=True)): the recorded input would be relu(x). Refused."""
    _, twin = _twin("llama")
    for layer in twin.model.layers:
        layer.mlp.act_fn = torch.nn.ReLU(inplace=True)
    with pytest.raises(ValueError, match=r"layers: 'model\.layers\.0\.mlp\.act_fn': its input was changed in place"):
        pyattr.layer_relevance(twin, _ids(), "model.layers.0.mlp.act_fn", target=5, rules=pyattr.RelevanceRules(),
                               attribute_to_layer_input=True)
