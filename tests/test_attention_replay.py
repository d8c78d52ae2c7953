"""Blockwise patching replays the node's own block's attention (pyattr.patching.attention_replay)
wherever the patched site comes after it: exact patching's effects there, the attention's
projections not run again; the block runs whole for residual nodes, post-norm attention
outputs, an attention that adds anything after its output projection, and sites inside the
attention's arithmetic."""

import pytest
import torch

from models import tiny_causal_lm
from pyattr.patching import activation_patching, attribution_patching
from pyattr.patching.nodes import Site
from pyattr.targets import LogitDiff

pytestmark = pytest.mark.usefixtures("one_thread")

CLEAN = torch.tensor([[5, 9, 14, 3, 22, 7], [11, 4, 4, 30, 2, 17]])
CORRUPT = torch.tensor([[5, 9, 20, 3, 22, 7], [11, 4, 4, 30, 8, 17]])
NODES = ["residual", "attention", "heads", "mlp", "neurons"]


@pytest.fixture
def replayed(monkeypatch):
    """(layer, node) → whether :meth:`AttentionReplay.usable` allowed the replay."""
    import pyattr.patching.attention_replay as AR

    seen = {}
    usable = AR.AttentionReplay.usable

    def spy(self, layer, sites):
        ok = usable(self, layer, sites)
        for s in sites:
            seen[(layer, s.node)] = ok
        return ok

    monkeypatch.setattr(AR.AttentionReplay, "usable", spy)
    return seen


def _exact(model, metric=LogitDiff(3, 7), nodes=NODES):
    est = attribution_patching(model, CLEAN, CORRUPT, metric, nodes=nodes, method="blockwise")
    exact = activation_patching(model, CLEAN, CORRUPT, metric, nodes=nodes, progress=False)
    for n in nodes:
        assert exact[n].abs().max() > 1e-3, n  # the pairs move every node type
        torch.testing.assert_close(est[n].double(), exact[n].double(), atol=1e-9, rtol=1e-7, msg=n)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox", "phi", "gemma2"])
def test_replayed_after_the_attention_whole_for_residual_nodes(arch, replayed):
    _exact(tiny_causal_lm(arch, dtype=torch.float64))
    assert {n: ok for (_, n), ok in replayed.items()} == {
        "residual": False, "attention": True, "heads": True, "mlp": True, "neurons": True}


def test_the_attention_projections_do_not_run_again_in_the_nodes_block():
    """Heads of a 2-layer model: block 1's query projection runs for the changes coming from
    block 0's heads, not for block 1's own heads; block 0's not at all after the clean runs."""
    model = tiny_causal_lm("llama", dtype=torch.float64)
    rows = {0: [], 1: []}
    hooks = [model.model.layers[i].self_attn.q_proj.register_forward_pre_hook(
        lambda mod, args, i=i: rows[i].append(args[0].shape[0])) for i in (0, 1)]
    try:
        attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes="heads", method="blockwise",
                             sum_positions=True)
    finally:
        for h in hooks:
            h.remove()
    heads = model.config.num_attention_heads
    assert max(rows[0]) <= 2                     # the recorded runs and probes only
    assert rows[1].count(2 * heads + 2) == 1     # block 0's heads' changes, beside one copy of each row


def test_post_norm_attention_output_runs_whole(replayed):
    """BERT's attention output module adds the residual and normalizes after its dense
    projection: its output is not the projection's, so nothing is replayed."""
    _exact(tiny_causal_lm("bert", dtype=torch.float64), metric=lambda out: out.logits[:, 2, 3])
    assert replayed and not any(replayed.values())


def test_an_attention_that_adds_after_its_projection_runs_whole(replayed, monkeypatch):
    model = tiny_causal_lm("llama", dtype=torch.float64)
    attn = model.model.layers[0].self_attn
    forward = type(attn).forward

    def scaled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return (out[0] * 1.5, *out[1:])

    monkeypatch.setattr(type(attn), "forward", scaled)
    _exact(model, nodes=["heads", "mlp"])
    assert replayed == {(0, "heads"): False, (0, "mlp"): False, (1, "heads"): False, (1, "mlp"): False}


