"""``torch.func`` transforms (grad, vjp, jacrev) around the user's forward inside a scope.
Reported: they failed with torch's message about autograd.Function.setup_context (the
attention Functions) and about saved-tensor hooks (the first call's check of a rebuilt
forward). Now each gives pyattr.relevance's numbers."""

import pytest
import torch
import torch.func as tf

import pyattr
from models import VOCAB, tiny_causal_lm

LRP = pyattr.RelevanceRules.all(attention="attnlrp")


def _scope(m, rules):
    return pyattr.use_relevance_rules(m) if rules is None else pyattr.use_relevance_rules(m, rules)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("rules", [None, LRP], ids=["default", "attnlrp"])
def test_grad_and_vjp_equal_relevance(attn, rules):
    m = tiny_causal_lm("llama", attn=attn)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    emb = m.get_input_embeddings()(ids).detach()
    want = pyattr.relevance(m, ids, target=5, rules=rules).token_relevance
    plain = pyattr.relevance(m, ids, target=5, rules=pyattr.RelevanceRules()).token_relevance
    assert (want - plain).abs().max() > 1e-3  # the rules change the gradient here

    def f(e):
        return m(inputs_embeds=e).logits[0, -1, 5]

    with _scope(m, rules):
        g = tf.grad(f)(emb)
        _, vjp = tf.vjp(f, emb)
        gv = vjp(torch.tensor(1.0))[0]
    for got in (g, gv):
        torch.testing.assert_close((got * emb).sum(-1), want, rtol=1e-5, atol=1e-7)


def test_jacrev_of_two_targets():
    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    emb = m.get_input_embeddings()(ids).detach()
    want = torch.stack([pyattr.relevance(m, ids, target=t).token_relevance[0] for t in (5, 7)])
    with pyattr.use_relevance_rules(m):
        jac = tf.jacrev(lambda e: m(inputs_embeds=e).logits[0, -1, [5, 7]])(emb)  # (2, 1, seq, hidden)
    torch.testing.assert_close((jac * emb).sum(-1)[:, 0], want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("how", ["jvp", "jacfwd", "forward_ad"])
def test_forward_mode_is_refused_by_name(how):
    """Reported: forward-mode AD inside a scope failed with torch's message about a missing jvp,
    naming neither pyattr nor what to do instead."""
    import torch.autograd.forward_ad as fwAD

    m = tiny_causal_lm("llama")
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    emb = m.get_input_embeddings()(ids).detach()

    def f(e):
        return m(inputs_embeds=e).logits[0, -1, 5]

    with pyattr.use_relevance_rules(m):
        with pytest.raises(NotImplementedError, match=r"pyattr's relevance rules are defined on the backward pass; "
                                                      r"forward-mode AD .* Use reverse mode"):
            if how == "jvp":
                tf.jvp(f, (emb,), (torch.ones_like(emb),))
            elif how == "jacfwd":
                tf.jacfwd(f)(emb)
            else:
                with fwAD.dual_level():
                    f(fwAD.make_dual(emb, torch.ones_like(emb)))
    tf.jvp(f, (emb,), (torch.ones_like(emb),))  # outside the scope: the model's own
