"""A byte-level BPE tokenizer (GPT-2's scheme: ``Ġ`` marks a leading space, ``Ċ`` a line
break) trained here on a small word list, and a tiny random GPT-2 over its vocabulary:
the tokenizer family whose joint tokenization differs from tokenizing pieces apart."""

from __future__ import annotations

import torch

WORDS = "sun cat red tree dog owl fish bee ant ship sea sky the a is on and user assistant".split()


def byte_bpe_tokenizer(punctuation_with_line_breaks: bool = False):
    """A GPT-2-style fast tokenizer (``<|endoftext|>`` bos/eos/pad) trained on :data:`WORDS`
    in sentences, lines and chat turns; deterministic (no randomness in BPE training).
    ``punctuation_with_line_breaks``: a pre-tokenizer that keeps a full stop and the line
    breaks after it in one token, as Llama 3's vocabulary has ``'.ĊĊ'``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if punctuation_with_line_breaks:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"[.]\n+| ?[a-zA-Z]+|\s+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    corpus += ["\n".join(WORDS), "user: the cat\nassistant: the dog", "the ship\nthe sea",
               "the cat.\n\nthe dog.\nthe owl.\n\n"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(corpus * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token=None)


def tiny_gpt2(tok, seed: int = 0, positions: int = 64):
    """A random 2-layer GPT-2 over ``tok``'s vocabulary (float32, eval mode)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=positions, n_embd=32, n_layer=2, n_head=4,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return GPT2LMHeadModel(cfg).eval()


def save_bpe_gpt2(path, eos_appended: bool = False, seed: int = 0, positions: int = 64):
    """A model directory for the command line: :func:`tiny_gpt2` and its byte-level BPE
    tokenizer; ``eos_appended``: the tokenizer appends ``<|endoftext|>`` to every text
    (as tokenizers with ``add_eos_token`` do)."""
    from tokenizers.processors import TemplateProcessing

    tok = byte_bpe_tokenizer()
    if eos_appended:
        eos = tok.eos_token_id
        tok._tokenizer.post_processor = TemplateProcessing(single="$A <|endoftext|>", pair="$A $B <|endoftext|>",
                                                           special_tokens=[("<|endoftext|>", eos)])
    model = tiny_gpt2(tok, seed=seed, positions=positions)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


#: Llama 3's chat template, reduced to what the tests use (the header and end-of-turn
#: markers, the BOS written into the text, the generation prompt)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def chat_tokenizer():
    """A Llama-3-style fast tokenizer: the byte-level BPE of :func:`byte_bpe_tokenizer` with
    ``<|begin_of_text|>`` (BOS, which the tokenizer prepends to every text, as Llama 3's does),
    the header and end-of-turn markers, and a chat template that writes the BOS into its text."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    base = byte_bpe_tokenizer()
    tk = base._tokenizer
    tk.add_special_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    bos = tk.token_to_id("<|begin_of_text|>")
    tk.post_processor = TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                           special_tokens=[("<|begin_of_text|>", bos)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                  pad_token="<|endoftext|>", unk_token=None)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_chat_llama(tok, seed: int = 0):
    """A random 2-layer Llama over ``tok``'s vocabulary (float64, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      initializer_range=0.2)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()
