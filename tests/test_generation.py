"""generation_relevance: every row equals the per-step loop of pyattr.relevance on every
mapped decoder, span linearity, exact zeros, padding, inseq parity, targets, errors."""

import pytest
import torch

import pyattr
import pyattr.toy as toy
from models import ENCODERS, TEXT_ARCHS, pad_rows, tiny_causal_lm
from pyattr.methods.generation import loop_reference
from pyattr.targets import LogitDiff, LogProb

pytestmark = pytest.mark.usefixtures("one_thread")

DECODERS = [a for a in TEXT_ARCHS if a not in ENCODERS]
ROWS = [[5, 9, 14, 3, 22], [11, 4, 30]]
CONT = torch.tensor([[7, 8, 9, 10, 11], [12, 13, 14, 15, 16]])


def _close(a, b):
    torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", DECODERS)
def test_rows_equal_the_per_step_loop_on_every_decoder(arch):
    model = tiny_causal_lm(arch)
    ids, mask = pad_rows(ROWS, "left")
    enc = {"input_ids": ids, "attention_mask": mask}
    r = pyattr.generation_relevance(model, enc, continuation=CONT, batch_targets=2)
    ref = loop_reference(model, r.sequences, r.attention_mask, r.prompt_width)
    _close(r.token_relevance, ref["token_relevance"])
    _close(r.target, ref["target"])
    assert r.token_relevance.shape == (2, 5, 10) and r.batch_targets == 2
    assert bool(r.step_mask.all()) and r.conservation_delta.shape == (2, 5)


def test_generated_tokens_are_greedy_and_rows_match_the_loop():
    model, tok, _ = toy.load()
    enc = dict(tok(["sun cat red tree sun", "dog owl fish bee ant dog owl"], padding=True, return_tensors="pt"))
    r = pyattr.generation_relevance(model, enc, max_new_tokens=6, batch_targets=4)
    assert tok.batch_decode(r.generated) == ["cat red tree sun cat red", "fish bee ant dog owl fish"]
    ref = loop_reference(model, r.sequences, r.attention_mask, r.prompt_width)
    _close(r.token_relevance, ref["token_relevance"])
    _close(r.target, ref["target"])
    # the default rules conserve: the relevance of each step sums to its logit
    assert float(r.conservation_delta.abs().max()) < 1e-4
    # an induction step's top source is the earlier occurrence of the copied word
    assert r.top_sources(0, 1, row=0)[0][:2] == (4, tok.convert_tokens_to_ids("cat"))


def test_zeros_at_and_after_the_own_column_and_at_padding():
    model = tiny_causal_lm("llama")
    ids, mask = pad_rows(ROWS, "left")
    r = pyattr.generation_relevance(model, {"input_ids": ids, "attention_mask": mask}, continuation=CONT,
                                    batch_targets=3)
    for t in range(5):
        own = r.prompt_width + t
        assert torch.equal(r.token_relevance[:, t, own:], torch.zeros(2, 10 - own))
        assert bool((r.token_relevance[:, t, :own] != 0).all(dim=-1).logical_or(mask[:, :own].eq(0).any(-1)).all())
    assert torch.equal(r.token_relevance[1, :, :2], torch.zeros(5, 2))  # row 1's two pad columns


def test_a_padded_row_equals_the_row_alone():
    model = tiny_causal_lm("qwen2")
    ids, mask = pad_rows(ROWS, "left")
    both = pyattr.generation_relevance(model, {"input_ids": ids, "attention_mask": mask}, continuation=CONT)
    alone = pyattr.generation_relevance(model, torch.tensor([ROWS[1]]), continuation=CONT[1:])
    _close(both.token_relevance[1, :, 2:], alone.token_relevance[0])
    _close(both.target[1], alone.target[0])


