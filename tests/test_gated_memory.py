"""The gated MLP's memory mount (pyattr.integration.forwards.GATED_MEMORY): with both gated
rules off and another rule on (the LN-rule alone, attention rules alone), a plain gated MLP
runs through the fused gated op with the ordinary gradient, which saves ``gate`` and ``up``
and not ``act(gate)``. It changes no value and no gradient, lists nothing in the coverage,
and steps aside (the module's own forward runs) wherever it could not run as that would."""

from __future__ import annotations

import contextlib

import pytest
import torch

import pyattr
from pyattr import RelevanceRules, use_relevance_rules
from pyattr.integration import forwards
from pyattr.integration.errors import RelevanceRuleUnsupportedError
from pyattr.integration.errors import RelevanceRuleConflictError
from pyattr.integration.gated_memory import GATED_MEMORY, MLPParts, lenient, native_instead
from pyattr.integration.install import RuleState, state_of

pytestmark = pytest.mark.usefixtures("one_thread")

LN = RelevanceRules(normalization=True)


def _model(arch: str = "llama", dtype=torch.float64):
    from models import tiny_causal_lm

    m = tiny_causal_lm(arch, dtype=dtype)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def _mlps(m):
    return [layer.mlp for layer in m.model.layers]


def _wide_saved(m, ids, rules, width: int) -> int:
    """How many distinct tensors of width ``width`` (the MLP's intermediate size) the
    forward saves for the backward, with ``rules`` installed (None: none)."""
    seen = set()

    def pack(t):
        if tuple(t.shape) == (*ids.shape, width):  # an activation, not a weight
            seen.add(t.untyped_storage().data_ptr())
        return t

    x = m.get_input_embeddings()(ids).requires_grad_(True)
    with use_relevance_rules(m, rules) if rules is not None else contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(inputs_embeds=x, logits_to_keep=1)
    return len(seen)


def _without_mount(monkeypatch):
    import pyattr.integration.gated_plan as gp

    monkeypatch.setattr(gp, "lenient", lambda verify: (_ for _ in ()).throw(AssertionError("mounted")))
    real = gp._mount

    def rules_only(pl, path, mlp, act, kind, wanted, plain, make, act_name):
        if wanted:
            real(pl, path, mlp, act, kind, wanted, plain, make, act_name)

    monkeypatch.setattr(gp, "_mount", rules_only)


@pytest.mark.parametrize("rules", [LN, RelevanceRules(attention="attnlrp"), RelevanceRules(attention=True)])
def test_saves_gate_and_up_only(rules):
    m = _model(dtype=torch.float32)
    ids = torch.randint(3, 90, (1, 7))
    width = m.config.intermediate_size
    # native: act's input (gate), and both operands of the product (act(gate), up), per block
    assert _wide_saved(m, ids, None, width) == 3 * len(_mlps(m))
    assert _wide_saved(m, ids, rules, width) == 2 * len(_mlps(m))


@pytest.mark.parametrize("arch", ["llama", "phi3", "qwen2_moe"])
def test_same_relevance_and_no_coverage_entry(arch, monkeypatch):
    dtype = torch.float32 if arch == "qwen2_moe" else torch.float64  # its experts' grouped GEMM has no float64
    m = _model(arch, dtype)
    ids = torch.randint(3, 90, (2, 6))
    with use_relevance_rules(m, LN) as cov:
        mounted = [st for st in (state_of(mod) for mod in m.modules()) if st is not None
                   and GATED_MEMORY in st.counts]
        assert mounted, "no gated MLP carries the memory mount"
        assert not any(st.path in cov.installed for st in mounted)
        assert GATED_MEMORY not in cov.by_kind
    got = pyattr.relevance(m, ids, target=5, rules="ln")
    with monkeypatch.context() as mp:
        _without_mount(mp)
        want = pyattr.relevance(m, ids, target=5, rules="ln")
    tol = {} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    torch.testing.assert_close(got.relevance, want.relevance, **tol)
    # values are the model's own, bit for bit
    assert torch.equal(got.target, want.target)
    assert all(state_of(mod) is None for mod in m.modules())


def test_nothing_mounted_without_any_rule_or_with_the_gated_rules():
    m = _model()
    with use_relevance_rules(m, RelevanceRules()):
        assert all(state_of(mlp) is None for mlp in _mlps(m))
    with use_relevance_rules(m, RelevanceRules.all()):
        assert all(GATED_MEMORY not in state_of(mlp).counts for mlp in _mlps(m))


