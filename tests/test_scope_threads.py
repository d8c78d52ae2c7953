"""A rule scope is its thread's. The rules sit on the model's modules, which every thread
shares: reported, a scope open in one thread gave another thread's plain backward (and its own
LN-rule-only scope) the first thread's rules, silently. Now a forward that records a gradient
in another thread, or a scope opened there, raises; a forward under ``no_grad`` runs (its
value is the model's own either way)."""

import threading

import pytest
import torch

import pyattr
from models import VOCAB, tiny_causal_lm

ATTENTION_ONLY = pyattr.RelevanceRules(attention=True)


def _grad_x_input(m, ids):
    emb = m.get_input_embeddings()(ids).detach().requires_grad_()
    m(inputs_embeds=emb).logits[0, -1, 5].backward()
    return (emb * emb.grad).sum(-1)


def _in_other_thread(m, scope, calls):
    """Run each of ``calls`` in a second thread while ``scope`` is open in this one; the
    exception each raised, or None."""
    out = {}

    def other():
        for name, fn in calls.items():
            try:
                fn()
                out[name] = None
            except Exception as e:  # noqa: BLE001 - the test reads it
                out[name] = e

    with scope:
        t = threading.Thread(target=other)
        t.start()
        t.join(timeout=120)
    assert not t.is_alive()
    return out


@pytest.mark.parametrize("rules", [None, ATTENTION_ONLY], ids=["default", "attention_only"])
def test_other_threads_gradient_and_scope_raise(rules):
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    plain = pyattr.relevance(m, ids, target=5, rules=pyattr.RelevanceRules()).token_relevance
    ref = m(ids).logits
    scope = pyattr.use_relevance_rules(m) if rules is None else pyattr.use_relevance_rules(m, rules)
    out = _in_other_thread(m, scope, {
        "plain": lambda: _grad_x_input(m, ids),
        "scope": lambda: pyattr.use_relevance_rules(m, pyattr.RelevanceRules(normalization=True)).__enter__(),
        "relevance": lambda: pyattr.relevance(m, ids, target=5),
        "no_grad": lambda: torch.testing.assert_close(torch.no_grad()(m)(ids).logits, ref, rtol=0, atol=0),
    })
    assert out["no_grad"] is None
    for name in ("plain", "scope", "relevance"):
        assert isinstance(out[name], pyattr.RelevanceRuleConflictError), (name, out[name])
        assert "another thread" in str(out[name]) and "its own copy of the model" in str(out[name])
    # the scope closed cleanly in its thread: plain gradients again, here and in a thread
    torch.testing.assert_close(_grad_x_input(m, ids), plain, rtol=1e-5, atol=1e-6)
    done = _in_other_thread(m, pyattr.use_relevance_rules(tiny_causal_lm("llama", seed=1)),
                            {"plain": lambda: torch.testing.assert_close(_grad_x_input(m, ids), plain, rtol=1e-5,
                                                                         atol=1e-6)})
    assert done["plain"] is None  # a scope on another model leaves this one alone


def test_each_thread_its_own_model_copy():
    """The remedy the message names: a copy per thread, each with its own scope."""
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    a, b = tiny_causal_lm("llama"), tiny_causal_lm("llama")
    want = pyattr.relevance(a, ids, target=5).token_relevance
    got = {}

    def run(name, m):
        with pyattr.use_relevance_rules(m):
            got[name] = _grad_x_input(m, ids)

    ts = [threading.Thread(target=run, args=(n, m)) for n, m in (("a", a), ("b", b))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    for name in "ab":
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6)


def test_generic_scope_functional_rules_stay_in_their_thread():
    from models import tiny_unmapped

    m = tiny_unmapped("CohereConfig", torch.float32)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    plain = pyattr.relevance(m, ids, target=5, rules=pyattr.RelevanceRules(), generic=True).token_relevance
    out = _in_other_thread(m, pyattr.use_relevance_rules(m, generic=True),
                           {"plain": lambda: _grad_x_input(m, ids), "no_grad": lambda: torch.no_grad()(m)(ids)})
    assert isinstance(out["plain"], pyattr.RelevanceRuleConflictError) and "another thread" in str(out["plain"])
    assert out["no_grad"] is None
    torch.testing.assert_close(_grad_x_input(m, ids), plain, rtol=1e-5, atol=1e-6)


def test_a_scope_belongs_to_its_thread_not_to_a_reused_thread_ident():
    """Reported: ownership by ``threading.get_ident()`` passed to a later, unrelated thread that
    got the same ident. A thread opens a scope and ends without closing it; any later thread,
    whatever its ident, is not its owner."""
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    scope = pyattr.use_relevance_rules(m)
    opener = threading.Thread(target=scope.__enter__)
    opener.start()
    opener.join()
    try:
        for _ in range(3):  # a new thread, often with the ended one's ident
            got = {}
            t = threading.Thread(target=lambda: got.setdefault("e", _raises(lambda: _grad_x_input(m, ids))))
            t.start()
            t.join()
            assert isinstance(got["e"], pyattr.RelevanceRuleConflictError), got
    finally:
        scope.__exit__(None, None, None)


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads it
        return e
    return None


def test_a_checkpoint_swaps_only_its_own_threads_models():
    """Reported: a checkpoint recorded and, in its recomputation, swapped the rules of every
    scoped model, another thread's own copy included (that thread got its previous rules)."""
    from torch.utils.checkpoint import checkpoint

    from pyattr.integration.checkpoint import _scoped_modules

    a, b = tiny_causal_lm("llama"), tiny_causal_lm("llama", seed=1)
    inside, release, seen = threading.Event(), threading.Event(), {}

    def other():
        with pyattr.use_relevance_rules(b):
            inside.set()
            release.wait(60)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(60)
        with pyattr.use_relevance_rules(a):
            mods = {id(x) for x in _scoped_modules()}
            seen["a"] = all(id(x) in mods for x in a.modules())
            seen["b"] = any(id(x) in mods for x in b.modules())
            ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
            emb = a.get_input_embeddings()(ids).detach().requires_grad_()
            checkpoint(lambda e: a(inputs_embeds=e, use_cache=False).logits, emb,
                       use_reentrant=False)[0, -1, 5].backward()
    finally:
        release.set()
        t.join(60)
    assert seen == {"a": True, "b": False}
    torch.testing.assert_close((emb * emb.grad).sum(-1), pyattr.relevance(a, ids, target=5).token_relevance,
                               rtol=1e-5, atol=1e-6)
