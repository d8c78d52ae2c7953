import pytest
import torch

import pyattr
from models import VOCAB, minilm, tiny_causal_lm
from pyattr.rules import half_rule, ln_rule




def test_result_shapes_and_default_target_is_top1(llama):
    ids = torch.randint(0, VOCAB, (2, 8))
    r = pyattr.relevance(llama, ids)
    assert r.token_relevance.shape == (2, 8) and r.relevance.shape == (2, 8, 32)
    logits = llama(ids).logits[:, -1]
    assert torch.equal(r.target_ids, logits.argmax(-1))
    torch.testing.assert_close(r.target.float(), logits.max(-1).values)  # float32: the head ran at one position
    torch.testing.assert_close(r.token_relevance, r.relevance.sum(-1))
    assert r.backend == ("cpp" if pyattr.available_backends()["cpp"].available else "torch")


def test_target_forms_agree(llama):
    ids = torch.randint(0, VOCAB, (2, 8))
    a = pyattr.relevance(llama, ids, target=7)
    b = pyattr.relevance(llama, ids, target=[7, 7])
    c = pyattr.relevance(llama, ids, target=torch.tensor([7, 7]))
    d = pyattr.relevance(llama, ids, target=lambda out: out.logits[:, -1, 7])
    # The targets are float64 holding float32 values: a token id (int, list, tensor) runs
    # the float32 head at the last position alone, the callable reads the head's output at
    # every position, and the two matmuls may sum the K = hidden_size products w_k h_k of
    # logit 7 in another order. Each sum is within K·u·Σ|w_k h_k| of the exact one (u =
    # eps/2, float32), so they differ by at most K·eps·Σ|w_k h_k|. float64's default
    # tolerance (1e-7 + 1e-7·|target|) is under two float32 ulps of a logit near 1: the forms
    # differed by 1.8e-7 for seed 0's ids, and 48 of 200 seeds failed it (the largest
    # difference seen is 3% of this bound). The relevance (one backward) is the same in all four.
    h = llama(ids, output_hidden_states=True).hidden_states[-1][:, -1].detach().double()
    dot = (h * llama.lm_head.weight[7].detach().double()).abs().sum(-1)
    bound = llama.config.hidden_size * torch.finfo(torch.float32).eps * dot
    for r in (b, c, d):
        torch.testing.assert_close(r.relevance, a.relevance)
        assert ((r.target - a.target).abs() <= bound).all(), (r.target - a.target, bound)


def test_per_row_targets_are_independent(llama):
    ids = torch.randint(0, VOCAB, (2, 8))
    both = pyattr.relevance(llama, ids, target=[3, 9])
    row1 = pyattr.relevance(llama, ids[1:], target=9)
    torch.testing.assert_close(both.relevance[1:], row1.relevance, atol=1e-6, rtol=1e-5)


def test_attention_mask_left_padding_uses_last_real_token(llama):
    ids = torch.randint(1, VOCAB, (1, 6))
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    r = pyattr.relevance(llama, {"input_ids": padded, "attention_mask": mask}, target=4)
    assert r.token_relevance.shape == (1, 8)
    assert (r.conservation_delta.abs() <= 1e-4 * r.target.abs()).all()
    right = torch.cat([ids, torch.zeros(1, 2, dtype=torch.long)], 1)
    rmask = torch.cat([torch.ones(1, 6, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long)], 1)
    r2 = pyattr.relevance(llama, right, target=4, attention_mask=rmask)
    plain = pyattr.relevance(llama, ids, target=4)
    torch.testing.assert_close(r2.target, plain.target, atol=1e-5, rtol=1e-5)


def test_model_state_restored(llama):
    llama.train()
    flags = [p.requires_grad for p in llama.parameters()]
    pyattr.relevance(llama, torch.randint(0, VOCAB, (1, 4)))
    assert llama.training and [p.requires_grad for p in llama.parameters()] == flags
    llama.eval()


