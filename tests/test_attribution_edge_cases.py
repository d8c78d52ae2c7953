"""Edge cases of the attribution API found by an adversarial pass (relevance /
layer_relevance / integrated_gradients / capture / targets): fixed positions on padded
columns are refused, k targets run inside capture and grad_edits, and the head's
logits_to_keep shortcut never changes a layer's shape."""

import pytest
import torch

import pyattr
from pyattr.methods._core.inputs import accepts
from pyattr.targets import Logit, ModuleOutput

IDS = torch.tensor([[5, 7, 9, 11, 13, 15], [6, 8, 10, 12, 14, 16]])
LEFT = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
RIGHT = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])




def _hooks(model):
    return sum(len(x._forward_hooks) + len(x._forward_pre_hooks) + len(x._backward_hooks) for x in model.modules())


# --------------------------------------------------------------------------------------
# 1. A fixed position (p >= 0) that is padding in some row is refused.
# --------------------------------------------------------------------------------------


def test_logit_position_in_right_padding_is_refused(llama):
    """Row 1 alone has 4 tokens, so Logit(position=5) is refused for it ("position 5 is
    outside the sequence of length 4"); in a right-padded batch the same row
    explains the logit of a pad position (garbage), with no error."""
    alone = IDS[1:, :4]
    with pytest.raises(ValueError):
        pyattr.relevance(llama, alone, target=Logit(3, position=5))
    with pytest.raises(ValueError, match="position"):
        pyattr.relevance(llama, IDS, target=Logit(3, position=5), attention_mask=RIGHT)


