"""patch_copies, the tap body of activation and blockwise patching: each copy's unit (head
slice, neuron, whole width) at its position (or every valid one) takes the source value, or
with a base gets source − base added, bit for bit as written unit by unit."""

import pytest
import torch

from pyattr.patching.activation import _Job, patch_copies
from pyattr.patching.nodes import Site


def _unit_by_unit(site, jobs, t, src, valid, base):
    """The reference: one copy at a time, by slices."""
    new = t.clone()
    for j, job in jobs:
        width = t.shape[-1]
        if job.unit < 0:
            cols = slice(None)
        elif site.node == "heads":
            d = width // site.heads
            cols = slice(job.unit * d, (job.unit + 1) * d)
        else:
            cols = slice(job.unit, job.unit + 1)
        pos = [job.position] if job.position >= 0 else valid[j].nonzero().flatten().tolist()
        for p in pos:
            if base is None:
                new[j, p, cols] = src[j, p, cols].to(t.dtype)
            else:
                new[j, p, cols] = t[j, p, cols] + (src[j, p, cols].double() - base[j, p, cols].double()).to(t.dtype)
    return new


@pytest.mark.parametrize("node,heads,width", [("heads", 4, 32), ("neurons", 0, 20), ("residual", 0, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("with_base", [False, True])
def test_patch_copies_matches_unit_by_unit(node, heads, width, dtype, with_base):
    g = torch.Generator().manual_seed(0)
    site = Site(node, 0, "x", None, "input", heads)
    n, seq = 9, 7
    jobs = []
    for j in range(0, n, 2):  # every other copy patched, the rest left as they are
        unit = -1 if node == "residual" else int(torch.randint(heads or width, (1,), generator=g))
        jobs.append((j, _Job(0, 0, int(torch.randint(-1, seq, (1,), generator=g)), unit)))
    assert any(job.position < 0 for _, job in jobs) and any(job.position >= 0 for _, job in jobs)
    t, src, base = (torch.randn(n, seq, width, generator=g).to(dtype) for _ in range(3))
    valid = torch.rand(n, seq, generator=g) > 0.3
    base = base if with_base else None
    got = patch_copies(site, jobs, src, valid, base=base)(t)
    want = _unit_by_unit(site, jobs, t, src, valid, base)
    assert torch.equal(got, want)
    assert torch.equal(got[1::2], t[1::2]) and not torch.equal(got, t)
