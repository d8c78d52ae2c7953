import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import DTYPES, assert_close, node_name
from oracles import layer_norm_rule_grads
import pyattr
from pyattr.ops import layer_norm


def _run(x, w, b, eps, dy):
    ins = [x.detach().requires_grad_(True)]
    ins += [t.detach().requires_grad_(True) for t in (w, b) if t is not None]
    it = iter(ins[1:])
    wr = next(it) if w is not None else None
    br = next(it) if b is not None else None
    y = layer_norm(ins[0], wr, br, eps)
    grads = torch.autograd.grad(y, ins, dy)
    return y, grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [17, 768, 1023, 4097])
def test_layer_norm_rule_matches_oracle(backend_name, dtype, hidden):
    x = (torch.randn(5, hidden) * 2 + 0.5).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    b = (0.1 * torch.randn(hidden)).to(dtype)
    dy = torch.randn(5, hidden).to(dtype)
    y, (dx, dw, db) = _run(x, w, b, 1e-5, dy)
    assert torch.equal(y, F.layer_norm(x, (hidden,), w, b, 1e-5))
    ex, ew, eb = layer_norm_rule_grads(x, w, b, 1e-5, dy)
    assert_close(dx, ex, dtype)
    # parameter grads sum over rows: allow the accumulated rounding of `rows` terms
    atol = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    torch.testing.assert_close(dw.double(), ew, atol=atol, rtol=2e-2)
    torch.testing.assert_close(db.double(), eb, atol=atol, rtol=2e-2)


def test_layer_norm_forward_equals_module_and_rule_differs_from_native():
    mod = nn.LayerNorm(64, eps=1e-5)
    with torch.no_grad():
        mod.weight.normal_()
        mod.bias.normal_()
    x = torch.randn(3, 7, 64, requires_grad=True)
    y = layer_norm(x, mod.weight, mod.bias, mod.eps)
    assert torch.equal(y, mod(x))
    dy = torch.randn_like(y)
    (g_rule,) = torch.autograd.grad(y, x, dy)
    (g_nat,) = torch.autograd.grad(mod(x), x, dy)
    assert (g_rule - g_nat).abs().max() > 1e-3  # the rule changes the backward
    # mean of the LN-rule gradient is zero per row (μ stays differentiable)
    assert g_rule.sum(-1).abs().max() < 1e-5


def test_layer_norm_without_affine_non_contiguous_empty():
    x = torch.randn(40, 17).t()  # (17, 40), non-contiguous
    dy = torch.randn(17, 40)
    y, (dx,) = _run(x, None, None, 1e-6, dy)
    assert torch.equal(y, F.layer_norm(x, (40,), None, None, 1e-6))
    assert_close(dx, layer_norm_rule_grads(x, None, None, 1e-6, dy)[0], torch.float32)
    e = torch.empty(0, 8)
    y, (de,) = _run(e, None, None, 1e-5, torch.empty(0, 8))
    assert de.shape == (0, 8)


def test_layer_norm_special_values():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [float("nan"), 0.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    y, (dx,) = _run(x, None, None, 1e-5, torch.ones(3, 4))
    assert torch.isfinite(dx[0]).all() and torch.isnan(dx[1]).all()
    assert torch.isfinite(dx[2]).all()  # constant row: σ = sqrt(eps), no 0/0


def _saved(x, w, b):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer_norm(x, w, b, 1e-5)
    return sorted(t.numel() for t in saved)


def test_layer_norm_saves_x_weight_and_the_forward_statistics():
    """float32: x, the weight and the native forward's per-row mean and rstd (4 values each)."""
    x = torch.randn(4, 32, requires_grad=True)
    w, b = torch.randn(32, requires_grad=True), torch.randn(32, requires_grad=True)
    assert _saved(x, w, b) == [4, 4, 32, 128]


def test_layer_norm_16_bit_saves_x_and_weight():
    """bfloat16: the native forward's statistics are bfloat16, so x is saved and μ, σ are
    recomputed in float32."""
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(32, dtype=torch.bfloat16)
    assert _saved(x, w, None) == [32, 128]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_saved_statistics_give_the_recomputed_parameter_gradients(backend):
    """With weight and bias needing gradients, the backward from the forward's mean and
    rstd (cpp: pyattr::layer_norm_backward_stats) equals the float64 oracle."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(7, 33, generator=g, dtype=torch.float64) * 2 - 1).requires_grad_()
    w = torch.randn(33, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(33, generator=g, dtype=torch.float64).requires_grad_()
    dy = torch.randn(7, 33, generator=g, dtype=torch.float64)
    with pyattr.backend(backend):
        got = torch.autograd.grad(layer_norm(x, w, b, 1e-5), (x, w, b), dy)
    for a, e in zip(got, layer_norm_rule_grads(x.detach(), w.detach(), b.detach(), 1e-5, dy)):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_rstd_path_equals_the_recomputing_path(backend):
    """The saved-rstd backward (frozen parameters) and the recomputing one (parameters with
    gradients) give the same dx, on the reference and the C++ backend."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 3, 50, generator=g, dtype=torch.float64) * 3 + 1
    w, b, dy = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64), \
        torch.randn(6, 3, 50, generator=g, dtype=torch.float64)
    with pyattr.backend(backend):
        xa = x.clone().requires_grad_()
        (dx_stats,) = torch.autograd.grad(layer_norm(xa, w, b, 1e-5), xa, dy)
        xb = x.clone().requires_grad_()
        wb = w.clone().requires_grad_()
        dx_full, _ = torch.autograd.grad(layer_norm(xb, wb, b, 1e-5), (xb, wb), dy)
    torch.testing.assert_close(dx_stats, dx_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx_stats, layer_norm_rule_grads(x, w, b, 1e-5, dy)[0], rtol=1e-12, atol=1e-12)


