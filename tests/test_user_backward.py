"""DESIGN §12: the rule scope under the user's own forward and backward gives the numbers
``pyattr.relevance`` gives on the same model, over mapped architectures × attention
implementations × rule sets × backends × trainable / frozen parameters, with more than one
intra-op thread (a CPU kernel's worker threads do not share the caller's autograd state:
AttnLRP's eager attention backward raised there, issue 45 §5). Flex attention has no CPU
backward in torch, so it is not among the implementations here."""

import contextlib
import importlib

import pytest
import torch

import pyattr
from models import VOCAB, tiny_causal_lm
from pyattr import use_relevance_rules
from pyattr.methods._core.inputs import entry_module
from pyattr.methods._core.text import rules_from

ARCHS = ("llama", "qwen3", "gpt2", "gpt_neox", "phi3", "bert")
ATTN = ("eager", "sdpa")
RULES = ("all", "attnlrp", "ln")
BACKENDS = [b for b in ("cpp", "torch") if pyattr.available_backends()[b].available]


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _model(arch, attn):
    return tiny_causal_lm(arch, attn=attn, dtype=torch.float64)


def user_relevance(model, ids, token, rules, position=-1):
    """What a user writes: the scope around their own forward and ``.backward()``, the
    gradient read where the residual stream enters the first block (a hook keeps it), and
    gradient × input summed over the hidden dimension."""
    entry, where = entry_module(model)
    kept = []

    def keep(t):
        t.retain_grad()
        kept.append(t)

    handle = (entry.register_forward_pre_hook(lambda m, a, k: keep(a[0] if a else k["hidden_states"]), with_kwargs=True)
              if where == "input" else entry.register_forward_hook(lambda m, a, o: keep(o)))
    try:
        e = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        with use_relevance_rules(model, rules):
            value = model(inputs_embeds=e).logits[0, position, token]
            value.backward()
    finally:
        handle.remove()
    x = kept[0]
    return (x * x.grad).sum(-1).detach()[0], float(value.detach())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rules", RULES)
@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("arch", ARCHS)
def test_scope_under_the_users_backward_equals_relevance(arch, attn, rules, backend):
    model = _model(arch, attn)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(11))
    token = 7
    with threads(2), pyattr.backend(backend):
        ref = pyattr.relevance(model, ids, target=pyattr.targets.Logit(token), rules=rules)
        want = ref.token_relevance[0].double()
        for trainable in (True, False):  # a loaded model's parameters require grad; a frozen one's do not
            for p in model.parameters():
                p.requires_grad_(trainable)
            have, value = user_relevance(model, ids, token, rules_from(rules))
            assert value == pytest.approx(float(ref.target.reshape(-1)[0]), abs=1e-12)
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()),
                                       msg=lambda m: f"trainable={trainable}: {m}")
            model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lxt_drop_in_with_eager_attention_and_two_threads(backend):
    """The LXT drop-in's own workflow (monkey_patch, the user's backward) on eager
    attention with two threads: AttnLRP's numbers, as ``pyattr.relevance`` gives them."""
    from pyattr.compat.lxt import monkey_patch, undo

    module = importlib.import_module("transformers.models.llama.modeling_llama")
    model = _model("llama", "eager")
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(12))
    with threads(2), pyattr.backend(backend):
        ref = pyattr.relevance(model, ids, target=pyattr.targets.Logit(5), rules="attnlrp").token_relevance[0]
        try:
            monkey_patch(module)
            for p in model.parameters():
                p.requires_grad_(False)
            e = model.get_input_embeddings()(ids).requires_grad_()
            model(inputs_embeds=e, use_cache=False).logits[0, -1, 5].backward()
        finally:
            undo(module)
    torch.testing.assert_close((e.grad * e).sum(-1).detach()[0], ref.double(), rtol=1e-5,
                               atol=1e-6 * float(ref.abs().max()))