def test_a_span_equals_its_summed_logits_explained_as_one_target():
    model = tiny_causal_lm("llama")
    ids = torch.tensor([ROWS[0]])
    cont = CONT[:1]
    r = pyattr.generation_relevance(model, ids, continuation=cont)
    seq = torch.cat([ids, cont], 1)
    w = ids.shape[1]

    def summed(out):  # logits of steps 1, 2, 3 at the positions before them
        return sum(out.logits[:, w + t - 1, cont[0, t]] for t in (1, 2, 3))

    one = pyattr.relevance(model, seq[:, : w + 3], target=summed)
    _close(r.span(1, 4)[:, : w + 3], one.token_relevance)
    assert torch.equal(r.span(1, 4)[:, w + 3:], torch.zeros(1, seq.shape[1] - w - 3))


@pytest.mark.parametrize("kind", ["logprob", "prob"])
def test_probability_targets_and_contrast_equal_relevance_of_that_target(kind):
    model = tiny_causal_lm("gemma")
    ids = torch.tensor([ROWS[0]])
    for contrast in (None, 40):
        r = pyattr.generation_relevance(model, ids, continuation=CONT[:1], target=kind, contrast=contrast)
        assert r.target_kind == kind and r.contrast is (contrast is not None)
        seq = torch.cat([ids, CONT[:1]], 1)
        for t in range(5):
            want = pyattr.relevance(model, seq[:, : 5 + t],
                                    target=LogProb(CONT[:1, t], contrast=contrast, prob=kind == "prob"))
            _close(r.token_relevance[0, t, : 5 + t], want.token_relevance[0])
            _close(r.target[0, t:t + 1], want.target)


def test_logit_contrast_per_step_is_a_logit_difference():
    model = tiny_causal_lm("mistral")
    ids = torch.tensor([ROWS[0]])
    alt = torch.tensor([[20, 21, 22, 23, 24]])
    r = pyattr.generation_relevance(model, ids, continuation=CONT[:1], contrast=alt)
    seq = torch.cat([ids, CONT[:1]], 1)
    want = pyattr.relevance(model, seq[:, :7], target=LogitDiff(CONT[:1, 2], alt[:, 2]))
    _close(r.token_relevance[0, 2, :7], want.token_relevance[0])


def test_steps_after_the_end_of_sequence_do_not_exist():
    model = tiny_causal_lm("llama")
    ids = torch.tensor([ROWS[0], [1, 2, 3, 4, 6]])
    free = pyattr.generation_relevance(model, ids, max_new_tokens=4, generate_kwargs={"eos_token_id": -1})
    eos = int(free.generated[0, 1])  # make row 0's second token the end of sequence
    r = pyattr.generation_relevance(model, ids, max_new_tokens=4, generate_kwargs={"eos_token_id": eos})
    stop = r.step_mask[0].tolist()
    assert stop[:2] == [True, True] and not any(stop[2:])
    assert bool(torch.isnan(r.target[0, 2:]).all()) and torch.equal(r.token_relevance[0, 2:], torch.zeros_like(
        r.token_relevance[0, 2:]))
    _close(r.token_relevance[0, :2], free.token_relevance[0, :2])


def test_continuations_of_different_lengths():
    model = tiny_causal_lm("llama")
    r = pyattr.generation_relevance(model, torch.tensor([ROWS[0], [1, 2, 3, 4, 6]]), continuation=[[7, 8, 9], [10]])
    assert r.step_mask.tolist() == [[True, True, True], [True, False, False]]
    assert bool(torch.isnan(r.target[1, 1:]).all())


def test_inseq_input_x_gradient_equals_gradient_x_input():
    inseq = pytest.importorskip("inseq")  # in the dev extra; skipped only outside it
    model, tok, _ = toy.load()
    im = inseq.load_model(model, "input_x_gradient", tokenizer=tok)
    out = im.attribute("sun cat red tree sun", generated_texts="sun cat red tree sun cat red tree sun",
                       attributed_fn="logit", show_progress=False)
    theirs = out.sequence_attributions[0].target_attributions.sum(-1).T  # (steps, seq)
    enc = dict(tok("sun cat red tree sun", return_tensors="pt"))
    cont = tok("cat red tree sun", add_special_tokens=False, return_tensors="pt")["input_ids"]
    ours = pyattr.generation_relevance(model, enc, continuation=cont, rules=pyattr.RelevanceRules())
    visible = ~torch.isnan(theirs)
    torch.testing.assert_close(ours.token_relevance[0][visible].double(), theirs[visible].double(),
                               rtol=1e-5, atol=1e-6)


