"""pyattr.evaluate: perturbation curves and ABPC against hand computations and against
the model run on explicitly perturbed inputs."""

import pytest
import torch

import pyattr
import pyattr.evaluate as E
from models import pad_rows, tiny_causal_lm
from pyattr.evaluate.perturbation import perturbed_masks
from pyattr.targets import Logit, LogitDiff

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.tensor([[5, 9, 14, 3, 22, 7], [11, 4, 4, 30, 2, 17]])


def test_area_is_the_trapezoid_rule_by_hand():
    f = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    assert E.area(torch.tensor([1.0, 0.5, 0.0]), f).item() == pytest.approx(0.5)
    # (2 + 4) / 2 · 0.5 + (4 + 1) / 2 · 0.5 = 1.5 + 1.25
    assert E.area(torch.tensor([[2.0, 4.0, 1.0]]), f).tolist() == [pytest.approx(2.75)]


def test_levels_by_hand():
    rel = torch.tensor([[3.0, 1.0, 2.0, 0.5]])
    real = torch.tensor([[True, True, True, False]])  # the last token is padding: never perturbed
    morf = perturbed_masks(rel, real, "morf", 3).int().tolist()[0]
    assert morf == [[0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 0]]
    lerf = perturbed_masks(rel, real, "lerf", 3).int().tolist()[0]
    assert lerf == [[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [1, 1, 1, 0]]
    ins = perturbed_masks(rel, real, "insertion", 3).int().tolist()[0]
    assert ins == [[1, 1, 1, 0], [0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]]
    # more steps than tokens: round(j·n/steps), half up; ties broken by position
    tied = perturbed_masks(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), "morf", 4)
    assert tied.int().tolist()[0] == [[0, 0], [1, 0], [1, 0], [1, 1], [1, 1]]


@pytest.fixture(scope="module")
def model():
    m = tiny_causal_lm("llama")
    m.config.pad_token_id = 0
    return m


def _oracle(model, ids, mask, token, embeds=None):
    """logit of ``token`` at the last position, the model run on explicitly perturbed input."""
    with torch.no_grad():
        e = model.get_input_embeddings()(ids) if embeds is None else embeds
        e = e.masked_fill(mask[..., None], 0.0) if embeds is None else e
        return model(inputs_embeds=e).logits[:, -1].gather(1, token[:, None])[:, 0].double()


