"""Relevance on weight-quantized models as users load them (issue 26 §3): torchao int8 and
int4 weight-only through ``TorchAoConfig`` and ``quantize_`` on the trained toy decoder
(4 prompts of 32 tokens), bitsandbytes 8-bit / 4-bit where it is installed, and the
refusals. Agreement thresholds are the measured values (benchmarks/quantized_agreement.py,
benchmarks/results/cpu_quantized.md) less a margin."""

import copy
import re

import pytest
import torch

from conftest import assert_scope_hygiene, need_torchao

need_torchao(module=True)  # a dev dependency; a skip only where this torch cannot import it (CI: a failure)

import torchao.quantization as tq  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402

import pyattr  # noqa: E402
from pyattr.integration.errors import RelevanceRuleUnsupportedError
from pyattr.integration.quantized import (
    QuantizedLinearFunction,
    UnsupportedQuantizationError,
    quantized_input_gradients,
    quantized_linears,
)
from pyattr.toy import INDUCTION_DIR, task

pytestmark = pytest.mark.usefixtures("one_thread")

def _int4():
    # torchao's Int4WeightOnlyConfig has no CPU layout in this torchao (mslk / CUDA only):
    # int4 weight-only on CPU is IntxWeightOnlyConfig with torch.int4
    return tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=tq.PerGroup(32))


# scheme -> (config, worst prompt's top-10 overlap, worst prompt's Pearson); measured on
# these 4 prompts: int8 1.0 / 0.99998, int4 0.9 / 0.9967
SCHEMES = {
    "int8_weight_only": (tq.Int8WeightOnlyConfig, 1.0, 0.9999),
    "int4_weight_only": (_int4, 0.9, 0.99),
}
ROUTES = ("TorchAoConfig", "quantize_")


def _load(**kw):
    return transformers.AutoModelForCausalLM.from_pretrained(INDUCTION_DIR, attn_implementation="eager", **kw).eval()


def _quantize(fp, make, route):
    if route == "TorchAoConfig":
        return _load(quantization_config=transformers.TorchAoConfig(make()))
    m = copy.deepcopy(fp)
    tq.quantize_(m, make())
    return m


def _agreement(a, b):
    """(worst top-10 overlap, worst Pearson) over the rows."""
    top = [len(set(x.topk(10).indices.tolist()) & set(y.topk(10).indices.tolist())) / 10 for x, y in zip(a, b)]
    pear = [torch.corrcoef(torch.stack([x, y]).double())[0, 1].item() for x, y in zip(a, b)]
    return min(top), min(pear)


def _agrees(a, b, top10, pearson):
    got = _agreement(a, b)
    assert got[0] >= top10 and got[1] >= pearson, got
    return True


def _conserves(r, tol=1e-4):
    return bool((r.conservation_delta.abs() <= tol * r.target.abs()).all())


@pytest.fixture(scope="module")
def fp():
    return _load()


@pytest.fixture(scope="module")
def ids():
    return task.batch(torch.Generator().manual_seed(0), 4, length=31)[0]  # (4, 32)


@pytest.fixture(scope="module")
def fp_result(fp, ids):
    return pyattr.relevance(fp, ids)


@pytest.fixture(scope="module")
def int8(fp):
    """The toy decoder with torchao int8 weight-only on every linear layer, the head too."""
    return _quantize(fp, tq.Int8WeightOnlyConfig, "quantize_")


@pytest.fixture(scope="module", params=[(s, r) for s in SCHEMES for r in ROUTES], ids=lambda p: f"{p[0]}-{p[1]}")
def quantized(request, fp):
    scheme, route = request.param
    return scheme, route, _quantize(fp, SCHEMES[scheme][0], route)


def test_layers_found(quantized):
    scheme, route, m = quantized
    layers = quantized_linears(m)
    # TorchAoConfig leaves the output head alone (include_input_output_embeddings=False)
    expected = 14 + (route == "quantize_")
    assert len(layers) == expected and ("lm_head" in layers) == (route == "quantize_")
    want = "Int8Tensor" if scheme == "int8_weight_only" else "IntxUnpackedToInt8Tensor"
    assert {(q.method, q.scheme, q.activation_quantized, q.patched) for q in layers.values()} == {
        ("torchao", want, False, True)}


