"""pyattr's promise as one property: a padded row gives what the row gives alone, and a
method's answer depends neither on the other rows nor on earlier calls. Drawn: every
mapped text architecture plus two batch-dependent RoPE decoders × every method ×
padding side × a batch of rows of mixed lengths × a key/value cache. The oracle is each
row's own forward on an untouched copy of the model (the target value) and the method on
that row alone (the per-token numbers)."""

import copy
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyattr
from pyattr import RelevanceRules, targets
import pyattr.architectures as A
from pyattr.patching import attribution_patching
from conftest import keeps_rng_state
from models import ENCODERS, TEXT_ARCHS, VOCAB, tiny_causal_lm, tiny_rope_scaled

pytestmark = pytest.mark.usefixtures("one_thread")

ROPE = ("longrope", "dynamic")
METHODS = ("relevance", "layer_relevance", "integrated_gradients", "attribution_patching")


def test_text_architectures_cover_the_table():
    """The padding tests reach every mapped architecture that takes token ids."""
    assert set(TEXT_ARCHS) | set(A.VISION) | {"clip_text_model"} == set(A.ARCHITECTURES)


@functools.lru_cache(maxsize=None)
@keeps_rng_state
def _model(arch):
    return tiny_rope_scaled(arch) if arch in ROPE else tiny_causal_lm(arch)


def _own_logit(model, inputs, token):
    """The row's own forward (with its own copy of its cache rows), on a copy of the model
    nobody has run (dynamic-NTK keeps state between forwards)."""
    kwargs = copy.deepcopy(inputs) if isinstance(inputs, dict) else {"input_ids": inputs}
    with torch.no_grad():
        return copy.deepcopy(model)(**kwargs).logits[0, -1, token].double()


def _run(method, model, inputs, tgt, rules):
    if method == "relevance":
        r = pyattr.relevance(model, inputs, target=tgt, rules=rules)
        return r.target, r.token_relevance
    if method == "layer_relevance":
        r = pyattr.layer_relevance(model, inputs, "residual", target=tgt, rules=rules)
        return r.target, sum(r[p].relevance.sum(-1) for p in r.paths)
    if method == "integrated_gradients":
        r = pyattr.integrated_gradients(model, inputs, target=tgt, n_steps=2, internal_batch_size=3)
        return r.target, r.token_attribution
    ids = inputs["input_ids"] if isinstance(inputs, dict) else inputs
    corrupt = dict(inputs) if isinstance(inputs, dict) else {"input_ids": inputs}
    # each real token replaced by a function of itself alone, so a row's corrupt input does
    # not depend on its padding; pad tokens (ids below 3) stay
    corrupt["input_ids"] = torch.where(ids < 3, ids, (ids * 7 + 3) % (VOCAB - 3) + 3)
    r = attribution_patching(model, inputs, corrupt, targets.Logit(tgt), nodes="residual", method="atp")
    return r.clean_metric, r["residual"].sum(1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", TEXT_ARCHS + ROPE)
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_rows_equal_alone(arch, method, data):
    model = _model(arch)
    pad = model.config.pad_token_id or 0
    # rows of 5 and 12 tokens straddle the RoPE models' 8-position threshold
    lengths = data.draw(st.lists(st.sampled_from([2, 3, 5, 9, 12]), min_size=1, max_size=3), label="lengths")
    decoder = arch not in ENCODERS
    use_cache = decoder and data.draw(st.booleans(), label="cache")
    side = data.draw(st.sampled_from(["left", "right"]), label="side")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    g = torch.Generator().manual_seed(seed)
    if use_cache:  # a cache lines every row up: one length for the new tokens, one for the prefix
        lengths = [lengths[0]] * len(lengths)
    rows = [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]
    tgt = torch.randint(0, VOCAB, (len(rows),), generator=g)
    rules = RelevanceRules.all() if method in ("relevance", "layer_relevance") else None
    if use_cache:
        prefix = torch.randint(3, VOCAB, (len(rows), 3), generator=g)
        ids = torch.stack(rows)
        mask = torch.ones_like(ids, dtype=torch.bool)
        with torch.no_grad():
            cache = copy.deepcopy(model)(prefix, use_cache=True).past_key_values
        inputs = {"input_ids": ids, "past_key_values": cache}
        alone_inputs = [{"input_ids": r[None], "past_key_values": copy.deepcopy(cache)} for r in rows]
        for i, a in enumerate(alone_inputs):
            a["past_key_values"].batch_select_indices(torch.tensor([i]))
        # for most models also the whole sequence's forward; not for LongRoPE, whose cache
        # holds keys rotated with the prefix's (short) factors
        full = alone_inputs
    else:
        n = max(lengths)
        ids = torch.full((len(rows), n), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), n, dtype=torch.bool)
        for i, r in enumerate(rows):
            sl = slice(n - len(r), n) if side == "left" else slice(0, len(r))
            ids[i, sl], mask[i, sl] = r, True
        inputs = {"input_ids": ids, "attention_mask": mask.long()}
        alone_inputs = [r[None] for r in rows]
        full = alone_inputs
    # longrope: short or long factors (above 8 positions); dynamic: frequencies for each length above 8
    total = [n + (3 if use_cache else 0) for n in lengths]
    mixed = arch in ROPE and len({(n > 8) if arch == "longrope" else max(n, 8) for n in total}) > 1
    if method == "attribution_patching" and mixed:
        with pytest.raises(ValueError, match="have lengths for which .* rotary embedding computes different frequencies"):
            _run(method, model, inputs, tgt, rules)
        return
    value, per_token = _run(method, model, inputs, tgt, rules)
    for i, row in enumerate(rows):
        torch.testing.assert_close(value[i], _own_logit(model, full[i], int(tgt[i])), atol=2e-5, rtol=2e-5)
        _, alone = _run(method, model, alone_inputs[i], tgt[i:i + 1], rules)
        torch.testing.assert_close(per_token[i, mask[i]], alone[0], atol=2e-5, rtol=2e-4)
        # padding carries nothing
        assert float(per_token[i, ~mask[i]].abs().sum()) == 0.0
    if use_cache:
        assert cache.get_seq_length() == 3