def test_hook_on_the_activation_sees_its_call():
    m = _model()
    ids = torch.randint(3, 90, (1, 6))
    calls = []
    act = m.model.layers[0].mlp.act_fn
    # a hook in place before the scope: no mount on that MLP
    h = act.register_forward_hook(lambda mod, a, out: calls.append("before"))
    try:
        with use_relevance_rules(m, LN):
            assert state_of(m.model.layers[0].mlp) is None
            assert GATED_MEMORY in state_of(m.model.layers[1].mlp).counts
            m(ids)
    finally:
        h.remove()
    assert calls == ["before"]
    # a hook added inside the scope: the module's own forward runs that call
    with use_relevance_rules(m, LN):
        h = act.register_forward_hook(lambda mod, a, out: calls.append("inside"))
        try:
            m(ids)
        finally:
            h.remove()
    assert calls == ["before", "inside"]


def test_layer_relevance_of_the_neurons_under_the_ln_rule(monkeypatch):
    """A method's own tap on the activation (the neurons) reaches it through the module's
    own forward; the numbers are those without the mount."""
    m = _model()
    ids = torch.randint(3, 90, (1, 6))
    path = "model.layers.0.mlp.act_fn"
    got = pyattr.layer_relevance(m, ids, [path], target=5, rules="ln")[path].relevance
    with monkeypatch.context() as mp:
        _without_mount(mp)
        want = pyattr.layer_relevance(m, ids, [path], target=5, rules="ln")[path].relevance
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert got.abs().sum() > 0


def test_a_rebuilt_forward_that_differs_steps_aside(monkeypatch):
    """Where the first call's check finds the rebuilt forward differing from the module's
    own, the module's own forward runs under the memory mount alone, and a gated rule on
    that module raises."""
    m = _model()
    ids = torch.randint(3, 90, (1, 6))
    want = m(ids).logits
    real = forwards.gated_activation
    monkeypatch.setattr(forwards, "gated_activation", lambda g, u, act, identity, half:
                        real(g, u, act, identity=identity, half=half) * (1 + 1e-3))
    monkeypatch.setattr(forwards, "_VERIFIED", type(forwards._VERIFIED)())
    with use_relevance_rules(m, LN):
        assert torch.equal(m(ids).logits, want)
        assert all(state_of(mlp).mismatch is not None for mlp in _mlps(m))
        with use_relevance_rules(m, RelevanceRules(activation=True)):
            with pytest.raises(RelevanceRuleUnsupportedError, match="rebuilt|bit for bit|differ"):
                m(ids)
    assert all(state_of(mlp) is None for mlp in _mlps(m))


def test_lenient_and_native_instead_units():
    mlp = torch.nn.Module()
    mlp.act = torch.nn.SiLU()
    held = MLPParts(mlp, {"act": mlp.act}, "act")
    state = RuleState(mlp, "mlp")
    err = RelevanceRuleUnsupportedError("differs")

    def failing(*args):
        raise err

    state.counts[GATED_MEMORY] = 1
    assert lenient(failing)(mlp, state, None, (), {}) is True
    assert state.mismatch is err
    assert native_instead(state, held, ruled=False) is True
    with pytest.raises(RelevanceRuleUnsupportedError, match="differs"):
        native_instead(state, held, ruled=True)
    state.counts["activation"] = 1
    with pytest.raises(RelevanceRuleUnsupportedError, match="differs"):
        lenient(failing)(mlp, state, None, (), {})
    fresh = RuleState(mlp, "mlp")
    assert native_instead(fresh, held, ruled=False) is False
    h = mlp.act.register_forward_hook(lambda *a: None)
    assert native_instead(fresh, held, ruled=False) is True
    assert native_instead(fresh, held, ruled=True) is False
    h.remove()
    g = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert native_instead(fresh, held, ruled=False) is True
        assert lenient(failing)(mlp, fresh, None, (), {}) is False  # deferred: its two rows would reach the hook
        assert fresh.deferred and fresh.mismatch is None
    finally:
        g.remove()
    assert native_instead(fresh, held, ruled=False) is True  # this call's check was put off
    fresh.deferred = False
    mlp.act.forward = torch.relu
    assert held.changed() == "act.forward" and native_instead(fresh, held, ruled=False) is True
    del mlp.act.forward
    mlp.act = torch.nn.ReLU()
    assert held.changed() == "act"


