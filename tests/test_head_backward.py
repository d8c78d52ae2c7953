"""The output head's backward during a pass multiplies only the nonzero rows of the
logits' gradient (``pyattr.methods._core.passes.SparseRowsHeadFunction``): same gradient, same relevance."""

import contextlib

import pytest
import torch

import pyattr
from conftest import graph_names
from models import VOCAB, tiny_causal_lm
import pyattr.methods._core as core
import pyattr.methods._core.passes as passes
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("rows", [[5], [0, 3], list(range(8))])
def test_gradient_equals_the_dense_product(rows):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 4, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(40, 16, dtype=torch.float64, generator=g)
    logits = (h @ w.T).detach()
    out = core.SparseRowsHeadFunction.apply(h, logits, w)
    assert torch.equal(out, logits)
    dy = torch.zeros(2, 4, 40, dtype=torch.float64)
    flat = dy.view(8, 40)
    for r in rows:
        flat[r] = torch.randn(40, dtype=torch.float64, generator=g)
    (got,) = torch.autograd.grad(out, h, dy)
    torch.testing.assert_close(got, dy @ w, rtol=1e-12, atol=1e-12)
    zero = [r for r in range(8) if r not in rows]
    assert torch.equal(got.reshape(8, 16)[zero], torch.zeros(len(zero), 16, dtype=torch.float64))


def test_double_backward_runs_the_dense_product():
    h = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 8, dtype=torch.float64)
    out = core.SparseRowsHeadFunction.apply(h, (h @ w.T).detach(), w)
    dy = torch.zeros(3, 5, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(out, h, dy, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), dy)
    torch.testing.assert_close(gg, w.sum(1).expand(3, 5))




@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_relevance_equals_the_dense_head(arch, monkeypatch):
    m = tiny_causal_lm(arch, dtype=torch.float64)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    r = pyattr.relevance(m, ids)
    monkeypatch.setattr(passes, "sparse_rows_head", lambda model: contextlib.nullcontext())
    dense = pyattr.relevance(m, ids)
    torch.testing.assert_close(r.relevance, dense.relevance, rtol=1e-6, atol=1e-9)
    assert torch.equal(r.target, dense.target)  # the forward is the head's own


def test_only_inside_a_pass_and_the_head_is_left_as_found():
    m = tiny_causal_lm("llama")
    ids = torch.randint(3, VOCAB, (1, 6))
    hooks = dict(m.lm_head._forward_hooks)
    with core.sparse_rows_head(m), torch.enable_grad():
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        for p in m.parameters():
            p.requires_grad_(False)
        names = graph_names(m(inputs_embeds=emb).logits[0, -1, 3])
        for p in m.parameters():
            p.requires_grad_(True)
    assert "SparseRowsHeadFunctionBackward" in names
    assert dict(m.lm_head._forward_hooks) == hooks
    # a trainable head (weight requiring grad) keeps the native backward
    with core.sparse_rows_head(m):
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        names = graph_names(m(inputs_embeds=emb).logits[0, -1, 3])
    assert "SparseRowsHeadFunctionBackward" not in names


def test_a_head_whose_output_is_not_h_times_w_keeps_the_native_backward():
    """A forward hook that scales the logits, or a Linear subclass with its own forward:
    the sparse backward (dh = dy·W) would miss the extra factor, so it is not used."""
    m = tiny_causal_lm("llama", dtype=torch.float64)
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    handle = m.lm_head.register_forward_hook(lambda mod, args, out: out * 0.5)
    try:
        r = pyattr.relevance(m, ids, target=5)
    finally:
        handle.remove()
    plain = pyattr.relevance(m, ids, target=5)
    torch.testing.assert_close(r.target, plain.target * 0.5)
    assert (r.conservation_delta.abs() <= 1e-6 * r.target.abs()).all()

    class ScaledHead(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 3.0

    head = ScaledHead(m.lm_head.in_features, m.lm_head.out_features, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(m.lm_head.weight)
    m.lm_head = head
    r3 = pyattr.relevance(m, ids, target=5)
    torch.testing.assert_close(r3.target, plain.target * 3.0)
    assert (r3.conservation_delta.abs() <= 1e-6 * r3.target.abs()).all()
