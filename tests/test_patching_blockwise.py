"""attribution_patching(method="blockwise"): exact patching's effects computed block by block
from the clean run, on every node type and architecture form (2- and 3-layer models, the
trained 4-layer decoder, a post-norm encoder, MoE, user hooks on blocks), 0 for identical
inputs, independent of how nodes are batched; and its refusals."""

import pytest
import torch

from models import VOCAB, tiny_causal_lm
from pyattr.config import RelevanceRules
from pyattr.patching import activation_patching, attribution_patching
from pyattr.targets import LogitDiff, ModuleOutput

pytestmark = pytest.mark.usefixtures("one_thread")

CLEAN = torch.tensor([[5, 9, 14, 3, 22, 7], [11, 4, 4, 30, 2, 17]])
CORRUPT = torch.tensor([[5, 9, 20, 3, 22, 7], [11, 4, 4, 30, 8, 17]])
NODES = ["residual", "attention", "heads", "mlp"]


def _llama(layers: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=layers, vocab_size=VOCAB, initializer_range=0.2,
                      max_position_embeddings=32)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="eager").double().eval()


def _both(model, metric, **kw):
    est = attribution_patching(model, CLEAN, CORRUPT, metric, nodes=NODES, method="blockwise", **kw)
    exact = activation_patching(model, CLEAN, CORRUPT, metric, nodes=NODES, progress=False,
                                sum_positions=kw.get("sum_positions", False))
    return est, exact


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("sum_positions", [False, True], ids=["per-position", "summed"])
def test_two_layer_models_give_exact_patching(arch, sum_positions):
    model = tiny_causal_lm(arch, dtype=torch.float64)
    est, exact = _both(model, LogitDiff(3, 7), sum_positions=sum_positions)
    for n in NODES:
        assert est[n].shape == exact[n].shape
        assert exact[n].abs().max() > 1e-3, n  # the pairs move every node type
        torch.testing.assert_close(est[n].double(), exact[n].double(), atol=1e-6, rtol=1e-5, msg=n)
    assert est.method == "blockwise" and est.rules is None
    torch.testing.assert_close(est.clean_metric, exact.clean_metric, atol=1e-9, rtol=0)


def test_deeper_models_exact_in_every_block():
    for model in (_llama(3), tiny_causal_lm("bert", dtype=torch.float64)):  # pre-norm and post-norm blocks
        metric = LogitDiff(3, 7) if model.config.model_type == "llama" else (lambda out: out.logits[:, 2, 3])
        est, exact = _both(model, metric, sum_positions=True)
        for n in NODES:
            assert exact[n].abs().max() > 1e-3, n
            torch.testing.assert_close(est[n].double(), exact[n].double(), atol=1e-6, rtol=1e-5, msg=n)


def test_identical_inputs_give_exactly_zero():
    model = _llama(3)
    est = attribution_patching(model, CLEAN, CLEAN.clone(), LogitDiff(3, 7), nodes=NODES, method="blockwise")
    for n in NODES:
        assert torch.equal(est[n], torch.zeros_like(est[n])), n


def test_a_patch_that_changes_nothing_is_not_run():
    """Identical inputs: every node's patch is 0, so no block runs after the clean one; per
    position, only the positions where the runs differ (from the changed token on) run."""
    model = _llama(2)
    calls = []
    h = model.model.layers[0].register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape[0]))
    try:
        est = attribution_patching(model, CLEAN, CLEAN.clone(), LogitDiff(3, 7), nodes=["heads"], method="blockwise")
        assert max(calls) <= 2  # the recorded runs and probes alone (no batch of patched copies)
        assert torch.equal(est["heads"], torch.zeros_like(est["heads"]))
        calls.clear()
        est = attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=["heads"], method="blockwise",
                                   sum_positions=False)
    finally:
        h.remove()
    # heads of layer 0 move from the changed token on: positions 2-5 of row 0 and 4-5 of row 1,
    # 4 heads each, beside one unpatched copy of each row
    assert calls[-1] == 6 * 4 + 2 and max(calls[:-1]) <= 2
    exact = activation_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=["heads"], progress=False,
                                sum_positions=False)
    torch.testing.assert_close(est["heads"].double(), exact["heads"].double(), atol=1e-6, rtol=1e-5)
    assert torch.equal(est["heads"][0, :, :2], torch.zeros_like(est["heads"][0, :, :2]))


def test_with_references_appends_one_unpatched_copy_per_row():
    from pyattr.patching.blockwise import with_references

    ext, ref = with_references(torch.tensor([2, 0, 2, 1]))
    assert ext.tolist() == [2, 0, 2, 1, 0, 1, 2]
    assert ref.tolist() == [6, 4, 6, 5]
    assert torch.equal(ext[ref], torch.tensor([2, 0, 2, 1]))


def test_batch_size_does_not_change_the_estimate():
    model = _llama(3)
    a = attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=NODES, method="blockwise")
    b = attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=NODES, method="blockwise", batch_size=5)
    for n in NODES:
        torch.testing.assert_close(a[n], b[n], atol=1e-12, rtol=1e-12, msg=n)