def test_zero_embedding_curve_equals_the_model_on_zeroed_embeddings(model):
    r = pyattr.relevance(model, IDS)
    curve = E.perturbation_curve(model, IDS, r, steps=3)
    assert curve.values.shape == (2, 4) and curve.fractions.tolist() == [0, 1 / 3, 2 / 3, 1]
    levels = perturbed_masks(r.token_relevance, torch.ones_like(IDS, dtype=torch.bool), "morf", 3)
    for j in range(4):
        want = _oracle(model, IDS, levels[:, j], r.target_ids)
        torch.testing.assert_close(curve.values[:, j], want, atol=1e-5, rtol=1e-5)
    # level 0 is the explained value itself; the target stays the unperturbed top-1 token
    torch.testing.assert_close(curve.values[:, 0], r.target, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(curve.auc, E.area(curve.values, curve.fractions))


@pytest.mark.parametrize("perturbation", ["pad", "mask", "mean_embedding"])
def test_token_and_mean_perturbations_equal_the_model_on_replaced_inputs(model, perturbation):
    rel = torch.arange(12.0).reshape(2, 6)
    tok = torch.tensor([3, 8])
    kw = {"token_id": 31} if perturbation == "mask" else {}
    curve = E.perturbation_curve(model, IDS, rel, Logit(tok), order="lerf", perturbation=perturbation, steps=2, **kw)
    levels = perturbed_masks(rel, torch.ones_like(IDS, dtype=torch.bool), "lerf", 2)
    emb = model.get_input_embeddings()
    for j in range(3):
        m = levels[:, j]
        if perturbation == "mean_embedding":
            e = torch.where(m[..., None], emb.weight.mean(0), emb(IDS)).detach()
            want = _oracle(model, IDS, m, tok, embeds=e)
        else:
            with torch.no_grad():
                ids = IDS.masked_fill(m, 0 if perturbation == "pad" else 31)
                want = model(ids).logits[:, -1].gather(1, tok[:, None])[:, 0].double()
        torch.testing.assert_close(curve.values[:, j], want, atol=1e-5, rtol=1e-5)


def test_abpc_is_lerf_minus_morf_and_a_good_ranking_beats_its_reverse(model):
    r = pyattr.relevance(model, IDS)
    a = E.abpc(model, IDS, r, steps=6)
    lerf = E.perturbation_curve(model, IDS, r, order="lerf", steps=6)
    morf = E.perturbation_curve(model, IDS, r, order="morf", steps=6)
    torch.testing.assert_close(a, lerf.auc - morf.auc)
    torch.testing.assert_close(E.abpc(model, IDS, -r.token_relevance, steps=6), -a)
    with pytest.raises(TypeError, match="abpc\\(\\) sets order itself"):
        E.abpc(model, IDS, r, order="morf")


def test_a_padded_row_equals_the_row_alone(model):
    rows = [[5, 9, 14, 3, 22, 7], [11, 4, 30]]
    ids, mask = pad_rows(rows, "left")
    rel = torch.tensor([[0.3, -1.0, 2.0, 0.1, 0.7, 1.1], [0.0, 0.0, 0.0, 0.4, 2.0, -0.2]])
    both = E.perturbation_curve(model, {"input_ids": ids, "attention_mask": mask}, rel, steps=3)
    alone = E.perturbation_curve(model, torch.tensor([rows[1]]), rel[1:, 3:], steps=3)
    torch.testing.assert_close(both.values[1], alone.values[0], atol=1e-5, rtol=1e-5)


def test_batch_size_chunks_do_not_change_the_values(model):
    rel = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    whole = E.perturbation_curve(model, IDS, rel, LogitDiff(3, 4), steps=5)
    chunked = E.perturbation_curve(model, IDS, rel, LogitDiff(3, 4), steps=5, batch_size=5)
    torch.testing.assert_close(whole.values, chunked.values, atol=1e-5, rtol=1e-5)


def test_integrated_gradients_results_are_accepted(model):
    ig = pyattr.integrated_gradients(model, IDS, n_steps=4)
    curve = E.perturbation_curve(model, IDS, ig, steps=2)
    ranked = E.perturbation_curve(model, IDS, ig.token_attribution, steps=2)
    assert torch.equal(curve.values, ranked.values)


def test_plot_writes_a_png(model, tmp_path):
    curve = E.perturbation_curve(model, IDS, torch.rand(2, 6), steps=2)
    curve.plot(tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kw, err, message", [
    ({"order": "random"}, ValueError, "order must be one of ('morf', 'lerf', 'insertion'), got 'random'"),
    ({"perturbation": "blur"}, ValueError, "perturbation must be one of ('zero_embedding', 'pad', 'mask', "
                                           "'mean_embedding'), got 'blur'"),
    ({"steps": 0}, ValueError, "steps must be an int ≥ 1, got 0"),
    ({"batch_size": 0}, ValueError, "batch_size must be an int ≥ 1, got 0"),
    ({"perturbation": "mask"}, ValueError, "perturbation='mask' needs token_id="),
    ({"token_id": 3}, ValueError, "token_id is used by perturbation='pad' or 'mask', not 'zero_embedding'"),
    ({"relevance": torch.zeros(2, 5)}, ValueError, "relevance of shape (2, 5) does not match the inputs: expected (2, 6)"),
    ({"relevance": torch.zeros(2, 6, dtype=torch.long)}, TypeError, "relevance must be a floating tensor"),
    ({"relevance": torch.full((2, 6), float("nan"))}, ValueError, "relevance has non-finite values"),
    ({"relevance": [[0.0] * 6] * 2}, TypeError, "relevance must be a Tensor[batch, seq]"),
    ({"target": torch.tensor([[1, 2], [3, 4]])}, ValueError, "a perturbation curve scores one target per row"),
])
def test_bad_arguments_name_what_was_expected(model, kw, err, message):
    kw = {"relevance": torch.zeros(2, 6), **kw}
    rel = kw.pop("relevance")
    with pytest.raises(err) as e:
        E.perturbation_curve(model, IDS, rel, **kw)
    assert message in str(e.value)


def test_pad_perturbation_needs_a_pad_token():
    m = tiny_causal_lm("llama")
    m.config.pad_token_id = None
    with pytest.raises(ValueError, match="perturbation='pad' needs a pad token: LlamaForCausalLM's config has no "
                                         "pad_token_id; pass token_id="):
        E.perturbation_curve(m, IDS, torch.zeros(2, 6), perturbation="pad")


@pytest.mark.parametrize("kw, message", [
    ({"perturbation": "pad", "token_id": 1000}, "token_id must be in [0, 96) (config.vocab_size), got 1000"),
    ({"perturbation": "mask", "token_id": -1}, "token_id must be in [0, 96) (config.vocab_size), got -1"),
    ({"perturbation": "mask", "token_id": 3.7}, "token_id must be an int token id, got 3.7"),
])
def test_bad_token_ids(model, kw, message):
    with pytest.raises(ValueError) as e:
        E.perturbation_curve(model, IDS, torch.zeros(2, 6), **kw)
    assert message in str(e.value)
