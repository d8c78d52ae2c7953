"""generation_relevance reads back what generate and the model decided (DESIGN §10):
the steps each row actually got, whatever stopped it (stop strings, custom criteria, a
passed GenerationConfig, an eos in the config that generation does not use), and the
length a batch-dependent forward runs at (chunked = the per-step loop). Each oracle is
independent of pyattr: transformers' own generate and decode, the per-step loop."""

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

import pyattr
import pyattr.toy as toy
from bpe import byte_bpe_tokenizer, tiny_gpt2
from models import tiny_causal_lm, tiny_rope_scaled
from pyattr.methods.generation import loop_reference

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["sun cat red tree sun", "dog owl fish bee ant dog owl"]


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def _toy():
    model, tok, _ = toy.load()
    return model, tok, dict(tok(PROMPTS, padding=True, return_tensors="pt"))


def _first_stop(gen_rows, stops):
    """Oracle: per row, the steps up to and including the first one ``stops(row, t)``."""
    out = []
    for i, row in enumerate(gen_rows):
        hit = next((t for t in range(len(row)) if stops(i, t)), None)
        out.append([hit is None or t <= hit for t in range(len(row))])
    return out


def _check_against_free(r, free, want_mask):
    """Existing steps equal the unstopped run's (same greedy tokens, same relevance);
    steps that do not exist are zero with NaN targets."""
    assert r.step_mask.tolist() == want_mask
    keep = r.step_mask
    g = keep.shape[1]
    assert torch.equal(r.generated[keep], free.generated[:, :g][keep])
    _close(r.token_relevance[keep], free.token_relevance[:, :g][keep])
    _close(r.target[keep], free.target[:, :g][keep])
    assert bool(torch.isnan(r.target[~keep]).all()) and bool((r.token_relevance[~keep] == 0).all())


