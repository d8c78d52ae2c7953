"""Blockwise patching runs each re-run block's MLP from the first position its input changed
(pyattr.patching.mlp_positions): exact patching's effects (nodes and edges), the MLP's
arithmetic before the change skipped, user hooks on the MLP seeing the full length, and the
whole MLP wherever the change starts at the first position or the MLP is not position-wise."""

import pytest
import torch

from models import tiny_causal_lm
from pyattr.patching import activation_patching, attribution_patching, edge_attribution, edge_effects
from pyattr.patching.mlp_positions import MLPOutputs, first_changed
from pyattr.targets import LogitDiff

pytestmark = pytest.mark.usefixtures("one_thread")

CLEAN = torch.tensor([[5, 9, 14, 3, 22, 7], [11, 4, 4, 30, 2, 17]])
CORRUPT = torch.tensor([[5, 9, 20, 3, 22, 7], [11, 4, 4, 30, 8, 17]])


def test_first_changed():
    x = torch.zeros(5, 6, 3)
    ref = torch.tensor([3, 4, 3])
    assert first_changed(x, 3, ref) == 6            # nothing changed
    x[1, 4, 2] = 1.0
    assert first_changed(x, 3, ref) == 4
    x[2, 1, 0] = float("nan")
    assert first_changed(x, 3, ref) == 1            # NaN is a change
    x[3, 0, 0] = 2.0                                 # a reference row differing from its copies
    assert first_changed(x, 3, ref) == 0


@pytest.fixture
def starts(monkeypatch):
    """Every first changed position the re-run MLPs computed from (a hook on the MLP's children
    would make it not position-wise, so the positions are read here)."""
    import pyattr.patching.mlp_positions as MP

    seen = []

    def spy(x, n, ref):
        seen.append(first_changed(x, n, ref))
        return seen[-1]

    monkeypatch.setattr(MP, "first_changed", spy)
    return seen


def test_the_mlp_runs_from_the_first_changed_position_and_stays_exact(starts):
    """The pairs differ from position 2 on (row 0) and 4 on (row 1)."""
    model = tiny_causal_lm("llama", dtype=torch.float64)
    nodes = ["residual", "attention", "heads", "mlp"]
    est = attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=nodes, method="blockwise")
    assert starts and set(starts) <= {2, 4}
    exact = activation_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=nodes, progress=False)
    for n in nodes:
        assert exact[n].abs().max() > 1e-3, n
        torch.testing.assert_close(est[n].double(), exact[n].double(), atol=1e-9, rtol=1e-7, msg=n)


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc1(x)
        h = self.act(h)
        return self.fc2(h)


def test_from_change_computes_after_the_change_and_fills_before_it():
    torch.manual_seed(0)
    mlp = _MLP().double()
    parts = MLPOutputs([mlp])
    clean = torch.randn(2, 5, 4, dtype=torch.float64)
    with parts.recording():
        mlp(clean)
    assert parts.usable(0) and torch.equal(parts.raw[0], mlp(clean))
    parts.raw[0] = torch.full_like(parts.raw[0], 123.0)       # tells the fill from the computed part
    idx = torch.tensor([1, 0, 1, 0])                            # two patched copies, then their references
    x = clean[idx].clone()
    x[0, 3:] += 1.0
    with parts.from_change(0, idx, 2, torch.tensor([2, 3]), 2):
        out = mlp(x)
    assert torch.equal(out[:, :3], torch.full_like(out[:, :3], 123.0))
    torch.testing.assert_close(out[:, 3:], mlp(x)[:, 3:], atol=1e-12, rtol=0)
    x[3, 0] += 1.0                                              # a change at the first position: whole
    with parts.from_change(0, idx, 2, torch.tensor([2, 3]), 2):
        assert torch.equal(mlp(x), mlp(x))
        torch.testing.assert_close(mlp(x), _MLP.forward(mlp, x), atol=0, rtol=0)