@pytest.mark.parametrize(
    "kwargs,exc,msg",
    [
        (dict(inputs=torch.randn(1, 4)), TypeError, "input_ids must be an integer tensor"),
        (dict(inputs=[1.5, 2.0]), TypeError, r"inputs must be token ids \(a LongTensor, or a list of ints or of rows "
         r"of ints\), a floating pixel_values tensor or a mapping, got list"),
        (dict(inputs={"ids": torch.ones(1, 3, dtype=torch.long)}), ValueError, "must contain 'input_ids'"),
        (dict(inputs=torch.ones(1, 0, dtype=torch.long)), ValueError, r"seq > 0"),
        (dict(inputs=torch.ones(1, 3, dtype=torch.long), target=VOCAB), ValueError, rf"token ids must be in \[0, {VOCAB}\)"),
        (dict(inputs=torch.ones(2, 3, dtype=torch.long), target=[1]), ValueError, r"one token id per batch row, shape \(2,\) or \(2, 1\), got shape \(1,\)"),
        (dict(inputs=torch.ones(1, 3, dtype=torch.long), target=lambda o: o.logits), ValueError, "must return a scalar tensor or one value per batch row"),
        (dict(inputs=torch.ones(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4)), ValueError, r"attention_mask of shape \(1, 4\) must match"),
        (dict(inputs=torch.ones(1, 3, dtype=torch.long), target=1.5), TypeError, "target must be None, a token id"),
    ],
)
def test_relevance_errors(llama, kwargs, exc, msg):
    inputs = kwargs.pop("inputs")
    with pytest.raises(exc, match=msg):
        pyattr.relevance(llama, inputs, **kwargs)


def test_minilm_pair_cosine_half_rule_split():
    tok, m = minilm()
    enc = tok(["a cat on a mat", "a dog on a rug"], padding=True, return_tensors="pt")
    mask = enc["attention_mask"]

    def cosine(out):
        h = out.last_hidden_state
        w = mask.to(h.dtype).unsqueeze(-1)
        p = (h * w).sum(1) / w.sum(1)
        return half_rule(ln_rule(p[0], p[0].norm()), ln_rule(p[1], p[1].norm())).sum()

    r = pyattr.relevance(m, dict(enc), target=cosine)
    with torch.no_grad():
        h = m(**enc).last_hidden_state
        w = mask.unsqueeze(-1).float()
        p = (h * w).sum(1) / w.sum(1)
        ref = torch.nn.functional.cosine_similarity(p[0], p[1], dim=0)
    torch.testing.assert_close(r.target.float(), ref, atol=1e-6, rtol=1e-5)
    assert r.relevance.shape[0] == 2
    # padded positions carry no relevance
    assert (r.token_relevance[mask == 0] == 0).all()
    torch.testing.assert_close(r.relevance.double().sum(), r.target - r.conservation_delta)


@pytest.mark.parametrize(
    "form",
    [
        lambda b: torch.tensor(5),
        lambda b: torch.tensor([5] * b),
        lambda b: torch.tensor([[5]] * b),
        lambda b: torch.tensor([5] * b, dtype=torch.int32),
        lambda b: __import__("numpy").int64(5),
        lambda b: __import__("numpy").int32(5),
        lambda b: __import__("numpy").array(5),
        lambda b: __import__("numpy").array([5] * b),
        lambda b: __import__("numpy").array([[5]] * b, dtype="uint8"),
        lambda b: [[5]] * b,
        lambda b: (5,) * b,
        lambda b: [__import__("numpy").int64(5)] * b,
    ],
    ids=["tensor0d", "tensor1d", "tensor_b1", "int32", "np_int64", "np_int32", "np_0d", "np_1d", "np_b1_uint8",
         "list_b1", "tuple", "list_np"],
)
def test_integer_like_target_forms_equal_int(llama, form):
    ids = torch.randint(0, VOCAB, (2, 6))
    ref = pyattr.relevance(llama, ids, target=5)
    r = pyattr.relevance(llama, ids, target=form(2))
    torch.testing.assert_close(r.relevance, ref.relevance, atol=0, rtol=0)
    assert torch.equal(r.target_ids, torch.tensor([5, 5]))


