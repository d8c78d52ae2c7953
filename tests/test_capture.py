"""pyattr.capture: per-call outputs and inputs, per-pass gradients, grad edits, hook hygiene,
composition with the rule scope."""

import gc
import weakref

import pytest
import torch
from torch import nn

import pyattr
from models import VOCAB, tiny_causal_lm

capture = pyattr.capture

MLP0, MLP1, L0, L1 = "model.layers.0.mlp", "model.layers.1.mlp", "model.layers.0", "model.layers.1"




@pytest.fixture
def ids():
    return torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))


def _embeds(m, ids):
    return m.get_input_embeddings()(ids).detach().requires_grad_(True)


def _live(module, store, pre=False):
    """A user hook keeping the live (non-cloned) output or first positional input."""
    if pre:
        return module.register_forward_pre_hook(lambda mod, args: store.append(args[0]))
    return module.register_forward_hook(lambda mod, args, out: store.append(out if torch.is_tensor(out) else out[0]))


def _hook_counts(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def _target(logits, tok):
    return logits[:, -1, tok].sum()


# --- outputs, inputs, calls ---------------------------------------------------------------


def test_outputs_and_inputs_positional_and_keyword(llama, ids):
    attn = "model.layers.0.self_attn"
    live_mlp_in, live_mlp_out, live_attn = [], [], []
    hs = [_live(llama.model.layers[0].mlp, live_mlp_in, pre=True), _live(llama.model.layers[0].mlp, live_mlp_out)]
    hs.append(llama.model.layers[0].self_attn.register_forward_hook(
        lambda mod, args, kwargs, out: live_attn.append((kwargs["hidden_states"], out)), with_kwargs=True))
    try:
        with capture(llama, [MLP0, attn, MLP0], inputs=True) as cap:
            llama(ids)
            llama(ids[:1])
    finally:
        for h in hs:
            h.remove()
    assert list(cap) == [MLP0, attn] and len(cap) == 2
    rec = cap[MLP0]
    assert len(rec.outputs) == len(rec.inputs) == 2
    for i in range(2):
        assert torch.equal(rec.outputs[i], live_mlp_out[i]) and not rec.outputs[i].requires_grad
        assert torch.equal(rec.inputs[i], live_mlp_in[i])  # positional argument
    assert rec.output is rec.outputs[-1] and rec.input is rec.inputs[-1] and rec.output.shape[0] == 1
    # self_attn is called with hidden_states=... and returns (attn_output, attn_weights)
    a = cap[attn]
    (hidden, out) = live_attn[0]
    assert torch.equal(a.inputs[0], hidden)
    assert isinstance(a.outputs[0], tuple) and len(a.outputs[0]) == len(out)
    for got, want in zip(a.outputs[0], out):
        assert torch.equal(got, want) and got is not want
    assert cap[MLP0].grads == [] and cap[MLP0].grad is None  # no backward ran


def test_tuple_output_grad_is_first_tensors():
    class Layer(nn.Module):  # returns (hidden_states, extra) as older Hugging Face decoder layers
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, flag=None):
            h = self.lin(x)
            return h, {"aux": h * 2}, None

    m = nn.Sequential(Layer())
    x = torch.randn(3, 4)
    live = []
    h = _live(m[0], live)
    with capture(m, "0") as cap:
        out = m(x)
        (out[0] ** 2).sum().backward()
    h.remove()
    o = cap["0"].output
    assert isinstance(o, tuple) and o[2] is None and torch.equal(o[0], live[0])
    assert torch.equal(o[1]["aux"], live[0] * 2)
    assert torch.equal(cap["0"].grad, 2 * live[0].detach())


def test_inputs_not_recorded_raises(llama, ids):
    with capture(llama, MLP0) as cap:
        llama(ids)
    with pytest.raises(RuntimeError, match="inputs=True"):
        cap[MLP0].input
    with pytest.raises(KeyError, match="captured"):
        cap["model.norm"]


def test_several_calls_per_forward():
    lin = nn.Linear(3, 3)
    m = nn.Module()
    m.lin = lin
    x = torch.randn(2, 3)
    live = []
    h = _live(lin, live)
    with capture(m, "lin", inputs=True) as cap:
        y = lin(lin(x))
        (y ** 2).sum().backward()
    h.remove()
    rec = cap["lin"]
    assert len(rec.outputs) == 2 and torch.equal(rec.inputs[1], live[0])
    g1 = 2 * live[1].detach()
    z = live[0].detach().requires_grad_(True)
    (g0,) = torch.autograd.grad((lin(z) ** 2).sum(), z)
    assert len(rec.grads) == 1 and len(rec.call_grads) == 1
    assert torch.equal(rec.grad, g1)  # the latest call's, as .output
    assert sorted(rec.call_grads[0]) == [0, 1]
    assert torch.equal(rec.call_grads[0][1], g1) and torch.equal(rec.call_grads[0][0], g0)


