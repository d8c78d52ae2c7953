"""Hugging Face gradient checkpointing with rule scopes: a recomputed block runs with exactly
the rules of its forward, whenever and in whatever scope the backward runs; never a mixture."""

import contextlib

import pytest
import torch

import pyattr
from models import VOCAB, tiny_causal_lm

LN = pyattr.RelevanceRules(normalization=True)
ALL = pyattr.RelevanceRules.all()
LRP = pyattr.RelevanceRules.all(attention="attnlrp")
MODES = ["reentrant", "non_reentrant"]


@contextlib.contextmanager
def _checkpointing(m, mode):
    """Checkpointing on (``mode`` None: off) in training mode, which is when Hugging Face
    checkpoints (the tiny configs have no dropout); both undone afterwards."""
    kw = {"use_reentrant": mode == "reentrant"}
    if mode is not None:
        if hasattr(m, "activation_checkpointing_enable"):  # the name since transformers 5.x
            m.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    m.train()
    try:
        yield
    finally:
        (getattr(m, "activation_checkpointing_disable", None) or m.gradient_checkpointing_disable)()
        m.eval()


def _scope(m, rules):
    return contextlib.nullcontext() if rules is None else pyattr.use_relevance_rules(m, rules)


def _grad(m, ids, forward_rules, backward_rules="same", mode=None):
    """Gradient of one logit w.r.t. the input embeddings: the forward under ``forward_rules``,
    the backward inside that scope ("same") or afterwards inside ``backward_rules``."""
    with _checkpointing(m, mode):
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        with _scope(m, forward_rules):
            out = m(inputs_embeds=emb).logits[0, -1, 5]
            if backward_rules == "same":
                out.backward()
        if backward_rules != "same":
            with _scope(m, backward_rules):
                out.backward()
    return emb.grad


@pytest.fixture(scope="module")
def setup():
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 7))
    rule, plain = _grad(m, ids, ALL), _grad(m, ids, None)
    assert (rule - plain).abs().max() > 1e-3  # the rules change the gradient here
    return m, ids, rule


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("inside", [True, False], ids=["backward_inside", "backward_after_scope"])
def test_checkpointed_rule_gradient_equals_unchecked(setup, mode, inside):
    m, ids, rule = setup
    g = _grad(m, ids, ALL, "same" if inside else None, mode)
    torch.testing.assert_close(g, rule, atol=1e-6, rtol=1e-5)
    # the model is back to its own forwards after the late backward
    assert all("forward" not in mod.__dict__ for mod in m.modules())


