"""k logit targets of one kind read with one gather (pyattr/targets/stacked.py), and k targets'
backward run in chunks over one forward (relevance_in_chunks): the same values and
gradients as each target read on its own and as one batched backward."""

import pytest
import torch

import pyattr
import pyattr.targets as T
from models import VOCAB, tiny_causal_lm
from pyattr.methods._core.forward import evaluate_targets
from pyattr.methods.generation import ChunkSizes, segment_end
from pyattr.methods.relevance import relevance_in_chunks
from pyattr.targets.stacked import stacked_values

pytestmark = pytest.mark.usefixtures("one_thread")


def _forward(seed=0, batch=2, seq=7, vocab=11, mask=None, kept=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq if kept is None else kept.numel(), vocab, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return T.Forward(logits.requires_grad_(True), ids, mask, {}, kept), logits


KINDS = {
    "logit": lambda: [T.Logit(3, -1), T.Logit([4, 9], -3), T.Logit(0, 2)],
    "logit_diff": lambda: [T.LogitDiff(3, 5, -1), T.LogitDiff([1, 2], 7, -2)],
    "logprob": lambda: [T.LogProb(3, -1), T.LogProb([4, 9], -4)],
    "prob_contrast": lambda: [T.LogProb(3, -1, contrast=5, prob=True), T.LogProb(8, 1, contrast=[0, 2], prob=True)],
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("padded", [False, True])
def test_stacked_values_and_gradients_equal_each_target_alone(kind, padded):
    mask = torch.tensor([[1] * 7, [0, 0] + [1] * 5]) if padded else None
    fwd, logits = _forward(mask=mask)
    targets = KINDS[kind]()
    vals, ids = stacked_values(targets, fwd)
    alone = [t.value(fwd) for t in targets]
    assert torch.equal(vals, torch.stack([v for v, _ in alone]))
    assert torch.equal(ids, torch.stack([i for _, i in alone]))
    # a batched backward of every target's one-hot gradient: the same gradient at the logits
    k = len(targets)
    g = torch.eye(k, dtype=vals.dtype).view(k, k, 1).expand(k, k, 2)
    (mine,) = torch.autograd.grad(vals, [logits], g, is_grads_batched=True)
    (each,) = torch.autograd.grad(torch.stack([v for v, _ in alone]), [logits], g, is_grads_batched=True)
    assert torch.equal(mine, each)


def test_stacked_values_read_kept_logits_and_name_bad_ids():
    kept = torch.tensor([2, 5, 6])  # logits_to_keep: only these positions were computed
    fwd, _ = _forward(kept=kept)
    targets = [T.Logit(1, -1), T.Logit(2, -2), T.Logit(3, 2)]
    vals, _ = stacked_values(targets, fwd)
    assert torch.equal(vals, torch.stack([t.value(fwd)[0] for t in targets]))
    with pytest.raises(ValueError, match=r"^target: token ids must be in \[0, 11\), got \[11, 11\]$"):
        stacked_values([T.Logit(1), T.Logit(11)], fwd)
    with pytest.raises(ValueError, match=r"^target: token ids must be in \[0, 11\), got \[-1, -1\]$"):
        stacked_values([T.LogitDiff(1, 2), T.LogitDiff(3, -1)], fwd)


def test_stacked_values_leave_other_mixes_to_each_target():
    fwd, _ = _forward()
    assert stacked_values([T.Logit(1)], fwd) is None                      # one target
    assert stacked_values([T.Logit(1), T.LogitDiff(1, 2)], fwd) is None  # two kinds
    assert stacked_values([T.Logit(1), T.Logit(None)], fwd) is None       # a top-1 id is chosen per target
    assert stacked_values([T.LogProb(1), T.LogProb(1, prob=True)], fwd) is None
    classes = T.Forward(torch.randn(2, 5), torch.zeros(2, 3, dtype=torch.long), None, {})
    assert stacked_values([T.Logit(1), T.Logit(2)], classes) is None       # a classifier's (batch, classes)
    vals, ids, fixed = evaluate_targets([T.Logit(1), T.Logit(None)], fwd, True)  # the per-target path
    assert vals.shape == (2, 2) and fixed[1].token_id is not None


class _Record(ChunkSizes):
    def __init__(self, k):
        super().__init__(k, fixed=True)
        self.sizes = []

    def measured(self, steps, seconds, peak_bytes=None):
        self.sizes.append(steps)
        super().measured(steps, seconds, peak_bytes)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_backward_in_chunks_equals_one_batched_backward(arch):
    m = tiny_causal_lm(arch, "sdpa", dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, 9), generator=g)
    targets = [T.Logit(int(t), position=-(5 - j)) for j, t in enumerate(torch.randint(1, VOCAB, (5,), generator=g))]
    one = pyattr.relevance(m, ids, target=targets)
    rec = _Record(2)
    chunked = relevance_in_chunks(m, ids, targets, None, None, rec)
    assert rec.sizes == [2, 2, 1] and rec.largest == 2
    torch.testing.assert_close(chunked.relevance, one.relevance, atol=1e-12, rtol=0)
    assert torch.equal(chunked.target, one.target)
    torch.testing.assert_close(chunked.conservation_delta, one.conservation_delta, atol=1e-12, rtol=0)


def test_segments_end_where_the_cut_passes_a_quarter_more_than_the_first_step_needs():
    assert segment_end(16384, 0, 16) == 16           # a long context: one forward for every step
    assert segment_end(128, 0, 64) == 33             # cut 160 = 1.25 × 128
    assert segment_end(128, 33, 64) == 64            # 161 → at most 201: the rest
    assert segment_end(2, 0, 8) == 1 and segment_end(2, 1, 8) == 2  # always one step at least