def test_logit_position_in_left_padding_is_refused_or_equals_row_alone(llama):
    """Left padding: Logit(position=0) in the padded row reads the logit at a pad token;
    the row alone reads its first real token. Either raise (the position is padding in
    row 1) or give the row-alone numbers, never a third value."""
    alone = pyattr.relevance(llama, IDS[1:, 2:], target=Logit(3, position=0))
    try:
        padded = pyattr.relevance(llama, IDS, target=Logit(3, position=0), attention_mask=LEFT)
    except ValueError:
        return
    # float32 logits (held in float64) from a padded batch and the row alone: other GEMM shapes,
    # so float32 rounding, not float64's default tolerance (DESIGN §13)
    torch.testing.assert_close(padded.target[1], alone.target[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(padded.token_relevance[1, 2:], alone.token_relevance[0], rtol=1e-5, atol=1e-6)


def test_module_output_select_position_is_per_row(llama):
    """ModuleOutput(select=(p, j)): p is each row's p-th real token (issue 22), so the
    left-padded row explains what it explains alone at p; a row too short for p, and a
    slice over the positions of a padded batch, are refused."""
    target = ModuleOutput("model.layers.1.mlp", select=(0, 3))
    padded = pyattr.relevance(llama, IDS, target=target, attention_mask=LEFT)
    alone = pyattr.relevance(llama, IDS[1:, 2:], target=target)
    torch.testing.assert_close(padded.target[1], alone.target[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(padded.token_relevance[1, 2:], alone.token_relevance[0], atol=1e-6, rtol=1e-5)
    last = pyattr.relevance(llama, IDS, target=ModuleOutput("model.layers.1.mlp", select=(-1, 3)), attention_mask=RIGHT)
    alone = pyattr.relevance(llama, IDS[1:, :4], target=ModuleOutput("model.layers.1.mlp", select=(-1, 3)))
    torch.testing.assert_close(last.target[1], alone.target[0], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"select position 5 is outside row 1, which has 4 real tokens"):
        pyattr.relevance(llama, IDS, target=ModuleOutput("model.layers.1.mlp", select=(5, 3)), attention_mask=LEFT)
    with pytest.raises(ValueError, match=r"slices the positions of a padded batch"):
        pyattr.relevance(llama, IDS, target=ModuleOutput("model.layers.1.mlp", select=(slice(-2, None), 3)),
                         attention_mask=RIGHT)


# --------------------------------------------------------------------------------------
# 2. k targets (one batched backward, is_grads_batched) inside pyattr.capture.
# --------------------------------------------------------------------------------------


def test_k_targets_inside_capture(llama):
    """README: methods can run inside capture (captured grads are the rule-modified ones).
    With k targets the capture's gradient hook runs inside the batched backward and
    records the k gradients stacked."""
    k = torch.tensor([[3, 4], [3, 4]])
    ref = pyattr.relevance(llama, IDS, target=k)
    with pyattr.capture(llama, ["model.norm"]) as cap:
        res = pyattr.relevance(llama, IDS, target=k)
    torch.testing.assert_close(res.token_relevance, ref.token_relevance)
    (g,) = cap["model.norm"].grads  # one batched pass: the k gradients stacked
    assert g.shape == (2, 2, 6, 32)
    for j, tid in enumerate((3, 4)):
        with pyattr.use_relevance_rules(llama), pyattr.capture(llama, ["model.norm"]) as one:
            llama(IDS).logits[:, -1, tid].sum().backward()
        torch.testing.assert_close(g[j], one["model.norm"].grad, rtol=1e-5, atol=1e-7)
    assert _hooks(llama) == 0


def test_k_targets_layer_relevance_inside_capture(llama):
    ref = pyattr.layer_relevance(llama, IDS, "residual", target=[Logit(3), Logit(4)])
    with pyattr.capture(llama, ["model.layers.1.mlp"]):
        res = pyattr.layer_relevance(llama, IDS, "residual", target=[Logit(3), Logit(4)])
    torch.testing.assert_close(res["model.norm"].relevance, ref["model.norm"].relevance)


def test_k_targets_with_grad_edits(llama):
    """grad_edits zeroing an MLP: k targets must equal each target explained alone under
    the same edit."""
    edits = {"model.layers.1.mlp": torch.zeros_like}
    with pyattr.capture(llama, [], grad_edits=edits):
        k = pyattr.relevance(llama, IDS, target=[Logit(3), Logit(4)])
    for i, tid in enumerate((3, 4)):
        with pyattr.capture(llama, [], grad_edits=edits):
            one = pyattr.relevance(llama, IDS, target=Logit(tid))
        torch.testing.assert_close(k.token_relevance[i], one.token_relevance, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------
# 3. The logits_to_keep shortcut never changes the shape of a layer that is read.
# --------------------------------------------------------------------------------------


def test_layer_relevance_lm_head_shape_with_k_targets(llama):
    """layer_relevance(..., "lm_head") is documented "shaped like the layer's output",
    (batch, seq, vocab) = (2, 6, 96) with one target; with k logit targets the head must
    still run at every position when it is one of the layers (no logits_to_keep)."""
    one = pyattr.layer_relevance(llama, IDS, "lm_head", target=3)["lm_head"]
    k = pyattr.layer_relevance(llama, IDS, "lm_head", target=[Logit(3), Logit(4)])["lm_head"]
    assert k.activation.shape == one.activation.shape
    assert k.relevance.shape == (2, *one.relevance.shape)
    torch.testing.assert_close(k.relevance[0], one.relevance, rtol=1e-5, atol=1e-6)


def test_layer_ig_at_lm_head(llama):
    """Layer IG at the LM head (Captum's LayerIntegratedGradients allows any layer) fails
    like with a callable target: the path passes must not use logits_to_keep there."""
    ok = pyattr.integrated_gradients(llama, IDS, target=lambda o: o.logits[:, -1, 3], layer="lm_head",
                                     baseline="pad", n_steps=4)
    res = pyattr.integrated_gradients(llama, IDS, target=3, layer="lm_head", baseline="pad", n_steps=4)
    torch.testing.assert_close(res.attribution, ok.attribution)


def test_single_target_runs_the_head_at_its_position_only(llama):
    """One logit target: the head sees one position per pass, and the reported target is
    bit for bit the model's own logit from that call (``logits_to_keep``); a caller's
    ``logits_to_keep=0`` keeps the full head, whose logit it then reports exactly."""
    seen = []
    hook = llama.lm_head.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape)))
    try:
        r = pyattr.relevance(llama, IDS, target=3)
        full = pyattr.relevance(llama, {"input_ids": IDS, "logits_to_keep": 0}, target=3)
    finally:
        hook.remove()
    assert seen == [(2, 1, 32), (2, 6, 32)]
    with torch.no_grad():
        kept = llama(IDS, logits_to_keep=1).logits[:, -1, 3]
        every = llama(IDS).logits[:, -1, 3]
    assert torch.equal(r.target, kept.double()) and torch.equal(full.target, every.double())
    assert torch.equal(r.relevance, full.relevance)  # the backward reads one row of the head either way
    torch.testing.assert_close(r.conservation_delta, torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-4)


def test_relevance_builds_no_key_value_cache(llama):
    """An attribution pass never reads a key/value cache, so it asks the model for none."""
    calls = []
    hook = llama.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs.get("use_cache")),
                                           with_kwargs=True)
    try:
        pyattr.relevance(llama, IDS, target=3)
        pyattr.relevance(llama, {"input_ids": IDS, "use_cache": True}, target=3)
    finally:
        hook.remove()
    assert calls == [False, True]