def test_a_change_at_the_first_position_runs_the_whole_mlp(starts):
    model = tiny_causal_lm("llama", dtype=torch.float64)
    corrupt = CLEAN.clone()
    corrupt[:, 0] = torch.tensor([6, 12])
    est = attribution_patching(model, CLEAN, corrupt, LogitDiff(3, 7), nodes="heads", method="blockwise")
    assert starts and set(starts) == {0}
    exact = activation_patching(model, CLEAN, corrupt, LogitDiff(3, 7), nodes="heads", progress=False)
    torch.testing.assert_close(est["heads"].double(), exact["heads"].double(), atol=1e-9, rtol=1e-7)


def test_user_hooks_on_the_mlp_see_every_position():
    model = tiny_causal_lm("gpt2", dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    steer = torch.randn(model.config.n_embd, generator=g, dtype=torch.float64)
    seen = []
    mlp = model.transformer.h[0].mlp
    hooks = [mlp.register_forward_hook(lambda mod, args, out: seen.append(out.shape[1]) or out + steer.cumsum(0)),
             mlp.register_forward_pre_hook(lambda mod, args: (args[0] * 0.75,))]
    try:
        nodes = ["heads", "mlp", "neurons"]
        est = attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=nodes, method="blockwise")
        exact = activation_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=nodes, progress=False)
    finally:
        for h in hooks:
            h.remove()
    assert set(seen) == {6}
    for n in nodes:
        torch.testing.assert_close(est[n].double(), exact[n].double(), atol=1e-9, rtol=1e-7, msg=n)


def test_edges_block_by_block_stay_exact_with_the_cut(starts):
    model = tiny_causal_lm("llama", dtype=torch.float64)
    est = edge_attribution(model, CLEAN, CORRUPT, LogitDiff(3, 7), method="blockwise")
    assert 2 in starts
    exact = edge_effects(model, CLEAN, CORRUPT, LogitDiff(3, 7))
    assert exact.per_pair.abs().max() > 1e-3
    torch.testing.assert_close(est.per_pair, exact.per_pair, atol=1e-9, rtol=1e-7)


def test_only_position_wise_mlps_are_cut():
    moe = tiny_causal_lm("mixtral").model.layers[0].mlp
    llama = tiny_causal_lm("llama").model.layers[0].mlp
    parts = MLPOutputs([moe, llama, None])
    assert parts.mlps == [None, llama, None]
    assert not parts.usable(1)                      # nothing recorded yet


class _TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)

    def forward(self, x, scale):
        return self.fc2(self.act(self.fc1(x))) * scale


def _mixing(forward):
    import functools

    @functools.wraps(forward)
    def wrapped(self, x):
        return forward(self, x + x.mean(1, keepdim=True))

    return wrapped


class _Decorated(_MLP):
    forward = _mixing(_MLP.forward)


def test_mlps_whose_positions_could_mix_are_not_cut():
    """Found by a bad-input pass: a second input (a per-row scale pooled over positions), a
    decorator that mixes positions around a chain of children, and a hook registered for
    every module each made the cut wrong; each now keeps the MLP whole."""
    from pyattr.patching.last_block import positionwise

    assert positionwise(_MLP())
    assert not positionwise(_TwoInputs())
    assert not positionwise(_Decorated())
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)
    try:
        assert not positionwise(_MLP())
    finally:
        handle.remove()


def test_a_hook_for_every_module_keeps_blockwise_exact(starts):
    model = tiny_causal_lm("llama", dtype=torch.float64)

    def pooled(mod, args, out):
        return out + 0.5 * out.mean(1, keepdim=True) if type(mod).__name__ == "LlamaMLP" else None

    handle = torch.nn.modules.module.register_module_forward_hook(pooled)
    try:
        nodes = ["residual", "heads", "mlp"]
        est = attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=nodes, method="blockwise")
        exact = activation_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=nodes, progress=False)
    finally:
        handle.remove()
    assert not starts
    for n in nodes:
        torch.testing.assert_close(est[n].double(), exact[n].double(), atol=1e-9, rtol=1e-7, msg=n)