# --- passes ---------------------------------------------------------------------------------


def test_three_backward_passes_and_a_pass_that_misses(llama, ids):
    toks = (3, 17, 41)
    # independent gradients, one forward each, at the live outputs
    want = {MLP0: [], MLP1: []}
    for t in toks:
        live0, live1 = [], []
        hs = [_live(llama.model.layers[0].mlp, live0), _live(llama.model.layers[1].mlp, live1)]
        g = torch.autograd.grad(_target(llama(ids).logits, t), [live0[0], live1[0]])
        for h in hs:
            h.remove()
        want[MLP0].append(g[0])
        want[MLP1].append(g[1])
    live0 = []
    h = _live(llama.model.layers[0].mlp, live0)
    with capture(llama, [MLP0, MLP1]) as cap:
        logits = llama(ids).logits
        h.remove()
        for t in toks:
            _target(logits, t).backward(retain_graph=True)
        for p in (MLP0, MLP1):
            assert len(cap[p].grads) == 3
            for got, w in zip(cap[p].grads, want[p]):
                assert torch.equal(got, w)
            assert cap[p].grad is cap[p].grads[-1]
        assert not torch.equal(cap[MLP1].grads[0], cap[MLP1].grads[1])
        assert isinstance(cap[MLP1], pyattr.Captured)
        # a fourth pass from layer 0's MLP output reaches layer 0's MLP, not layer 1's
        torch.autograd.grad((live0[0] * 3).sum(), llama.model.embed_tokens.weight)
    assert len(cap[MLP1].grads) == 3
    assert len(cap[MLP0].grads) == 4 and torch.equal(cap[MLP0].grad, torch.full_like(live0[0], 3.0))


def test_passes_after_separate_forwards(llama, ids):
    with capture(llama, MLP1) as cap:
        _target(llama(ids).logits, 5).backward()
        _target(llama(ids[:1]).logits, 5).backward()
    rec = cap[MLP1]
    assert len(rec.outputs) == 2 and len(rec.grads) == 2
    assert [list(p) for p in rec.call_grads] == [[0], [1]]
    assert rec.grads[1].shape == rec.outputs[1].shape == (1, 6, 32)


def test_no_grad_records_outputs_only(llama, ids):
    with capture(llama, [MLP0, "model.norm"]) as cap:
        with torch.no_grad():
            llama(ids)
    assert len(cap[MLP0].outputs) == 1 and cap[MLP0].grads == [] and cap[MLP0].grad is None


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(ids, reentrant):
    m = tiny_causal_lm("llama")
    with capture(m, [MLP1, L1]) as ref:
        _target(m(ids).logits, 3).backward()
    kw = {"use_reentrant": reentrant}
    if hasattr(m, "activation_checkpointing_enable"):  # the name since transformers 5.x
        m.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    m.train()  # dropout is 0: same values
    emb = _embeds(m, ids)
    with capture(m, [MLP1, L1]) as cap:
        _target(m(inputs_embeds=emb, use_cache=False).logits, 3).backward()
    for p in (MLP1, L1):  # recomputations during the backward are not recorded again
        assert len(cap[p].outputs) == 1 and torch.equal(cap[p].output, ref[p].output)
    assert torch.equal(cap[L1].grad, ref[L1].grad)
    if reentrant:  # the block's inner forward ran without autograd
        assert cap[MLP1].grads == []
    else:
        assert torch.equal(cap[MLP1].grad, ref[MLP1].grad)


# --- in-place safety ----------------------------------------------------------------------


def test_inplace_relu_and_inplace_hook_do_not_corrupt_records():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    ref = nn.Sequential(m[0], nn.ReLU(), m[2])
    x = torch.randn(5, 4)
    pre = m[0](x).detach()
    assert (pre < 0).any()
    z = pre.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(ref[2](ref[1](z)).sum(), z)
    with capture(m, ["0", "1"], inputs=True) as cap:
        m(x).sum().backward()
    assert torch.equal(cap["0"].output, pre)  # not the ReLU'd tensor
    assert torch.equal(cap["1"].input, pre) and torch.equal(cap["1"].output, pre.clamp_min(0))
    assert torch.equal(cap["0"].grad, want)
    # a forward hook registered after the capture's edits the output in place
    with capture(m, "0") as cap:
        h = m[0].register_forward_hook(lambda mod, args, out: out.mul_(0))
        m(x)
        h.remove()
    assert torch.equal(cap["0"].output, pre)


