"""The last block's MLP at the metric's positions only (pyattr.patching.last_block): exact at
those positions, used by blockwise nodes and edges where it holds (observed), the block run
whole for a patch inside the MLP, and left off where the MLP mixes positions."""

import pytest
import torch
from torch import nn

from test_patching_blockwise import CLEAN, CORRUPT, _llama
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
from pyattr.patching import activation_patching, attribution_patching
from pyattr.patching.last_block import checked_cut, last_mlp, mlp_at, positionwise
from pyattr.targets import LogitDiff

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def cuts(monkeypatch):
    """The positions of every run of the last MLP cut by blockwise (a hook on the MLP would
    itself keep it whole)."""
    import pyattr.patching.last_block as LB

    seen, real = [], LB.mlp_at

    def spy(mlp, positions):
        seen.append(positions.tolist())
        return real(mlp, positions)

    monkeypatch.setattr(LB, "mlp_at", spy)
    return seen


def test_mlp_at_is_the_mlp_at_those_positions_and_zero_elsewhere():
    mlp = _llama(1).model.layers[0].mlp
    x = torch.randn(3, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([2, 6])
    with mlp_at(mlp, pos):
        y = mlp(x)
    full = mlp(x)
    assert y.shape == full.shape
    torch.testing.assert_close(y[:, pos], full[:, pos], atol=1e-12, rtol=0)
    keep = torch.zeros(7, dtype=torch.bool)
    keep[pos] = True
    assert bool((y[:, ~keep] == 0).all()) and bool((full[:, ~keep] != 0).any())
    assert not mlp._forward_pre_hooks and not mlp._forward_hooks  # the hooks are gone after


@pytest.mark.parametrize("nodes", [["heads", "mlp", "residual"], ["neurons"]])
def test_blockwise_with_the_cut_is_exact_patching(nodes, cuts):
    model = _llama(2)
    est = attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=nodes, method="blockwise")
    exact = activation_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=nodes, progress=False)
    for n in nodes:
        assert exact[n].abs().max() > 1e-3, n
        torch.testing.assert_close(est[n].double(), exact[n].double(), atol=1e-9, rtol=1e-7, msg=n)
    assert cuts and all(c == [CLEAN.shape[1] - 1] for c in cuts)   # the metric reads the last position


class _Mixing(nn.Linear):
    """A down projection that mixes positions (a running mean over the sequence): then no
    position of the MLP's output is its own."""

    def forward(self, x):
        y = super().forward(x)
        return y.cumsum(1) / torch.arange(1, y.shape[1] + 1, dtype=y.dtype)[None, :, None]


class _Capacity(LlamaMLP):
    """An MLP with a token capacity (Switch-style): only the first 2 tokens of each row
    that a router picks get the MLP. On the clean run the last token may be within it,
    and a patched run can push it out: only reading the forward tells."""

    def forward(self, x):
        picked = self.router(x).squeeze(-1) > 0
        keep = picked & (picked.long().cumsum(1) <= 2)
        return super().forward(x) * keep[..., None].to(x.dtype)


def _mixing(model):
    mlp = model.model.layers[-1].mlp
    mixing = _Mixing(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False, dtype=torch.float64)
    mixing.weight.data.copy_(mlp.down_proj.weight)
    mlp.down_proj = mixing


def _capacity(model):
    mlp = model.model.layers[-1].mlp
    mlp.__class__ = _Capacity
    torch.manual_seed(3)
    mlp.router = nn.Linear(model.config.hidden_size, 1, dtype=torch.float64)


@pytest.mark.parametrize("make", [_mixing, _capacity], ids=["mixing-down-projection", "token-capacity"])
def test_an_mlp_across_positions_runs_whole(make, cuts):
    model = _llama(2)
    make(model)
    est = attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=["heads", "mlp"], method="blockwise")
    exact = activation_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=["heads", "mlp"], progress=False)
    for n in ("heads", "mlp"):
        assert exact[n].abs().max() > 1e-3
        torch.testing.assert_close(est[n].double(), exact[n].double(), atol=1e-9, rtol=1e-7)
    assert cuts == []     # read off the forward: never cut, not even tried


def test_positionwise_reads_the_forward():
    from models import tiny_causal_lm

    for arch, want in (("llama", True), ("gpt2", True), ("qwen2", True), ("phi3", False), ("mixtral", False)):
        model = tiny_causal_lm(arch, dtype=torch.float64)
        assert positionwise(last_mlp(model, False)) is want, arch
    model = _llama(2)
    mlp = model.model.layers[-1].mlp
    assert positionwise(mlp)
    h = mlp.down_proj.register_forward_hook(lambda m, a, out: out.cumsum(1))   # a user's hook across positions
    assert not positionwise(mlp)
    h.remove()
    mlp.forward = lambda x: mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)).flip(1)
    assert not positionwise(mlp)                                            # a forward replaced on the instance


def test_the_cut_is_kept_only_where_observed_exact():
    model = _llama(2)
    mlp = model.model.layers[-1].mlp

    class Calls:  # the last block's recorded output, and a re-run that gives it or not
        blocks = [None]
        x = [torch.zeros(2, 6, 32, dtype=torch.float64)]

        def __init__(self, off):
            self.y = [torch.ones(2, 6, 32, dtype=torch.float64)]
            self.off = off

        def rerun(self, i, idx, x, batch):
            return self.y[0] + self.off

    pos = torch.tensor([5])
    assert checked_cut(Calls(0.0), mlp, pos, 2) == (mlp, pos)
    assert checked_cut(Calls(1e-3), mlp, pos, 2) is None            # another value there: the block runs whole
    assert checked_cut(Calls(0.0), mlp, torch.arange(6), 2) is None  # every position read: nothing to cut
    assert checked_cut(Calls(0.0), mlp, None, 2) is None             # the head runs at every position


class _CentredNorm(LlamaRMSNorm):
    """A final norm that centres over the sequence first: the head at the last position
    then reads every position of the last block's output."""

    def forward(self, x):
        return super().forward(x - x.mean(1, keepdim=True))


@pytest.mark.parametrize("how", ["hook", "module"])
def test_a_head_that_reads_other_positions_keeps_the_block_whole(how, cuts):
    from pyattr.patching import edge_attribution, edge_effects

    model = _llama(2)
    if how == "hook":  # a user's hook after the last block, on the final norm
        model.model.norm.register_forward_hook(lambda m, args, out: out - out.mean(1, keepdim=True))
    else:
        model.model.norm.__class__ = _CentredNorm
    nodes = ["residual", "heads", "mlp"]
    est = attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=nodes, method="blockwise")
    exact = activation_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=nodes, progress=False)
    for n in nodes:
        assert exact[n].abs().max() > 1e-3
        torch.testing.assert_close(est[n].double(), exact[n].double(), atol=1e-9, rtol=1e-7, msg=n)
    if how == "hook":   # the edge graph reads the final norm as the table maps it
        e = edge_attribution(model, CLEAN, CORRUPT, LogitDiff(3, 7), method="blockwise")
        x = edge_effects(model, CLEAN, CORRUPT, LogitDiff(3, 7))
        assert x.per_pair.abs().max() > 1e-3
        torch.testing.assert_close(e.per_pair, x.per_pair, atol=1e-9, rtol=1e-7)
    assert cuts     # the MLP cut was tried on the check run, then left off: the head read other positions
