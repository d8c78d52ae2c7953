"""Padded rows give the numbers of the same row alone, on every architecture and padding side."""

import pytest
import torch

import pyattr
from models import VOCAB, pad_rows, tiny_causal_lm

from models import TEXT_ARCHS as ARCHS  # every mapped text architecture, encoders included




@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", ARCHS)
def test_padded_row_equals_row_alone(arch, side):
    m = tiny_causal_lm(arch)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 6, 3)]
    # the model's own pad id: RoBERTa numbers positions from its padding_idx
    ids, mask = pad_rows(rows, side, m.config.pad_token_id or 0)
    batch = pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=[4, 11, 17])
    for i, (row, tid) in enumerate(zip(rows, [4, 11, 17])):
        alone = pyattr.relevance(m, torch.tensor([row]), target=tid)
        real = mask[i].bool()
        torch.testing.assert_close(batch.target[i], alone.target[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batch.token_relevance[i, real], alone.token_relevance[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(
            batch.conservation_delta[i], alone.conservation_delta[0], atol=1e-5, rtol=1e-4
        )
        # pad positions carry no relevance (they are masked out as keys)
        assert float(batch.token_relevance[i, ~real].abs().sum()) <= 1e-6


def test_gpt2_left_padding_issue_case():
    """The reported case: a GPT-2 row left-padded by 3 tokens changed its target from +1.70 to −0.29."""
    m = tiny_causal_lm("gpt2")
    row = torch.randint(1, VOCAB, (1, 5))
    ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), row], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)], 1)
    padded = pyattr.relevance(m, ids, attention_mask=mask, target=7)
    alone = pyattr.relevance(m, row, target=7)
    torch.testing.assert_close(padded.target, alone.target, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded.token_relevance[:, 3:], alone.token_relevance, atol=1e-5, rtol=1e-4)


def test_caller_position_ids_are_kept():
    m = tiny_causal_lm("gpt2")
    ids = torch.randint(1, VOCAB, (1, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    shifted = torch.arange(5)[None]  # deliberately the arange positions
    r = pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask, "position_ids": shifted}, target=3)
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=mask, position_ids=shifted).logits[0, -1, 3]
    torch.testing.assert_close(r.target[0], ref.double(), atol=1e-6, rtol=1e-6)


class _NoPositions(torch.nn.Module):
    """GPT-2 behind a forward that takes no position_ids."""

    def __init__(self, inner):
        super().__init__()
        self.transformer, self.lm_head, self.config = inner.transformer, inner.lm_head, inner.config
        self.base_model_prefix = "transformer"

    def forward(self, input_ids, attention_mask=None):
        h = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.lm_head(h)

    def get_input_embeddings(self):
        return self.transformer.wte


def test_left_padding_without_position_ids_raises():
    m = _NoPositions(tiny_causal_lm("gpt2"))
    ids = torch.randint(1, VOCAB, (1, 5))
    with pytest.raises(ValueError, match=r"_NoPositions.forward takes no position_ids"):
        pyattr.relevance(m, ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1]]), rules=pyattr.RelevanceRules())
    # right padding needs no position ids
    r = pyattr.relevance(m, ids, attention_mask=torch.tensor([[1, 1, 1, 1, 0]]), target=2,
                         rules=pyattr.RelevanceRules())
    assert r.token_relevance.shape == (1, 5)


def test_middle_padding_without_sliding_window_equals_row_alone():
    m = tiny_causal_lm("llama")
    row = torch.randint(1, VOCAB, (1, 6))
    ids = torch.cat([row[:, :2], torch.zeros(1, 2, dtype=torch.long), row[:, 2:]], 1)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1]])
    r = pyattr.relevance(m, ids, attention_mask=mask, target=5)
    alone = pyattr.relevance(m, row, target=5)
    torch.testing.assert_close(r.target, alone.target, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r.token_relevance[mask.bool()], alone.token_relevance[0], atol=1e-5, rtol=1e-4)


def test_middle_padding_with_sliding_window_raises():
    m = tiny_causal_lm("gemma2")  # sliding-window layers
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"attention_mask row 0 has padding between real tokens; Gemma2ForCausalLM uses "
                                         r"sliding-window attention"):
        pyattr.relevance(m, torch.randint(1, VOCAB, (1, 8)), attention_mask=mask)
    # left padding stays fine there
    r = pyattr.relevance(m, torch.randint(1, VOCAB, (1, 8)), attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]))
    assert r.token_relevance.shape == (1, 8)


def test_position_ids_none_is_absent():
    m = tiny_causal_lm("gpt2")
    row = torch.randint(1, VOCAB, (1, 5))
    ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), row], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)], 1)
    r = pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask, "position_ids": None}, target=7)
    alone = pyattr.relevance(m, row, target=7)
    torch.testing.assert_close(r.target, alone.target, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask", [[[2, 2, 2, 2]], [[1, -1, 1, 1]], [[0.5, 1.0, 1.0, 1.0]]])
def test_non_binary_mask_raises(mask):
    m = tiny_causal_lm("gpt2")
    with pytest.raises(ValueError, match=r"attention_mask must hold only 0 \(padding\) and 1 \(real token\), or booleans"):
        pyattr.relevance(m, torch.randint(1, VOCAB, (1, 4)), attention_mask=torch.tensor(mask))


def test_bool_and_float_masks_accepted():
    m = tiny_causal_lm("gpt2")
    ids = torch.randint(1, VOCAB, (1, 5))
    ref = pyattr.relevance(m, ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1]]), target=3)
    for mask in (torch.tensor([[False, True, True, True, True]]), torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]])):
        r = pyattr.relevance(m, ids, attention_mask=mask, target=3)
        torch.testing.assert_close(r.relevance, ref.relevance, atol=0, rtol=0)
