"""The row-independence property (tests/test_row_independence_property.py) on the
generation and evaluation paths: a padded batch of prompts, explained in chunks of any
size, gives each row what the per-step loop gives on that row alone, on every mapped
decoder and on the two length-dependent RoPE decoders (LongRoPE, dynamic NTK); a padded
perturbation curve gives each row what it gives alone. Oracles: each row's own per-step
loop of pyattr.relevance on an untouched copy of the model, and transformers' own
forward of the row alone for the targets."""

import copy
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyattr
import pyattr.evaluate as E
import pyattr.targets as T
from conftest import keeps_rng_state
from models import ENCODERS, TEXT_ARCHS, VOCAB, pad_rows, tiny_causal_lm, tiny_rope_scaled
from pyattr.methods.generation import loop_reference

pytestmark = pytest.mark.usefixtures("one_thread")

ROPE = ("longrope", "dynamic")
DECODERS = tuple(a for a in TEXT_ARCHS if a not in ENCODERS)


@functools.lru_cache(maxsize=None)
@keeps_rng_state
def _model(arch):
    return tiny_rope_scaled(arch) if arch in ROPE else tiny_causal_lm(arch)


@pytest.mark.parametrize("arch", DECODERS + ROPE)
@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_generation_chunks_of_padded_rows_equal_each_rows_loop_alone(arch, data):
    model = _model(arch)
    # prompts of 3 and 6 tokens + 4 steps straddle the RoPE models' 8-position threshold
    lengths = data.draw(st.lists(st.sampled_from([3, 6]), min_size=1, max_size=2), label="lengths")
    k = data.draw(st.integers(1, 4), label="batch_targets")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    cont = torch.randint(3, VOCAB, (len(rows), 4), generator=g)
    ids, mask = pad_rows(rows, "left", pad_id=model.config.pad_token_id or 0)
    r = pyattr.generation_relevance(model, {"input_ids": ids, "attention_mask": mask}, continuation=cont,
                                    batch_targets=k)
    for i, row in enumerate(rows):
        seq = torch.tensor([row + cont[i].tolist()])
        fresh = copy.deepcopy(model)  # dynamic NTK keeps state between forwards
        ref = loop_reference(fresh, seq, None, len(row))
        pad = ids.shape[1] - len(row)
        torch.testing.assert_close(r.token_relevance[i, :, pad:].double(), ref["token_relevance"][0].double(),
                                   rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            logits = copy.deepcopy(model)(seq).logits[0]
        own = torch.stack([logits[len(row) - 1 + t, cont[i, t]] for t in range(4)]).double()
        if arch not in ROPE:  # a length-dependent forward's targets are its value at each step's own length
            torch.testing.assert_close(r.target[i], own, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(r.target[i], ref["target"][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("perturbation", ["zero_embedding", "pad", "mask", "mean_embedding"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma", "longrope"])
@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_perturbation_curves_of_padded_rows_equal_each_row_alone(arch, perturbation, data):
    model = _model(arch)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = 0
    side = data.draw(st.sampled_from(["left", "right"]), label="side")
    order = data.draw(st.sampled_from(["morf", "lerf", "insertion"]), label="order")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 10)]
    tgt = torch.randint(3, VOCAB, (2,), generator=g)
    ids, mask = pad_rows(rows, side)
    rel = torch.rand(ids.shape, generator=g)
    kw = {"order": order, "perturbation": perturbation, "steps": 3}
    if perturbation == "mask":
        kw["token_id"] = 7
    both = E.perturbation_curve(model, {"input_ids": ids, "attention_mask": mask}, rel, T.Logit(tgt), **kw)
    for i, row in enumerate(rows):
        cols = mask[i].bool()
        alone = E.perturbation_curve(copy.deepcopy(model), torch.tensor([row]), rel[i, cols][None],
                                     T.Logit(tgt[i:i + 1]), **kw)
        torch.testing.assert_close(both.values[i], alone.values[0], rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # level 0 (morf/lerf) is the unperturbed row: transformers' own forward
            own = copy.deepcopy(model)(torch.tensor([row])).logits[0, -1, tgt[i]].double()
        if order != "insertion":
            torch.testing.assert_close(alone.values[0, 0], own, rtol=1e-5, atol=1e-5)
