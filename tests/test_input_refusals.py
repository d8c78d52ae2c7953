"""Inputs that gave a silent wrong number, a NaN or a raw torch error, now refused (or warned)
by name: a negative or out-of-range contrast token, non-finite grad_outputs, meta tensors,
padded ids without their mask, token type ids past the table, token inputs with media on a
vision-language model, a NaN gradient under a finite target; and a shape-only forward under
a user's scope, which has nothing to compare and runs."""

import warnings

import pytest
import torch

import pyattr
import pyattr.toy as toy
from pyattr.targets import LogProb

from models import pad_rows, tiny_causal_lm

TEXT = "sun cat red tree sun cat"


@pytest.fixture(scope="module")
def lm():
    model, tok, _ = toy.load()
    return model, tok


@pytest.mark.parametrize("contrast", [-1, 50, 10**6])
def test_a_contrast_token_outside_the_vocabulary_is_refused(lm, contrast):
    """-1 had indexed from the end: the last token's log-probability, silently."""
    model, tok = lm
    msg = f"contrast: token ids must be in \\[0, 50\\), got \\[{contrast}\\]"
    with pytest.raises(ValueError, match=msg):
        pyattr.relevance(model, TEXT, tokenizer=tok, target=LogProb(6, contrast=contrast))
    # generation checks them before it explains, named as the contrast for every target kind
    for kind in ("logprob", "logit"):
        with pytest.raises(ValueError, match=f"contrast: token ids must be in \\[0, 50\\) \\(the input embedding's rows, "
                                             f"config.vocab_size\\), got \\[{contrast}\\]"):
            pyattr.generation_relevance(model, "sun cat red tree sun", tokenizer=tok, max_new_tokens=2, target=kind,
                                        contrast=contrast)
    # k targets read together (targets/stacked.py) name it too
    with pytest.raises(ValueError, match=msg):
        pyattr.relevance(model, TEXT, tokenizer=tok, target=[LogProb(6, contrast=contrast), LogProb(7, contrast=contrast)])


def test_a_contrast_word_is_refused_with_the_way_to_its_id(lm):
    model, tok = lm
    with pytest.raises(TypeError, match="contrast must be a token id or token ids .*got str 'dog'; a word's id is "
                                        "tokenizer.convert_tokens_to_ids\\(word\\)"):
        pyattr.generation_relevance(model, "sun cat red tree sun", tokenizer=tok, max_new_tokens=2, contrast="dog")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_grad_outputs_are_refused(lm, bad):
    model, tok = lm
    for fn, kw in ((pyattr.relevance, {}), (pyattr.integrated_gradients, {"n_steps": 2})):
        with pytest.raises(ValueError, match="grad_outputs holds NaN or inf; the relevance would be NaN"):
            fn(model, TEXT, tokenizer=tok, grad_outputs=torch.tensor([bad]), **kw)


def test_grad_outputs_of_the_target_ids_layout_are_refused_naming_both(lm):
    model, tok = lm
    with pytest.raises(ValueError, match="grad_outputs of shape \\(1, 2\\) must match the target's shape \\(2, 1\\) "
                                         "\\(k targets, batch\\): the result's target layout, the transpose of "
                                         "\\(batch, k\\) target ids"):
        pyattr.relevance(model, TEXT, tokenizer=tok, target=torch.tensor([[3, 4]]), grad_outputs=torch.ones(1, 2))


def test_meta_models_and_tensors_are_refused_by_name(lm):
    model, tok = lm
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config)
    with pytest.raises(ValueError, match="model: relevance runs the model, and LlamaForCausalLM's parameters are on the meta device"):
        pyattr.relevance(meta, TEXT, tokenizer=tok)
    with pytest.raises(ValueError, match="model: integrated_gradients runs the model, and LlamaForCausalLM's parameters are on the "
                                         "meta device"):
        pyattr.integrated_gradients(meta, TEXT, tokenizer=tok, n_steps=2)
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    with pytest.raises(ValueError, match="inputs: a tensor on the meta device"):
        pyattr.relevance(model, ids.to("meta"))
    with pytest.raises(ValueError, match="baseline: a tensor on the meta device"):
        pyattr.relevance(model, ids, baseline=torch.zeros(1, ids.shape[1], 64, device="meta"))
    # a scope on it too: loading may put other modules in place of those that carry the rules
    # (an nnsight LanguageModel's dispatch does), which then run without them
    with pytest.raises(ValueError, match="model: use_relevance_rules runs the model, and LlamaForCausalLM's "
                                         "parameters are on the meta device .* dispatch=True or .dispatch\\(\\)"):
        with pyattr.use_relevance_rules(meta):
            pass
    # a shape-only forward (fake tensors) under a user's scope has no values to check, and runs
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), pyattr.use_relevance_rules(model):
        fake = model(input_ids=torch.ones(1, 5, dtype=torch.long)).logits
    assert fake.shape == (1, 5, 50)
    # the first real forward of a later scope is still checked and right
    plain = pyattr.relevance(model, ids)
    with pyattr.use_relevance_rules(model):
        x = model.get_input_embeddings()(ids).detach().requires_grad_()
        model(inputs_embeds=x).logits[0, -1].max().backward()
    torch.testing.assert_close((x.grad * x).sum(-1), plain.token_relevance, rtol=1e-5, atol=1e-6)


