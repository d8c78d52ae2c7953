"""relevance() under the caller's grad modes, and the model state it restores on failure."""

import pytest
import torch

import pyattr
from models import VOCAB, tiny_causal_lm




def _same(a, b):
    torch.testing.assert_close(a.relevance, b.relevance, atol=0, rtol=0)
    torch.testing.assert_close(a.target, b.target, atol=0, rtol=0)
    torch.testing.assert_close(a.conservation_delta, b.conservation_delta, atol=0, rtol=0)


def test_no_grad_gives_the_same_result(llama):
    ids = torch.randint(0, VOCAB, (2, 7))
    ref = pyattr.relevance(llama, ids, target=5)
    assert ref.token_relevance.abs().sum() > 0
    with torch.no_grad():
        r = pyattr.relevance(llama, ids, target=5)
    _same(r, ref)
    # conservation still holds: the result is not the all-zero relevance with delta == target
    assert (r.conservation_delta.abs() <= 1e-4 * r.target.abs()).all()
    # the caller's mode is back after the call
    with torch.no_grad():
        pyattr.relevance(llama, ids, target=5)
        assert not torch.is_grad_enabled()


def test_no_grad_callable_target(llama):
    ids = torch.randint(0, VOCAB, (1, 6))
    f = lambda out: out.logits[:, -1, 3] - out.logits[:, -1, 9]  # noqa: E731
    ref = pyattr.relevance(llama, ids, target=f)
    with torch.no_grad():
        r = pyattr.relevance(llama, ids, target=f)
    _same(r, ref)


def test_inference_mode_is_refused_and_inference_inputs_are_not(llama):
    # issue 9 §6: a call under torch.inference_mode() is one clear error; ids created
    # there and used outside it still work (they are copied)
    ids = torch.randint(0, VOCAB, (2, 7))
    ref = pyattr.relevance(llama, ids)
    with torch.inference_mode():
        inf_ids = ids.clone()  # an inference tensor
        with pytest.raises(RuntimeError, match=r"relevance\(\) cannot run under torch.inference_mode\(\)"):
            pyattr.relevance(llama, inf_ids)
        assert torch.is_inference_mode_enabled()
    _same(pyattr.relevance(llama, inf_ids), ref)


def test_state_restored_when_the_call_fails_on_inference_weights():
    with torch.inference_mode():
        m = tiny_causal_lm("llama")
    m.train()
    flags = [p.requires_grad for p in m.parameters()]
    training = [x.training for x in m.modules()]
    with pytest.raises(RuntimeError, match=r"parameter 'model.embed_tokens.weight' is an inference tensor"):
        pyattr.relevance(m, torch.randint(0, VOCAB, (1, 4)))
    assert [p.requires_grad for p in m.parameters()] == flags
    assert [x.training for x in m.modules()] == training


def test_state_restored_when_the_target_fails(llama):
    llama.train()
    frozen = llama.model.layers[0].mlp.up_proj.weight
    frozen.requires_grad_(False)
    flags = [p.requires_grad for p in llama.parameters()]
    try:
        def bad(out):
            raise KeyError("boom")

        with pytest.raises(KeyError, match="boom"):
            pyattr.relevance(llama, torch.randint(0, VOCAB, (1, 4)), target=bad)
        assert [p.requires_grad for p in llama.parameters()] == flags
        assert all(x.training for x in llama.modules())
        assert not frozen.requires_grad
    finally:
        frozen.requires_grad_(True)
        llama.eval()