def test_rules_are_refused():
    with pytest.raises(ValueError, match="rules: method='blockwise' runs the later blocks exactly, with no gradient"):
        attribution_patching(_llama(2), CLEAN, CORRUPT, LogitDiff(3, 7), method="blockwise",
                             rules=RelevanceRules(normalization=True))


def test_blocks_that_do_not_chain_are_refused():
    import pyattr.patching.blockwise as BW

    calls = BW.BlockCalls([torch.nn.Identity(), torch.nn.Identity()])
    calls.count, calls.calls = [1, 1], [((), {}), ((), {})]
    calls.inputs = [torch.zeros(2, 3, 4), torch.ones(2, 3, 4)]
    calls.y = [torch.zeros(2, 3, 4), torch.ones(2, 3, 4)]
    with pytest.raises(ValueError, match="block 1 of Identity .* does not receive block 0's output"):
        calls.check(torch.nn.Identity(), 2)
    calls.inputs[1] = calls.y[0]
    calls.check(torch.nn.Identity(), 2)


def _top2(x):
    flat = x.double().abs().reshape(x.shape[0], -1)
    return [set(r.tolist()) for r in flat.topk(2, dim=-1).indices]


@pytest.mark.parametrize("which", ["shipped", "second"])
def test_key_pairs_of_the_toy_decoders_exact(which):
    import pyattr.toy as toy
    import pyattr.toy.circuit as C
    import pyattr.toy.task as task

    model, _, _ = toy.load(None if which == "shipped" else toy.INDUCTION_B_DIR)
    clean, corrupt, answer, alternative = C.pair_tensors(task.pairs(torch.Generator().manual_seed(11), 16, kind="key"))
    metric = LogitDiff(answer, alternative)
    exact = activation_patching(model, clean, corrupt, metric, nodes="heads", sum_positions=True, progress=False)
    est = attribution_patching(model, clean, corrupt, metric, nodes="heads", sum_positions=True, method="blockwise")
    torch.testing.assert_close(est["heads"], exact["heads"], atol=5e-4, rtol=1e-4)
    assert _top2(est["heads"]) == _top2(exact["heads"])


def test_four_layer_toy_exact_where_linear_estimates_are_not():
    import pyattr.toy as toy
    import pyattr.toy.circuit as C
    import pyattr.toy.task as task

    model, _, _ = toy.load(toy.INDUCTION_4L_DIR)
    assert model.config.num_hidden_layers == 4
    clean, corrupt, answer, alternative = C.pair_tensors(task.pairs(torch.Generator().manual_seed(11), 32, kind="key"))
    metric = LogitDiff(answer, alternative)
    exact = activation_patching(model, clean, corrupt, metric, nodes=["heads", "residual"], sum_positions=True,
                                progress=False)
    est = attribution_patching(model, clean, corrupt, metric, nodes=["heads", "residual"], sum_positions=True,
                               method="blockwise")
    for n in ("heads", "residual"):
        torch.testing.assert_close(est[n], exact[n], atol=5e-4, rtol=1e-4, msg=n)
    assert _top2(est["heads"]) == _top2(exact["heads"])
    relp = attribution_patching(model, clean, corrupt, metric, nodes="heads", sum_positions=True)["heads"]
    assert sum(a == b for a, b in zip(_top2(relp), _top2(exact["heads"]))) < 0.7 * len(clean)


def test_refusals():
    model = _llama(2)
    with pytest.raises(ValueError, match="metric: method='blockwise' reads the metric after the last block, and "
                                         "it reads module 'model.layers.0.mlp' inside a block"):
        attribution_patching(model, CLEAN, CORRUPT, ModuleOutput("model.layers.0.mlp", select=(-1, 0)), nodes="heads",
                             method="blockwise")
    with pytest.raises(ValueError, match="batch_size must be an int ≥ 1, got 0"):
        attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes="heads", method="blockwise", batch_size=0)
    with pytest.raises(ValueError, match="rules: method='atp' uses the plain gradient"):
        attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), method="atp", rules=RelevanceRules())


def test_metric_after_the_blocks_and_padded_rows_exact():
    model = _llama(2).float()  # float64 eager Llama gives NaN on left-padded rows (transformers' mask)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    for metric, m in ((ModuleOutput("model.norm", select=(-1, 5)), None), (LogitDiff(3, 7), mask)):
        kw = dict(nodes=NODES, attention_mask=m, corrupt_attention_mask=m)
        est = attribution_patching(model, CLEAN, CORRUPT, metric, method="blockwise", **kw)
        exact = activation_patching(model, CLEAN, CORRUPT, metric, progress=False, **kw)
        for n in NODES:
            assert exact[n].abs().max() > 1e-3
            if m is not None:  # padding: no node
                assert torch.equal(est[n][0, :, :2], torch.zeros_like(est[n][0, :, :2])), n
            torch.testing.assert_close(est[n].double(), exact[n].double(), atol=2e-4, rtol=1e-3, msg=n)