# --- the C++ autograd Function (csrc/layer_norm_rule.cpp) -------------------------------

def _needs_cpp():
    import pyattr

    if not pyattr.available_backends()["cpp"].available:
        pytest.skip("the cpp backend is not built")


def _python_function(x, w, b, eps):
    from pyattr import _function
    from pyattr.ops.layer_norm import LayerNormRuleFunction

    return _function.apply(LayerNormRuleFunction, x, w, b, eps, None)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
@pytest.mark.parametrize("grads", ["all", "x", "params", "weight"])
def test_cpp_function_equals_the_python_function(dtype, affine, grads):
    """With the cpp backend a CPU float32/float64 LayerNorm is a C++ autograd node: the
    same forward (bit for bit) and the same gradients (bit for bit: the same kernels) as
    the Python Function, for every subset of inputs that need a gradient."""
    import pyattr

    _needs_cpp()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 33, generator=g, dtype=dtype)
    w = torch.randn(33, generator=g, dtype=dtype) if affine in ("both", "weight") else None
    b = torch.randn(33, generator=g, dtype=dtype) if affine in ("both", "bias") else None
    want_grad = {"all": (True, True, True), "x": (True, False, False), "params": (False, True, True),
                 "weight": (False, True, False)}[grads]
    for t, r in zip((x, w, b), want_grad):
        if t is not None:
            t.requires_grad_(r)
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    if not leaves:
        return
    dy = torch.randn(5, 3, 33, generator=g, dtype=dtype)
    with pyattr.backend("cpp"):
        y = layer_norm(x, w, b, 1e-5)
        assert "CppNode" in y.grad_fn.name() and "LayerNormRule" in y.grad_fn.name()
        ref = _python_function(x, w, b, 1e-5)
        assert type(ref.grad_fn).__name__ == "LayerNormRuleFunctionBackward"
        assert torch.equal(y, ref) and torch.equal(y, F.layer_norm(x, (33,), w, b, 1e-5))
        got = torch.autograd.grad(y, leaves, dy)
        want = torch.autograd.grad(ref, leaves, dy)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and torch.equal(a, e)


