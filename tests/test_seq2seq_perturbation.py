"""Perturbation curves on encoder–decoder models: the source tokens perturbed in the order of
their relevance, the decoder's inputs kept; against a loop over the model written here with
a hook at the encoder's entry, and the padded row against the row alone."""

import pytest
import torch

import pyattr
from models import tiny_seq2seq
from test_seq2seq import ENTRIES, _ids

pytestmark = pytest.mark.usefixtures("one_thread")


def _loop(model, arch, src, dec, token, rel, steps, perturbation, mask=None, pad_id=None):
    """Each row's target (the last decoder position's logit of ``token``) with its
    round(j/steps · n) most relevant real source tokens zeroed at the encoder's entry or
    replaced by ``pad_id``, one forward per level."""
    out = torch.empty(src.shape[0], steps + 1, dtype=torch.float64)
    for b in range(src.shape[0]):
        real = torch.ones(src.shape[1], dtype=torch.bool) if mask is None else mask[b].bool()
        n = int(real.sum())
        order = [i for i in sorted(range(src.shape[1]), key=lambda i: (-float(rel[b, i]), i)) if real[i]]
        for j in range(steps + 1):
            k = int(torch.floor(torch.tensor(j * n / steps + 0.5, dtype=torch.float64)))
            hit = torch.zeros(src.shape[1], dtype=torch.bool)
            hit[order[:k]] = True
            ids = src[b:b + 1].clone()
            hooks = []
            if perturbation == "pad":
                ids[0, hit] = pad_id
            else:
                def pre(mod, args, hit=hit):
                    return (args[0].masked_fill(hit[None, :, None], 0.0), *args[1:])
                hooks.append(model.get_submodule(ENTRIES[arch][0]).register_forward_pre_hook(pre))
            try:
                with torch.no_grad():
                    kw = {} if mask is None else {"attention_mask": mask[b:b + 1]}
                    logits = model(input_ids=ids, decoder_input_ids=dec[b:b + 1], use_cache=False, **kw).logits
            finally:
                for h in hooks:
                    h.remove()
            out[b, j] = logits[0, -1, token].double()
    return out


@pytest.mark.parametrize("perturbation", ["zero_embedding", "pad"])
@pytest.mark.parametrize("arch", ["t5", "bart", "marian", "mbart", "m2m_100"])
def test_curve_equals_the_loop_over_the_model(arch, perturbation):
    model = tiny_seq2seq(arch)
    src, dec = _ids(arch, seed=21, src=7, tgt=4)
    r = pyattr.relevance(model, src, target=9, decoder_input_ids=dec)
    c = pyattr.evaluate.perturbation_curve(model, src, r, target=9, decoder_input_ids=dec, steps=5,
                                           perturbation=perturbation, batch_size=4)
    want = _loop(model, arch, src, dec, 9, r.source_relevance, 5, perturbation, pad_id=model.config.pad_token_id)
    assert torch.allclose(c.values, want, rtol=1e-10, atol=1e-10)
    assert torch.allclose(c.values[:, 0], r.target, rtol=1e-10, atol=1e-12)   # level 0: the unperturbed value
    assert torch.allclose(c.auc, torch.trapezoid(want, c.fractions, dim=-1), rtol=1e-12, atol=1e-12)