def _per_row(out):
    rows = torch.arange(out.logits.shape[0])
    return out.logits[rows, -1, torch.tensor([5, 6])] - out.logits[rows, -1, torch.tensor([7, 8])]


_ROWS = "metric: attribution_patching.method='blockwise'. runs rows in other batches, so the metric must compute each row"
_REPLAY = "metric: method='blockwise' evaluates the metric on forwards that replay the blocks"


@pytest.mark.parametrize("metric, config, msg", [
    (_per_row, {}, _ROWS),
    (lambda out: out.logits[:, -1, 5] * torch.tensor([1.0, -1.0]), {}, _ROWS),
    (lambda out: (out.hidden_states[1][:, -1, :8] ** 2).sum(-1), {"output_hidden_states": True}, _REPLAY),
    (lambda out: out.attentions[-1][:, 0, -1, 0], {"output_attentions": True}, _REPLAY),
], ids=["per-row ids", "per-row weights", "hidden states", "attentions"])
def test_metrics_the_replay_cannot_serve_are_refused(metric, config, msg):
    model = _llama(2).float()
    for k, v in config.items():
        setattr(model.config, k, v)
    for bs in (None, 2):
        with pytest.raises(ValueError, match=msg):
            attribution_patching(model, CLEAN, CORRUPT, metric, nodes="heads", method="blockwise", batch_size=bs)
    assert all(getattr(model.config, k) == v for k, v in config.items())  # restored


def test_user_hooks_on_blocks_apply_once():
    model = _llama(2)
    steer = torch.randn(32, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 3
    hooks = [model.model.layers[1].register_forward_hook(lambda mod, a, out: out + steer),
             model.model.layers[1].register_forward_pre_hook(
                 lambda mod, a, kw: ((a[0] + steer, *a[1:]), kw) if a else
                 (a, {**kw, "hidden_states": kw["hidden_states"] + steer}), with_kwargs=True)]
    try:
        est, exact = _both(model, LogitDiff(3, 7))
        for n in NODES:
            torch.testing.assert_close(est[n].double(), exact[n].double(), atol=1e-6, rtol=1e-5, msg=n)
    finally:
        for h in hooks:
            h.remove()


def test_mixture_of_experts_exact_zero_and_router_logits():
    model = tiny_causal_lm("mixtral")
    model.config.output_router_logits = True
    same = attribution_patching(model, CLEAN, CLEAN.clone(), LogitDiff(3, 7), nodes=["mlp", "heads"],
                                method="blockwise")
    for n in ("mlp", "heads"):
        assert torch.equal(same[n], torch.zeros_like(same[n])), n
    est = attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=["mlp", "heads"], method="blockwise")
    exact = activation_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=["mlp", "heads"], progress=False)
    for n in ("mlp", "heads"):
        torch.testing.assert_close(est[n], exact[n], atol=2e-5, rtol=1e-4, msg=n)
    assert model.config.output_router_logits is True


def test_more_refusals():
    import transformers as tr

    model = _llama(2)
    with pytest.raises(ValueError, match="target: LlamaForCausalLM has no module 'model.nope'"):
        attribution_patching(model, CLEAN, CORRUPT, ModuleOutput("model.nope"), method="blockwise")
    torch.manual_seed(0)
    bloom = tr.BloomForCausalLM._from_config(tr.BloomConfig(hidden_size=32, n_head=4, n_layer=2, vocab_size=VOCAB),
                                             attn_implementation="eager").eval()
    with pytest.raises(ValueError, match="method='blockwise' re-runs the blocks on selected rows, and block 0 of "
                                         "BloomForCausalLM takes 'alibi' with leading dimension 8 for a batch of 2"):
        attribution_patching(bloom, CLEAN, CORRUPT, LogitDiff(3, 7), method="blockwise", generic=True)
    with pytest.raises(TypeError, match="sum_positions must be a bool, got 'yes'"):
        attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), method="blockwise", sum_positions="yes")
    with pytest.raises(TypeError, match="sum_positions must be a bool, got None"):
        activation_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), sum_positions=None)
    with pytest.raises(ValueError, match="model: attribution_patching runs the model, and LlamaForCausalLM's "
                                         "parameters are on the meta device"):
        attribution_patching(_llama(2).to("meta"), CLEAN, CORRUPT, LogitDiff(3, 7))


def test_a_word_metric_with_a_tokenizer_is_its_logit():
    import pyattr.toy as toy
    from pyattr.targets import Logit

    model, tok, _ = toy.load()
    kw = dict(tokenizer=tok, nodes="heads", sum_positions=True)
    for call, extra in ((attribution_patching, {"method": "blockwise"}), (activation_patching, {"progress": False})):
        word = call(model, "sun cat red tree sun cat", "sun ant red tree sun cat", "red", **kw, **extra)
        ids = call(model, "sun cat red tree sun cat", "sun ant red tree sun cat",
                   Logit(tok.convert_tokens_to_ids("red")), **kw, **extra)
        assert torch.equal(word["heads"], ids["heads"]) and word["heads"].abs().max() > 1
