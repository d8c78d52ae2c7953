"""pyattr.compat.lxt: LXT's call shape (monkey_patch a modeling module, then grad * input)
gives the float64 AttnLRP reference on transformers 5; forwards unchanged; undo restores."""

import importlib

import pytest
import torch

from models import VOCAB, tiny_causal_lm
from pyattr.compat.lxt import monkey_patch, undo
from test_attnlrp_qk_norm import _attnlrp_reference

pytestmark = pytest.mark.usefixtures("one_thread")

MODULES = {"llama": "transformers.models.llama.modeling_llama", "qwen2": "transformers.models.qwen2.modeling_qwen2",
           "qwen3": "transformers.models.qwen3.modeling_qwen3"}


@pytest.mark.parametrize("arch", sorted(MODULES))
def test_lxt_call_shape_gives_attnlrp(arch):
    module = importlib.import_module(MODULES[arch])
    m = tiny_causal_lm(arch, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    ref, target = _attnlrp_reference(m, ids, 7)
    with torch.no_grad():
        native = m(ids).logits
    try:
        names = monkey_patch(module)
        assert type(m).__name__ in names
        # what an LXT user writes (LXT's README), with this one import changed
        for p in m.parameters():
            p.requires_grad_(False)
        input_embeds = m.get_input_embeddings()(ids)
        output_logits = m(inputs_embeds=input_embeds.requires_grad_(), use_cache=False).logits
        output_logits[0, -1, 7].backward()
        relevance = (input_embeds.grad * input_embeds).sum(-1).detach()[0]
        assert torch.equal(output_logits.detach(), native)  # the forward is the model's own
        assert output_logits[0, -1, 7].item() == pytest.approx(target, abs=1e-12)
        torch.testing.assert_close(relevance, ref, atol=1e-6 * ref.abs().max().item(), rtol=1e-5)
    finally:
        undo(module)
    # undone: plain gradients again
    emb = m.get_input_embeddings()(ids).requires_grad_()
    m(inputs_embeds=emb).logits[0, -1, 7].backward()
    assert not torch.allclose((emb.grad * emb).sum(-1).detach()[0], ref, atol=1e-6, rtol=1e-5)


def test_patching_twice_wraps_once_and_errors_are_named(capsys):
    import transformers.models.llama.modeling_llama as modeling_llama

    try:
        monkey_patch(modeling_llama)
        first = modeling_llama.LlamaForCausalLM.forward
        monkey_patch(modeling_llama, verbose=True)
        assert "pyattr.compat.lxt: AttnLRP rules on" in capsys.readouterr().out
        assert modeling_llama.LlamaForCausalLM.forward.__pyattr_lxt_original_forward__ is \
            first.__pyattr_lxt_original_forward__
    finally:
        undo(modeling_llama)
    assert not hasattr(modeling_llama.LlamaForCausalLM.forward, "__pyattr_lxt_original_forward__")
    with pytest.raises(TypeError, match="monkey_patch: module must be a transformers modeling module, got str"):
        monkey_patch("transformers.models.llama.modeling_llama")
    with pytest.raises(ValueError, match="defines no Hugging Face model class"):
        monkey_patch(torch)
    with pytest.raises(TypeError, match="rules must be a pyattr.RelevanceRules, got str"):
        monkey_patch(modeling_llama, rules="attnlrp")
