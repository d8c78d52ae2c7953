"""Edge values (issue 31, case 6b): every rule family on every backend that runs on CPU
tensors here (`torch`, `cpp`, `triton` under TRITON_INTERPRET=1), forward and backward, at
+inf, -inf, NaN, 0, -0.0, huge finite (±1e38 / ±finfo.max in float32, ±1e308 / ±max in
float64), subnormals, in float32, float64, bfloat16 and float16; the batched paths
(torch.vmap, is_grads_batched) and the C++ autograd nodes (the public functions under
`cpp`) included.

One defined answer per case (DESIGN §2; pyattr/activations.py says it in words):

* forwards are the native ops, bit for bit (NaN where they give NaN);
* φ in closed form: φ(NaN) = NaN, φ(±0) = φ(subnormal) = ½ (ReLU: 1[x > 0]), φ(+inf) =
  φ(huge) = 1, φ(-inf) = φ(-huge) = 0; a custom callable: act(x)/x, φ(±0) = zero_limit,
  the quotient at ±finfo.max for ±inf;
* act(g) in a backward is g·φ(g) (ReLU: relu(g), relu(-0) = -0), so act(+inf) = +inf
  and act(-inf) = -inf·0 = NaN, whatever PyTorch's float32 GELU gives at +inf (NaN);
* act'(±inf) is the limit, 1 and 0 (PyTorch's own derivative gives NaN there);
* products are IEEE, evaluated in the accumulation dtype (float32; float64 stays) in the
  formula's order: 0·inf = NaN; scale_gradient and ln_rule likewise;
* norms: the LayerNorm backward's μ and σ are the native forward's where it recomputes
  them (a constant row has variance exactly 0, a row of ±1e38 has rstd = 0, values more
  than finfo.max apart give NaN); RMSNorm's r is mean(x²) as the forward computes it;
* frozen attention: P = 0 for a row whose keys are all masked; NaN for a row with a NaN or
  +inf score, except at causally hidden keys (0 in every row); dV = Pᵀ·dO over every
  query row, so a non-finite dO meets P = 0 as NaN, blocks or not.

Elementwise results are compared with that answer (an oracle built from the table above,
in the same operation order) and, bit for bit and sign of zero included, with the `torch`
backend; reductions (norms, attention) have the same NaN / ±inf / zero pattern as the
`torch` backend exactly and finite values within rounding, plus the answers above.
Triton on bfloat16 is left out under the interpreter: its numpy conversion truncates
bfloat16 and flushes its subnormals on load (a property of the interpreter, not of the
kernel; tests/test_backend_parity.py leaves those elements out as well).
"""

import functools
import os

import pytest
import torch
import torch.nn.functional as F

import pyattr
from pyattr.ops import gated_activation, layer_norm, rms_norm
from pyattr.ops.attention import attention_dv
from pyattr.rules import half_rule, identity_rule, ln_rule, scale_gradient

from conftest import TOL, cpu_backends

# numpy inside Triton's interpreter warns where the kernels compute inf and NaN on purpose
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

BACKENDS = cpu_backends()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
KINDS = ["silu", "gelu", "gelu_tanh", "quick_gelu", "relu"]


def custom_silu(t):
    """A callable pyattr does not recognise: the generic φ = act(x)/x path."""
    return t * torch.sigmoid(t)


def custom_leaky(t):
    return torch.where(t > 0, t, 0.01 * t)


ACTS = {k: k for k in KINDS} | {"custom_silu": custom_silu, "custom_leaky": custom_leaky}
NATIVE = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t),
    "relu": F.relu,
    "custom_silu": custom_silu,
    "custom_leaky": custom_leaky,
}


#: every backend with every dtype, but Triton's interpreter (CPU) truncates bfloat16 and
#: flushes its subnormals on load: that pair is not generated there (never a skip counted
#: as a pass); on a GPU it runs
BACKEND_DTYPES = [(n, d) for n in BACKENDS for d in DTYPES
                  if not (n == "triton" and d == torch.bfloat16 and INTERPRETED)]


def acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def edges(dtype):
    """The edge values of ``dtype``: ±inf, NaN, ±0, huge finite (±1e38 and ±max in float32
    and bfloat16, ±1e308 and ±max in float64, ±6e4 and ±max in float16), the smallest
    subnormal and one inside the subnormal range (float16's smallest alone: its others are
    ordinary numbers in the float32 the kernels compute in)."""
    fi = torch.finfo(dtype)
    huge = {torch.float64: 1e308, torch.float16: 6e4}.get(dtype, 1e38)
    sub = {
        torch.float32: [1e-45, 1e-40],
        torch.float64: [5e-324, 1e-310],
        torch.bfloat16: [9.183549615799121e-41, 1e-39],
        torch.float16: [2.0 ** -24],
    }[dtype]
    vals = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, huge, -huge, fi.max, -fi.max]
    vals += [s for v in sub for s in (v, -v)]
    t = torch.tensor(vals, dtype=torch.float64).to(dtype)
    sub_t = t[9:]
    assert bool(((sub_t != 0) & (sub_t.abs() < fi.smallest_normal)).all())  # subnormal in dtype
    return t


def act_edges(dtype):
    """Edge values for an activation's input: float16's subnormals are ordinary float32
    numbers to the kernels (σ(1.702·2⁻²⁴) is ½ only to within an ulp there, which backends
    round differently), so they are operands below, not activation inputs."""
    e = edges(dtype)
    return e[:9] if dtype == torch.float16 else e


def factors(dtype):
    """Values for the other operands (u, dy, dh): the edges and two ordinary numbers."""
    return torch.cat([edges(dtype), torch.tensor([1.0, -2.0], dtype=dtype)])


def grid(*axes):
    """Every combination of the axes' values, flattened (one element per case)."""
    return [t.reshape(-1).contiguous() for t in torch.meshgrid(*axes, indexing="ij")]


def assert_bits(got, expected, sign=True):
    """Equal values, NaN where NaN (torch.testing with no tolerance), and the same sign
    of zero."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    if sign:
        zero = (got == 0) & (expected == 0)
        bad = zero & (torch.signbit(got) != torch.signbit(expected))
        assert not bool(bad.any()), f"sign of zero differs at {bad.nonzero().flatten().tolist()[:8]}"


def assert_values(got, expected):
    """Equal values, NaN where NaN (a zero's sign not compared)."""
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


# --- the defined answer, elementwise -----------------------------------------------------

def _is_large(x):
    return x.abs() > 1e3  # the edge grids hold nothing between 1e-7 and 1e3


def phi_def(x, kind):
    """φ at an edge value, from the table (x in the accumulation dtype)."""
    if kind == "relu":
        r = (x > 0).to(x.dtype)
    elif kind.startswith("custom"):
        return _phi_custom(x, NATIVE[kind])
    else:
        assert bool((torch.isnan(x) | _is_large(x) | (x.abs() < torch.finfo(x.dtype).smallest_normal)).all())
        r = torch.where(_is_large(x), (x > 0).to(x.dtype), torch.full_like(x, 0.5))
    return torch.where(torch.isnan(x), x, r)


def _phi_custom(x, fn, zero_limit=0.5):
    """The generic path's definition: act(x)/x; φ(±0) = zero_limit; at ±inf the quotient at
    ±finfo.max; NaN for NaN."""
    big = torch.where(torch.isinf(x), torch.sign(x) * torch.finfo(x.dtype).max, x)
    safe = torch.where(x == 0, torch.ones_like(x), big)
    return torch.where(x == 0, torch.full_like(x, zero_limit), fn(safe) / safe)


def act_def(x, kind):
    """act(g) in a backward: g·φ(g); ReLU relu(g) (relu(-0) = -0); custom: the callable."""
    if kind == "relu":
        return torch.where(x < 0, torch.zeros_like(x), x)
    if kind.startswith("custom"):
        return NATIVE[kind](x)
    return x * phi_def(x, kind)


def dact_def(x, kind):
    """act'(g): 1 at +inf and huge g, 0 at -inf and -huge, ½ at 0 and subnormals (ReLU's
    step: 1[x > 0]), NaN at NaN; custom: the callable's own autograd derivative."""
    if kind.startswith("custom"):
        with torch.enable_grad():
            xr = x.detach().clone().requires_grad_(True)
            (d,) = torch.autograd.grad(NATIVE[kind](xr * 1.0).sum(), xr)
        return d
    return phi_def(x, kind)  # the same table at the edge values


def _run(fn, inputs, grad_out):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*inputs)
    grads = torch.autograd.grad(y, inputs, grad_out)
    return y.detach(), grads


