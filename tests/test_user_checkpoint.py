"""torch's activation checkpointing called by the user, not through Hugging Face's
``_gradient_checkpointing_func``: ``torch.utils.checkpoint.checkpoint`` around the whole
model or a block (reentrant or not), and ``checkpoint_wrapper`` (FSDP's and accelerate's).
Reported: inside a scope the reentrant recomputation ran without rules (the gradient was the
plain one, silently) and the non-reentrant one died with torch's CheckpointError."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import pyattr
from models import VOCAB, tiny_causal_lm

LRP = pyattr.RelevanceRules.all(attention="attnlrp")


@pytest.fixture(scope="module")
def setup():
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    return m, ids


def _want(m, ids, rules=None):
    return pyattr.relevance(m, ids, target=5, rules=rules).token_relevance


def _user(m, ids, reentrant, rules=None, backward_outside=False):
    """Gradient × input of logit 5 with the forward checkpointed by the user's own call."""
    emb = m.get_input_embeddings()(ids).detach().requires_grad_()
    with pyattr.use_relevance_rules(m, rules) if rules is not None else pyattr.use_relevance_rules(m):
        y = checkpoint(lambda e: m(inputs_embeds=e, use_cache=False).logits, emb, use_reentrant=reentrant)[0, -1, 5]
        if not backward_outside:
            y.backward()
    if backward_outside:
        y.backward()
    return (emb * emb.grad).sum(-1)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("backward_outside", [False, True], ids=["backward_inside", "backward_after_scope"])
def test_users_own_checkpoint_gives_the_rule_gradient(setup, reentrant, backward_outside):
    m, ids = setup
    want = _want(m, ids)
    plain = _want(m, ids, pyattr.RelevanceRules())
    assert (want - plain).abs().max() > 1e-2  # the rules change the gradient here
    got = _user(m, ids, reentrant, backward_outside=backward_outside)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_users_own_checkpoint_under_attnlrp(setup, reentrant):
    m, ids = setup
    torch.testing.assert_close(_user(m, ids, reentrant, rules=LRP), _want(m, ids, LRP), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpointed_outside_every_scope_recomputes_plainly_inside_one(setup, reentrant):
    """The forward ran without rules: its recomputation inside a scope runs without them."""
    m, ids = setup
    emb = m.get_input_embeddings()(ids).detach().requires_grad_()
    y = checkpoint(lambda e: m(inputs_embeds=e, use_cache=False).logits, emb, use_reentrant=reentrant)[0, -1, 5]
    with pyattr.use_relevance_rules(m):
        y.backward()
    torch.testing.assert_close((emb * emb.grad).sum(-1), _want(m, ids, pyattr.RelevanceRules()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["REENTRANT", "NO_REENTRANT"])
def test_checkpoint_wrapper_blocks(impl):
    wrapper = pytest.importorskip("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    want = _want(m, ids)
    for i, layer in enumerate(m.model.layers):
        m.model.layers[i] = wrapper.checkpoint_wrapper(layer, checkpoint_impl=getattr(wrapper.CheckpointImpl, impl))
    emb = m.get_input_embeddings()(ids).detach().requires_grad_()
    with pyattr.use_relevance_rules(m):
        m(inputs_embeds=emb, use_cache=False).logits[0, -1, 5].backward()
    torch.testing.assert_close((emb * emb.grad).sum(-1), want, rtol=1e-5, atol=1e-6)
    if impl == "NO_REENTRANT":  # torch.autograd.grad refuses reentrant checkpoints (said so by name)
        torch.testing.assert_close(_want(m, ids), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inner", ["hf_reentrant", "hf_non_reentrant", "wrapper_non_reentrant"])
def test_checkpointed_blocks_inside_a_checkpointed_model_backward_after_the_scope(inner):
    """Reported: the blocks' own checkpoints, started during the outer recomputation (after the
    scope closed), recomputed without rules (reentrant) or died with CheckpointError."""
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    want = _want(m, ids)
    if inner.startswith("hf"):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": inner == "hf_reentrant"})
        m.train()  # the tiny config has no dropout; Hugging Face checkpoints in training mode only
    else:
        wrapper = pytest.importorskip("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
        for i, layer in enumerate(m.model.layers):
            m.model.layers[i] = wrapper.checkpoint_wrapper(layer, checkpoint_impl=wrapper.CheckpointImpl.NO_REENTRANT)
    emb = m.get_input_embeddings()(ids).detach().requires_grad_()
    with pyattr.use_relevance_rules(m):
        y = checkpoint(lambda e: m(inputs_embeds=e, use_cache=False).logits, emb, use_reentrant=True)[0, -1, 5]
    y.backward()
    torch.testing.assert_close((emb * emb.grad).sum(-1), want, rtol=1e-5, atol=1e-6)


def test_selective_checkpointing_on_the_scopes_first_call():
    """Reported: the first call's check of a rebuilt forward ran inside selective activation
    checkpointing's dispatch mode, which cached its ops: the recomputation got them out of order."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *a, **k):
        saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    m = tiny_causal_lm("llama", seed=3)  # a model of its own: the check runs on its first call
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5))
    want = _want(m, ids)
    m = tiny_causal_lm("llama", seed=3)
    emb = m.get_input_embeddings()(ids).detach().requires_grad_()
    with pyattr.use_relevance_rules(m):
        y = checkpoint(lambda e: m(inputs_embeds=e, use_cache=False).logits, emb, use_reentrant=False,
                       context_fn=partial(create_selective_checkpoint_contexts, policy))[0, -1, 5]
        y.backward()
    torch.testing.assert_close((emb * emb.grad).sum(-1), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_nnsight_model_recomputed_under_other_rules_keeps_the_open_scopes_rules(reentrant):
    """Reported: a recomputation put the open scope's rule forwards back by ``__dict__``, where
    nnsight holds them in its controller: later backwards in that scope ran without them."""
    nnsight = pytest.importorskip("nnsight")
    m = tiny_causal_lm("gpt_neox")
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(6))
    ln = pyattr.RelevanceRules(normalization=True)
    want_all, want_ln = _want(m, ids), _want(m, ids, ln)
    nm = nnsight.NNsight(m)
    inner = nm._module
    emb = inner.get_input_embeddings()(ids).detach().requires_grad_()
    with pyattr.use_relevance_rules(nm, ln):
        y = checkpoint(lambda e: inner(inputs_embeds=e, use_cache=False).logits, emb, use_reentrant=reentrant)[0, -1, 5]
    with pyattr.use_relevance_rules(nm):
        y.backward()  # recomputed with the forward's LN-rule alone
        torch.testing.assert_close((emb * emb.grad).sum(-1), want_ln, rtol=1e-5, atol=1e-6)
        e2 = inner.get_input_embeddings()(ids).detach().requires_grad_()
        inner(inputs_embeds=e2, use_cache=False).logits[0, -1, 5].backward()
        torch.testing.assert_close((e2 * e2.grad).sum(-1), want_all, rtol=1e-5, atol=1e-6)