# --- hook hygiene ---------------------------------------------------------------------------


def test_hooks_removed_on_exit_and_on_exception(llama, ids):
    before = _hook_counts(llama)
    live = []
    h = _live(llama.model.layers[1].mlp, live)  # a retained output
    paths = [MLP0, MLP1, L1, "model.norm"]
    with capture(llama, paths, inputs=True, grad_edits={L0: lambda g: g}) as cap:
        llama(ids)
        assert len(live[0]._backward_hooks) == 1
        assert len(llama.model.layers[1].mlp._forward_hooks) == 2
    assert not live[0]._backward_hooks
    h.remove()
    assert _hook_counts(llama) == before
    live = []
    h = _live(llama.model.layers[1].mlp, live)
    with pytest.raises(KeyError):
        with capture(llama, paths, inputs=True):
            llama(ids)
            raise KeyError("user error")
    h.remove()
    assert not live[0]._backward_hooks and _hook_counts(llama) == before
    assert len(cap) == 5


def _tensor_count():
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))  # type(): no __class__ lookups


def test_thousand_scopes_leave_no_hooks_and_no_tensors():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(2, 4)
    before = _hook_counts(m)

    def scope():
        with capture(m, ["0", "1", "2"], inputs=True, grad_edits={"1": lambda g: g * 2}) as cap:
            out = m(x)
            out.sum().backward(retain_graph=True)
            out.sum().backward()
        return cap, out

    scope()
    m.zero_grad(set_to_none=True)
    base = _tensor_count()
    for _ in range(1000):
        cap, out = scope()
        assert len(cap["0"].grads) == 2
    m.zero_grad(set_to_none=True)
    assert _hook_counts(m) == before
    assert not out._backward_hooks  # the retained output of "2"
    refs = [weakref.ref(cap["0"].output), weakref.ref(cap["0"].grad), weakref.ref(cap["1"].input)]
    del cap, out
    gc.collect()
    assert all(r() is None for r in refs)
    assert _tensor_count() == base


# --- grad edits -----------------------------------------------------------------------------


def test_grad_edit_zero_cuts_the_module(llama, ids):
    emb = _embeds(llama, ids)
    h = llama.model.layers[1].mlp.register_forward_hook(lambda mod, args, out: out.detach())
    (detached,) = torch.autograd.grad(_target(llama(inputs_embeds=emb).logits, 7), emb)
    h.remove()
    (plain,) = torch.autograd.grad(_target(llama(inputs_embeds=emb).logits, 7), emb)
    live = []
    h = _live(llama.model.layers[1].mlp, live)
    (g_plain_mlp,) = torch.autograd.grad(_target(llama(inputs_embeds=emb).logits, 7), live[0])
    h.remove()
    with capture(llama, [], grad_edits={MLP1: torch.zeros_like}) as cap:
        (edited,) = torch.autograd.grad(_target(llama(inputs_embeds=emb).logits, 7), emb)
    assert not torch.equal(plain, detached)
    assert torch.equal(edited, detached)
    assert list(cap) == [MLP1] and torch.equal(cap[MLP1].grad, g_plain_mlp)  # before the edit
    # layer 0's output carries everything from the embeddings
    with capture(llama, [], grad_edits={L0: torch.zeros_like}):
        (g,) = torch.autograd.grad(_target(llama(inputs_embeds=emb).logits, 7), emb)
    assert torch.equal(g, torch.zeros_like(g))


def test_grad_edit_scale_scales_the_share(llama, ids):
    emb = _embeds(llama, ids)
    up = "model.layers.1.mlp.up_proj"
    h = llama.model.layers[1].mlp.register_forward_hook(lambda mod, args, out: out.detach())
    (detached,) = torch.autograd.grad(_target(llama(inputs_embeds=emb).logits, 7), emb)
    h.remove()
    with capture(llama, up) as plain:
        (full,) = torch.autograd.grad(_target(llama(inputs_embeds=emb).logits, 7), emb)
    for c in (2.0, 3.0, -0.5):
        with capture(llama, up, grad_edits={MLP1: lambda g: g * c}) as cap:
            (scaled,) = torch.autograd.grad(_target(llama(inputs_embeds=emb).logits, 7), emb)
        share = full - detached
        torch.testing.assert_close(scaled - detached, c * share, atol=1e-5 * full.abs().max().item(), rtol=1e-5)
        if c == 2.0:  # a power of two commutes exactly with the linear backward inside the MLP
            assert torch.equal(cap[up].grad, 2 * plain[up].grad)
            assert torch.equal(cap[MLP1].grad, plain_mlp_grad(llama, emb))