def test_word_and_segment_aggregation():
    model, tok, _ = toy.load()
    r = pyattr.generation_relevance(model, dict(tok("sun cat red tree sun", return_tensors="pt")), max_new_tokens=3)
    words, agg = r.aggregate("word", tok)
    assert words == ["<s>", "sun", "cat", "red", "tree", "sun", "cat", "red", "tree"]
    torch.testing.assert_close(agg, r.token_relevance[0])  # one token per word here
    labels, seg = r.aggregate([(0, 1), (1, 5), (5, 9)])
    assert labels == ["0:1", "1:5", "5:9"]
    torch.testing.assert_close(seg.sum(-1), r.token_relevance[0].sum(-1))


@pytest.mark.parametrize("kw, err, message", [
    ({}, ValueError, "pass exactly one of max_new_tokens= (generate, then explain) and continuation="),
    ({"max_new_tokens": 2, "continuation": CONT}, ValueError, "pass exactly one of"),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be an int ≥ 1, got 0"),
    ({"continuation": CONT, "target": "loss"}, ValueError, "target must be one of ('logit', 'logprob', 'prob'), got 'loss'"),
    ({"continuation": CONT, "batch_targets": 0}, ValueError, "batch_targets must be an int ≥ 1, got 0"),
    ({"continuation": CONT, "contrast": torch.tensor([[1, 2]])}, ValueError,
     "contrast of shape (1, 2): expected (batch, generated) = (2, 5)"),
    ({"continuation": CONT, "contrast": 1.5}, TypeError, "contrast must be a token id"),
    ({"continuation": CONT[:1]}, ValueError, "continuation has 1 rows, the prompt 2"),
    ({"continuation": torch.zeros(2, 0, dtype=torch.long)}, ValueError, "nothing to explain"),
    ({"continuation": CONT.float()}, TypeError, "continuation must be token ids"),
    ({"continuation": CONT, "generate_kwargs": {"top_k": 3}}, ValueError, "generate_kwargs: a continuation is given"),
    ({"max_new_tokens": 2, "generate_kwargs": {"num_beams": 2}}, ValueError, "one sequence per prompt"),
])
def test_bad_arguments(kw, err, message):
    model = tiny_causal_lm("llama")
    ids, mask = pad_rows(ROWS, "left")
    with pytest.raises(err) as e:
        pyattr.generation_relevance(model, {"input_ids": ids, "attention_mask": mask}, **kw)
    assert message in str(e.value)


def test_right_padding_and_encoders_are_refused():
    model = tiny_causal_lm("llama")
    ids, mask = pad_rows(ROWS, "right")
    with pytest.raises(ValueError, match="the prompt must be left-padded"):
        pyattr.generation_relevance(model, {"input_ids": ids, "attention_mask": mask}, continuation=CONT)
    with pytest.raises(ValueError, match="is not a causal language model"):
        pyattr.generation_relevance(tiny_causal_lm("bert"), ids, continuation=CONT)
    r = pyattr.generation_relevance(model, torch.tensor([ROWS[0]]), continuation=CONT[:1])
    with pytest.raises(IndexError, match=r"step must be an int in \[-5, 5\), got 5"):
        r.top_sources(5)
    with pytest.raises(ValueError, match="span: need 0 <= start < end <= 5"):
        r.span(3, 3)
    with pytest.raises(ValueError, match="aggregate\\('word'\\) needs tokenizer="):
        r.aggregate("word")


