"""DESIGN §12, nnsight, tdhook and Captum: the rule scope opened on their wrapper objects,
around (or inside) their own forward and backward, gives the rule gradients. The oracle is
the rule gradient on a copy of the same model taken by a plain forward hook and
``torch.autograd.grad`` under ``use_relevance_rules`` — the same computation, so the
tolerances are float64's."""

import copy

import pytest
import torch
from torch import nn

import pyattr
from models import VOCAB, tiny_causal_lm
from pyattr import RelevanceRules, use_relevance_rules

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

IDS = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
EMBED = {"gpt2": "transformer.wte"}


def _embed_path(arch):
    return EMBED.get(arch, "model.embed_tokens")


def rule_gradient(model, arch, token, rules=None, ids=IDS):
    """(embeddings, gradient of logit ``token`` at the last position) under the rules."""
    kept = {}
    h = model.get_submodule(_embed_path(arch)).register_forward_hook(lambda m, i, o: kept.__setitem__("e", o))
    try:
        with use_relevance_rules(model, rules):
            (g,) = torch.autograd.grad(model(ids).logits[0, -1, token], kept["e"])
    finally:
        h.remove()
    return kept["e"].detach(), g


def close(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * float(want.abs().max()))


# ------------------------------------------------------------------------------ nnsight


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_nnsight_grad_in_a_trace_is_the_rule_gradient_over_two_backward_passes(arch):
    from nnsight import NNsight

    model = tiny_causal_lm(arch, dtype=torch.float64)
    ref = copy.deepcopy(model)
    lm = NNsight(model)
    envoy = lm.transformer.wte if arch == "gpt2" else lm.model.embed_tokens
    with use_relevance_rules(lm) as cov:
        with lm.trace(IDS):
            emb = envoy.output.save()
            logits = lm.output.logits
            with logits[0, -1, 7].backward(retain_graph=True):
                g7 = emb.grad.save()
            with logits[0, -1, 40].backward():
                g40 = emb.grad.save()
    assert cov.model_type == arch and cov.installed
    for g, token in ((g7, 7), (g40, 40)):
        e, want = rule_gradient(ref, arch, token)
        close(g, want)
        close(emb.detach(), e)
    plain = rule_gradient(ref, arch, 7, RelevanceRules())[1]
    assert float((g7 - plain).abs().max()) > 1e-2 * float(plain.abs().max())  # the rules changed it
    # the controllers nnsight installed are in place again, running the class forwards
    body = model.model.layers[0].mlp.__dict__["forward"].state.body if arch != "gpt2" else \
        model.transformer.h[0].mlp.__dict__["forward"].state.body
    assert body is type(model.model.layers[0].mlp if arch != "gpt2" else model.transformer.h[0].mlp).forward


def test_nnsight_scope_opened_inside_the_trace():
    from nnsight import NNsight

    model = tiny_causal_lm("llama", dtype=torch.float64)
    ref = copy.deepcopy(model)
    lm = NNsight(model)
    with lm.trace(IDS):
        with use_relevance_rules(lm):
            emb = lm.model.embed_tokens.output
            with lm.output.logits[0, -1, 7].backward():
                g = emb.grad.save()
    close(g, rule_gradient(ref, "llama", 7)[1])


def test_nnsight_wrappers_are_taken_wherever_a_model_is():
    from nnsight import LanguageModel, NNsight

    import pyattr.toy as toy

    model, tok, _ = toy.load()
    ids = tok("sun cat red tree sun", return_tensors="pt")["input_ids"]
    want = pyattr.relevance(model, ids, target=pyattr.targets.Logit(3)).relevance
    for wrapper in (NNsight(model), LanguageModel(model, tokenizer=tok)):
        assert torch.equal(pyattr.relevance(wrapper, ids, target=pyattr.targets.Logit(3)).relevance, want)
    # text: a LanguageModel reads it with its own tokenizer, a bare NNsight asks for one
    text = pyattr.relevance(model, "sun cat red tree sun", tokenizer=tok)
    got = pyattr.relevance(LanguageModel(model, tokenizer=tok), "sun cat red tree sun")
    assert torch.equal(got.relevance, text.relevance) and got.tokens == text.tokens
    with pytest.raises(ValueError, match=r"relevance\(\): inputs are text; pass tokenizer="):
        pyattr.relevance(NNsight(model), "sun cat red tree sun")
    with use_relevance_rules(NNsight(model).model) as cov:  # a child envoy: the module it holds
        pass
    assert cov.model_type == "llama"