def plain_mlp_grad(llama, emb):
    live = []
    h = _live(llama.model.layers[1].mlp, live)
    (g,) = torch.autograd.grad(_target(llama(inputs_embeds=emb).logits, 7), live[0])
    h.remove()
    return g


def test_grad_edit_wrong_shape_raises_and_leaves_no_hook(llama, ids):
    before = _hook_counts(llama)
    live = []
    h = _live(llama.model.layers[1].mlp, live)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp.*\(2, 6, 1\).*\(2, 6, 32\)"):
        with capture(llama, [], grad_edits={MLP1: lambda g: g[..., :1]}):
            _target(llama(ids).logits, 2).backward()
    h.remove()
    assert not live[0]._backward_hooks and _hook_counts(llama) == before
    with pytest.raises(TypeError, match="must return a Tensor"):
        with capture(llama, [], grad_edits={MLP1: lambda g: None}):
            _target(llama(ids).logits, 2).backward()
    with pytest.raises(TypeError, match="callable"):
        capture(llama, [], grad_edits={MLP1: 3})
    assert _hook_counts(llama) == before


def test_unknown_path_names_nearest(llama):
    before = _hook_counts(llama)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlpp'.*'model\.layers\.1\.mlp'"):
        capture(llama, [MLP0, "model.layers.1.mlpp"])
    with pytest.raises(ValueError, match="'model.layer.0.mlp'"):
        with capture(llama, [], grad_edits={"model.layer.0.mlp": torch.zeros_like}):
            pass
    with pytest.raises(ValueError, match="no module path is close"):
        capture(llama, "zzzz")
    with pytest.raises(TypeError):
        capture(llama, [3])
    assert _hook_counts(llama) == before


# --- with relevance rules -------------------------------------------------------------------


def _ruled_norm_input_grad(llama, emb, tok):
    live = []
    with pyattr.use_relevance_rules(llama, pyattr.RelevanceRules.all()):
        h = _live(llama.model.norm, live, pre=True)
        (g,) = torch.autograd.grad(_target(llama(inputs_embeds=emb).logits, tok), live[0])
        h.remove()
    return g


@pytest.mark.parametrize("order", ["capture_outside", "capture_inside"])
def test_rules_on_capture(llama, ids, order):
    emb = _embeds(llama, ids)
    want = [_ruled_norm_input_grad(llama, emb, t) for t in (4, 9)]
    paths = [L1, MLP0, "model.norm", "model.layers.0.input_layernorm", "model.layers.1.self_attn.q_proj"]
    before = _hook_counts(llama)
    with capture(llama, L1) as plain:
        _target(llama(inputs_embeds=emb).logits, 4).backward()
    rules = pyattr.RelevanceRules.all()
    if order == "capture_outside":
        with capture(llama, paths, inputs=True) as cap, pyattr.use_relevance_rules(llama, rules):
            logits = llama(inputs_embeds=emb).logits
            _target(logits, 4).backward(retain_graph=True)
            _target(logits, 9).backward()
    else:
        with pyattr.use_relevance_rules(llama, rules), capture(llama, paths, inputs=True) as cap:
            logits = llama(inputs_embeds=emb).logits
            _target(logits, 4).backward(retain_graph=True)
            _target(logits, 9).backward()
    assert _hook_counts(llama) == before
    # the final norm's input is layer 1's output: rule-modified gradient, per pass
    assert len(cap[L1].grads) == 2
    assert torch.equal(cap[L1].grads[0], want[0]) and torch.equal(cap[L1].grads[1], want[1])
    assert not torch.allclose(cap[L1].grads[0], plain[L1].grad)
    assert torch.equal(cap["model.norm"].input, cap[L1].output)
    # the AH-rule cuts the query path: no gradient reaches q_proj's output
    assert cap["model.layers.1.self_attn.q_proj"].grads == []


def test_rules_on_grad_edit_and_bypassed_act_fn(llama, ids):
    emb = _embeds(llama, ids)
    with pyattr.use_relevance_rules(llama), capture(llama, [], grad_edits={L0: torch.zeros_like}):
        (g,) = torch.autograd.grad(_target(llama(inputs_embeds=emb).logits, 4), emb)
    assert torch.equal(g, torch.zeros_like(g))
    before = _hook_counts(llama)
    # the gated rule computes act(gate)·up in one op: a hook on act_fn would never run
    with pytest.raises(pyattr.RelevanceRuleConflictError, match="act_fn"):
        with pyattr.use_relevance_rules(llama), capture(llama, "model.layers.0.mlp.act_fn"):
            llama(inputs_embeds=emb)
    assert _hook_counts(llama) == before