def test_checkpoint_function_restored_after_scope(setup):
    m, _, _ = setup
    with _checkpointing(m, "reentrant"):
        before = [mod.__dict__.get("_gradient_checkpointing_func") for mod in m.modules()]
        with pyattr.use_relevance_rules(m):
            inside = [mod.__dict__.get("_gradient_checkpointing_func") for mod in m.modules()]
        after = [mod.__dict__.get("_gradient_checkpointing_func") for mod in m.modules()]
    assert after == before and inside != before


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "forward_rules,backward_rules",
    [(None, ALL), (LN, ALL), (LN, LRP), (ALL, LRP), (LRP, None), (None, None)],
    ids=["plain->all", "ln->all", "ln->attnlrp", "all->attnlrp", "attnlrp->none", "plain->plain"],
)
def test_recomputation_uses_the_forward_rules(setup, mode, forward_rules, backward_rules):
    """The backward in another scope (or none) gives the forward's rule gradient."""
    m, ids, _ = setup
    expected = _grad(m, ids, forward_rules)
    g = _grad(m, ids, forward_rules, backward_rules, mode)
    torch.testing.assert_close(g, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_nested_scope_forward_backward_after_both(setup, mode):
    m, ids, rule = setup
    with _checkpointing(m, mode):
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        with pyattr.use_relevance_rules(m, LN), pyattr.use_relevance_rules(m, ALL):
            out = m(inputs_embeds=emb).logits[0, -1, 5]
        out.backward()
    torch.testing.assert_close(emb.grad, rule, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_enabled_inside_the_scope(setup, mode):
    m, ids, rule = setup
    with _checkpointing(m, None):
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        with pyattr.use_relevance_rules(m):
            # the older name, still the entry point of many scripts
            with pytest.warns((FutureWarning, DeprecationWarning)) if hasattr(m, "activation_checkpointing_enable") \
                    else contextlib.nullcontext():
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
            inner = [mod.__dict__.get("_gradient_checkpointing_func") for mod in m.modules()]
            out = m(inputs_embeds=emb).logits[0, -1, 5]
        out.backward()
        # the function enabled inside the scope is the one left after it (unwrapped)
        assert [mod.__dict__.get("_gradient_checkpointing_func") for mod in m.modules()] == inner
    torch.testing.assert_close(emb.grad, rule, atol=1e-6, rtol=1e-5)


def test_plain_and_rule_forwards_summed(setup):
    """A checkpointed plain forward and a rule forward, one backward inside the scope: each
    part keeps its own gradient."""
    m, ids, rule = setup
    plain = _grad(m, ids, None)
    with _checkpointing(m, "reentrant"):
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        a = m(inputs_embeds=emb).logits[0, -1, 5]
        with pyattr.use_relevance_rules(m):
            b = m(inputs_embeds=emb).logits[0, -1, 5]
            (a + b).backward()
    torch.testing.assert_close(emb.grad, plain + rule, atol=1e-6, rtol=1e-5)


def _enable(m, mode):
    kw = {"use_reentrant": mode == "reentrant"}
    if hasattr(m, "activation_checkpointing_enable"):
        m.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def _saved_bytes(fn):
    """(result, bytes autograd saved for backward during ``fn()``)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "gpt_neox", "bert"])
@pytest.mark.parametrize("mode", MODES)
def test_relevance_with_gradient_checkpointing_equals_without(arch, mode):
    """pyattr.relevance runs in eval mode, and Hugging Face checkpoints only in training
    mode: the checkpointing modules stay in training mode for the pass, and a reentrant
    checkpoint (which torch.autograd.grad refuses) runs non-reentrant. Same relevance, the
    blocks recomputed, less saved for backward; the model's flags and functions restored."""
    m = tiny_causal_lm(arch)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    targets = torch.tensor([[1, 2, 3], [4, 5, 6]])
    want, plain_bytes = _saved_bytes(lambda: pyattr.relevance(m, ids, target=targets))
    _enable(m, mode)
    try:
        funcs = [mod.__dict__.get("_gradient_checkpointing_func") for mod in m.modules()]
        blocks = [mod for mod in m.modules() if getattr(mod, "gradient_checkpointing", False) is True]
        leaf = next(c for c in blocks[-1].modules() if not list(c.children()) and list(c.parameters()))
        calls = []
        hook = leaf.register_forward_pre_hook(lambda *a: calls.append(1))
        got, ckpt_bytes = _saved_bytes(lambda: pyattr.relevance(m, ids, target=targets))
        hook.remove()
        assert len(calls) == 2  # the forward, and its recomputation in the backward
        # within 1e-6 of the largest relevance (batched recomputation rounds differently)
        assert (got.relevance - want.relevance).abs().max() <= 1e-6 * want.relevance.abs().max()
        # GPT-2's forward takes another path under checkpointing (no cache) that rounds
        # differently by a few float32 ulps
        assert (got.target - want.target).abs().max() <= 1e-5 * want.target.abs().max()
        assert ckpt_bytes < 0.5 * plain_bytes, (ckpt_bytes, plain_bytes)
        assert [mod.__dict__.get("_gradient_checkpointing_func") for mod in m.modules()] == funcs
        assert not any(mod.training for mod in m.modules())
        assert all(p.requires_grad for p in m.parameters())
    finally:
        (getattr(m, "activation_checkpointing_disable", None) or m.gradient_checkpointing_disable)()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer, kw", [("model.layers.0.self_attn", {}), ("model.layers.0.mlp", {"attribute_to_layer_input": True}),
                                       ("model.layers.1.post_attention_layernorm", {})])
def test_integrated_gradients_at_a_layer_inside_a_checkpointed_block(mode, layer, kw):
    """The path point replaces the layer's value in the forward and again in the block's
    recomputation during the backward (reported: the recomputation used the model's own
    activation, max |diff| 1.06 of 2.07)."""
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    want = pyattr.integrated_gradients(m, ids, n_steps=3, layer=layer, **kw)
    _enable(m, mode)
    try:
        got = pyattr.integrated_gradients(m, ids, n_steps=3, layer=layer, **kw)
    finally:
        (getattr(m, "activation_checkpointing_disable", None) or m.gradient_checkpointing_disable)()
    torch.testing.assert_close(got.attribution, want.attribution, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.convergence_delta, want.convergence_delta, rtol=1e-5, atol=1e-6)


def test_reentrant_checkpointing_inside_an_open_scope():
    """Reported: inside use_relevance_rules the scope had wrapped the checkpoint function,
    so the reentrant one was not recognised and torch refused autograd.grad."""
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    want = pyattr.relevance(m, ids)
    _enable(m, "reentrant")
    try:
        with pyattr.use_relevance_rules(m):
            got = pyattr.relevance(m, ids)
            lay = pyattr.layer_relevance(m, ids, layers="residual")
    finally:
        (getattr(m, "activation_checkpointing_disable", None) or m.gradient_checkpointing_disable)()
    assert (got.relevance - want.relevance).abs().max() <= 1e-6 * want.relevance.abs().max()
    assert (lay["model.layers.0"].relevance - want.relevance).abs().max() <= 1e-6 * want.relevance.abs().max()