def test_review_cases():
    """From the adversarial review: end of sequence from generate_kwargs, the mask argument
    winning as in relevance, a whole-sequence tensor baseline, ids outside the vocabulary,
    non-finite outputs, the result helpers' edges."""
    import numpy as np

    model = tiny_causal_lm("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    free = pyattr.generation_relevance(model, ids, max_new_tokens=4)
    eos = int(free.generated[0, 1])
    r = pyattr.generation_relevance(model, torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]), max_new_tokens=4,
                                    generate_kwargs={"eos_token_id": eos, "pad_token_id": 0})
    assert r.step_mask[0].tolist()[:2] == [True, True] and not any(r.step_mask[0].tolist()[2:])
    assert r.top_sources(3, row=0) == []
    # the attention_mask argument wins over the mapping's, as in pyattr.relevance
    enc = {"input_ids": torch.tensor([[0, 0, 7, 8]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    masked = torch.tensor([[0, 0, 1, 1]])
    a = pyattr.generation_relevance(model, enc, continuation=CONT[:1, :2], attention_mask=masked)
    b = pyattr.generation_relevance(model, {"input_ids": enc["input_ids"], "attention_mask": masked},
                                    continuation=CONT[:1, :2])
    assert torch.equal(a.token_relevance, b.token_relevance)
    # a tensor baseline covers prompt and continuation; each step sees its prefix of it
    base = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(0))
    r = pyattr.generation_relevance(model, ids, continuation=CONT[:1], baseline=base, batch_targets=2)
    seq = torch.cat([ids, CONT[:1]], 1)
    want = pyattr.relevance(model, seq[:, :6], target=pyattr.targets.Logit(CONT[:1, 2]), baseline=base[:, :6])
    _close(r.token_relevance[0, 2, :6], want.token_relevance[0])
    with pytest.raises(ValueError, match=r"a tensor baseline covers the whole sequence \(prompt and generated "
                                         r"tokens, 9 positions\)"):
        pyattr.generation_relevance(model, ids, continuation=CONT[:1], baseline=torch.zeros(1, 7, 32))
    with pytest.raises(ValueError, match=r"inputs: token ids must be in \[0, 96\) \(the input embedding's rows, config.vocab_size\), got \[600\]"):
        pyattr.generation_relevance(model, torch.tensor([[5, 600]]), max_new_tokens=2)
    assert free.top_sources(np.int64(1)) == free.top_sources(1)
    with pytest.raises(IndexError, match=r"row must be an int in \[0, 1\), got 5"):
        free.top_sources(0, row=5)
    with pytest.raises(ValueError, match="non-empty list of"):
        free.aggregate([])


def test_non_finite_outputs_are_an_error_not_nan_relevance():
    model = tiny_causal_lm("llama", dtype=torch.float64)
    enc = {"input_ids": torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]]),
           "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])}
    with torch.no_grad():
        finite = bool(torch.isfinite(model(**enc).logits).all())
    if finite:  # transformers' float64 eager attention gives NaN on left padding in 5.x; if fixed, results are finite
        r = pyattr.generation_relevance(model, enc, continuation=CONT[:, :2])
        assert bool(torch.isfinite(r.target).all())
    else:
        with pytest.raises(ValueError, match="the model's output is not finite"):
            pyattr.generation_relevance(model, enc, continuation=CONT[:, :2])


def test_chunk_sizes_double_while_the_time_per_step_falls():
    from pyattr.methods.generation import ChunkSizes

    c = ChunkSizes(64, fixed=False)
    sizes = []
    for per_step in (0.20, 0.15, 0.18):  # 8 → 16 faster → 32 slower: back to 16
        k = c.next()
        sizes.append(k)
        c.measured(k, per_step * k)
    assert sizes == [8, 16, 32] and c.next() == 16 and c.largest == 32
    c.measured(16, 0.16 * 16)  # 16 measured again: still the fastest
    assert c.next() == 16
    c.measured(5, 100.0)  # a short last chunk changes nothing
    assert c.next() == 16 and c.per_step == {8: 0.20, 16: 0.16, 32: 0.18}
    capped = ChunkSizes(12, fixed=False)
    capped.measured(8, 1.0)
    assert capped.next() == 12  # doubling stops at the memory cap
    fixed = ChunkSizes(3, fixed=True)
    fixed.measured(3, 1.0)
    assert fixed.next() == 3 and fixed.per_step == {}


