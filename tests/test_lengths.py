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