def test_rules_install_forward_unchanged(quantized, fp, ids):
    _, _, m = quantized
    with pyattr.use_relevance_rules(fp) as cov_fp:
        pass
    with torch.no_grad():
        native = m(ids).logits
        with pyattr.use_relevance_rules(m) as cov:
            inside = m(ids).logits
    assert cov.installed == cov_fp.installed and cov.by_kind == cov_fp.by_kind
    assert torch.equal(inside, native)


def test_relevance_finite_conserved_agrees(quantized, fp_result, ids):
    scheme, _, m = quantized
    r = pyattr.relevance(m, ids, target=fp_result.target_ids)
    assert torch.isfinite(r.relevance).all()
    assert _conserves(fp_result) and _conserves(r)
    assert _agrees(r.token_relevance, fp_result.token_relevance, *SCHEMES[scheme][1:])


def test_gradient_is_dy_times_dequantized_weight():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    tq.quantize_(lin, tq.Int8WeightOnlyConfig())
    lin.bias.requires_grad_(True)
    x = torch.randn(2, 3, 64, requires_grad=True)
    dy = torch.randn(2, 3, 48)
    native = torch.autograd.grad(lin(x), x, dy)[0]  # torchao's own, where it has one
    with quantized_input_gradients(lin) as layers:
        assert list(layers) == [""] and "forward" in lin.__dict__
        y = lin(x)
        assert y.grad_fn.name() == "QuantizedLinearFunctionBackward"
        gx, gb = torch.autograd.grad(y, (x, lin.bias), dy)
    assert "forward" not in lin.__dict__ and "_pyattr_quantized" not in lin.__dict__
    assert torch.equal(y, lin(x))
    assert torch.equal(gx, dy @ lin.weight.dequantize())
    assert torch.equal(gb, dy.reshape(-1, 48).sum(0))
    torch.testing.assert_close(gx, native)