def test_chunk_sizes_follow_the_measured_memory_model():
    from pyattr.methods.generation import ChunkSizes

    GB = 1 << 30
    # a long context: the estimate allows one step; each chunk's peak is a + b·k with
    # a = 0.7 GB, b = 0.6 GB, and the batching may add 2 GB over one step
    c = ChunkSizes(1, fixed=False, budget=2 * GB)
    sizes = []
    for _ in range(4):
        k = c.next()
        sizes.append(k)
        c.measured(k, 10.0 + 4.0 * k, int(0.7 * GB + 0.6 * GB * k))
    # 1 step: b ≤ 1.3 GB (a ≥ 0), so 2 fit; 2 steps: the slope 0.6 GB, so 1 + 2 / 0.6 = 4
    assert sizes == [1, 2, 4, 4]
    assert abs(c.step_bytes() - 0.6 * GB) < 1e-3 * GB and c.cap == 4
    # the estimate was too generous: the first chunk's peak shrinks the cap below it
    d = ChunkSizes(16, fixed=False, budget=1 * GB)
    d.measured(8, 8.0, 4 * GB)  # b ≤ 0.5 GB: 1 + 1 / 0.5 = 3 steps
    assert d.cap == 3 and d.next() == 3
    d.measured(3, 4.5, int(1.5 * GB))  # slope (4 − 1.5) / 5 = 0.5 GB: still 3
    assert d.next() == 3
    # no growth measured (noise): the per-step upper bound of the largest size
    e = ChunkSizes(8, fixed=False, budget=2 * GB)
    e.measured(8, 8.0, GB)
    e.measured(16, 12.0, GB // 2)
    assert e.step_bytes() == (GB // 2) / 16
    # without a peak (a platform with no observable peak) the estimate stays the cap
    f = ChunkSizes(12, fixed=False)
    f.measured(8, 1.0, None)
    assert f.cap == 12 and f.next() == 12


def test_peak_memory_observes_a_block_and_not_the_one_before():
    import resource

    from pyattr.methods._core.peak_memory import PeakMemory

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    meter = PeakMemory("cpu")
    assert meter.observable
    meter.start()
    x = torch.ones(64 << 20)  # 256 MiB of float32, every page written
    first = meter.stop()
    assert first >= 250 << 20
    del x  # an allocation this large is returned to the system when freed
    meter.start()
    y = torch.ones(16 << 20)  # 64 MiB
    second = meter.stop()
    del y
    assert 60 << 20 <= second < 200 << 20  # the first block's 256 MiB is not in it
    # the process's own peak, which other tools read, is left as it was
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >= before
    assert meter.stop() is None  # no block started
    nothing = PeakMemory("meta")
    nothing.start()
    assert not nothing.observable and nothing.stop() is None


def test_a_model_left_in_training_mode_generates_as_in_eval_mode():
    """generate runs in eval mode, as the passes that explain its steps: GPT-2's dropout does
    not sample the continuation; the model's training flags come back."""
    import transformers as T

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64,
                                           resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5))
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    model.eval()
    want = pyattr.generation_relevance(model, ids, max_new_tokens=6)
    model.train()
    model.transformer.h[1].eval()  # a mixed state, restored as it was
    for seed in (1, 2):
        torch.manual_seed(seed)
        got = pyattr.generation_relevance(model, ids, max_new_tokens=6)
        assert torch.equal(got.generated, want.generated)
        torch.testing.assert_close(got.token_relevance, want.token_relevance, rtol=1e-6, atol=1e-6)
    assert model.training and not model.transformer.h[1].training and model.transformer.h[0].training