def test_cpp_function_second_order_batched_and_saved_tensors():
    """create_graph runs the reference formula (as the Python Function does); k gradients
    in one batched backward equal the loop; four tensors are saved (x, weight, mean, rstd)."""
    import pyattr

    _needs_cpp()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 17, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(17, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(17, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(4, 17, generator=g, dtype=torch.float64)
    with pyattr.backend("cpp"):
        for fn in (layer_norm, _python_function):
            (gx,) = torch.autograd.grad(fn(x, w, b, 1e-5), x, dy, create_graph=True)
            assert gx.requires_grad
            second = torch.autograd.grad((gx * gx).sum(), [x, w])
            if fn is layer_norm:
                first = second
        for a, e in zip(first, second):
            assert torch.equal(a, e)
        y = layer_norm(x, w, b, 1e-5)
        G = torch.randn(3, 4, 17, generator=g, dtype=torch.float64)
        loop = [torch.autograd.grad(y, [x, w, b], gi, retain_graph=True) for gi in G]
        batched = torch.autograd.grad(y, [x, w, b], G, is_grads_batched=True)
        for i, bt in enumerate(batched):
            torch.testing.assert_close(bt, torch.stack([lp[i] for lp in loop]), rtol=1e-12, atol=1e-12)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            layer_norm(x, w, b, 1e-5)
    assert sorted(saved) == sorted([(4, 17), (17,), (4, 1), (4, 1)])


def test_cpp_function_only_where_it_gives_the_same_result():
    """The Python Function stays where the C++ node would differ or could not be seen: the
    torch backend, 16-bit inputs, mixed dtypes, a module's own forward, tensor subclasses,
    torch.func transforms."""
    import pyattr
    from pyattr.ops.layer_norm import _cpp_function_applies

    _needs_cpp()
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)

    def node(*a, **k):
        return node_name(layer_norm(*a, **k).grad_fn)

    with pyattr.backend("cpp"):
        assert "CppNode" in node(x, w, None, 1e-5)
        assert "CppNode" not in node(x.bfloat16(), w.bfloat16(), None, 1e-5)
        assert "CppNode" not in node(x.bfloat16(), w, None, 1e-5)  # 16-bit x with a float32 weight
        custom = torch.nn.LayerNorm(8)
        custom.forward = lambda t: F.layer_norm(t, (8,), None, None, 1e-5)
        assert "CppNode" not in node(x, None, None, 1e-5, _native=custom.forward)

        class Sub(torch.Tensor):
            pass

        assert "CppNode" not in node(x.detach().as_subclass(Sub).requires_grad_(), w, None, 1e-5)
        seen = []

        def f(t):
            y = layer_norm(t, w.detach(), None, 1e-5)
            seen.append(_cpp_function_applies(t, w.detach(), None, None))
            return y.sum()

        gx = torch.func.grad(f)(x.detach())  # inside a transform: the Python Function
        assert seen == [False] and gx.shape == x.shape
        assert _cpp_function_applies(x, w, None, None)
    with pyattr.backend("torch"):
        assert "CppNode" not in node(x, w, None, 1e-5)
    assert "CppNode" in node(x, w, None, 1e-5) or pyattr.backends.select(x.device, "layer_norm") != "cpp"


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_cpp_function_in_a_model_scope_gives_the_python_function_relevance(arch, monkeypatch):
    """Inside use_relevance_rules the models' nn.LayerNorm (nn.Parameter weights) get the
    C++ node with the cpp backend, and relevance equals, bit for bit, what the Python
    Function gives with the same backend."""
    import sys

    import pyattr

    _needs_cpp()
    from models import VOCAB, tiny_causal_lm

    L = sys.modules["pyattr.ops.layer_norm"]  # pyattr.ops.layer_norm is the function

    model = tiny_causal_lm(arch)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))

    def run():
        with pyattr.backend("cpp"):
            res = pyattr.relevance(model, ids, target=3)
        return res.relevance

    names, seen = [], set()
    with pyattr.backend("cpp"), pyattr.use_relevance_rules(model):
        emb = model.get_input_embeddings()(ids).detach().requires_grad_()
        out = model(inputs_embeds=emb).logits[0, -1, 3]
        stack = [out.grad_fn]
        while stack:
            n = stack.pop()
            if n is not None and n not in seen:  # the node itself: ids of short-lived wrappers recur
                seen.add(n)
                names.append(node_name(n))
                stack.extend(f for f, _ in n.next_functions)
    assert any("LayerNormRule" in n and "CppNode" in n for n in names)
    with_cpp = run()
    monkeypatch.setattr(L, "_cpp_function_applies", lambda *a: False)
    assert torch.equal(with_cpp, run())


def test_cpp_function_edge_cases_match_the_python_function(monkeypatch):
    """From the review of the C++ node: hidden size 0 with dx alone gives the empty
    gradient; k gradients for x alone in one is_grads_batched backward equal the loop bit
    for bit (the kernel on the physical tensor, with the forward's rstd); a bad
    PYATTR_BACKEND does not fail the forward, only the backward, as before."""
    import pyattr

    _needs_cpp()
    with pyattr.backend("cpp"):
        x0 = torch.randn(5, 0, requires_grad=True)
        y0 = layer_norm(x0, None, None, 1e-5)
        assert "CppNode" in y0.grad_fn.name()
        assert torch.autograd.grad(y0, x0, torch.ones_like(y0))[0].shape == (5, 0)
        g = torch.Generator().manual_seed(6)
        for w in (None, torch.randn(19, generator=g)):
            x = torch.randn(3, 19, generator=g, requires_grad=True)
            y = layer_norm(x, w, None, 1e-5)
            G = torch.randn(4, 3, 19, generator=g)
            loop = torch.stack([torch.autograd.grad(y, x, gi, retain_graph=True)[0] for gi in G])
            assert torch.equal(torch.autograd.grad(y, x, G, is_grads_batched=True)[0], loop)
    monkeypatch.setenv("PYATTR_BACKEND", "bogus")
    x = torch.randn(3, 8, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(layer_norm(x, None, None, 1e-5), F.layer_norm(x, (8,), None, None, 1e-5))
    y = layer_norm(x, None, None, 1e-5)
    with pytest.raises(ValueError, match="PYATTR_BACKEND: unknown backend 'bogus'"):
        torch.autograd.grad(y.sum(), x)