def test_padded_ids_without_their_mask_warn(lm):
    """The left-padded row read its pads as text (13.43 instead of 13.22 alone), silently."""
    model, tok = lm
    enc = tok([TEXT, "dog owl fish dog"], padding=True, return_tensors="pt")
    assert model.config.pad_token_id == 0 and enc["input_ids"][1, 0] == 0
    with pytest.warns(UserWarning, match="relevance: inputs hold the pad token \\(id 0\\) at a row's start or end and "
                                         "no attention_mask was given"):
        pyattr.relevance(model, enc["input_ids"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pyattr.relevance(model, enc)  # with its mask: silent, and right
        pyattr.relevance(model, enc["input_ids"][:1])  # no pad in it
        eos = model.config.eos_token_id
        try:  # a pad token that is also one of several EOS tokens legitimately ends a row
            model.config.eos_token_id = [7, 0]
            pyattr.relevance(model, enc["input_ids"])
        finally:
            model.config.eos_token_id = eos


def test_token_type_ids_past_the_table_are_refused():
    from models import minilm

    tok, model = minilm()
    enc = tok("a man plays", return_tensors="pt")
    enc["token_type_ids"] = torch.full_like(enc["input_ids"], 5)
    with pytest.raises(ValueError, match="token_type_ids: must be in \\[0, 2\\) \\(config.type_vocab_size\\), got \\[5\\]"):
        pyattr.relevance(model, enc, target=pyattr.targets.Cosine(torch.ones(384)))


def test_token_inputs_with_an_image_are_refused_on_a_vision_language_model():
    """Gemma 3's text stack is mapped; the image features are written over the placeholder
    tokens after the word embedding, so they read 0 relevance and the rest did not add up."""
    import transformers as T

    v = 96
    text = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, vocab_size=v,
                num_hidden_layers=1, head_dim=8, query_pre_attn_scalar=8, sliding_window=64)
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=8)
    cfg = T.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=v - 1,
                         boi_token_index=v - 3, eoi_token_index=v - 2)
    torch.manual_seed(0)
    m = T.Gemma3ForConditionalGeneration(cfg).eval()
    ids = torch.tensor([[2, 5, 6, v - 3] + [v - 1] * 4 + [v - 2, 7, 8]])
    pix = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="inputs: relevance\\(\\) reads relevance at the token embeddings, and "
                                         "Gemma3ForConditionalGeneration writes its pixel_values features over the "
                                         "placeholder tokens"):
        pyattr.relevance(m, {"input_ids": ids, "pixel_values": pix}, target=3)
    assert torch.isfinite(pyattr.relevance(m, ids[:, :3], target=3).token_relevance).all()  # text alone runs


def test_a_nan_gradient_under_a_finite_target_is_refused():
    """ModernBERT's eager local attention in float64 hides a pad position's whole window:
    the classifier's logit is finite, the padded row's gradient NaN."""
    import transformers as T

    cfg = T.ModernBertConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_hidden_layers=2,
                             vocab_size=96, local_attention=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                             cls_token_id=1, sep_token_id=2, mask_token_id=3, initializer_range=0.2,
                             classifier_pooling="cls", num_labels=3)
    torch.manual_seed(0)
    m = T.ModernBertForSequenceClassification(cfg)
    m.set_attn_implementation("eager")
    m = m.double().eval()
    ids, mask = pad_rows([[1, 5, 6, 7, 8, 9, 10, 11, 2], [1, 5, 6, 7, 2]], "right", 0)
    with pytest.raises(ValueError, match="the model's backward gives a gradient that is not finite \\(NaN or inf\\) at "
                                         "row 1, though the explained value is finite"):
        pyattr.relevance(m, {"input_ids": ids, "attention_mask": mask}, target=1)


def test_the_zero_baseline_hint_names_rms_norms_only_where_they_are():
    from pyattr.methods._core.convergence import baseline_hint

    llama, bert = tiny_causal_lm("llama"), tiny_causal_lm("bert")
    assert baseline_hint(llama, "zeros") == baseline_hint(llama, None) != ""
    assert baseline_hint(llama, "pad") == "" and baseline_hint(bert, "zeros") == ""


def test_the_scope_takes_the_methods_rule_shorthands(lm):
    model, tok = lm
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    want = pyattr.relevance(model, ids, rules="attnlrp")
    with pyattr.use_relevance_rules(model, "attnlrp"):
        x = model.get_input_embeddings()(ids).detach().requires_grad_()
        model(inputs_embeds=x).logits[0, -1, int(want.target_ids[0])].backward()
    torch.testing.assert_close((x.grad * x).sum(-1), want.token_relevance, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="rules: expected a RelevanceRules or one of 'all', 'attnlrp', 'ln', 'none', "
                                         "got 'lrp'"):
        with pyattr.use_relevance_rules(model, "lrp"):
            pass
