"""DESIGN §12 on encoder–decoder models: the rule scope opened on an nnsight wrapper, around
Captum's own layer attribution, and on a TransformerLens 4 bridge, under the user's own
forward and backward, gives ``pyattr.relevance``'s numbers at both stacks' entries, also on
T5, whose bridge runs each block through a forward TransformerLens wrote."""

import copy
import warnings

import pytest
import torch

import pyattr
from models import tiny_seq2seq
from pyattr import use_relevance_rules
from test_seq2seq import ENTRIES, _ids

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def _want(model, arch, seed=3):
    src, dec = _ids(arch, seed=seed, batch=1, src=6, tgt=4)
    return src, dec, pyattr.relevance(copy.deepcopy(model), src, target=7, decoder_input_ids=dec)


def _close(got, want):
    torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=1e-10 * float(want.abs().max()))


@pytest.mark.parametrize("arch", ["bart", "t5", "marian"])
def test_nnsight_trace_gives_relevance_on_both_sides(arch):
    from nnsight import NNsight

    model = tiny_seq2seq(arch)
    src, dec, want = _want(model, arch)
    lm = NNsight(model)

    def envoy(path):
        e = lm
        for part in path.split("."):
            e = e[int(part)] if part.isdigit() else getattr(e, part)
        return e

    with use_relevance_rules(lm) as cov:
        with lm.trace(input_ids=src, decoder_input_ids=dec, use_cache=False):
            xs, xt = envoy(ENTRIES[arch][0]).input, envoy(ENTRIES[arch][1]).input
            xs_saved, xt_saved = xs.save(), xt.save()
            with lm.output.logits[0, -1, 7].backward():
                gt = xt.grad.save()          # the backward reaches the decoder's entry first
                gs = xs.grad.save()
    assert cov.model_type == arch and cov.installed
    _close((xs_saved * gs).sum(-1), want.source_relevance)
    _close((xt_saved * gt).sum(-1), want.target_relevance)


def test_captums_layer_gradient_x_activation_on_the_encoder_is_source_relevance():
    from captum.attr import LayerGradientXActivation

    model = tiny_seq2seq("bart")
    src, dec, want = _want(model, "bart")
    with use_relevance_rules(model):
        got = LayerGradientXActivation(lambda s: model(input_ids=s, decoder_input_ids=dec, use_cache=False).logits[:, -1],
                                       model.get_submodule(ENTRIES["bart"][0])).attribute(
            src, target=7, attribute_to_layer_input=True)
    _close(got.sum(-1), want.source_relevance)


def _bridge(model):
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_bridge_from_module(model, type(model).__name__, hf_config=model.config)


@pytest.mark.parametrize("rules", ["all", "attnlrp"])
@pytest.mark.parametrize("arch", ["bart", "marian", "mbart", "m2m_100", "pegasus", "t5", "t5_gated"])
def test_transformer_lens_bridge_forward_and_backward_give_relevance(arch, rules):
    """The bridge's forward on source and decoder inputs, the user's own backward of a
    logit: gradient × input at the encoder's entry is pyattr.relevance's source relevance.
    TransformerLens replaces each T5 block's forward with its own (hook points between the
    block's own sublayer calls): a forward a bridge component wrote is the block's."""
    model = tiny_seq2seq(arch)
    scope_rules = {"all": None, "attnlrp": pyattr.RelevanceRules.all("attnlrp")}[rules]
    src, dec = _ids(arch, seed=3, batch=1, src=6, tgt=4)
    want = pyattr.relevance(copy.deepcopy(model), src, target=7, decoder_input_ids=dec, rules=rules)
    bridge = _bridge(model)
    kept = {}
    h = bridge.original_model.get_submodule(ENTRIES[arch][0]).register_forward_pre_hook(
        lambda mod, a, k: kept.__setitem__("x", a[0] if a else k["hidden_states"]), with_kwargs=True)
    try:
        with use_relevance_rules(bridge, scope_rules) as cov:
            logits = bridge(src, decoder_input_ids=dec, return_type="logits")
            (g,) = torch.autograd.grad(logits[0, -1, 7], kept["x"])
    finally:
        h.remove()
    assert cov.model_type == arch.split("_gated")[0] and cov.installed
    _close((kept["x"] * g).sum(-1).detach(), want.source_relevance)


def test_a_users_forward_on_a_bridged_t5_block_is_still_refused():
    """Only a forward the wrapping TransformerLens component wrote is taken as the block's:
    one the user sets on the block (a steering edit) is refused by name."""
    bridge = _bridge(tiny_seq2seq("t5"))
    block = bridge.original_model.encoder.block[0]
    block = getattr(block, "_original_component", block)
    written = block.forward
    block.forward = lambda *a, **k: written(*a, **k)
    with pytest.raises(pyattr.RelevanceRuleUnsupportedError, match=r"the forward replaced on this T5Block instance "
                                                                   r"\(.*<lambda>\) is not the t5 forward"):
        with use_relevance_rules(bridge):
            pass