def test_user_hooks_on_the_projection_and_the_attention_apply_as_in_patching(replayed):
    model = tiny_causal_lm("llama", dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    width = model.config.hidden_size
    steer = torch.randn(width, generator=g, dtype=torch.float64)
    attn = model.model.layers[0].self_attn
    hooks = [attn.o_proj.register_forward_pre_hook(lambda mod, args: (args[0] * 1.25 + steer,)),
             attn.register_forward_hook(lambda mod, args, out: (out[0] - 0.5 * steer, *out[1:]))]
    try:
        _exact(model, nodes=["heads", "attention", "mlp"])
    finally:
        for h in hooks:
            h.remove()
    assert replayed[(0, "heads")] and replayed[(0, "attention")]


def test_sites_inside_the_attention_or_before_it_are_not_replayed():
    from pyattr.patching.attention_replay import attention_replay

    model = tiny_causal_lm("llama", dtype=torch.float64)
    blk = model.model.layers[0]
    att = attention_replay(model, [], False)
    att.attn_count, att.proj.count, att.attn_end = [1, 1], [1, 1], [5, 9]
    assert att._site_after(0, Site("heads", 0, "", blk.self_attn.o_proj, "input"))
    assert not att._site_after(0, Site("heads", 0, "", blk.self_attn.o_proj, "output"))
    assert att._site_after(0, Site("attention", 0, "", blk.self_attn, "output"))
    assert not att._site_after(0, Site("attention", 0, "", blk.self_attn, "input"))
    assert not att._site_after(0, Site("q", 0, "", blk.self_attn.q_proj, "output"))
    mlp = Site("mlp", 0, "", blk.mlp, "output")
    att.sites = [mlp]
    assert not att._site_after(0, mlp)          # never seen running
    att.site_start = {0: 3}
    assert not att._site_after(0, mlp)          # began before the attention returned
    att.site_start = {0: 6}
    assert att._site_after(0, mlp)
    assert not att.usable(0, [mlp])             # nothing recorded: the block runs whole


def test_no_heads_role_no_replay():
    from pyattr.patching.attention_replay import attention_replay

    model = tiny_causal_lm("llama", dtype=torch.float64)
    assert attention_replay(torch.nn.Linear(2, 2), [], True) is None
    assert attention_replay(model, [], False) is not None


def test_an_attention_output_changed_in_place_after_its_projection_runs_whole(replayed):
    """The attention's output is still the projection's output object, but a wrapper on the
    instance steers it in place: the projection re-run on the clean run does not give it, so
    nothing is replayed (found by a bad-input pass: the steering was lost)."""
    model = tiny_causal_lm("llama", dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    for blk in model.model.layers:
        v = torch.randn(model.config.hidden_size, generator=g, dtype=torch.float64)

        def steered(*args, _forward=blk.self_attn.forward, _v=v, **kwargs):
            out = _forward(*args, **kwargs)
            out[0].add_(_v)
            return out

        blk.self_attn.forward = steered
    _exact(model, nodes=["heads", "attention", "mlp"])
    assert replayed and not any(replayed.values())


def test_a_pre_hook_changing_the_projection_input_in_place_applies_once(replayed):
    """A non-idempotent in-place pre-hook on the output projection: the recorded input is the
    one the projection received before it (a copy), so the replay applies it once."""
    model = tiny_causal_lm("llama", dtype=torch.float64)

    def double_head_0(mod, args):
        args[0][..., :8].mul_(2.0)

    hooks = [blk.self_attn.o_proj.register_forward_pre_hook(double_head_0) for blk in model.model.layers]
    try:
        _exact(model, nodes=["heads", "attention", "mlp", "neurons"])
    finally:
        for h in hooks:
            h.remove()
    assert replayed[(0, "heads")] and replayed[(1, "attention")]


def test_a_hook_registered_for_every_module_turns_the_replay_off(replayed):
    model = tiny_causal_lm("llama", dtype=torch.float64)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda mod, args: None)
    try:
        _exact(model, nodes=["heads", "mlp"])
    finally:
        handle.remove()
    assert replayed and not any(replayed.values())
