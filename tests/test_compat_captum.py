"""pyattr.compat.captum: Captum's own LLMGradientAttribution, NoiseTunnel, TCAV, metrics and
visualization run on pyattr relevance, and give pyattr's numbers (with every rule off,
Captum's own classes' numbers)."""

import inspect

import pytest
import torch
from torch import nn

import pyattr
import pyattr.toy as toy
from pyattr.targets import Logit

captum = pytest.importorskip("captum")  # in the dev extra; skipped only outside it
from captum.attr import (InputXGradient, LayerGradientXActivation, LLMGradientAttribution,  # noqa: E402
                         NoiseTunnel, TextTokenInput)
from captum.attr import visualization as viz  # noqa: E402
from captum.metrics import infidelity, sensitivity_max  # noqa: E402

from models import tiny_causal_lm  # noqa: E402
from pyattr.compat.captum import InputRelevance, LayerRelevance  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def toy_model():
    return toy.load()


def test_llm_gradient_attribution_equals_generation_relevance(toy_model):
    model, tok, _ = toy_model
    res = LLMGradientAttribution(LayerRelevance(model), tok).attribute(
        TextTokenInput("sun cat red tree sun", tok), target="cat red")
    assert res.input_tokens == ["<s>", "sun", "cat", "red", "tree", "sun"] and res.output_tokens == ["cat", "red"]
    enc = dict(tok(["sun cat red tree sun"], return_tensors="pt"))
    cont = tok(["cat red"], add_special_tokens=False, return_tensors="pt")["input_ids"]
    ours = pyattr.generation_relevance(model, enc, continuation=cont, target="logprob")
    # Captum explains each token's log-probability over the prompt tokens
    torch.testing.assert_close(res.token_attr, ours.token_relevance[0, :, :6], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(res.seq_attr, ours.token_relevance[0, :, :6].sum(0), rtol=1e-5, atol=1e-7)
    fig, ax = res.plot_token_attr(show=False)  # Captum's own heatmap of the result
    assert [t.get_text() for t in ax.get_xticklabels()][:2] == ["<s>", "sun"]


def test_layer_relevance_equals_pyattr_relevance(toy_model):
    model, tok, _ = toy_model
    ids = tok(["dog owl fish bee dog"], return_tensors="pt")["input_ids"]
    attr = LayerRelevance(model, forward_func=lambda x: model(x).logits[:, -1]).attribute(ids, target=5)
    want = pyattr.relevance(model, ids, target=Logit(5))
    torch.testing.assert_close(attr, want.relevance, rtol=1e-5, atol=1e-6)
    plain = LayerRelevance(model, forward_func=lambda x: model(x).logits[:, -1], rules=pyattr.RelevanceRules())
    grad_x_input = pyattr.relevance(model, ids, target=Logit(5), rules=pyattr.RelevanceRules())
    torch.testing.assert_close(plain.attribute(ids, target=5), grad_x_input.relevance, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="rules must be a pyattr.RelevanceRules, got str"):
        LayerRelevance(model, rules="all")
    with pytest.raises(TypeError, match="model must be the torch.nn.Module the rules are installed on, got function"):
        InputRelevance(lambda e: e, lambda e: e)


def test_captum_metrics_and_text_visualization_run_on_pyattr_relevance(toy_model):
    model, tok, _ = toy_model
    ids = tok(["sun cat red tree sun"], return_tensors="pt")["input_ids"]
    answer = tok.convert_tokens_to_ids("cat")
    emb = model.get_input_embeddings()(ids).detach()

    def f(e):
        return model(inputs_embeds=e).logits[:, -1, answer]

    explainer = InputRelevance(f, model)
    attr = explainer.attribute(emb)
    want = pyattr.relevance(model, ids, target=Logit(answer))
    torch.testing.assert_close(attr, want.relevance, rtol=1e-5, atol=1e-6)

    def perturb(e):
        noise = 0.01 * torch.randn(e.shape, generator=torch.Generator().manual_seed(0))
        return noise, e - noise

    torch.manual_seed(0)
    inf = infidelity(f, perturb, emb, attr, n_perturb_samples=4)
    torch.manual_seed(0)
    inf_pyattr = infidelity(f, perturb, emb, want.relevance, n_perturb_samples=4)
    assert inf.shape == (1,) and bool(torch.isfinite(inf).all())
    torch.testing.assert_close(inf, inf_pyattr, rtol=1e-4, atol=1e-8)
    sens = sensitivity_max(explainer.attribute, emb, n_perturb_samples=2, perturb_radius=0.001)
    assert sens.shape == (1,) and bool(torch.isfinite(sens).all()) and float(sens) >= 0
    html = viz.format_word_importances(tok.convert_ids_to_tokens(ids[0].tolist()), attr.sum(-1)[0].tolist())
    assert html.count("<mark") == 6 and "cat" in html


# --- Captum's wrappers of an Attribution object (NoiseTunnel, TCAV, LLMGradientAttribution,
# sensitivity_max of a wrapper): they call ``method.attribute.__wrapped__(method, ...)`` or
# ``method.attribute``; both take the gradients under the rules, and with every rule off
# the numbers are Captum's own classes'.

TOKEN = 7
IDS = torch.tensor([[1, 5, 9, 17, 5], [3, 22, 40, 8, 22]])
NT_TYPES = ("smoothgrad", "smoothgrad_sq", "vargrad")


@pytest.fixture(scope="module")
def llama64():
    """Tiny random Llama in float64 with its input embeddings of IDS (2, 5, 32)."""
    m = tiny_causal_lm("llama", dtype=torch.float64)
    m.requires_grad_(False)
    return m, m.get_input_embeddings()(IDS).detach()


def _logit(m):
    return lambda e: m(inputs_embeds=e).logits[:, -1, TOKEN]


def _rules_x_grad(m, rules, e):
    """Closed form: e × ∂logit/∂e with ``rules`` installed, (batch, seq, hidden)."""
    e = e.detach().clone().requires_grad_(True)
    with pyattr.use_relevance_rules(m, rules):
        (g,) = torch.autograd.grad(_logit(m)(e).sum(), e)
    return (e * g).detach()


def test_attribute_carries_captum_signature_and_wrapped(toy_model):
    model, _, _ = toy_model
    ours = {LayerRelevance(model): LayerGradientXActivation(model, model.get_input_embeddings()),
            InputRelevance(_logit(model), model): InputXGradient(_logit(model))}
    for drop_in, captum_own in ours.items():
        assert inspect.signature(drop_in.attribute) == inspect.signature(captum_own.attribute)
        assert inspect.signature(type(drop_in).attribute.__wrapped__) == inspect.signature(
            type(captum_own).attribute.__wrapped__)
        assert drop_in.attribute.__doc__ == captum_own.attribute.__doc__ and drop_in.attribute.__name__ == "attribute"
        # the unlogged function Captum's wrappers call is the one that installs the rules,
        # and no further __wrapped__ leads around it
        assert not hasattr(type(drop_in).attribute.__wrapped__, "__wrapped__")
        assert type(drop_in).attribute.__wrapped__.__qualname__ == f"{type(drop_in).__name__}.attribute"


@pytest.mark.parametrize("nt_type", NT_TYPES)
def test_noise_tunnel_input_relevance_rules_off_equals_captum_input_x_gradient(llama64, nt_type):
    m, e = llama64
    kw = dict(nt_type=nt_type, nt_samples=4, nt_samples_batch_size=3, stdevs=0.05)  # two __wrapped__ calls
    torch.manual_seed(0)
    want = NoiseTunnel(InputXGradient(_logit(m))).attribute(e, **kw)
    torch.manual_seed(0)
    got = NoiseTunnel(InputRelevance(_logit(m), m, rules=pyattr.RelevanceRules())).attribute(e, **kw)
    assert got.shape == e.shape == (2, 5, 32) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert float(want.abs().max()) > 1e-3


def test_noise_tunnel_input_relevance_applies_the_rules(llama64):
    m, e = llama64
    seen = []

    def f(x):
        seen.append(x.detach().clone())
        return _logit(m)(x)

    torch.manual_seed(1)
    got = NoiseTunnel(InputRelevance(f, m)).attribute(e, nt_type="smoothgrad", nt_samples=3, stdevs=0.05)
    # Captum expands the batch as (row 0 × nt_samples, row 1 × nt_samples, ...)
    (noisy,) = seen
    assert noisy.shape == (6, 5, 32) and not torch.equal(noisy[0], e[0])
    want = _rules_x_grad(m, pyattr.RelevanceRules.all(), noisy).view(2, 3, 5, 32).mean(1)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    plain = _rules_x_grad(m, pyattr.RelevanceRules(), noisy).view(2, 3, 5, 32).mean(1)
    assert float((got - plain).abs().max()) > 1e-3 * float(plain.abs().max())
    # no noise: the smoothed relevance is pyattr.relevance's
    torch.manual_seed(1)
    flat = NoiseTunnel(InputRelevance(_logit(m), m)).attribute(e, nt_type="smoothgrad", nt_samples=2, stdevs=0.0)
    ref = pyattr.relevance(m, IDS, target=Logit(TOKEN)).relevance
    torch.testing.assert_close(flat.float(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nt_type", NT_TYPES)
def test_noise_tunnel_layer_relevance_rules_off_equals_captum_layer_gradient_x_activation(llama64, nt_type):
    m, e = llama64
    f = lambda x: m(inputs_embeds=x).logits[:, -1]  # noqa: E731
    layer = m.model.layers[0]
    kw = dict(nt_type=nt_type, nt_samples=4, nt_samples_batch_size=2, stdevs=0.05, target=TOKEN)
    torch.manual_seed(0)
    want = NoiseTunnel(LayerGradientXActivation(f, layer)).attribute(e, **kw)
    torch.manual_seed(0)
    got = NoiseTunnel(LayerRelevance(m, layer, rules=pyattr.RelevanceRules(), forward_func=f)).attribute(e, **kw)
    assert got.shape == (2, 5, 32) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert float(want.abs().max()) > 1e-3


def test_noise_tunnel_layer_relevance_applies_the_rules(llama64):
    m, e = llama64
    f = lambda x: m(inputs_embeds=x).logits[:, -1]  # noqa: E731
    layer = m.model.layers[0]
    kw = dict(nt_type="smoothgrad", nt_samples=2, target=TOKEN)
    torch.manual_seed(2)
    flat = NoiseTunnel(LayerRelevance(m, layer, forward_func=f)).attribute(e, stdevs=0.0, **kw)
    ref = pyattr.layer_relevance(m, IDS, ["model.layers.0"], target=Logit(TOKEN))["model.layers.0"].relevance
    torch.testing.assert_close(flat.float(), ref, rtol=1e-5, atol=1e-6)
    torch.manual_seed(2)
    on = NoiseTunnel(LayerRelevance(m, layer, forward_func=f)).attribute(e, stdevs=0.05, **kw)
    torch.manual_seed(2)
    off = NoiseTunnel(LayerRelevance(m, layer, rules=pyattr.RelevanceRules(), forward_func=f)).attribute(
        e, stdevs=0.05, **kw)
    assert float((on - off).abs().max()) > 1e-3 * float(off.abs().max())
    assert float((on - flat).abs().max()) > 0  # the noise reached the samples


def test_sensitivity_max_of_noise_tunnel_equals_captum(llama64):
    m, e = llama64
    kw = dict(n_perturb_samples=2, perturb_radius=0.01, nt_type="smoothgrad", nt_samples=2, stdevs=0.05)
    torch.manual_seed(3)
    want = sensitivity_max(NoiseTunnel(InputXGradient(_logit(m))).attribute, e, **kw)
    torch.manual_seed(3)
    got = sensitivity_max(NoiseTunnel(InputRelevance(_logit(m), m, rules=pyattr.RelevanceRules())).attribute, e, **kw)
    assert got.shape == (2,) and bool((got > 0).all())
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)


def test_llm_gradient_attribution_rules_off_equals_captum(toy_model):
    model, tok, _ = toy_model
    inp = TextTokenInput("sun cat red tree sun", tok)
    want = LLMGradientAttribution(LayerGradientXActivation(model, model.get_input_embeddings()), tok).attribute(
        inp, target="cat red")
    got = LLMGradientAttribution(LayerRelevance(model, rules=pyattr.RelevanceRules()), tok).attribute(
        inp, target="cat red")
    torch.testing.assert_close(got.token_attr, want.token_attr, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(got.seq_attr, want.seq_attr, rtol=1e-6, atol=1e-8)


class _MeanDifference:
    """Deterministic CAV classifier for TCAV: class c's weights are its mean activation
    minus the other classes' (C × F), classes in label order."""

    def __init__(self):
        self._w = self._classes = None

    def train_and_eval(self, dataloader, **kwargs):
        xs, ys = zip(*[(x.reshape(x.shape[0], -1), y) for x, y in dataloader])
        x, y = torch.cat(xs).double(), torch.cat(ys)
        self._classes = sorted(int(c) for c in y.unique())
        means = torch.stack([x[y == c].mean(0) for c in self._classes])
        self._w = means - (means.sum(0, keepdim=True) - means) / (len(self._classes) - 1)
        return {"accs": torch.tensor(1.0)}

    def weights(self):
        return self._w

    def classes(self):
        return self._classes


def _tcav_scores(m, layer_attr_method, e, concept_embs, save_path):
    from captum.concept import TCAV, Concept
    from captum.concept._utils.classifier import Classifier

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = m

        def forward(self, x):
            return self.lm(inputs_embeds=x).logits[:, -1]

    classifier = type("MeanDifference", (_MeanDifference, Classifier), {})()
    concepts = [Concept(i, f"c{i}", torch.utils.data.DataLoader(list(c), batch_size=3)) for i, c in
                enumerate(concept_embs)]
    tcav = TCAV(Head(), ["lm.model.layers.0"], classifier=classifier, layer_attr_method=layer_attr_method,
                save_path=str(save_path))
    scores = tcav.interpret(e, [concepts], target=TOKEN)
    return scores["0-1"]["lm.model.layers.0"], classifier.weights()


def test_tcav_with_layer_relevance(llama64, tmp_path):
    m, e = llama64
    g = torch.Generator().manual_seed(4)
    concept_embs = [m.get_input_embeddings()(torch.randint(4, 40, (4, 5), generator=g)).detach(),
                    m.get_input_embeddings()(torch.randint(40, 90, (4, 5), generator=g)).detach()]
    layer = m.model.layers[0]
    f = lambda x: m(inputs_embeds=x).logits[:, -1]  # noqa: E731
    want, _ = _tcav_scores(m, LayerGradientXActivation(f, layer, multiply_by_inputs=False), e, concept_embs,
                           tmp_path / "captum")
    off, _ = _tcav_scores(m, LayerRelevance(m, layer, rules=pyattr.RelevanceRules(), forward_func=f,
                                            multiply_by_inputs=False), e, concept_embs, tmp_path / "off")
    for k in ("sign_count", "magnitude"):
        assert off[k].shape == (2,)
        torch.testing.assert_close(off[k], want[k], rtol=1e-6, atol=1e-7)
    on, cav = _tcav_scores(m, LayerRelevance(m, layer, forward_func=f, multiply_by_inputs=False), e, concept_embs,
                           tmp_path / "on")
    # closed form: TCAV scores each input's rule gradient at the layer against each CAV
    grad = pyattr.layer_relevance(m, IDS, ["model.layers.0"], target=Logit(TOKEN))["model.layers.0"].gradient
    s = grad.reshape(2, -1).double() @ cav.double().T  # (inputs, concepts)
    torch.testing.assert_close(on["magnitude"].double(), s.mean(0), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(on["sign_count"], (s > 0).float().mean(0))
    assert float((on["magnitude"] - off["magnitude"]).abs().max()) > 1e-3 * float(off["magnitude"].abs().max())


@pytest.mark.parametrize("layer", ["model.layers.1.input_layernorm", "model.norm"])
def test_captum_layer_methods_on_a_norm_inside_a_scope(layer):
    """Reported: Captum's layer methods on a norm (a rule module) were refused inside a scope,
    as replacing its output (their hook returns a clone). Captum's own LayerGradientXActivation
    there gives pyattr.layer_relevance's numbers, and pyattr's drop-in the same."""
    from captum.attr import LayerIntegratedGradients

    m = tiny_causal_lm("llama")
    x = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(1))
    want = pyattr.layer_relevance(m, x, [layer], target=5)[layer].relevance
    def last(ids):
        return m(ids).logits[:, -1]
    with pyattr.use_relevance_rules(m):
        got = LayerGradientXActivation(last, m.get_submodule(layer)).attribute(x, target=5)
        lig = LayerIntegratedGradients(last, m.get_submodule(layer)).attribute(
            x, baselines=torch.zeros_like(x), target=5, n_steps=4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # Captum's layer IG (its hook puts a new leaf in the norm's place) is pyattr's, rules on
    base = m.get_input_embeddings()(torch.zeros_like(x)).detach()
    ig = pyattr.integrated_gradients(m, x, target=5, baseline=base, n_steps=4, layer=layer,
                                     rules=pyattr.RelevanceRules.all())
    torch.testing.assert_close(lig.float(), ig.attribution.float(), rtol=1e-4, atol=1e-6)
