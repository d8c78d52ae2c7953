"""One clear error, naming the length and the limit, when an input is longer than the
model's position table, in every method (GPT-2 with learned positions failed with a bare
IndexError, MiniLM with a tensor-size RuntimeError, rotary models returned numbers for
positions they never saw)."""

import pytest
import torch

import pyattr
import pyattr.evaluate as E
import pyattr.patching as PT
import pyattr.targets as T
from models import minilm, tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n, seed=0, hi=90):
    return torch.randint(3, hi, (1, n), generator=torch.Generator().manual_seed(seed))


CALLS = {
    "relevance": lambda m, x: pyattr.relevance(m, x),
    "layer_relevance": lambda m, x: pyattr.layer_relevance(m, x, "residual"),
    "integrated_gradients": lambda m, x: pyattr.integrated_gradients(m, x, n_steps=2),
    "attribution_patching": lambda m, x: PT.attribution_patching(m, x, x.flip(1), T.Logit(5), nodes=["residual"]),
    "activation_patching": lambda m, x: PT.activation_patching(m, x, x.flip(1), T.Logit(5), nodes=["residual"]),
    "perturbation_curve": lambda m, x: E.perturbation_curve(m, x, torch.ones(x.shape, dtype=torch.float32),
                                                            T.Logit(5), steps=2),
}


@pytest.mark.parametrize("method", sorted(CALLS))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_every_method_refuses_an_input_past_the_position_table(arch, method):
    model = tiny_causal_lm(arch)
    if arch == "llama":  # rotary: the config's limit, made short here (the rotary tables do not depend on it)
        model.config.max_position_embeddings = 24
    limit = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    name = type(model).__name__
    with pytest.raises(ValueError, match=rf"row 0 is {limit + 3} positions long; {name} reads at most {limit} "
                                         r"\(config.max_position_embeddings / n_positions\)"):
        CALLS[method](model, _ids(limit + 3))
    CALLS[method](model, _ids(limit))  # the limit itself runs


def test_padded_rows_count_their_real_tokens():
    model = tiny_causal_lm("gpt2")
    limit = model.config.n_positions
    ids = _ids(limit + 2)
    mask = torch.ones_like(ids)
    mask[:, :2] = 0  # left padding: the row reads `limit` positions
    r = pyattr.relevance(model, {"input_ids": ids, "attention_mask": mask})
    assert r.token_relevance.shape == (1, limit + 2)


def test_minilm_past_512_tokens_is_refused_not_a_tensor_size_error():
    tok, model = minilm()
    ids = _ids(model.config.max_position_embeddings + 190, hi=1000)
    with pytest.raises(ValueError, match=r"row 0 is 702 positions long; BertModel reads at most 512"):
        pyattr.relevance(model, ids, target=lambda out: out.last_hidden_state[:, 0].sum(-1))


def test_right_padding_past_the_table_reads_only_the_real_tokens_positions():
    """A right-padded batch wider than the position table: the pad columns get the pad
    position, so a row whose real tokens fit runs and equals the row alone (transformers
    numbers every column and fails inside)."""
    model = tiny_causal_lm("gpt2")
    limit = model.config.n_positions
    row = _ids(10)
    ids = torch.cat([row, torch.zeros(1, limit + 6, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, limit + 6)], 1).long()
    r = pyattr.relevance(model, {"input_ids": ids, "attention_mask": mask})
    alone = pyattr.relevance(model, row)
    torch.testing.assert_close(r.token_relevance[:, :10], alone.token_relevance)
    # float32 logits (held in float64) of a padded row and the row alone: other GEMM shapes
    torch.testing.assert_close(r.target, alone.target, atol=1e-6, rtol=1e-5)
    tok, enc_model = minilm()
    enc = tok(["a short sentence"], padding="max_length", max_length=600, return_tensors="pt")
    out = pyattr.relevance(enc_model, enc, target=lambda o: o.last_hidden_state[:, 0].sum(-1))
    assert out.token_relevance.shape == (1, 600)


def test_patching_names_the_input_that_is_too_long():
    model = tiny_causal_lm("gpt2")
    limit = model.config.n_positions
    with pytest.raises(ValueError, match=rf"corrupt: row 0 is {limit + 2} positions long"):
        PT.attribution_patching(model, _ids(limit), _ids(limit + 2), T.Logit(5), nodes=["residual"])


def test_a_yarn_extended_rotary_model_reads_factor_times_its_original_context():
    """Qwen 2.5's documented YaRN set-up keeps max_position_embeddings at the original
    context and sets factor 4: the model is configured for 4x as many positions."""
    import transformers as TR

    torch.manual_seed(0)
    cfg = TR.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                          "original_max_position_embeddings": 16})
    model = TR.Qwen2ForCausalLM(cfg).eval()
    from pyattr.methods._core import max_positions

    assert max_positions(model) == 64
    r = pyattr.relevance(model, _ids(40))
    with torch.no_grad():
        want = model(_ids(40)).logits[0, -1].max()
    assert float(r.target[0]) == pytest.approx(float(want), rel=1e-5)
    with pytest.raises(ValueError, match=r"row 0 is 65 positions long; Qwen2ForCausalLM reads at most 64"):
        pyattr.relevance(model, _ids(65))
