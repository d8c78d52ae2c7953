"""Hugging Face gradient checkpointing inside and after a rule scope: rule gradients, never a mixture."""

import pytest
import torch

import pyattr
from models import VOCAB, tiny_causal_lm


def _grads(m, ids, tid, *, checkpoint=None, backward_inside=True, rules=True):
    """Gradient of one logit with respect to the input embeddings, rules on or off."""
    if checkpoint is not None:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpoint == "reentrant"})
    else:
        m.gradient_checkpointing_disable()
    m.train()  # Hugging Face checkpoints only in training mode (the tiny configs have no dropout)
    emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
    try:
        if not rules:
            m(inputs_embeds=emb).logits[0, -1, tid].backward()
            return emb.grad
        with pyattr.use_relevance_rules(m):
            out = m(inputs_embeds=emb).logits[0, -1, tid]
            if backward_inside:
                out.backward()
        if not backward_inside:
            out.backward()
        return emb.grad
    finally:
        m.gradient_checkpointing_disable()
        m.eval()


@pytest.fixture(scope="module")
def setup():
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 7))
    rule = _grads(m, ids, 5)
    plain = _grads(m, ids, 5, rules=False)
    assert (rule - plain).abs().max() > 1e-3  # the rules change the gradient here
    return m, ids, rule


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("inside", [True, False], ids=["backward_inside", "backward_after_scope"])
def test_checkpointed_rule_gradient_equals_unchecked(setup, mode, inside):
    m, ids, rule = setup
    g = _grads(m, ids, 5, checkpoint=mode, backward_inside=inside)
    torch.testing.assert_close(g, rule, atol=1e-6, rtol=1e-5)
    # the model is back to its own forwards after the late backward
    assert all("forward" not in mod.__dict__ for mod in m.modules())


def test_checkpoint_function_restored_after_scope(setup):
    m, _, _ = setup
    m.gradient_checkpointing_enable()
    try:
        before = [mod.__dict__.get("_gradient_checkpointing_func") for mod in m.modules()]
        with pyattr.use_relevance_rules(m):
            inside = [mod.__dict__.get("_gradient_checkpointing_func") for mod in m.modules()]
        after = [mod.__dict__.get("_gradient_checkpointing_func") for mod in m.modules()]
        assert after == before and inside != before
    finally:
        m.gradient_checkpointing_disable()


def test_late_backward_conflicting_scope_raises(setup):
    m, ids, _ = setup
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    m.train()
    try:
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention="frozen")):
            out = m(inputs_embeds=emb).logits[0, -1, 5]
        with pyattr.use_relevance_rules(m, pyattr.RelevanceRules.all(attention="attnlrp")):
            with pytest.raises(pyattr.RelevanceRuleConflictError, match="already carries the attention rule"):
                out.backward()
    finally:
        m.gradient_checkpointing_disable()
        m.eval()