@pytest.mark.parametrize("replace", ["act_fn", "gate_proj", "act_fn.forward"])
def test_a_part_replaced_inside_the_scope_runs_or_raises(replace):
    """An ablation that swaps a submodule of the MLP (or the activation's forward) after the
    scope's first call: under the memory mount the module's own forward runs it, exactly;
    under the gated rules it raises (it gave logits off by 1.05 and 3.44, and gradients off by
    a third, before)."""
    m = _model()
    ids = torch.randint(3, 90, (1, 6))
    mlp = m.model.layers[0].mlp

    def swap():
        if replace == "act_fn":
            mlp.act_fn = torch.nn.ReLU()
        elif replace == "gate_proj":
            torch.manual_seed(3)
            mlp.gate_proj = torch.nn.Linear(32, 48, bias=False).double()
        else:
            mlp.act_fn.forward = torch.relu

    kept = {n: getattr(mlp, n) for n in ("act_fn", "gate_proj")}
    try:
        x = m.get_input_embeddings()(ids).requires_grad_(True)
        with use_relevance_rules(m, LN):
            m(ids)
            swap()
            out = m(inputs_embeds=x).logits[0, -1, 5]
            got = torch.autograd.grad(out, x)[0]
        with use_relevance_rules(m, LN), pytest.MonkeyPatch.context() as mp:
            _without_mount(mp)
            want_out = m(inputs_embeds=x).logits[0, -1, 5]
            want = torch.autograd.grad(want_out, x)[0]
        assert torch.equal(out, want_out)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    finally:
        for n, mod in kept.items():
            setattr(mlp, n, mod)
        mlp.act_fn.__dict__.pop("forward", None)
    if replace == "act_fn.forward":
        return  # under the gated rules the activation's forward is the rules' (observed at install)
    with use_relevance_rules(m, RelevanceRules.all()):
        m(ids)
        swap()
        with pytest.raises(RelevanceRuleConflictError, match=r"'model\.layers\.0\.mlp': .* was replaced while"):
            m(ids)
    for n, mod in kept.items():
        setattr(mlp, n, mod)
    mlp.act_fn.__dict__.pop("forward", None)


def test_a_global_hook_sees_the_activation_and_torch_func_runs_first():
    """Hooks on every module see the activation's call (its own forward runs); ``torch.func``
    as the first call of the scope runs (the check is deferred, the module's own forward runs)."""
    m = _model()
    ids = torch.randint(3, 90, (1, 6))
    x = m.get_input_embeddings()(ids).detach()
    act = m.model.layers[0].mlp.act_fn
    seen = []
    g = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, a, out: seen.append(tuple(out.shape)) if mod is act else None)
    try:
        with use_relevance_rules(m, LN):
            m(ids)
    finally:
        g.remove()
    assert seen == [(1, 6, 48)]  # the one call of the forward, none of a check
    with use_relevance_rules(m, LN):
        jac = torch.func.jacrev(lambda e: m(inputs_embeds=e).logits[0, -1, :3])(x)
    with use_relevance_rules(m, LN), pytest.MonkeyPatch.context() as mp:
        _without_mount(mp)
        want = torch.func.jacrev(lambda e: m(inputs_embeds=e).logits[0, -1, :3])(x)
    torch.testing.assert_close(jac, want, rtol=1e-12, atol=1e-14)


def test_copying_the_mlp_inside_the_scope_says_why():
    import copy

    m = _model()
    with use_relevance_rules(m, LN):
        with pytest.raises(RelevanceRuleConflictError, match="'model.layers.0.mlp' while it runs through pyattr's "
                                                             "fused gated op"):
            copy.deepcopy(m.model.layers[0].mlp)


def test_gradient_checkpointing_runs_the_forward_it_ran(monkeypatch):
    """A checkpointed block's recomputation keeps what the forward found (a mismatch)."""
    m = _model()
    m.gradient_checkpointing_enable()
    m.train()
    ids = torch.randint(3, 90, (1, 6))
    want = pyattr.relevance(m, ids, target=5, rules="ln").relevance
    real = forwards.gated_activation
    monkeypatch.setattr(forwards, "gated_activation", lambda g, u, act, identity, half:
                        real(g, u, act, identity=identity, half=half) * (1 + 1e-3))
    monkeypatch.setattr(forwards, "_VERIFIED", type(forwards._VERIFIED)())
    got = pyattr.relevance(m, ids, target=5, rules="ln").relevance
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