def test_right_padded_source_row_equals_the_row_alone():
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=22, src=7, tgt=3)
    mask = torch.ones_like(src)
    mask[1, 4:] = 0
    rel = torch.randn(src.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    c = pyattr.evaluate.perturbation_curve(model, src, rel, target=5, decoder_input_ids=dec, attention_mask=mask,
                                           steps=4)
    alone = pyattr.evaluate.perturbation_curve(model, src[1:, :4], rel[1:, :4], target=5, decoder_input_ids=dec[1:],
                                               steps=4)
    assert torch.allclose(c.values[1], alone.values[0], rtol=1e-9, atol=1e-10)
    assert torch.allclose(c.values, _loop(model, "bart", src, dec, 5, rel, 4, "zero_embedding", mask=mask),
                          rtol=1e-10, atol=1e-10)


def test_abpc_of_relevance_beats_reversed_relevance_on_the_translation_toy():
    """On the toy whose alignment is known, relevance's own order removes the value faster
    than its reverse: ABPC of relevance > ABPC of −relevance on every row."""
    from pyattr.toy import translation as TR

    model, tok = TR.load()
    src = ["sun cat red dog", "red dog cat", "cat sun red dog"]
    prefix = ["DOG RED", "CAT DOG", "DOG RED CAT"]
    target = ["CAT", "RED", "SUN"]
    r = pyattr.relevance(model, src, target=[tok.convert_tokens_to_ids(t) for t in target], decoder_input_ids=prefix,
                         tokenizer=tok)
    kw = dict(decoder_input_ids=prefix, tokenizer=tok, steps=8)
    tid = [tok.convert_tokens_to_ids(t) for t in target]
    good = pyattr.evaluate.abpc(model, src, r, target=tid, **kw)
    bad = pyattr.evaluate.abpc(model, src, -r.source_relevance, target=tid, **kw)
    assert (good > bad).all() and (good > 0).all()


def test_encoder_decoder_curves_refuse_by_name():
    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=23, src=5, tgt=3)
    one = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=r"relevance of shape \(2, 4\) does not match the source: expected \(2, 5\)"):
        pyattr.evaluate.perturbation_curve(model, src, one[:, :4], target=3, decoder_input_ids=dec)
    with pytest.raises(TypeError, match="relevance: on an encoder–decoder model, a result with source_relevance"):
        pyattr.evaluate.perturbation_curve(model, src, type("R", (), {"token_relevance": one})(), target=3,
                                           decoder_input_ids=dec)
    with pytest.raises(ValueError, match="decoder_input_ids / decoder_attention_mask: LlamaForCausalLM is not an "
                                         "encoder–decoder model"):
        from models import tiny_causal_lm

        pyattr.evaluate.perturbation_curve(tiny_causal_lm("llama"), src, one, decoder_input_ids=dec)
    with pytest.raises(ValueError, match="perturbation_curve\\(\\): .* does not make its decoder's inputs"):
        pyattr.evaluate.perturbation_curve(tiny_seq2seq("t5"), src, one, target=3)


def test_a_callable_target_giving_one_value_for_all_levels_is_refused():
    """Every level of a row is a copy in one batched forward: a callable returning one
    scalar would give every level the first copy's value (a flat curve), so it is refused,
    on an encoder–decoder as on a decoder."""
    from models import tiny_causal_lm

    model = tiny_seq2seq("bart")
    src, dec = _ids("bart", seed=24, batch=1, src=6, tgt=3)
    rel = pyattr.relevance(model, src, decoder_input_ids=dec)
    with pytest.raises(ValueError, match="target: the callable returned one value for a forward of several rows"):
        pyattr.evaluate.perturbation_curve(model, src, rel, lambda out: out.logits[0, -1, 3], decoder_input_ids=dec,
                                           steps=3)
    per_row = pyattr.evaluate.perturbation_curve(model, src, rel, lambda out: out.logits[:, -1, 3],
                                                 decoder_input_ids=dec, steps=3)
    assert not torch.allclose(per_row.values[0, 1:], per_row.values[0, :1].expand(3))
    lm = tiny_causal_lm("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with pytest.raises(ValueError, match="target: the callable returned one value for a forward of several rows"):
        pyattr.evaluate.perturbation_curve(lm, ids, pyattr.relevance(lm, ids), lambda out: out.logits[0, -1, 3],
                                           steps=3)


@pytest.mark.parametrize("arch", ["bart", "t5", "prophetnet"])
def test_mean_embedding_replaces_the_encoders_token_embedding_by_its_vocabulary_mean(arch):
    """The encoder's own token embedding (ProphetNet's is ``word_embeddings``, as its
    get_input_embeddings() says)."""
    model = tiny_seq2seq(arch)
    src, dec = _ids(arch, seed=25, batch=1, src=6, tgt=3)
    rel = torch.arange(6, dtype=torch.float64)[None]                 # the last token most relevant
    c = pyattr.evaluate.perturbation_curve(model, src, rel, target=9, decoder_input_ids=dec, steps=6,
                                           perturbation="mean_embedding")
    emb = model.get_encoder().get_input_embeddings()
    with torch.no_grad():
        mean = emb(torch.arange(emb.num_embeddings)[None])[0].mean(0)
        for j in (0, 2, 6):
            hit = torch.zeros(6, dtype=torch.bool)
            hit[6 - j:] = True                                            # the j most relevant: the last j
            calls = []

            def hook(mod, args, out, hit=hit):
                if calls:
                    return None                                            # the decoder's call of a shared table
                calls.append(1)
                return torch.where(hit[None, :, None], mean, out)

            h = emb.register_forward_hook(hook)
            try:
                want = model(input_ids=src, decoder_input_ids=dec, use_cache=False).logits[0, -1, 9].double()
            finally:
                h.remove()
            assert torch.allclose(c.values[0, j], want, rtol=1e-10, atol=1e-10), j
