"""pyattr.compat.captum: Captum's own LLMGradientAttribution, metrics and visualization run
on pyattr relevance, and give pyattr's numbers."""

import pytest
import torch

import pyattr
import pyattr.toy as toy
from pyattr.targets import Logit

captum = pytest.importorskip("captum")  # in the dev extra; skipped only outside it
from captum.attr import LLMGradientAttribution, TextTokenInput  # noqa: E402
from captum.attr import visualization as viz  # noqa: E402
from captum.metrics import infidelity, sensitivity_max  # noqa: E402

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