@pytest.mark.parametrize("keep", [1, 3, torch.tensor([2, 5])])
def test_a_callers_partial_logits_to_keep_is_refused_for_logit_targets(llama, keep):
    """logits_to_keep=k (or positions) re-indexes the logits from 0: a Logit target at
    position p would read another position's logit. Refused, naming the argument; a
    callable target indexes the output itself, so it may keep what it likes."""
    msg = "inputs: logits_to_keep=.* keeps the logits of some positions only"
    for target in (None, 3, Logit(3, position=2), [Logit(3), Logit(4)]):
        with pytest.raises(ValueError, match=msg):
            pyattr.relevance(llama, {"input_ids": IDS, "logits_to_keep": keep}, target=target)
    with pytest.raises(ValueError, match=msg):
        pyattr.layer_relevance(llama, {"input_ids": IDS, "logits_to_keep": keep}, "model.norm", target=3)
    with pytest.raises(ValueError, match=msg):
        pyattr.integrated_gradients(llama, {"input_ids": IDS, "logits_to_keep": keep}, target=3, n_steps=2)
    if isinstance(keep, int):
        r = pyattr.relevance(llama, {"input_ids": IDS, "logits_to_keep": keep}, target=lambda o: o.logits[:, -1, 3])
        ref = pyattr.relevance(llama, IDS, target=3)
        torch.testing.assert_close(r.relevance, ref.relevance, rtol=1e-5, atol=1e-7)


def test_layers_on_the_cut_hidden_states_keep_their_shape():
    """BERT and RoBERTa decoders cut the hidden states to the kept positions before the
    rest of their LM head (``cls.predictions.transform``, ``lm_head.dense``): a layer read
    there must see every position, so the head then runs in full."""
    import transformers as tr

    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
               max_position_embeddings=64, is_decoder=True)
    torch.manual_seed(0)
    for model, layer in ((tr.BertLMHeadModel(tr.BertConfig(**cfg)).eval(), "cls.predictions.transform"),
                         (tr.RobertaForCausalLM(tr.RobertaConfig(**cfg, pad_token_id=1)).eval(), "lm_head.dense")):
        ids = torch.randint(3, 96, (2, 9))
        full = {"input_ids": ids, "logits_to_keep": 0}
        got = pyattr.layer_relevance(model, ids, layer, target=Logit(5, position=3)).layers[layer]
        ref = pyattr.layer_relevance(model, full, layer, target=Logit(5, position=3)).layers[layer]
        assert got.relevance.shape == ref.relevance.shape == (2, 9, 32)
        torch.testing.assert_close(got.relevance, ref.relevance)
        ig = pyattr.integrated_gradients(model, ids, target=Logit(5, position=3), layer=layer, n_steps=4)
        ig_ref = pyattr.integrated_gradients(model, full, target=Logit(5, position=3), layer=layer, n_steps=4)
        assert ig.token_attribution.shape == (2, 9)
        torch.testing.assert_close(ig.token_attribution, ig_ref.token_attribution)


def test_labels_in_the_inputs_keep_the_full_head(llama):
    """A collator batch with ``labels``: the model's own loss needs every position's logits."""
    got = pyattr.relevance(llama, {"input_ids": IDS, "labels": IDS}, target=Logit(4, position=2))
    ref = pyattr.relevance(llama, {"input_ids": IDS, "logits_to_keep": 0}, target=Logit(4, position=2))
    assert torch.equal(got.relevance, ref.relevance) and torch.equal(got.target, ref.target)


def test_a_compiled_model_gets_the_head_shortcut(llama):
    """torch.compile's wrapper forwards (*args, **kwargs): pyattr reads the wrapped
    model's signature, so a compiled model also runs the head at the target only."""

    cm = torch.compile(llama)
    assert accepts(cm, "logits_to_keep", by_name=True) and accepts(cm, "use_cache", by_name=True)
