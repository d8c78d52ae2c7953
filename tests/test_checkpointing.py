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


def _ref(m, ids, rules):
    """Gradient without checkpointing under ``rules`` (None: plain gradient)."""
    emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
    if rules is None:
        m(inputs_embeds=emb).logits[0, -1, 5].backward()
    else:
        with pyattr.use_relevance_rules(m, rules):
            m(inputs_embeds=emb).logits[0, -1, 5].backward()
    return emb.grad


LN = pyattr.RelevanceRules(normalization=True)
ALL = pyattr.RelevanceRules.all()
LRP = pyattr.RelevanceRules.all(attention="attnlrp")


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize(
    "forward_rules,backward_rules",
    [(None, ALL), (LN, ALL), (LN, LRP), (ALL, LRP), (LRP, None), (None, None)],
    ids=["plain->all", "ln->all", "ln->attnlrp", "all->attnlrp", "attnlrp->none", "plain->plain"],
)
def test_recomputation_uses_the_forward_rules(setup, mode, forward_rules, backward_rules):
    """Whatever scope the backward runs in, a checkpointed block recomputes with the rules of
    its forward: the gradient is the one of the forward's rules without checkpointing."""
    m, ids, _ = setup
    expected = _ref(m, ids, forward_rules)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    m.train()
    try:
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        if forward_rules is None:
            out = m(inputs_embeds=emb).logits[0, -1, 5]
        else:
            with pyattr.use_relevance_rules(m, forward_rules):
                out = m(inputs_embeds=emb).logits[0, -1, 5]
        if backward_rules is None:
            out.backward()
        else:
            with pyattr.use_relevance_rules(m, backward_rules):
                out.backward()
    finally:
        m.gradient_checkpointing_disable()
        m.eval()
    torch.testing.assert_close(emb.grad, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_nested_scope_forward_backward_after_both(setup, mode):
    m, ids, _ = setup
    expected = _ref(m, ids, ALL)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    m.train()
    try:
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        with pyattr.use_relevance_rules(m, LN):
            with pyattr.use_relevance_rules(m, ALL):
                out = m(inputs_embeds=emb).logits[0, -1, 5]
        out.backward()
    finally:
        m.gradient_checkpointing_disable()
        m.eval()
    torch.testing.assert_close(emb.grad, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpointing_enabled_inside_the_scope(setup, mode):
    m, ids, rule = setup
    m.train()
    try:
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        with pyattr.use_relevance_rules(m):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
            inner = [mod.__dict__.get("_gradient_checkpointing_func") for mod in m.modules()]
            out = m(inputs_embeds=emb).logits[0, -1, 5]
        out.backward()
        # the function enabled inside the scope is the one left after it (unwrapped)
        after = [mod.__dict__.get("_gradient_checkpointing_func") for mod in m.modules()]
        assert after == inner
    finally:
        m.gradient_checkpointing_disable()
        m.eval()
    torch.testing.assert_close(emb.grad, rule, atol=1e-6, rtol=1e-5)


def test_plain_and_rule_forwards_summed(setup):
    """A checkpointed plain forward and a rule forward, one backward inside the scope: each
    part keeps its own gradient."""
    m, ids, rule = setup
    plain = _ref(m, ids, None)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    m.train()
    try:
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        a = m(inputs_embeds=emb).logits[0, -1, 5]
        with pyattr.use_relevance_rules(m):
            b = m(inputs_embeds=emb).logits[0, -1, 5]
            (a + b).backward()
    finally:
        m.gradient_checkpointing_disable()
        m.eval()
    torch.testing.assert_close(emb.grad, plain + rule, atol=1e-6, rtol=1e-5)
