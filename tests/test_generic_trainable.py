"""generic=True with the model's parameters left trainable, in the user's own scope (issue
45 §4): a parameter, or what the forward computes from parameters alone (a layer scale λ,
DiffLlama's λ, MobileBERT's NoNorm weight), is a constant of the relevance path, never the
second factor of a Half-rule product. The oracle is conservation (the zoo's models have
their biases zeroed: Σ relevance = target) and ``pyattr.relevance``, which freezes the
parameters; the plan check's verdict is not reused across requires_grad states."""

import warnings

import pytest
import torch

import pyattr
from pyattr.bench import zoo, zoo_build
from pyattr.integration.plan_check import checked_state

pytestmark = pytest.mark.usefixtures("one_thread")

# the zoo entries the issue found silently wrong (those buildable here): layer scales,
# DiffLlama's λ, Doge's and MobileBERT's parameter products
ENTRIES = [("image_classification", "dinov2", "Dinov2ForImageClassification"),
           ("image_classification", "beit", "BeitForImageClassification"),
           ("causal_lm", "diffllama", "DiffLlamaForCausalLM"),
           ("causal_lm", "doge", "DogeForCausalLM"),
           ("masked_lm", "mobilebert", "MobileBertForMaskedLM")]


def _build(mapping, model_type, cls):
    model, x = zoo_build.build(mapping, model_type, cls, zoo.SEQ)
    zoo_build.zero_biases(model)
    with torch.no_grad():
        y = zoo._logits(model(x, **zoo._plain_kwargs(model)))
    tid = int(y[0, -1].argmax() if y.dim() == 3 else y[0].argmax())
    return model, x, tid


@pytest.mark.parametrize("mapping,model_type,cls", ENTRIES, ids=[e[1] for e in ENTRIES])
def test_trainable_parameters_in_the_users_scope_conserve_and_equal_relevance(mapping, model_type, cls):
    model, x, tid = _build(mapping, model_type, cls)
    assert all(p.requires_grad for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", pyattr.PartialRelevanceWarning)
        # a fresh model: the plan check probes the trainable state (no false refusal)
        rel, value = zoo.scope_relevance(model, x, tid)
        assert float(rel.sum()) == pytest.approx(value, abs=1e-6 * max(abs(value), float(rel.abs().sum())))
        ref = pyattr.relevance(model, x, target=tid, generic=True)  # parameters frozen for the call
        assert all(p.requires_grad for p in model.parameters())
        again, _ = zoo.scope_relevance(model, x, tid)
    want = ref.relevance.double()
    torch.testing.assert_close(rel, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    torch.testing.assert_close(again, rel, rtol=1e-12, atol=1e-12 * float(rel.abs().max()))


def test_a_cached_verdict_holds_only_for_the_state_it_checked():
    model, x, _ = _build("image_classification", "dinov2", "Dinov2ForImageClassification")
    s0 = checked_state(model)
    assert checked_state(model) == s0
    next(model.parameters()).requires_grad_(False)
    s1 = checked_state(model)
    assert s1 != s0
    mlp = model.dinov2.encoder.layer[0].mlp
    mlp.forward = lambda h: h  # a forward replaced on the instance is another plan
    assert checked_state(model) != s1
    del mlp.forward
    assert checked_state(model) == s1
    handle = mlp.register_forward_hook(lambda mod, args, out: out.exp() - 1)  # a hook that edits an output
    assert checked_state(model) != s1
    handle.remove()
    assert checked_state(model) == s1
    model.to(torch.float32)
    assert checked_state(model) != s1


def test_a_hook_added_after_a_verdict_is_checked_again():
    """A forward hook that edits an MLP's output, added after a first generic call that
    passed its probe, is seen by a new probe and refused (it answered with 390 % off before)."""
    from models import tiny_causal_lm

    m = tiny_causal_lm("llama", dtype=torch.float64)
    m.config.model_type = "llama_twin"
    ids = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(3))
    pyattr.relevance(m, ids, target=5, generic=True)
    m.model.layers[1].mlp.register_forward_hook(lambda mod, args, out: out.exp() - 1)
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError, match=r"'model\.layers\.1\.mlp' \(LlamaMLP\) loses"):
        pyattr.relevance(m, ids, target=5, generic=True)


def _scaled_twin(scale):
    """A tiny float64 Llama under generic=True (a renamed twin) whose MLP outputs are
    multiplied by a learned factor, written as ``scale(module, y)``."""
    from torch import nn

    from models import tiny_causal_lm

    class Scaled(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.a = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))
            self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 32, dtype=torch.float64))

        def forward(self, x):
            y = self.inner(x)
            return y * scale(self, y)

    m = tiny_causal_lm("llama", dtype=torch.float64)
    m.config.model_type = "llama_twin"
    for layer in m.model.layers:
        layer.mlp = Scaled(layer.mlp)
    return m


@pytest.mark.parametrize("form", ["a * ones_like(y)", "gamma.expand_as(y)", "gamma[arange]"])
def test_a_learned_factor_shaped_by_the_path_is_a_constant(form):
    """A factor computed from a parameter and a tensor used only for its shape, or from a
    constant the forward makes (``ones_like``, ``arange``), is a constant of the path: the
    user's scope with the parameters trainable equals pyattr.relevance and conserves (it
    took the Half-rule, or was refused, before)."""
    scale = {"a * ones_like(y)": lambda s, y: s.a * torch.ones_like(y),
             "gamma.expand_as(y)": lambda s, y: s.gamma.expand_as(y),
             "gamma[arange]": lambda s, y: s.gamma[torch.arange(y.shape[-1])]}[form]
    m = _scaled_twin(scale)
    ids = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(3))
    ref = pyattr.relevance(m, ids, target=5, generic=True)
    for toggle in (False, True):  # trainable from the start, or unfrozen inside the open scope
        m.requires_grad_(not toggle)
        with torch.enable_grad(), pyattr.use_relevance_rules(m, generic=True):
            m.requires_grad_(True)
            x = m.get_input_embeddings()(ids).detach().requires_grad_(True)
            value = m(inputs_embeds=x).logits[0, -1, 5]
            value.backward()
        rel = (x * x.grad).detach()
        # eager attention's softmax runs in float32 even in a float64 model: conservation to ~1e-7
        assert float(rel.sum()) == pytest.approx(float(value.detach()), rel=1e-6)
        torch.testing.assert_close(rel, ref.relevance.double(), rtol=1e-5, atol=1e-6)