def test_a_rule_carrying_modules_output_and_grad_in_a_trace():
    """``.output`` of a rule-carrying module inside a trace is its output under the rules
    (the same values as without them), and its ``.grad`` the rule gradient there."""
    from nnsight import NNsight

    model = tiny_causal_lm("llama", dtype=torch.float64)
    ref = copy.deepcopy(model)
    lm = NNsight(model)
    with lm.trace(IDS):
        plain = lm.model.layers[0].mlp.output.save()
    with use_relevance_rules(lm):
        with lm.trace(IDS):
            out = lm.model.layers[0].mlp.output
            ruled = out.save()
            with lm.output.logits[0, -1, 7].backward():
                g = out.grad.save()
    assert torch.equal(plain, ruled)
    kept = {}
    h = ref.model.layers[0].mlp.register_forward_hook(lambda m, i, o: kept.__setitem__("o", o))
    with use_relevance_rules(ref):
        (want,) = torch.autograd.grad(ref(IDS).logits[0, -1, 7], kept["o"])
    h.remove()
    close(g, want)


# ------------------------------------------------------------------------------- tdhook


class Logits(nn.Module):
    """A user's adapter: the model's logits as a tensor, as tdhook's TensorDictModule wants."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids).logits


@pytest.mark.parametrize("adapter", [False, True])
@pytest.mark.parametrize("where", ["context", "hooked"])
def test_tdhook_saliency_under_the_scope_is_relevance(adapter, where):
    from tdhook.attribution import Saliency
    from tensordict import TensorDict

    model = tiny_causal_lm("llama", dtype=torch.float64)
    ref = copy.deepcopy(model)
    mod = Logits(model) if adapter else model
    path = ("lm." if adapter else "") + "model.embed_tokens"

    def target(outputs, _):
        return TensorDict(score=outputs["logits"][:, -1, 7], batch_size=outputs.batch_size)

    ctx = Saliency(use_inputs=False, input_modules=[path], init_attr_targets=target,
                   multiply_by_inputs=True).prepare(mod, in_keys=["input_ids"], out_keys=["logits"])
    if where == "context":
        with use_relevance_rules(ctx) as cov, ctx as hooked:
            out = hooked(TensorDict(input_ids=IDS, batch_size=[1]))
    else:
        with ctx as hooked, use_relevance_rules(hooked) as cov:
            out = hooked(TensorDict(input_ids=IDS, batch_size=[1]))
    assert cov.model_type == "llama"
    e, g = rule_gradient(ref, "llama", 7)
    close(out["attr", path][0], (e * g)[0])
    want = pyattr.relevance(ref, IDS, target=pyattr.targets.Logit(7)).relevance[0].double()  # kept in float32
    torch.testing.assert_close(out["attr", path][0], want, rtol=0, atol=1e-6 * float(want.abs().max()))


def test_a_module_with_two_models_inside_is_not_guessed():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = tiny_causal_lm("llama"), tiny_causal_lm("gpt2")

    with pytest.raises(pyattr.RelevanceRuleUnsupportedError, match=r"model type None \(Two\) has no rule map"):
        with use_relevance_rules(Two()):
            pass


# ------------------------------------------------------------------------------- Captum


def test_captums_own_layer_gradient_x_activation_under_the_scope_is_relevance():
    from captum.attr import LayerGradientXActivation

    model = tiny_causal_lm("qwen2", dtype=torch.float64)
    ref = copy.deepcopy(model)
    with use_relevance_rules(model):
        got = LayerGradientXActivation(lambda ids: model(ids).logits[:, -1], model.model.embed_tokens).attribute(
            IDS, target=7)
    e, g = rule_gradient(ref, "qwen2", 7)
    close(got, e * g)


def test_nnsight_wrapping_inside_an_open_scope_keeps_the_rules_and_gives_them_back():
    """``NNsight(model)`` while a scope is open: nnsight's controllers call the rule forwards
    the scope installed (the trace's gradient is the rules'), and at the scope's exit each
    controller runs the module's own forward again — the rules do not outlive the scope
    (they did, silently, 3.5 off)."""
    from nnsight import NNsight

    model = tiny_causal_lm("llama", dtype=torch.float64)
    ref = copy.deepcopy(model)
    with use_relevance_rules(model):
        lm = NNsight(model)
        with lm.trace(IDS):
            emb = lm.model.embed_tokens.output
            with lm.output.logits[0, -1, 7].backward():
                g = emb.grad.save()
    close(g, rule_gradient(ref, "llama", 7)[1])
    close(rule_gradient(model, "llama", 7, RelevanceRules())[1], rule_gradient(ref, "llama", 7, RelevanceRules())[1])
    mlp = model.model.layers[0].mlp
    assert mlp.__dict__["forward"].state.body is type(mlp).forward and "_pyattr_rules" not in mlp.__dict__


def test_nnsight_inside_a_rule_carrying_mlp_in_the_first_trace_of_a_scope():
    """The first call of a scope checks each rebuilt MLP forward on two rows: nnsight must
    not see those calls (``.output`` of ``down_proj`` was the check's (2, hidden) rows, its
    ``.grad`` raised nnsight's OutOfOrderError). And the activation the fused rule op would
    bypass is called through its controller: an edit of ``act_fn.output`` is what the
    rules act on (it was ignored, 0.25 off)."""
    from nnsight import NNsight

    model = tiny_causal_lm("llama", dtype=torch.float64)
    ref = copy.deepcopy(model)
    lm = NNsight(model)
    with lm.trace(IDS):
        plain = lm.model.layers[0].mlp.down_proj.output.save()
    with use_relevance_rules(lm):
        with lm.trace(IDS):
            out = lm.model.layers[0].mlp.down_proj.output
            first = out.save()
            with lm.output.logits[0, -1, 7].backward():
                g = out.grad.save()
    assert torch.equal(first, plain)
    kept = {}
    h = ref.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: kept.__setitem__("o", o))
    with use_relevance_rules(ref):
        (want,) = torch.autograd.grad(ref(IDS).logits[0, -1, 7], kept["o"])
    h.remove()
    close(g, want)
    # an edit of the activation's output, against the same edit of up_proj's (the same product)
    oracle = copy.deepcopy(ref)
    h = oracle.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: o * 2)
    e, want = rule_gradient(oracle, "llama", 7)
    h.remove()
    with use_relevance_rules(lm):
        with lm.trace(IDS):
            emb = lm.model.embed_tokens.output.save()
            act = lm.model.layers[0].mlp.act_fn
            act.output = act.output * 2
            with lm.output.logits[0, -1, 7].backward():
                g = emb.grad.save()
    close(g, want)


@pytest.mark.parametrize("kind, at_zero", [("relu", 0.0), ("silu", 0.5), ("gelu", 0.5)])
def test_identity_rule_of_a_traced_activation_at_zero(kind, at_zero):
    """Under an nnsight trace the gated MLP's Identity-rule divides the activation's real output
    by its input; where the input is 0 it takes the activation's own φ(0), as every backend does
    (reported: ½ for every kind, so a ReLU-gated MLP differed from pyattr.relevance there)."""
    from pyattr.activations import known
    from pyattr.integration.forwards import _IdentityOfOutput

    act = known(kind)
    g = torch.tensor([0.0, -0.0, 1.5, -2.0], requires_grad=True)
    a = _IdentityOfOutput.apply(g, act.fn(g.detach()), act)
    a.backward(torch.ones(4))
    want = torch.tensor([at_zero, at_zero, float(act.fn(torch.tensor(1.5)) / 1.5), float(act.fn(torch.tensor(-2.0)) / -2.0)])
    torch.testing.assert_close(g.grad, want, rtol=1e-6, atol=0)
