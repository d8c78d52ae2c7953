"""Second-order gradients through every rule op on every backend: the reference's result.

Oracle: ``gradgradcheck`` differentiates the rule backward numerically (float64), so the
second backward must be the derivative of the first-order rule gradient, on every backend;
and every backend's second-order result must equal the ``torch`` backend's.
"""

import pytest
import torch

import pyattr
from conftest import cpu_backends
from models import VOCAB, tiny_causal_lm
from pyattr.ops import gated_activation, layer_norm, rms_norm
from pyattr.rules import half_rule, identity_rule, ln_rule, ln_rule_grad, scale_gradient

ACTS = ["silu", "gelu", "gelu_tanh", "quick_gelu", "relu", torch.tanh]


def _ops():
    w = torch.randn(6, dtype=torch.float64) + 1.5
    b = torch.randn(6, dtype=torch.float64)
    yield "layer_norm", lambda x: layer_norm(x, w, b, 1e-5)
    yield "layer_norm_noaffine", lambda x: layer_norm(x, None, None, 1e-5)
    yield "rms_norm", lambda x: rms_norm(x, w, 1e-6)
    yield "rms_norm_offset", lambda x: rms_norm(x, w, 1e-6, offset=1.0)
    for a in ACTS:
        name = a if isinstance(a, str) else "custom"
        yield f"identity_{name}", (lambda a: lambda x: identity_rule(x, a))(a)
        for ident, half in [(True, True), (True, False), (False, True)]:
            yield f"gated_{name}_{int(ident)}{int(half)}", (
                lambda a, i, h: lambda x: gated_activation(x, x.flip(-1) * 0.7 + 0.1, a, identity=i, half=h)
            )(a, ident, half)
    yield "half", lambda x: half_rule(x, x.roll(1, -1) + 0.3)
    yield "ln_rule", lambda x: ln_rule(x - x.mean(-1, keepdim=True), x.std(-1, keepdim=True))
    yield "scale_gradient", lambda x: scale_gradient(x * x, 0.25)


OPS = dict(_ops())


def _x():
    g = torch.Generator().manual_seed(3)
    # away from 0 so that ReLU's kink is not inside the finite-difference step
    x = torch.randn(3, 6, dtype=torch.float64, generator=g)
    return (x + 0.2 * torch.sign(x)).requires_grad_(True)


def _second_order(fn, x, dy):
    (g,) = torch.autograd.grad(fn(x), x, dy, create_graph=True)
    (gg,) = torch.autograd.grad((g * g).sum(), x)
    return g, gg


@pytest.mark.parametrize("name", list(OPS))
def test_gradgradcheck_every_backend(name, backend_name):
    fn = OPS[name]
    x = _x()
    assert torch.autograd.gradgradcheck(fn, (x,), eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(OPS))
def test_second_order_matches_reference_backend(name):
    fn = OPS[name]
    x = _x()
    dy = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with pyattr.backend("torch"):
        g_ref, gg_ref = _second_order(fn, x, dy)
    assert gg_ref.abs().sum() > 0 or name.startswith(("identity_relu", "scale"))
    for b in cpu_backends():
        with pyattr.backend(b):
            g, gg = _second_order(fn, x, dy)
            # first order without create_graph runs the backend's own kernel
            (g1,) = torch.autograd.grad(fn(x), x, dy)
        assert gg is not None, b
        torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(gg, gg_ref, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(g1, g_ref, atol=1e-12, rtol=1e-10)


def test_identity_issue_case_x_grad_is_not_none():
    """The reported case: x.grad stayed None on cpp after a double backward."""
    for b in cpu_backends():
        x = torch.randn(4, 8, requires_grad=True)
        dy = torch.randn(4, 8)
        with pyattr.backend(b):
            (g,) = torch.autograd.grad(identity_rule(x, "silu"), x, dy, create_graph=True)
            g.sum().backward()
        # d/dx Σ dy·σ(x) = dy·σ(x)(1 − σ(x))
        s = torch.sigmoid(x.detach().double())
        torch.testing.assert_close(x.grad.double(), dy.double() * s * (1 - s), atol=1e-6, rtol=1e-5)


SECOND_PASS = "a second derivative \\(create_graph=True\\) would flow back through the output of one of pyattr's rule ops"


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "identity_gelu", "identity_silu", "gated_silu_11", "half",
                                  "scale_gradient"])
