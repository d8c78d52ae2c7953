"""The last block's MLP at the metric's positions only (pyattr.patching.last_block): exact at
those positions, used by blockwise nodes and edges where it holds (observed), the block run
whole for a patch inside the MLP, and left off where the MLP mixes positions."""

import pytest
import torch
from torch import nn

from test_patching_blockwise import CLEAN, CORRUPT, _llama
from pyattr.patching import activation_patching, attribution_patching
from pyattr.patching.last_block import mlp_at
from pyattr.targets import LogitDiff

pytestmark = pytest.mark.usefixtures("one_thread")


def _seen_lengths(module):
    """The sequence lengths ``module`` sees, recorded by a pre-hook."""
    seen = []
    return seen, module.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))


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
def test_blockwise_with_the_cut_is_exact_patching(nodes):
    model = _llama(2)
    seen, h = _seen_lengths(model.model.layers[-1].mlp.down_proj)
    try:
        est = attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=nodes, method="blockwise")
    finally:
        h.remove()
    exact = activation_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=nodes, progress=False)
    for n in nodes:
        assert exact[n].abs().max() > 1e-3, n
        torch.testing.assert_close(est[n].double(), exact[n].double(), atol=1e-9, rtol=1e-7, msg=n)
    assert 1 in seen        # the metric reads the last position: the last MLP ran there alone


class _Mixing(nn.Linear):
    """A down projection that mixes positions (a running mean over the sequence): then no
    position of the MLP's output is its own."""

    def forward(self, x):
        y = super().forward(x)
        return y.cumsum(1) / torch.arange(1, y.shape[1] + 1, dtype=y.dtype)[None, :, None]


def test_an_mlp_that_mixes_positions_runs_whole():
    model = _llama(2)
    mlp = model.model.layers[-1].mlp
    mixing = _Mixing(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False, dtype=torch.float64)
    mixing.weight.data.copy_(mlp.down_proj.weight)
    mlp.down_proj = mixing
    seen, h = _seen_lengths(mixing)
    try:
        est = attribution_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=["heads"], method="blockwise")
    finally:
        h.remove()
    exact = activation_patching(model, CLEAN, CORRUPT, LogitDiff(3, 7), nodes=["heads"], progress=False)
    assert exact["heads"].abs().max() > 1e-3
    torch.testing.assert_close(est["heads"].double(), exact["heads"].double(), atol=1e-9, rtol=1e-7)
    assert seen.count(1) == 1          # tried once (the check), then every run whole
    assert set(seen) == {1, CLEAN.shape[1]}
