import pytest
import torch

from conftest import DTYPES, assert_close
from oracles import rms_norm_rule_grads
from pyattr.ops import rms_norm


def _run(x, w, eps, offset, dy):
    x = x.detach().requires_grad_(True)
    ins = [x]
    if w is not None:
        w = w.detach().requires_grad_(True)
        ins.append(w)
    y = rms_norm(x, w, eps, offset)
    return y, torch.autograd.grad(y, ins, dy)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [17, 768, 1023, 4097])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_rule_matches_oracle(backend_name, dtype, hidden, offset):
    x = (torch.randn(4, hidden) * 3).to(dtype)
    w = (0.1 * torch.randn(hidden) + (0.0 if offset else 1.0)).to(dtype)
    dy = torch.randn(4, hidden).to(dtype)
    y, (dx, dw) = _run(x, w, 1e-6, offset, dy)
    ex, ew = rms_norm_rule_grads(x, w, 1e-6, offset, dy)
    assert_close(dx, ex, dtype)
    atol = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    torch.testing.assert_close(dw.double(), ew, atol=atol, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_bit_identical_to_hf_llama_and_gemma2(dtype):
    # (float64 is excluded: LlamaRMSNorm rounds float64 through float32, rms_norm does not;
    # the rule scope on a model always runs the module's own forward.)
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(3, 5, 96).to(dtype)
    llama = LlamaRMSNorm(96, eps=1e-6).to(dtype)
    gemma = Gemma2RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        llama.weight.normal_()
        gemma.weight.normal_()
    assert torch.equal(rms_norm(x, llama.weight, 1e-6, 0.0), llama(x))
    assert torch.equal(rms_norm(x, gemma.weight, 1e-6, 1.0), gemma(x))


def test_rms_norm_conserves_without_weight():
    x = torch.randn(6, 50, dtype=torch.float64)
    y, (dx,) = _run(x, None, 1e-6, 0.0, torch.ones(6, 50))
    torch.testing.assert_close((x * dx).sum(-1), y.sum(-1))


def test_rms_norm_special_values_and_empty():
    x = torch.tensor([[0.0, 0.0, 0.0], [float("inf"), 1.0, 1.0], [-0.0, 1e-40, 2.0]])
    y, (dx,) = _run(x, None, 1e-6, 0.0, torch.ones(3, 3))
    assert torch.isfinite(dx[0]).all() and torch.isfinite(dx[2]).all()
    assert dx[1].eq(0).all()  # r = inf: the native 1/r is 0 too; nothing NaN is created
    e = torch.empty(2, 0, 8)
    _, (de,) = _run(e, None, 1e-6, 0.0, torch.empty(2, 0, 8))
    assert de.shape == (2, 0, 8)


def test_rms_norm_non_contiguous():
    x = torch.randn(24, 10).t()
    w = torch.randn(24)
    dy = torch.randn(10, 24)
    _, (dx, _) = _run(x, w, 1e-5, 0.0, dy)
    assert_close(dx, rms_norm_rule_grads(x, w, 1e-5, 0.0, dy)[0], torch.float32)
