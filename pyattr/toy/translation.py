"""The toy translation model: a tiny Marian encoder–decoder trained to translate a sentence
of words into "upper-case language", word for word, in reverse order.

The source is ``n`` distinct words of :data:`pyattr.toy.task.WORDS` (``n`` from
``LENGTHS``) and ``</s>``; the target is the same words upper-cased, last word first, then
``</s>``: ``sun cat red`` → ``RED CAT SUN``. Target step ``t`` (``t < n``) is aligned to
source word ``n − 1 − t``, a known alignment against which source relevance is checked
(the reversal keeps it off the diagonal, so a method that favours the same position fails).

``python -m pyattr.toy.translation [DIR]`` trains it deterministically on the CPU (one
thread, seed 0) and writes the model and its tokenizer to ``DIR`` (default: the copy
shipped in the package, about 0.5 MB); :func:`load` reads it offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Tuple

import torch

from pyattr.toy.fit import fit, one_thread, train_main, word_tokenizer
from pyattr.toy.task import WORDS

#: Where the shipped model lives.
SHIPPED = Path(__file__).resolve().parent / "translation"
PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
#: Source sentence lengths (words) the model is trained on.
LENGTHS = tuple(range(3, 9))
SEED, STEPS, BATCH, LR = 0, 1500, 64, 2e-3


def vocabulary() -> dict:
    """Token → id: ``<pad>`` 0 (also the decoder start), ``</s>`` 1, ``<unk>`` 2, the source
    words, then their upper-case translations."""
    return {w: i for i, w in enumerate((PAD, EOS, UNK, *WORDS, *(w.upper() for w in WORDS)))}


def translate(words: List[str]) -> List[str]:
    """The reference translation: upper-cased, in reverse order."""
    return [w.upper() for w in reversed(words)]


def tokenizer():
    """A ``PreTrainedTokenizerFast``: whitespace-split words, ``</s>`` appended (source and
    ``text_target``), ``<pad>`` on the right."""
    return word_tokenizer(vocabulary(), f"$A {EOS}", EOS, "right", eos_token=EOS, pad_token=PAD, unk_token=UNK)


def config():
    """A 2 + 2-layer Marian (hidden 64, 4 heads, GELU feed-forward of width 128, sinusoidal
    positions, post-norm), one vocabulary for both sides, tied embeddings."""
    from transformers import MarianConfig

    vocab = vocabulary()
    return MarianConfig(vocab_size=len(vocab), decoder_vocab_size=len(vocab), d_model=64, encoder_layers=2,
                        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, max_position_embeddings=32, pad_token_id=vocab[PAD],
                        eos_token_id=vocab[EOS], decoder_start_token_id=vocab[PAD], forced_eos_token_id=None,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True,
                        share_encoder_decoder_embeddings=True, tie_word_embeddings=True)


def sentences(generator: torch.Generator, count: int) -> List[List[str]]:
    """``count`` source sentences of distinct words, lengths drawn from ``LENGTHS``."""
    lengths = torch.tensor(LENGTHS)[torch.randint(len(LENGTHS), (count,), generator=generator)]
    return [[WORDS[i] for i in torch.randperm(len(WORDS), generator=generator)[:n].tolist()]
            for n in lengths.tolist()]


def batch(generator: torch.Generator, count: int) -> Tuple[dict, List[List[str]]]:
    """A tokenized batch (``input_ids``, ``attention_mask``, ``labels`` with -100 at
    padding) and its source sentences."""
    tok = tokenizer()
    src = sentences(generator, count)
    enc = tok([" ".join(s) for s in src], text_target=[" ".join(translate(s)) for s in src], padding=True,
              return_tensors="pt")
    labels = enc["labels"].masked_fill(enc["labels"] == tok.pad_token_id, -100)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}, src


def train(steps: int = STEPS, seed: int = SEED, log=None):
    """The trained ``MarianMTModel`` (eval mode, float32): AdamW, one-cycle learning rate,
    cross-entropy on the target tokens."""
    from transformers import MarianMTModel

    with one_thread():  # the same sums in the same order on every machine
        torch.manual_seed(seed)
        model = MarianMTModel(config()).float()
        g = torch.Generator().manual_seed(seed)
        return fit(model, lambda: model(**batch(g, BATCH)[0]).loss, steps, LR, log, betas=(0.9, 0.98))


@torch.no_grad()
def accuracy(model, count: int = 256, seed: int = 1) -> float:
    """Exact-match rate of greedy translations of ``count`` fresh sentences."""
    tok = tokenizer()
    src = sentences(torch.Generator().manual_seed(seed), count)
    enc = tok([" ".join(s) for s in src], padding=True, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=max(LENGTHS) + 2, do_sample=False)
    got = tok.batch_decode(out, skip_special_tokens=True)
    return sum(g.split() == translate(s) for g, s in zip(got, src)) / count


def load(path=None):
    """(model, tokenizer) of the toy translation model, model in eval mode, float32.
    ``path``: a directory written by ``python -m pyattr.toy.translation`` (default: the
    shipped one)."""
    from transformers import AutoTokenizer, MarianMTModel

    from pyattr._quiet import quiet_transformers

    path = Path(path) if path is not None else SHIPPED
    with quiet_transformers():
        model = MarianMTModel.from_pretrained(path).eval()
        tok = AutoTokenizer.from_pretrained(path)
    return model, tok


def main(argv=None) -> int:
    a, model, meta = train_main(argv, "python -m pyattr.toy.translation", __doc__, SHIPPED, STEPS, SEED, train,
                                accuracy, "exact-match accuracy")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer().save_pretrained(out)
    (out / "training.json").write_text(json.dumps({**meta, "batch": BATCH, "lr": LR}, indent=1) + "\n")
    print(f"saved to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