def _on(name, fn, inputs, grad_out):
    with pyattr.backend(name):
        return _run(fn, inputs, grad_out)


# --- identity_rule -----------------------------------------------------------------------

@pytest.mark.parametrize("name,dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("kind", list(ACTS))
def test_identity_rule_edges(name, kind, dtype):
    x, dy = grid(act_edges(dtype), factors(dtype))
    fn = lambda t: identity_rule(t, ACTS[kind])  # noqa: E731
    y, (dx,) = _on(name, fn, [x], dy)
    assert_bits(y, NATIVE[kind](x))  # the native forward, NaN where it gives NaN
    a = acc(dtype)
    assert_values(dx, (dy.to(a) * phi_def(x.to(a), kind)).to(dtype))
    _, (dx_ref,) = _on("torch", fn, [x], dy)
    assert_bits(dx, dx_ref)


# --- gated activation, each rule on and off ----------------------------------------------

RULES = [(True, True), (True, False), (False, True), (False, False)]


@pytest.mark.parametrize("name,dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("kind", list(ACTS))
@pytest.mark.parametrize("identity,half", RULES)
def test_gated_activation_edges(name, kind, dtype, identity, half):
    g, u, dh = grid(act_edges(dtype), factors(dtype), factors(dtype))
    fn = lambda gg, uu: gated_activation(gg, uu, ACTS[kind], identity=identity, half=half)  # noqa: E731
    h, (dg, du) = _on(name, fn, [g, u], dh)
    assert_bits(h, NATIVE[kind](g) * u)
    a = acc(dtype)
    g32, u32, dh32 = g.to(a), u.to(a), dh.to(a)
    s = 0.5 if half else 1.0
    local = phi_def(g32, kind) if identity else dact_def(g32, kind)
    assert_values(dg, (s * dh32 * u32 * local).to(dtype))
    assert_values(du, (s * dh32 * act_def(g32, kind)).to(dtype))
    _, (dg_ref, du_ref) = _on("torch", fn, [g, u], dh)
    assert_bits(dg, dg_ref)
    assert_bits(du, du_ref)


def test_gated_gelu_at_plus_inf_is_inf_not_nan():
    """The reported case: gate = +inf, GELU. PyTorch's float32 GELU gives NaN there; the
    rule's du = ½·dh·act(+inf) = ±inf and dg = ½·dh·u·φ(+inf) = ½·dh·u on every backend."""
    g = torch.tensor([float("inf")] * 3)
    u = torch.tensor([1.0, -2.0, 3.0])
    dh = torch.tensor([1.0, 1.0, -1.0])
    for name in BACKENDS:
        _, (dg, du) = _on(name, lambda gg, uu: gated_activation(gg, uu, "gelu"), [g, u], dh)
        assert_bits(dg, torch.tensor([0.5, -1.0, -1.5]))
        assert_bits(du, torch.tensor([float("inf"), float("inf"), float("-inf")]))


# --- half_rule, ln_rule, scale_gradient --------------------------------------------------

@pytest.mark.parametrize("name,dtype", BACKEND_DTYPES)
def test_half_rule_edges(name, dtype):
    u, v, dy = grid(factors(dtype), factors(dtype), factors(dtype))
    y, (du, dv) = _on(name, half_rule, [u, v], dy)
    assert_bits(y, u * v)
    a = acc(dtype)
    d = dy.to(a) * 0.5
    assert_values(du, (d * v.to(a)).to(dtype))
    assert_values(dv, (d * u.to(a)).to(dtype))
    _, (du_ref, dv_ref) = _on("torch", half_rule, [u, v], dy)
    assert_bits(du, du_ref)
    assert_bits(dv, dv_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ln_rule_edges(dtype):
    """``d num = dy / denom`` (IEEE: /0 = ±inf or NaN, /inf = 0) and nothing to ``denom``."""
    num, denom, dy = grid(factors(dtype), factors(dtype), factors(dtype))
    n, d = num.clone().requires_grad_(True), denom.clone().requires_grad_(True)
    y = ln_rule(n, d)
    dnum, ddenom = torch.autograd.grad(y, (n, d), dy, allow_unused=True)
    assert_bits(y.detach(), num / denom)
    assert_bits(dnum, dy / denom)
    assert ddenom is None
    for c in (0.0, -0.0, 1e-45, 3.0):  # a number as denominator
        n = num.clone().requires_grad_(True)
        (dnum,) = torch.autograd.grad(ln_rule(n, c), n, dy)
        assert_bits(dnum, dy / c)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.25, -3.0, 0.0, 1e30])
def test_scale_gradient_edges(dtype, scale):
    """``dx = c·dy`` in the accumulation dtype (0·inf = NaN, as IEEE says; a scale beyond
    float16's range is not rounded to inf first), a float scale and a tensor one alike."""
    x, dy = grid(factors(dtype), factors(dtype))
    expected = (dy.to(acc(dtype)) * scale).to(dtype)
    y, (dx,) = _run(lambda t: scale_gradient(t, scale), [x], dy)
    assert_bits(y, x)
    assert_bits(dx, expected)
    for c in (torch.full(x.shape, scale, dtype=torch.float64), torch.full((1,), scale, dtype=torch.float64)):
        _, (dx,) = _run(lambda t: scale_gradient(t, c), [x], dy)
        assert_bits(dx, expected)


# --- batched paths (torch.vmap over the vjp; is_grads_batched through the kernels) -------

@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", KINDS)
def test_batched_paths_give_the_same_edge_answers(name, kind, dtype):
    g, u, dh = grid(edges(dtype), factors(dtype), factors(dtype)[:4])
    gated = lambda gg, uu: gated_activation(gg, uu, kind)  # noqa: E731
    ident = lambda t: identity_rule(t, kind)  # noqa: E731
    with pyattr.backend(name):
        _, (dg, du) = _run(gated, [g, u], dh)
        _, (dx,) = _run(ident, [g], dh)
        G, U, DH = (torch.stack([t, t]) for t in (g, u, dh))
        # torch.vmap over torch.func.vjp (the recorded, differentiable reference formulas)
        vg, vu = torch.vmap(lambda a, b, c: torch.func.vjp(gated, a, b)[1](c))(G, U, DH)
        (vx,) = torch.vmap(lambda a, c: torch.func.vjp(ident, a)[1](c))(G, DH)
        # one backward for two gradients (the kernels' batching rules)
        gr, ur = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
        bg, bu = torch.autograd.grad(gated(gr, ur), (gr, ur), DH, is_grads_batched=True)
        xr = g.clone().requires_grad_(True)
        (bx,) = torch.autograd.grad(ident(xr), xr, DH, is_grads_batched=True)
    for batched, single in ((vg, dg), (vu, du), (vx, dx), (bg, dg), (bu, du), (bx, dx)):
        for row in batched:
            assert_bits(row, single)


# --- LayerNorm and RMSNorm rules ---------------------------------------------------------

H = 37  # a vector body and a scalar tail in the CPU kernels


def norm_rows(dtype):
    """(x, dy, names): an ordinary row with one edge value in x; rows made of one edge
    value; rows alternating ±huge and ±max (within and beyond finfo.max apart); an
    ordinary x with one edge value in dy."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(H, generator=gen, dtype=torch.float64).to(dtype)
    ones = torch.randn(H, generator=gen, dtype=torch.float64).to(dtype)
    X, DY, names = [], [], []
    E = edges(dtype)
    for e in E:
        x = base.clone()
        x[5] = e
        X.append(x), DY.append(ones), names.append(f"x[5]={e.item():.3g}")
    for e in E:
        X.append(torch.full((H,), e.item(), dtype=dtype)), DY.append(ones), names.append(f"x=all {e.item():.3g}")
    for e in (E[5], E[7]):
        x = torch.full((H,), e.item(), dtype=dtype)
        x[::2] = -x[::2]
        X.append(x), DY.append(ones), names.append(f"x=±{e.item():.3g}")
    for e in E:
        d = ones.clone()
        d[5] = e
        X.append(base), DY.append(d), names.append(f"dy[5]={e.item():.3g}")
    return torch.stack(X), torch.stack(DY), names


def _kind(t):
    """0 NaN, 1 +inf, 2 -inf, 3 zero, 4 finite non-zero."""
    t = t.double()
    out = torch.full(t.shape, 4, dtype=torch.int8)
    out[t == 0] = 3
    out[t == float("-inf")] = 2
    out[t == float("inf")] = 1
    out[torch.isnan(t)] = 0
    return out


def assert_norm_close(got, ref, dtype, names=None):
    """Same NaN / ±inf / zero pattern exactly; finite values within the dtype's rounding
    budget (reductions run in different orders on different backends)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    kg, kr = _kind(got), _kind(ref)
    if not torch.equal(kg, kr):
        rows = (kg != kr).reshape(-1, got.shape[-1]).any(-1).nonzero().flatten().tolist()
        raise AssertionError(f"NaN/inf/zero pattern differs in rows {[names[r] if names else r for r in rows]}")
    atol, rtol = TOL[dtype]
    fin = kr == 4
    if bool(fin.any()):
        scale = max(1.0, float(ref.double()[fin].abs().max()))
        torch.testing.assert_close(got.double()[fin], ref.double()[fin], atol=atol * scale, rtol=rtol)


def _norm_cases(dtype, eps):
    gen = torch.Generator().manual_seed(1)
    w = (torch.rand(H, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    b = torch.randn(H, generator=gen, dtype=torch.float64).to(dtype)
    native_ln = torch.nn.LayerNorm(H, eps=eps, dtype=dtype)
    native_ln.weight.data.copy_(w)
    native_ln.bias.data.copy_(b)

    def hf_rms(x, weight, offset):
        xf = x.to(torch.float32) if x.dtype != torch.float64 else x
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * n.to(x.dtype) if offset == 0.0 else (n * (offset + weight.to(n.dtype))).to(x.dtype)

    return {
        # (function of (x, *params), params, native forward of x)
        "layer_norm": (lambda x, ww, bb: layer_norm(x, ww, bb, eps), [w, b],
                       lambda x: F.layer_norm(x, (H,), w, b, eps)),
        "layer_norm_dx_only": (lambda x: layer_norm(x, w, b, eps), [], lambda x: F.layer_norm(x, (H,), w, b, eps)),
        "layer_norm_no_affine": (lambda x: layer_norm(x, None, None, eps), [],
                                 lambda x: F.layer_norm(x, (H,), None, None, eps)),
        # a module's own forward: the backward recomputes mu and sigma
        "layer_norm_module_forward": (lambda x, ww, bb: layer_norm(x, ww, bb, eps, _native=native_ln.forward),
                                      [w, b], lambda x: native_ln(x)),
        "rms_norm": (lambda x, ww: rms_norm(x, ww, eps), [w], lambda x: hf_rms(x, w, 0.0)),
        "rms_norm_gemma": (lambda x, ww: rms_norm(x, ww, eps, 1.0), [w], lambda x: hf_rms(x, w, 1.0)),
    }


def _native_layer_norm_overflows(dtype) -> bool:
    """Whether this torch's native layer_norm gives NaN for a row whose squares overflow
    (torch 2.6 to 2.8 do; later ones give the finite answer). A node that reads the native
    forward's statistics (the cpp backend's) then gives NaN in that row, where the forward
    itself is NaN too; observed here, not assumed from a version."""
    x = torch.zeros(1, 8, dtype=dtype)
    x[0, 5] = torch.finfo(dtype).max / 4  # one value whose square overflows, as norm_rows' x[5] rows
    return bool(torch.isnan(F.layer_norm(x, (8,))).any())


@pytest.mark.parametrize("name,dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("eps", [1e-5, 0.0])
def test_norm_rules_edges(name, dtype, eps):
    x, dy, names = norm_rows(dtype)
    for case, (fn, params, native) in _norm_cases(dtype, eps).items():
        y, grads = _on(name, fn, [x, *params], dy)
        assert_bits(y, native(x).detach())
        _, ref = _on("torch", fn, [x, *params], dy)
        keep = None
        if case.startswith("layer_norm") and _native_layer_norm_overflows(dtype):
            keep = torch.isfinite(y.detach()).all(-1)  # rows whose native forward is NaN: undefined there
        for got, expected in zip(grads, ref):
            if keep is not None and got.dim() == 2:
                got, expected = got[keep], expected[keep]
            try:
                rows = [n for n, k in zip(names, keep.tolist()) if k] if keep is not None else names
                assert_norm_close(got, expected, dtype, rows if got.dim() == 2 else None)
            except AssertionError as e:
                raise AssertionError(f"{case}: {e}") from None


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rules_edge_answers(dtype):
    """What the rows give (the reference; every backend equals it above). LayerNorm: a row
    with a value that is not finite is NaN; a constant row of any value has σ = sqrt(eps)
    (the native statistics' variance 0): dx = (g − mean g)/sqrt(eps), NaN with eps = 0; a
    row of ±huge whose variance is beyond the accumulation dtype has rstd = 0 (the native
    forward gives y = b): dx = 0; values more than its max apart give NaN (so do the native
    statistics). RMSNorm: r from mean(x²) as the Hugging Face forward computes it, so a row
    whose x² overflows (an infinite value included) has rinv = 0: dx = 0 (its forward gives
    0, NaN at the infinite value); a NaN gives a NaN row."""
    x, dy, names = norm_rows(dtype)
    row = {n: i for i, n in enumerate(names)}
    E = edges(dtype)
    amax = torch.finfo(acc(dtype)).max
    gen = torch.Generator().manual_seed(2)
    w = (torch.rand(H, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    g = dy.double() * w.double()
    atol, rtol = TOL[dtype]
    with pyattr.backend("torch"):
        for eps in (1e-5, 0.0):
            _, (dx, _, _) = _run(lambda t, ww, bb: layer_norm(t, ww, bb, eps), [x, w, torch.zeros_like(w)], dy)
            _, (rx, _) = _run(lambda t, ww: rms_norm(t, ww, eps), [x, w], dy)
            for e in E[:3]:  # ±inf, NaN in x: NaN rows (RMSNorm: r = inf, dx = 0, for ±inf)
                r = row[f"x[5]={e.item():.3g}"]
                assert bool(torch.isnan(dx[r]).all())
                if torch.isnan(e):
                    assert bool(torch.isnan(rx[r]).all())
                else:
                    assert_values(rx[r], torch.zeros_like(rx[r]))
            for e in E[3:]:
                r = row[f"x=all {e.item():.3g}"]
                if eps == 0.0:
                    assert bool(torch.isnan(dx[r]).all()), names[r]
                else:
                    expected = (g[r] - g[r].mean()) / (eps ** 0.5)
                    torch.testing.assert_close(dx[r].double(), expected, atol=atol * 1e3, rtol=rtol)
                if abs(float(e)) > amax ** 0.5:
                    assert_values(rx[r], torch.zeros_like(rx[r]))
            for e in (float(E[5]), float(E[7])):
                r = row[f"x=±{e:.3g}"]
                if 2 * e > amax:
                    assert bool(torch.isnan(dx[r]).all()), names[r]
                elif e > amax ** 0.5:
                    assert_values(dx[r], torch.zeros_like(dx[r]))
                else:  # float16 in float32: nothing overflows
                    assert bool(torch.isfinite(dx[r]).all() & (dx[r] != 0).any())
                if e > amax ** 0.5:
                    assert_values(rx[r], torch.zeros_like(rx[r]))


# --- frozen attention --------------------------------------------------------------------

def _attention_inputs(dtype, L, where, value, pos, causal_mask_row=True):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, L, 4, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(1, 1, L, 4, generator=gen, dtype=torch.float64).to(dtype)
    do = torch.randn(1, 2, L, 3, generator=gen, dtype=torch.float64).to(dtype)
    mask = torch.zeros(1, 1, L, L, dtype=dtype)
    if causal_mask_row:
        mask[0, 0, L - 1, :] = float("-inf")  # a row with every key masked
    {"q": q, "k": k, "dout": do, "mask": mask}[where][(0, 0) + pos] = value
    return q, k, do, mask


ATTENTION_EDGES = ["inf", "-inf", "nan", "huge", "-huge", "zero"]


def _value(name, dtype):
    huge = 1e308 if dtype == torch.float64 else 1e38
    return {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan"), "huge": huge, "-huge": -huge,
            "zero": 0.0}[name]


@pytest.mark.parametrize("name", [n for n in BACKENDS if n != "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("where", ["q", "k", "dout", "mask"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_dv_edges(name, dtype, where, causal):
    """P: 0 for a row whose keys are all masked; NaN for a row with a NaN or +inf score,
    except at keys the causal mask hides (0 in every row); dV = Pᵀ·dO over every query row
    (a non-finite dO meets P = 0 as NaN). Against the reference: the same NaN / inf /
    zero pattern, finite values within rounding."""
    for edge in ATTENTION_EDGES:
        for pos in [(1, 2), (3, 0)]:
            q, k, do, mask = _attention_inputs(dtype, 6, where, _value(edge, dtype), pos)
            with pyattr.backend("torch"):
                ref = attention_dv(q, k, do, mask, 0.5, None, causal)
            with pyattr.backend(name):
                got = attention_dv(q, k, do, mask, 0.5, None, causal)
            try:
                assert_norm_close(got, ref, torch.float32 if dtype == torch.float32 else dtype)
            except AssertionError as e:
                raise AssertionError(f"{where}={edge} at {pos}: {e}") from None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("where", ["q", "k", "dout", "mask"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_dv_16bit_kernel_edges(dtype, where, causal):
    """The C++ kernel's 16-bit path (GEMMs on the 16-bit operands, P rounded to the input
    type): the same NaN / inf / zero pattern as the reference for every edge value, finite
    values within the type's rounding budget."""
    assert "cpp" in BACKENDS, "the C++ kernels are not loaded"
    for edge in ATTENTION_EDGES:
        for pos in [(1, 2), (3, 0)]:
            q, k, do, mask = _attention_inputs(dtype, 6, where, _value(edge, torch.float32), pos)
            with pyattr.backend("torch"):
                ref = attention_dv(q, k, do, mask, 0.5, None, causal)
            with pyattr.backend("cpp"):
                got = attention_dv(q, k, do, mask, 0.5, None, causal)
            try:
                assert_norm_close(got, ref, dtype)
            except AssertionError as e:
                raise AssertionError(f"{where}={edge} at {pos}: {e}") from None


@pytest.mark.parametrize("name", BACKENDS)
def test_attention_dv_long_causal_non_finite_dout(name, monkeypatch):
    """Causal blocks skip the keys after their last row; with a non-finite dO the full
    product's 0·inf = NaN reaches those keys on every backend (blocks of 64 rows on cpp, of
    256 under Triton's interpreter, and small ones forced on the reference)."""
    import pyattr.backends.reference as reference

    monkeypatch.setattr(reference, "_BLOCK_ELEMENTS", 2 * 8 * 300)
    L = 300 if name == "triton" else 80
    for edge in ("inf", "nan", "huge"):
        q, k, do, mask = _attention_inputs(torch.float32, L, "dout", _value(edge, torch.float32), (2, 1),
                                           causal_mask_row=False)
        with pyattr.backend(name):
            got = attention_dv(q, k, do, None, 0.5, None, True)
        col = got[0, 0, :, 1]  # key j: P[2, j]·dO[2, 1] (j <= 2) or 0·dO[2, 1] (j > 2)
        if edge == "inf":
            assert bool((col[:3] == float("inf")).all()) and bool(torch.isnan(col[3:]).all())
        elif edge == "nan":
            assert bool(torch.isnan(col).all())
        else:
            assert bool(torch.isfinite(col).all())
        assert bool(torch.isfinite(got[..., 0]).all() & torch.isfinite(got[..., 2]).all())
        with pyattr.backend("torch"):
            ref = attention_dv(q, k, do, None, 0.5, None, True)
        assert_norm_close(got, ref, torch.float32)


def test_attention_dv_edge_answers():
    """The reference's answers: an all-masked row contributes nothing; a NaN in q row i
    makes dV NaN at keys j <= i only (causal), everywhere (not causal)."""
    q, k, do, mask = _attention_inputs(torch.float32, 6, "q", float("nan"), (3, 0))
    with pyattr.backend("torch"):
        causal = attention_dv(q, k, do, mask, 0.5, None, True)
        full = attention_dv(q, k, do, mask, 0.5, None, False)
    assert bool(torch.isnan(causal[0, 0, :4]).all()) and bool(torch.isfinite(causal[0, 0, 4:]).all())
    assert bool(torch.isnan(full).all())
    q, k, do, mask = _attention_inputs(torch.float32, 6, "q", 0.0, (3, 0))
    mask[0, 0, :, :] = float("-inf")  # every row masked everywhere
    with pyattr.backend("torch"):
        assert_bits(attention_dv(q, k, do, mask, 0.5, None, False), torch.zeros(1, 1, 6, 3))
