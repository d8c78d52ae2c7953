"""``pyattr.audit`` and the generic plan check built on it (pyattr/integration/audit.py,
plan_check.py): per-module balances against relevance's own numbers, bias accounting, a
nonlinearity without its rule found where it is computed, and fail-closed generic scopes."""

import warnings

import pytest
import torch
from torch import nn

import pyattr
from models import tiny_causal_lm, tiny_encoder, tiny_unmapped

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(batch=2, seq=7, seed=1):
    return torch.randint(3, 96, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_a_mapped_model_balances_at_every_module_and_matches_relevance():
    m = tiny_causal_lm("llama", dtype=torch.float64)
    ids = _ids()
    a = pyattr.audit(m, ids, target=5)
    r = pyattr.relevance(m, ids, target=5)
    assert a.leaks == []
    assert a.entry_relevance == pytest.approx(float(r.relevance.double().sum()), rel=1e-5)  # relevance is float32
    assert a.target == pytest.approx(float(r.target.sum()), rel=1e-12)
    assert abs(a.gap) <= 1e-6 * abs(a.target)
    paths = [g.path for g in a.modules]
    assert "model.layers.1.mlp" in paths and "lm_head" in paths
    # with every rule off, the norms and activations are where relevance is lost
    off = pyattr.audit(m, ids, target=5, rules=pyattr.RelevanceRules())
    leaking = {g.path for g in off.leaks}
    assert {"model.layers.0.input_layernorm", "model.norm"} <= leaking
    assert sum(g.own_gap for g in off.modules) == pytest.approx(off.gap, rel=1e-6, abs=1e-9)


def test_biases_are_measured_not_guessed():
    """BERT with its biases: target = entry relevance + Σ b·∂̃b, per module and in total."""
    m = tiny_encoder("bert").double()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    ids = _ids(1, 6)
    a = pyattr.audit(m, ids, target=7)
    assert abs(a.bias_relevance) > 1e-3 * abs(a.target)
    assert a.target == pytest.approx(a.entry_relevance + a.bias_relevance, rel=1e-8)
    dense = next(g for g in a.modules if g.path == "bert.encoder.layer.0.intermediate.dense")
    assert dense.relevance_in + dense.bias_relevance == pytest.approx(dense.relevance_out, rel=1e-9)
    assert a.to_pandas().shape[0] == len(a.modules)


class _LeakyMLP(nn.Module):
    """A gated MLP whose forward adds exp(x) − 1: a nonlinearity no rule covers."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + (torch.exp(0.1 * x) - 1.0)


def test_an_uncovered_nonlinearity_is_found_where_it_is_computed_and_refused():
    m = tiny_unmapped("GraniteConfig")
    m.model.layers[1].mlp = _LeakyMLP(m.model.layers[1].mlp)
    ids = _ids()
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError,
                       match=r"placed no rule: 'model.layers.1.mlp' \(_LeakyMLP\) loses [-0-9.e]+ of"):
        pyattr.relevance(m, ids, generic=True)
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError, match="_LeakyMLP"):
        pyattr.relevance(m, ids, generic="partial")  # an undeclared loss is refused whatever the opt-in
    # the same model without the addition: right, no warning
    m.model.layers[1].mlp = m.model.layers[1].mlp.inner
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = pyattr.relevance(m, ids, generic=True)
    assert (r.conservation_delta.abs() <= 1e-6 * r.target.abs()).all()


def test_the_audit_names_the_leak_on_the_callers_input():
    m = tiny_unmapped("GraniteConfig")
    m.model.layers[0].mlp = _LeakyMLP(m.model.layers[0].mlp)
    a = pyattr.audit(m, _ids(), target=3, generic=True)  # the audit itself does not refuse: it shows
    assert [g.path for g in a.leaks] == ["model.layers.0.mlp"] and a.leaks[0].cls == "_LeakyMLP"
    assert abs(a.leaks[0].own_gap) == pytest.approx(abs(a.gap), rel=1e-4)  # the rest: the norms' float32 casts
    assert "model.layers.0.mlp (_LeakyMLP): own gap" in repr(a)


def test_generic_mode_is_validated():
    m = tiny_unmapped("GraniteConfig")
    with pytest.raises(ValueError, match=r"generic must be False, True or 'partial'.*got 'yes'"):
        pyattr.relevance(m, _ids(), generic="yes")


def test_a_declared_missing_entry_is_honoured_and_models_without_embeddings_are_refused():
    """FNet: discovery finds no blocks, so no entry; the raw word embeddings are not where the
    residual stream starts, and pyattr refuses instead of reading relevance there. ResNet has
    no input embeddings at all (transformers raises NotImplementedError): a ValueError."""
    import transformers as T

    fnet = T.FNetForMaskedLM(T.FNetConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=48, vocab_size=96,
                                          max_position_embeddings=64)).eval()
    for rules in (None, pyattr.RelevanceRules()):
        with pytest.raises(ValueError, match=r"needs the 'entry' role.*FNetForMaskedLM.*no blocks"):
            pyattr.relevance(fnet, _ids(1, 6), rules=rules, generic=True)
    resnet = T.ResNetForImageClassification(T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                           num_labels=3)).eval()
    with pytest.raises(ValueError, match=r"'entry' role.*ResNetForImageClassification"):
        pyattr.relevance(resnet, torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)),
                         rules=pyattr.RelevanceRules(), generic=True)


def test_left_padding_is_refused_where_the_forward_does_not_name_position_ids():
    """BartForCausalLM's forward takes **kwargs but no position_ids: ids passed there vanish,
    so a left-padded row would see shifted positions. Refused; right padding still works."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.BartConfig(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64)
    m = T.BartForCausalLM(cfg).eval()
    ids = _ids(2, 6)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match=r"pads some rows on the left, but BartForCausalLM.forward takes no position_ids"):
        pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, rules=pyattr.RelevanceRules())
    right = torch.ones_like(ids)
    right[0, -2:] = 0
    r = pyattr.relevance(m, {"input_ids": ids, "attention_mask": right}, target=[5, 5], rules=pyattr.RelevanceRules())
    alone = pyattr.relevance(m, ids[:1, :4], target=[5], rules=pyattr.RelevanceRules())
    torch.testing.assert_close(r.token_relevance[0, :4], alone.token_relevance[0], rtol=1e-4, atol=1e-6)
