"""Inside pyattr's own passes (``pyattr._function.first_order_saves``) the norms' LN-rule
Functions save the per-row scale, not their input, when no parameter gradient is asked:
the same gradient, less memory, and a backward with ``create_graph=True`` refused by name;
outside, or with a parameter gradient asked, they save ``x`` as before."""

import pytest
import torch

import pyattr
from models import VOCAB, tiny_causal_lm
from pyattr._function import first_order, first_order_saves
from pyattr.ops import layer_norm, rms_norm


def _x(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 5, 24, generator=g, dtype=torch.float64) * 3 + 1).to(dtype).requires_grad_()


def _params(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(24, generator=g, dtype=torch.float64) + 1.5).to(dtype), \
        torch.randn(24, generator=g, dtype=torch.float64).to(dtype)


NORMS = {
    "rms_norm": lambda x, w, b: rms_norm(x, w, 1e-6),
    "rms_norm_offset": lambda x, w, b: rms_norm(x, w, 1e-6, offset=1.0),
    "layer_norm": lambda x, w, b: layer_norm(x, w, b, 1e-5),
    "layer_norm_noaffine": lambda x, w, b: layer_norm(x, None, None, 1e-5),
    "layer_norm_module_forward": lambda x, w, b: layer_norm(
        x, w, b, 1e-5, _native=lambda t: torch.nn.functional.layer_norm(t, (24,), w, b, 1e-5)),
}


def _saved_shapes(fn, x, w, b, lean):
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        if lean:
            with first_order_saves():
                y = fn(x, w, b)
        else:
            y = fn(x, w, b)
    return y, shapes


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)],
                         ids=["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", list(NORMS))
def test_same_gradient_without_the_input_saved(name, dtype, tol, backend):
    fn = NORMS[name]
    x = _x(dtype)
    w, b = _params(dtype)
    dy = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)
    with pyattr.backend(backend):
        y0, kept = _saved_shapes(fn, x, w, b, lean=False)
        y1, lean = _saved_shapes(fn, x, w, b, lean=True)
        assert torch.equal(y0, y1)  # the forward is untouched
        (want,) = torch.autograd.grad(y0, x, dy)
        (got,) = torch.autograd.grad(y1, x, dy)
    assert (3, 5, 24) in kept and (3, 5, 24) not in lean, (kept, lean)
    assert (3, 5, 1) in lean  # one scale per row
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("name", list(NORMS))
def test_float64_closed_form(name):
    """LN-rule oracle: RMSNorm dx = dy·(offset + w)/r; LayerNorm g = dy·w/σ, dx = g − mean(g)."""
    x = _x(torch.float64)
    w, b = _params(torch.float64)
    dy = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with first_order_saves():
        (got,) = torch.autograd.grad(NORMS[name](x, w, b), x, dy)
    xd = x.detach()
    if name.startswith("rms"):
        r = (xd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        want = dy * ((1.0 if name.endswith("offset") else 0.0) + w) / r
    else:
        sigma = (xd.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
        g = dy * (1.0 if name.endswith("noaffine") else w) / sigma
        want = g - g.mean(-1, keepdim=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", list(NORMS))
def test_create_graph_through_a_first_order_node_is_refused(name):
    x = _x(torch.float64)
    w, b = _params(torch.float64)
    with first_order_saves():
        y = NORMS[name](x, w, b)
    op = "rms_norm" if name.startswith("rms") else "layer_norm"
    with pytest.raises(RuntimeError, match=rf"^{op}: this node was recorded by one of pyattr's own passes"):
        torch.autograd.grad(y, x, torch.ones_like(y), create_graph=True)


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm"])
def test_a_parameter_gradient_keeps_the_input(name):
    x = _x(torch.float64)
    w, b = _params(torch.float64)
    w.requires_grad_()
    _, lean = _saved_shapes(NORMS[name], x, w, b, lean=True)
    assert (3, 5, 24) in lean
    with first_order_saves():
        y = NORMS[name](x, w, b)
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    assert dw is not None and dx.shape == x.shape


def test_the_flag_is_per_thread_and_off_under_transforms():
    import threading

    seen = []
    with first_order_saves():
        assert first_order()
        t = threading.Thread(target=lambda: seen.append(first_order()))
        t.start()
        t.join()
        assert torch.func.grad(lambda v: (first_order() and 0.0 or 1.0) * v.sum())(torch.ones(2)).sum() == 2
    assert seen == [False] and not first_order()


@pytest.mark.parametrize("arch, attn", [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "eager")])
@pytest.mark.parametrize("rules", ["all", "attnlrp", "ln"])
def test_relevance_is_the_same_with_the_inputs_saved(arch, attn, rules, monkeypatch):
    """pyattr.relevance (first-order saves) against the same call with the norms saving
    their inputs as before (float64: the LN-rule computed in the same order), and on Llama
    against the same rules around the user's own backward."""
    import pyattr._function as _function
    from pyattr.methods._core.text import rules_from

    model = tiny_causal_lm(arch, attn, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    res = pyattr.relevance(model, ids, target=3, rules=rules)
    with monkeypatch.context() as mp:
        mp.setattr(_function, "first_order", lambda *params: False)
        kept = pyattr.relevance(model, ids, target=3, rules=rules)
    torch.testing.assert_close(res.relevance, kept.relevance, atol=1e-12, rtol=1e-10)
    if arch == "llama":
        x = model.get_input_embeddings()(ids).detach().requires_grad_()
        with pyattr.use_relevance_rules(model, rules_from(rules)):
            (g,) = torch.autograd.grad(model(inputs_embeds=x).logits[:, -1, 3].sum(), x)
        torch.testing.assert_close(res.relevance.double(), (x * g).detach().double(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("where", ["another thread", "after the block", "plain forward, lean backward"])
def test_a_checkpointed_block_recomputes_with_the_saves_of_its_forward(where):
    """The backward (and so the recomputation of a checkpointed block) may run in another
    thread, or after the pass, or a plain forward's backward inside a pass: the block saves
    what its forward saved, and the gradient is the one without checkpointing (a mismatch
    fails checkpoint's metadata check, or reads x as 1/r)."""
    import threading

    from test_checkpointing import _checkpointing

    model = tiny_causal_lm("llama", dtype=torch.float64).requires_grad_(False)  # frozen, as in pyattr's passes
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(6))
    rules = pyattr.RelevanceRules.all()
    lean_forward = where != "plain forward, lean backward"
    grads = {}
    for mode in (None, "non_reentrant"):
        with _checkpointing(model, mode), pyattr.use_relevance_rules(model, rules):
            x = model.get_input_embeddings()(ids).detach().requires_grad_()
            with first_order_saves(lean_forward):
                out = model(inputs_embeds=x).logits[0, -1, 5]
            if where == "another thread":
                box = []
                t = threading.Thread(target=lambda: box.append(torch.autograd.grad(out, x)[0]))
                t.start()
                t.join()
                grads[mode] = box[0]
            else:
                with first_order_saves(not lean_forward):
                    grads[mode] = torch.autograd.grad(out, x)[0]
    torch.testing.assert_close(grads["non_reentrant"], grads[None], atol=1e-12, rtol=1e-10)
