"""Conservation on BERT's masked-LM head: its transform (dense → GELU → LayerNorm) carries
the rules like the encoder does, so with every bias zero nothing absorbs relevance."""

import torch

import pyattr
from models import tiny_causal_lm


def test_bert_mlm_head_conserves_when_every_bias_is_zero():
    # In the tiny BertForMaskedLM every bias (LayerNorm biases included) is zero, so
    # nothing may absorb relevance; an unruled head transform lost ~95 % of row 1's target
    m = tiny_causal_lm("bert")
    assert all(p.abs().max() == 0 for n, p in m.named_parameters() if n.endswith("bias"))
    torch.manual_seed(1)
    ids = torch.randint(1, 96, (2, 7))
    res = pyattr.relevance(m, ids, target=torch.tensor([3, 50]))
    assert res.conservation_delta.abs().max() <= 1e-4 * res.target.abs().max(), (
        res.target, res.token_relevance.sum(-1), res.conservation_delta)


def test_bert_residual_layers_conserve_when_every_bias_is_zero():
    m = tiny_causal_lm("bert")
    torch.manual_seed(1)
    ids = torch.randint(1, 96, (2, 7))
    lr = pyattr.layer_relevance(m, ids, "residual", target=torch.tensor([3, 50]))
    assert lr.paths == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    for path in lr.paths:
        d = lr[path].conservation_delta
        assert d.abs().max() <= 1e-4 * lr.target.abs().max(), (path, lr.target, d)


def test_bert_head_mounts_are_reported_and_absent_without_a_head():
    m = tiny_causal_lm("bert")
    with pyattr.use_relevance_rules(m) as cov:
        assert "cls.predictions.transform.LayerNorm" in cov.by_kind["normalization"]
        assert "cls.predictions.transform.transform_act_fn" in cov.by_kind["activation"]
    base = m.bert
    with pyattr.use_relevance_rules(base) as cov:
        assert not any("cls." in p for p in cov.installed)