@pytest.mark.parametrize(
    "target,exc,msg",
    [
        (torch.tensor(5.0), TypeError, r"token ids must be an integer tensor, got dtype torch.float32"),
        (torch.tensor([True, False]), TypeError, r"token ids must be an integer tensor, got dtype torch.bool"),
        (torch.tensor([[5, 6], [7, 8], [1, 2]]), ValueError, r"one token id per batch row, shape \(2,\) or \(2, 1\), got shape \(3,\)"),
        (torch.tensor([5, 6, 7]), ValueError, r"got shape \(3,\)"),
        ([5.0, 6.0], TypeError, r"token ids must be integers"),
        ([True, False], TypeError, r"token ids must be integers"),
        ("5", TypeError, r"target must be None, a token id"),
        (True, TypeError, r"target must be None, a token id"),
    ],
)
def test_bad_target_forms(llama, target, exc, msg):
    with pytest.raises(exc, match=msg):
        pyattr.relevance(llama, torch.randint(0, VOCAB, (2, 6)), target=target)


def test_bad_numpy_target_forms(llama):
    import numpy as np

    with pytest.raises(TypeError, match=r"token ids must be an integer array, got dtype float64"):
        pyattr.relevance(llama, torch.randint(0, VOCAB, (2, 6)), target=np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match=r"target must be None, a token id"):
        pyattr.relevance(llama, torch.randint(0, VOCAB, (2, 6)), target=np.float64(3.0))


def test_callable_target_must_be_differentiable(llama):
    ids = torch.randint(0, VOCAB, (2, 6))
    with pytest.raises(TypeError, match=r"target: the callable returned a torch.int64 tensor"):
        pyattr.relevance(llama, ids, target=lambda o: o.logits[:, -1].argmax(-1))
    with pytest.raises(TypeError, match=r"target: the callable returned a torch.bool tensor"):
        pyattr.relevance(llama, ids, target=lambda o: o.logits[:, -1, 0] > 0)
    with pytest.raises(ValueError, match=r"target: the callable's value does not depend on the model output"):
        pyattr.relevance(llama, ids, target=lambda o: o.logits[:, -1, 0].detach())


@pytest.mark.parametrize("target", [2**63, -(2**63) - 1, [2**64, 1], "np_uint64"])
def test_target_ids_beyond_int64(llama, target):
    import numpy as np

    if target == "np_uint64":
        target = np.array([2**64 - 1, 3], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"target: token id -?\d+ is out of range for a token id"):
        pyattr.relevance(llama, torch.randint(0, VOCAB, (2, 6)), target=target)


def test_token_ids_past_the_embedding_are_named_not_an_index_error():
    """Reported: ids past the input embedding's rows failed inside the model with a bare
    `IndexError: index out of range in self`; every method now names them."""
    import pyattr.patching as P

    model = tiny_causal_lm("llama")
    ids = torch.tensor([[1, 2, VOCAB + 4]])
    # patching names which of its two inputs holds the ids (clean here)
    msg = rf"(inputs|clean): token ids must be in \[0, {VOCAB}\) \(the input embedding's rows, config.vocab_size\), got \[{VOCAB + 4}\]"
    for call in (lambda: pyattr.relevance(model, ids, target=1),
                 lambda: pyattr.layer_relevance(model, ids, "residual", target=1),
                 lambda: pyattr.integrated_gradients(model, ids, target=1, n_steps=2),
                 lambda: P.attribution_patching(model, ids, torch.tensor([[1, 2, 3]]), pyattr.targets.Logit(1)),
                 lambda: pyattr.relevance(model, torch.tensor([[-1, 2]]), target=1)):
        with pytest.raises(ValueError, match=msg.replace(str(VOCAB + 4), r"-?\d+")):
            call()


def test_results_print_short():
    """Reported: print() of a result dumped every tensor in full (about 1,400 lines for a
    2-layer model's layer relevance). Results now print shapes and dtypes."""
    model = tiny_causal_lm("llama")
    ids = torch.tensor([[1, 2, 3, 4]])
    res = pyattr.relevance(model, ids, target=1)
    text = repr(res)
    assert text.startswith("RelevanceResult(token_relevance=Tensor(1, 4) float32, relevance=Tensor(1, 4, ")
    assert "tensor([" not in text and len(text.splitlines()) == 1
    lr = pyattr.layer_relevance(model, ids, "residual", target=1)
    assert len(repr(lr).splitlines()) == 1 and "'model.layers.0': …" in repr(lr)
    assert repr(lr["model.layers.0"]).startswith("LayerRelevance(activation=Tensor(1, 4, ")