def test_activation_quantized_layer_gets_straight_through_gradient():
    """torchao's dynamic-activation layer rounds its input without a gradient: alone, its
    output does not depend on the input in the graph (relevance through it would be 0)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    tq.quantize_(lin, tq.Int8DynamicActivationInt8WeightConfig())
    x = torch.randn(5, 64, requires_grad=True)
    dy = torch.randn(5, 48)
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(lin(x), x, dy)
    with quantized_input_gradients(lin) as layers:
        assert layers[""].activation_quantized
        (gx,) = torch.autograd.grad(lin(x), x, dy)
    assert torch.equal(gx, dy @ lin.weight.dequantize())


def test_k_targets_and_other_methods(int8, fp_result, ids):
    m = int8
    t = fp_result.target_ids
    one = pyattr.relevance(m, ids, target=t)
    k = pyattr.relevance(m, ids, target=torch.stack([t, t.flip(0)], 1))
    torch.testing.assert_close(k.token_relevance[0], one.token_relevance)
    # every rule off (gradient x input) and layer relevance run through the same layers
    gi = pyattr.relevance(m, ids, target=t, rules=pyattr.RelevanceRules())
    assert torch.isfinite(gi.token_relevance).all()
    lr = pyattr.layer_relevance(m, ids, ["model.layers.1"], target=t)
    assert torch.isfinite(lr["model.layers.1"].relevance).all()


def test_bfloat16(fp, fp_result, ids):
    fpb = copy.deepcopy(fp).to(torch.bfloat16)
    m = copy.deepcopy(fpb)
    tq.quantize_(m, tq.Int8WeightOnlyConfig())
    with torch.no_grad():
        native = m(ids).logits
        with pyattr.use_relevance_rules(m):
            assert torch.equal(m(ids).logits, native)
    rb = pyattr.relevance(fpb, ids, target=fp_result.target_ids)
    r = pyattr.relevance(m, ids, target=fp_result.target_ids)
    assert r.relevance.dtype == torch.float32 and torch.isfinite(r.relevance).all()
    # bfloat16's tolerance, met by both (measured: 5e-3 full precision, 1e-2 int8)
    assert _conserves(rb, 2e-2) and _conserves(r, 2e-2)
    assert _agrees(r.token_relevance, rb.token_relevance, 0.8, 0.999)


def test_dynamic_activation_is_straight_through(fp, fp_result, ids):
    """int8 activations too (W8A8): the gradient passes the activations' rounding straight
    through, so the rounding shows in the conservation delta (measured 0.6% of the target;
    with torchao's own autograd it was 100%: the layers passed no gradient)."""
    m = _quantize(fp, tq.Int8DynamicActivationInt8WeightConfig, "quantize_")
    assert all(q.activation_quantized for q in quantized_linears(m).values())
    r = pyattr.relevance(m, ids, target=fp_result.target_ids)
    assert torch.isfinite(r.relevance).all()
    assert _conserves(r, 2e-2) and not _conserves(r, 1e-4)
    assert _agrees(r.token_relevance, fp_result.token_relevance, 0.9, 0.999)


def test_scope_hygiene_and_nesting(fp, ids):
    m = _quantize(fp, tq.Int8WeightOnlyConfig, "quantize_")
    assert_scope_hygiene(m, fp)
    lin = m.model.layers[0].self_attn.q_proj  # carries the AH-rule on top of the quantized forward
    with pyattr.use_relevance_rules(m):
        with pyattr.use_relevance_rules(m):
            assert lin.__dict__["_pyattr_quantized"].count == 2
            r = pyattr.relevance(m, ids)
        assert lin.__dict__["_pyattr_quantized"].count == 1
        assert torch.isfinite(r.relevance).all()
    assert "forward" not in lin.__dict__ and "_pyattr_quantized" not in lin.__dict__


class LoraLinear(nn.Module):
    """peft's LoRA layer in miniature: the quantized layer inside, its weight shown as a property."""

    def __init__(self, base):
        super().__init__()
        self.base_layer, self.lora_A, self.lora_B = base, nn.Linear(base.in_features, 4, bias=False), nn.Linear(
            4, base.out_features, bias=False)

    @property
    def weight(self):
        return self.base_layer.weight

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_wrapper_showing_the_quantized_weight_is_not_refused():
    torch.manual_seed(0)
    base = nn.Linear(32, 16)
    tq.quantize_(base, tq.Int8WeightOnlyConfig())
    m = nn.Sequential(LoraLinear(base))
    assert list(quantized_linears(m)) == ["0.base_layer"]
    x = torch.randn(3, 32, requires_grad=True)
    with quantized_input_gradients(m):
        (gx,) = torch.autograd.grad(m(x).sum(), x)
    lora = m[0].lora_B.weight @ m[0].lora_A.weight
    torch.testing.assert_close(gx, torch.ones(3, 16) @ (base.weight.dequantize() + lora))


# --- refused ------------------------------------------------------------------------------

def _unpatched(m):
    return all("forward" not in mod.__dict__ for mod in m.modules())


def test_refuses_unknown_quant_method(fp, ids):
    m = copy.deepcopy(fp)
    m.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(UnsupportedQuantizationError) as e:
        pyattr.relevance(m, ids)
    assert str(e.value) == (
        "LlamaForCausalLM is quantized with quant_method='gptq' (its quantization_config); pyattr computes "
        "relevance through weight-quantized linear layers of torchao and bitsandbytes only, and has no checked "
        "input gradient for these layers. Load the model with TorchAoConfig, BitsAndBytesConfig, or unquantized")
    assert isinstance(e.value, NotImplementedError) and isinstance(e.value, RelevanceRuleUnsupportedError)
    assert _unpatched(m)


class QuantLinear(nn.Module):
    """A packed-int4 layer of an unknown library (GPTQ's layout)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("qweight", torch.zeros(8, 64, dtype=torch.int32))

    def forward(self, x):
        return x


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_refuses_unknown_quantized_layers(fp, int8, ids):
    m = copy.deepcopy(fp)
    m.model.layers[1].mlp.down_proj = QuantLinear()
    with pytest.raises(UnsupportedQuantizationError, match=re.escape(
            "'model.layers.1.mlp.down_proj' (QuantLinear) holds integer weights (qweight: torch.int32, a "
            "quantization pyattr does not know); pyattr computes relevance through weight-quantized linear "
            "layers of torchao and bitsandbytes only (torchao: an nn.Linear whose weight is a torchao tensor "
            "subclass; bitsandbytes: Linear4bit, Linear8bitLt)")):
        pyattr.relevance(m, ids)
    assert _unpatched(m)
    m = copy.deepcopy(int8)
    old = m.model.layers[0].mlp.up_proj
    new = ScaledLinear(old.in_features, old.out_features, bias=False)
    new.weight = old.weight
    m.model.layers[0].mlp.up_proj = new
    with pytest.raises(UnsupportedQuantizationError, match=re.escape(
            "'model.layers.0.mlp.up_proj' (ScaledLinear) holds a torchao Int8Tensor weight but its forward is not "
            "nn.Linear.forward, so its input gradient is not dy · W;")):
        pyattr.relevance(m, ids)
    assert _unpatched(m)


def test_refuses_weight_that_cannot_dequantize(int8, ids, monkeypatch):
    """A torchao layout without kernels here (int4 tile-packed needs CUDA) fails in the
    backward with the layer named, never with a wrong number."""
    m = int8
    cls = type(m.model.layers[0].mlp.up_proj.weight)

    def no_kernel(self, *a, **k):
        raise NotImplementedError("no cpu kernel")

    monkeypatch.setattr(cls, "dequantize", no_kernel)
    with pytest.raises(UnsupportedQuantizationError, match=re.escape(
            "'lm_head': the torchao Int8Tensor weight cannot be dequantized on cpu (NotImplementedError: no cpu "
            "kernel); relevance needs the dequantized weight for the layer's input gradient.")):
        pyattr.relevance(m, ids)
    assert _unpatched(m)


def test_quantized_linear_function_shapes():
    """Leading dimensions of any number, and a bias-free layer."""
    torch.manual_seed(1)
    lin = nn.Linear(32, 16, bias=False)
    tq.quantize_(lin, tq.Int8WeightOnlyConfig())
    w = lin.weight.dequantize()
    for shape in ((32,), (5, 32), (2, 3, 4, 32)):
        x = torch.randn(shape, requires_grad=True)
        y = QuantizedLinearFunction.apply(x, None, lin.forward, lin.weight.dequantize)
        assert torch.equal(y, lin(x))
        (gx,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(gx, torch.ones(*shape[:-1], 16) @ w)


# --- bitsandbytes (a dev dependency: without it these fail, they do not skip) -------------

@pytest.mark.parametrize("kind", ["8bit", "4bit"])
def test_bitsandbytes(kind, fp_result, ids):
    import bitsandbytes  # noqa: F401
    kw = dict(load_in_8bit=True) if kind == "8bit" else dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                              bnb_4bit_compute_dtype=torch.float32)
    m = _load(quantization_config=transformers.BitsAndBytesConfig(**kw), device_map="cpu")
    layers = quantized_linears(m)
    scheme = "Linear8bitLt" if kind == "8bit" else "Linear4bit"
    assert len(layers) == 14 and {(q.method, q.scheme, q.patched) for q in layers.values()} == {
        ("bitsandbytes", scheme, False)}
    r = pyattr.relevance(m, ids, target=fp_result.target_ids)
    assert torch.isfinite(r.relevance).all()
    # LLM.int8 rounds the activations too (straight-through gradient, bitsandbytes' own)
    assert _conserves(r, 2e-2 if kind == "8bit" else 1e-4)
    assert _agrees(r.token_relevance, fp_result.token_relevance, *((0.9, 0.999) if kind == "8bit" else (0.8, 0.98)))


# --- review: more inputs ------------------------------------------------------------------

def _leftovers(m):
    return [n for n, mod in m.named_modules()
            if any(k in mod.__dict__ for k in ("forward", "_pyattr_quantized", "_pyattr_rules"))]


def test_refuses_pytorch_quantized_modules(fp, ids):
    """torch.ao's dynamic quantization swaps nn.Linear for a module whose weight is packed
    (``weight()`` a method) and whose kernel has no input gradient: relevance came back 0
    everywhere with every rule on. Refused before anything is patched."""
    m = torch.ao.quantization.quantize_dynamic(copy.deepcopy(fp), {nn.Linear}, dtype=torch.qint8)
    with pytest.raises(UnsupportedQuantizationError, match=re.escape(
            "'model.layers.0.self_attn.q_proj' (DynamicQuantizedLinear) is a PyTorch-quantized module "
            "(torch.ao.quantization: packed weights, a kernel without an input gradient);")):
        pyattr.relevance(m, ids)
    with pytest.raises(UnsupportedQuantizationError):
        pyattr.relevance(m, ids, rules=pyattr.RelevanceRules())
    assert not _leftovers(m)


class PackedLinear(nn.Module):
    """A linear layer of an unknown library keeping its packed weight under another name (HQQ's W_q)."""

    def __init__(self, inner):
        super().__init__()
        self.register_buffer("W_q", torch.zeros(inner.out_features, inner.in_features // 2, dtype=torch.uint8))
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_refuses_integer_weights_under_any_name(fp, ids):
    m = copy.deepcopy(fp)
    m.model.layers[0].mlp.up_proj = PackedLinear(m.model.layers[0].mlp.up_proj)
    with pytest.raises(UnsupportedQuantizationError, match=re.escape(
            "'model.layers.0.mlp.up_proj' (PackedLinear) holds integer weights (W_q: torch.uint8")):
        pyattr.relevance(m, ids)
    assert not _leftovers(m)


def test_quantized_inside_an_open_scope_is_refused_naming_the_order(fp, ids):
    """The model quantized after a scope put its rules on the q/k projections: the rule
    forward sits where the layer's own would be, so the quantized layer cannot be given its
    gradient under it. Refused with what to do; the scopes still restore everything."""
    m = copy.deepcopy(fp)
    with pyattr.use_relevance_rules(m):
        tq.quantize_(m, tq.Int8WeightOnlyConfig())
        with pytest.raises(UnsupportedQuantizationError, match=r"'model\.layers\.0\.self_attn\.q_proj' \(Linear\) was "
                                                               r"quantized inside an open use_relevance_rules scope"):
            pyattr.relevance(m, ids)
    assert not _leftovers(m)
    r = pyattr.relevance(m, ids)
    assert torch.isfinite(r.relevance).all()


def test_layer_called_with_a_keyword_input():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    tq.quantize_(lin, tq.Int8DynamicActivationInt8WeightConfig())
    x = torch.randn(3, 16, requires_grad=True)
    with quantized_input_gradients(lin):
        (gx,) = torch.autograd.grad(lin(input=x).sum(), x)
    assert torch.equal(gx, torch.ones(3, 8) @ lin.weight.dequantize())


def test_offloaded_quantized_model(int8, ids, fp_result):
    """Under accelerate's offload the torchao weight sits on ``meta`` between calls: the
    backward must use the weight the forward multiplied by, not read the layer's weight
    again (it read the meta placeholder: relevance off by 1e25 with no error)."""
    from accelerate import cpu_offload

    m = copy.deepcopy(int8)
    cpu_offload(m, execution_device=torch.device("cpu"))
    assert m.model.layers[0].mlp.up_proj.weight.device.type == "meta"
    t = fp_result.target_ids
    for rules in (pyattr.RelevanceRules(), None):
        torch.testing.assert_close(pyattr.relevance(m, ids, target=t, rules=rules).relevance,
                                   pyattr.relevance(int8, ids, target=t, rules=rules).relevance)
    lin = m.model.layers[0].mlp.up_proj
    assert "_pyattr_quantized" not in lin.__dict__ and lin.__dict__["_old_forward"].__func__ is nn.Linear.forward


def _bnb_4bit():
    import bitsandbytes  # noqa: F401
    kw = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    return _load(quantization_config=transformers.BitsAndBytesConfig(**kw), device_map="cpu")


def test_bitsandbytes_4bit_after_a_call_without_gradient(ids):
    """bitsandbytes repacks a Linear4bit's weight for inference at its first call without
    gradient on a CPU with AVX-512 bf16 (for good; that kernel has no backward, and its
    inverse conversion does not restore the weights): relevance is refused there with the
    reason, never a number. On a CPU without those instructions nothing is repacked and
    relevance conserves."""
    m = _bnb_4bit()
    first = m.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        m(ids)
    repacked = bool(getattr(first.weight.quant_state, "packing_format_for_cpu", False))
    assert repacked == bool(first.support_avx512bf16_for_cpu)
    if repacked:
        with pytest.raises(UnsupportedQuantizationError, match=re.escape(
                "'model.layers.0.self_attn.q_proj' (Linear4bit): bitsandbytes repacked its weight for CPU inference")):
            pyattr.relevance(m, ids, target=5)
        assert _unpatched(m)
    else:
        assert _conserves(pyattr.relevance(m, ids, target=5), 1e-4)


def test_bitsandbytes_4bit_generation_keeps_the_layout_its_backward_needs(ids):
    """pyattr's own calls without gradient (generate, the rebuilt-forward check) leave the
    4-bit layout alone, so the steps it explains conserve on any CPU."""
    m = _bnb_4bit()
    res = pyattr.generation_relevance(m, ids[:2, :12], max_new_tokens=3)
    for layer in quantized_linears(m).values():
        assert not getattr(layer.module.weight.quant_state, "packing_format_for_cpu", False), layer.path
    assert bool((res.conservation_delta.abs() <= 1e-4 * res.target.abs().clamp_min(1.0)).all()), res.conservation_delta