def test_a_custom_stopping_criterion_ends_its_row():
    model, tok, enc = _toy()
    fish = tok.convert_tokens_to_ids("fish")

    class StopAtFish(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == fish

    free = pyattr.generation_relevance(model, enc, max_new_tokens=6)
    r = pyattr.generation_relevance(model, enc, max_new_tokens=6,
                                    generate_kwargs={"stopping_criteria": StoppingCriteriaList([StopAtFish()])})
    want = _first_stop(free.generated.tolist(), lambda i, t: free.generated[i, t] == fish)
    assert want == [[True] * 6, [True] + [False] * 5]  # row 1 generates fish first
    _check_against_free(r, free, want)


def test_a_passed_generation_config_with_its_own_eos():
    model, tok, enc = _toy()
    red = tok.convert_tokens_to_ids("red")
    gc = GenerationConfig(eos_token_id=red, pad_token_id=0, do_sample=False)
    free = pyattr.generation_relevance(model, enc, max_new_tokens=6)
    r = pyattr.generation_relevance(model, enc, max_new_tokens=6, generate_kwargs={"generation_config": gc})
    with torch.no_grad():  # transformers' own generate pads the finished row
        out = model.generate(**enc, generation_config=gc, max_new_tokens=6)[:, enc["input_ids"].shape[1]:]
    assert torch.equal(r.generated, out)
    want = _first_stop(free.generated.tolist(), lambda i, t: free.generated[i, t] == red)
    assert want[0] == [True, True, False, False, False, False]
    _check_against_free(r, free, want)


def test_an_eos_in_the_model_config_that_generation_does_not_use():
    """transformers stops at the generation config's eos; one only in model.config is
    not a stop, and the steps after it are real generated tokens."""
    model, tok, enc = _toy()
    free = pyattr.generation_relevance(model, enc, max_new_tokens=6)
    model.config.eos_token_id = tok.convert_tokens_to_ids("red")
    assert model.generation_config.eos_token_id is None
    r = pyattr.generation_relevance(model, enc, max_new_tokens=6)
    assert bool(r.step_mask.all())
    _check_against_free(r, free, [[True] * 6] * 2)


def test_stop_strings_on_a_byte_level_bpe_tokenizer():
    tok = byte_bpe_tokenizer()
    tok.padding_side = "left"
    model = tiny_gpt2(tok, seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)  # a varied greedy continuation
    enc = dict(tok(["the cat is on the", "dog owl"], return_tensors="pt", padding=True))
    free = pyattr.generation_relevance(model, enc, max_new_tokens=8, generate_kwargs={"eos_token_id": None})
    text = [tok.decode(g) for g in free.generated]
    # a stop string row 1 generates at a middle step and row 0 never does
    stop = next(w for t in range(2, 7) if (w := tok.decode(free.generated[1, t:t + 1]).strip()).isalnum()
                and w not in text[0] and w not in tok.decode(free.generated[1, :t]))
    r = pyattr.generation_relevance(model, enc, max_new_tokens=8,
                                    generate_kwargs={"stop_strings": [stop], "tokenizer": tok})
    prompt = [enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist() for i in range(2)]
    want = _first_stop(free.generated.tolist(), lambda i, t: tok.decode(
        prompt[i] + free.generated[i, : t + 1].tolist()).endswith(stop))
    assert want[0] == [True] * 8 and want[1].count(True) < 8, want  # row 1 stops, row 0 does not
    _check_against_free(r, free, want)


def test_unobservable_generation_is_refused():
    model, tok, enc = _toy()
    real = type(model).generate

    def generate_without_criteria(self, input_ids=None, **kw):  # a custom generate loop
        return torch.cat([input_ids, input_ids[:, -2:]], 1)

    type(model).generate = generate_without_criteria
    try:
        with pytest.raises(ValueError, match=r"generate produced 2 steps but its stopping criteria were consulted "
                                             r"0 times"):
            pyattr.generation_relevance(model, enc, max_new_tokens=2)
    finally:
        type(model).generate = real
    assert "_get_stopping_criteria" not in vars(model)  # the record leaves the model as it was


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_chunks_on_a_length_dependent_forward_equal_the_per_step_loop(kind):
    """Phi-3 LongRoPE and Llama dynamic NTK change every position's value once the input
    passes 8 positions: the chunk cut after a later step would explain other values."""
    model = tiny_rope_scaled(kind, seed=0)
    ids = torch.tensor([[5, 9, 14, 3, 22, 7]])
    cont = torch.tensor([[8, 9, 10, 11, 12, 13]])  # crosses 8 positions at step 2
    r = pyattr.generation_relevance(model, ids, continuation=cont, batch_targets=6)
    assert r.batch_targets == 1
    ref = loop_reference(model, r.sequences, r.attention_mask, r.prompt_width)
    _close(r.token_relevance, ref["token_relevance"])
    _close(r.target, ref["target"])


def test_a_prompt_longer_than_the_model_reads_is_refused():
    model = tiny_causal_lm("gpt2")
    limit = model.config.n_positions
    ids = torch.randint(3, 90, (1, limit + 1), generator=torch.Generator().manual_seed(0))
    msg = rf"inputs: row 0 is {limit + 1} positions long; GPT2LMHeadModel reads at most {limit}"
    with pytest.raises(ValueError, match=msg):
        pyattr.generation_relevance(model, ids, max_new_tokens=1)
    with pytest.raises(ValueError, match=msg):
        pyattr.relevance(model, ids)
    short = ids[:, : limit - 2]
    # the model reads every token but the last one generated: limit - 2 + 4 - 1 = limit + 1
    with pytest.raises(ValueError, match=rf"row 0 is {limit + 1} positions long \(prompt \+ max_new_tokens=4 - 1: "
                                         rf"the last generated token is not read\); GPT2LMHeadModel reads at most {limit}"):
        pyattr.generation_relevance(model, short, max_new_tokens=4)
    with pytest.raises(ValueError, match=rf"row 0 is {limit + 1} positions long \(prompt \+ continuation - 1"):
        pyattr.generation_relevance(model, short, continuation=torch.tensor([[5, 6, 7, 8]]))
    ok = pyattr.generation_relevance(model, short, max_new_tokens=3)  # reads exactly the limit
    assert ok.sequences.shape[1] == limit + 1
    with torch.no_grad():  # its last target is transformers' own logit at the last position it has
        logits = model(ok.sequences[:, :limit]).logits[0, -1]
    assert float(ok.target[0, -1]) == pytest.approx(float(logits[ok.sequences[0, limit]]), rel=1e-5)


def test_the_generation_config_in_force_is_read():
    """The model's saved generation config decides the pad (so sequences are what
    generate produced) and is checked for beams."""
    model, tok, enc = _toy()
    red = tok.convert_tokens_to_ids("red")
    model.generation_config.eos_token_id = red
    model.generation_config.pad_token_id = 3
    r = pyattr.generation_relevance(model, enc, max_new_tokens=6)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)[:, enc["input_ids"].shape[1]:]
    assert torch.equal(r.generated, out) and int(out[0, -1]) == 3
    assert r.step_mask[0].tolist() == [True, True, False, False, False, False]
    model.generation_config.num_beams = 3
    with pytest.raises(ValueError, match=r"one sequence per prompt .* the generation in force has num_beams=3"):
        pyattr.generation_relevance(model, enc, max_new_tokens=2)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 3}, "generate_kwargs: max_new_tokens is given by max_new_tokens= of generation_relevance"),
    ({"max_length": 9}, "generate_kwargs: max_length is given by max_new_tokens= of generation_relevance"),
    ({"generation_config": GenerationConfig(max_new_tokens=3)},
     "the GenerationConfig says max_new_tokens=3, the argument max_new_tokens=6; give one length"),
    ({"prompt_lookup_num_tokens": 2}, "generate_kwargs: prompt_lookup_num_tokens (assisted / prompt-lookup"),
])
def test_generate_kwargs_that_would_change_what_is_explained_are_refused(kwargs, message):
    model, tok, enc = _toy()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pyattr.generation_relevance(model, enc, max_new_tokens=6, generate_kwargs=kwargs)


def test_assisted_decoding_is_refused_and_the_model_left_as_it_was():
    model, tok, enc = _toy()
    with pytest.raises(ValueError, match=r"generate_kwargs: assistant_model \(assisted / prompt-lookup decoding"):
        pyattr.generation_relevance(model, enc, max_new_tokens=4, generate_kwargs={"assistant_model": model})
    assert "_get_stopping_criteria" not in vars(model)


def test_a_compiled_model_generates_through_its_module():
    model, tok, enc = _toy()
    free = pyattr.generation_relevance(model, enc, max_new_tokens=3)
    r = pyattr.generation_relevance(torch.compile(model, backend="eager"), enc, max_new_tokens=3)
    assert torch.equal(r.generated, free.generated)
    _close(r.token_relevance, free.token_relevance)
