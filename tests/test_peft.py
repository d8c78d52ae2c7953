"""A PEFT ``PeftModel`` is accepted where a model is: its injected adapters (LoRA) live in the
model's own modules, so ``pyattr.relevance`` on the wrapper equals it on ``get_base_model()``,
and a scope opened on the wrapper carries the rules under the user's own backward through
``PeftModel.forward``. A prompt-learning adapter, which changes the inputs in
``PeftModel.forward``, is refused by name."""

import pytest
import torch

import pyattr

from models import TEXT_ARCHS, tiny_causal_lm

peft = pytest.importorskip("peft")  # a dev dependency: present wherever the suite runs

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"], "qwen3": ["q_proj", "k_proj"],
           "phi3": ["qkv_proj"], "gpt_neox": ["query_key_value"]}


def _lora(arch):
    base = tiny_causal_lm(arch, dtype=torch.float64)
    torch.manual_seed(1)  # init_lora_weights=False: random B, so the adapters change the output
    cfg = peft.LoraConfig(r=4, target_modules=TARGETS[arch], init_lora_weights=False)
    return peft.get_peft_model(base, cfg).eval()


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_a_lora_peft_model_is_its_base_model_with_the_adapters(arch):
    assert arch in TEXT_ARCHS
    pm = _lora(arch)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = tiny_causal_lm(arch, dtype=torch.float64)(ids).logits[:, -1, 5]
        adapted = pm(input_ids=ids).logits[:, -1, 5]
    assert not torch.allclose(plain, adapted)  # the adapters are in the forward explained
    wrapped = pyattr.relevance(pm, ids, target=5)
    inner = pyattr.relevance(pm.get_base_model(), ids, target=5)
    assert torch.equal(wrapped.token_relevance, inner.token_relevance)
    torch.testing.assert_close(wrapped.target, adapted.double(), rtol=1e-12, atol=1e-12)
    # the user's own backward through PeftModel.forward inside a scope opened on the wrapper: the
    # gradient of a scope on the model inside, not the plain one
    emb = pm.get_base_model().get_input_embeddings()

    def grad(scope_on, run):
        x = emb(ids).detach().requires_grad_()
        with pyattr.use_relevance_rules(scope_on) if scope_on is not None else torch.enable_grad():
            run(inputs_embeds=x).logits[:, -1, 5].sum().backward()
        return x.grad

    g = grad(pm, pm)
    assert torch.equal(g, grad(pm.get_base_model(), pm.get_base_model()))
    assert not torch.allclose(g, grad(None, pm))
    if arch == "llama":  # the embedding's output is where relevance is read
        x = emb(ids).detach()
        torch.testing.assert_close((g * x).sum(-1).float(), wrapped.token_relevance, rtol=1e-5, atol=1e-7)


def test_a_prompt_learning_peft_model_is_refused_by_name():
    base = tiny_causal_lm("llama", dtype=torch.float64)
    pm = peft.get_peft_model(base, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    with pytest.raises(TypeError, match="model: a PeftModel with a prompt-learning adapter \\(PromptTuningConfig\\) "
                                        "adds virtual tokens in PeftModel.forward"):
        pyattr.relevance(pm, ids, target=5)
    with pytest.raises(TypeError, match="prompt-learning adapter"):
        with pyattr.use_relevance_rules(pm):
            pass


def test_a_mixed_peft_model_is_its_base_model_with_the_adapters():
    base = tiny_causal_lm("llama", dtype=torch.float64)
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=4, target_modules=TARGETS["llama"], init_lora_weights=False)
    mixed = peft.get_peft_model(base, cfg, mixed=True).eval()
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(4))
    wrapped = pyattr.relevance(mixed, ids, target=5)
    inner = pyattr.relevance(mixed.base_model.model, ids, target=5)
    assert torch.equal(wrapped.token_relevance, inner.token_relevance)