def test_a_second_derivative_back_through_a_rule_output_is_refused(name, backend_name):
    """Composed with a nonlinearity (``op(x) ** 2``), the op's incoming gradient depends on
    its output, and the second derivative would flow back through the op's node, which has
    the rule's Jacobian where the forward's own is needed (gradgradcheck of
    ``identity_rule(x, "gelu") ** 2`` was 110.7 against 126.5): refused when that backward
    is recorded, on every backend, the C++ nodes included. A given incoming gradient (a
    leaf, as gradgradcheck's above) runs, exactly."""
    fn = OPS[name]
    x = _x()
    with pytest.raises(RuntimeError, match=SECOND_PASS):
        torch.autograd.grad((fn(x) ** 2).sum(), x, create_graph=True)
    (g,) = torch.autograd.grad((fn(x) ** 2).sum(), x)  # first order alone: the rule gradient
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("rules,msg", [
    (pyattr.RelevanceRules(attention="frozen"), "FrozenAttentionFunction: a second derivative \\(create_graph=True\\) would flow back "
                                  "through a value the rule holds constant"),
    (pyattr.RelevanceRules(normalization=True), SECOND_PASS),
    (pyattr.RelevanceRules(attention="attnlrp"), SECOND_PASS),
    (pyattr.RelevanceRules.all(), SECOND_PASS),
])
def test_llama_gradient_of_token_relevance_is_refused(rules, msg, backend_name):
    """The gradient of one token's relevance through a model: every rule set's second
    derivative would differ from the derivative of its rule gradient (the LN-rule alone by
    0.25 % on GPT-2, the AH-rule's attention by its whole pattern term), so the backward
    with create_graph=True raises."""
    m = tiny_causal_lm("llama", dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    with pyattr.use_relevance_rules(m, rules):
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        out = m(inputs_embeds=emb).logits[0, -1, 3]
        with pytest.raises(RuntimeError, match=msg):
            torch.autograd.grad(out, emb, create_graph=True)
        (g,) = torch.autograd.grad(out, emb)  # the first-order rule gradient on the same graph
    assert torch.isfinite(g).all()
    # without rules the model's own second derivative is untouched
    emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
    (g,) = torch.autograd.grad(m(inputs_embeds=emb).logits[0, -1, 3], emb, create_graph=True)
    assert torch.autograd.grad((emb * g).sum(-1)[0, 2], emb)[0].abs().sum() > 0


@pytest.mark.parametrize("norm,offset", [("layer_norm", 0.0), ("rms_norm", 0.0), ("rms_norm", 1.0)])
def test_ln_rule_grad_is_differentiable_on_every_backend(norm, offset):
    """``ln_rule_grad`` on tensors that require grad keeps a graph (the reference formula runs)."""
    g = torch.Generator().manual_seed(6)
    x0 = torch.randn(3, 6, dtype=torch.float64, generator=g)
    dy = torch.randn(3, 6, dtype=torch.float64, generator=g)
    w = torch.randn(6, dtype=torch.float64, generator=g)
    grads = {}
    for b in cpu_backends():
        x = x0.clone().requires_grad_(True)
        with pyattr.backend(b):
            dx = ln_rule_grad(dy, x, w, 1e-5, norm=norm, offset=offset)
            (dx * dx).sum().backward()
        assert x.grad is not None, b
        grads[b] = x.grad
        # without grad-requiring inputs it is the backend's kernel, with the same value
        with pyattr.backend(b):
            torch.testing.assert_close(ln_rule_grad(dy, x0, w, 1e-5, norm=norm, offset=offset), dx.detach())
    assert grads["torch"].abs().sum() > 0
    for b, gx in grads.items():
        torch.testing.assert_close(gx, grads["torch"], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("op", ["identity", "gated"])
def test_custom_activation_second_order_at_zero(op):
    """At x == 0 the custom φ = act(x)/x has the limit derivative act''(0)/2: a custom SiLU
    matches the closed-form "silu" there (0.25), never NaN."""
    custom = lambda t: t * torch.sigmoid(t)  # noqa: E731
    x0 = torch.tensor([0.0, -0.0, 0.7, -1.3], dtype=torch.float64)
    dy = torch.tensor([1.0, 0.5, -2.0, 1.5], dtype=torch.float64)
    res = []
    for act in ("silu", custom):
        x = x0.clone().requires_grad_(True)
        if op == "identity":
            y = identity_rule(x, act)
        else:
            y = gated_activation(x, x * 0 + 0.9, act, identity=True, half=True)
        (g,) = torch.autograd.grad(y, x, dy, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        res.append((g.detach(), gg))
    assert torch.isfinite(res[1][1]).all()
    torch.testing.assert_close(res[1][0], res[0][0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(res[1][1], res[0][1], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("how", ["nested torch.func.grad", "is_grads_batched"])
def test_second_derivatives_by_other_routes_are_refused_too(how):
    """The check sits in every rule Function's backward, not in one way of calling it: a
    ``torch.func.grad`` inside another, and a batched backward recorded with
    ``create_graph=True`` (whose gradients hide their ``grad_fn``), are refused as eager
    ``create_graph=True`` is; one level of ``torch.func.grad`` / ``vjp`` still runs
    (tests/test_scope_torch_func.py)."""
    import torch.func as tf

    m = tiny_causal_lm("llama", dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    emb = m.get_input_embeddings()(ids).detach()

    def f(e):
        return m(inputs_embeds=e).logits[0, -1, 3]

    with pyattr.use_relevance_rules(m, pyattr.RelevanceRules(normalization=True)):
        with pytest.raises(RuntimeError, match=SECOND_PASS):
            if how == "is_grads_batched":
                e = emb.clone().requires_grad_(True)
                out = m(inputs_embeds=e).logits[0, -1, :2]
                torch.autograd.grad(out, e, torch.eye(2, dtype=out.dtype), is_grads_batched=True, create_graph=True)
            else:
                tf.grad(lambda e: (e * tf.grad(f)(e)).sum(-1)[0, 2])(emb)
