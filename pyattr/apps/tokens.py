"""Text to token ids for the applications that explain a next token (``pyattr explain``,
``pyattr generate``, ``pyattr patch``, ``pyattr run``): one reading of a prompt and of a
target token, so that the commands explain the same token for the same text."""

from __future__ import annotations

from typing import List, Union


def prompt_ids(tokenizer, text: str) -> List[int]:
    """The ids of a prompt whose next token is explained or generated: the tokenizer's ids
    without the end-of-text markers it appends (a BERT-style tokenizer's ``[SEP]``, an
    ``</s>``). After such a marker the model would predict what follows the end of a text,
    not the prompt's next word. One id is always kept."""
    ids = list(tokenizer(text)["input_ids"])
    end = {getattr(tokenizer, "sep_token_id", None), getattr(tokenizer, "eos_token_id", None)} - {None}
    while len(ids) > 1 and ids[-1] in end:
        ids.pop()
    return ids


def target_token_id(tokenizer, target: Union[str, int], vocab_size: int) -> Union[int, str]:
    """A target token → its id, or the reason it cannot be one (a string).

    A string is the vocabulary entry of that spelling, else the one token the tokenizer
    encodes it to (so ``"5"`` is the token "5", never id 5); a string the tokenizer maps to
    its unknown token is not in the vocabulary (explaining ``<unk>`` instead would be a
    silent wrong answer). An int (a JSON or Parquet number) is an id. The id must be one of
    the model's ``vocab_size`` output logits."""
    if isinstance(target, int):
        tid = target
    else:
        vocab = tokenizer.get_vocab()
        if target in vocab:
            tid = int(vocab[target])
        else:
            try:
                ids = tokenizer.encode(target, add_special_tokens=False)
            except Exception as e:  # noqa: BLE001 - a tokenizer that refuses this text
                return f"target token {target!r}: the tokenizer refused it ({type(e).__name__})"
            if len(ids) != 1:
                return f"target token {target!r} is not in the vocabulary (it splits into {len(ids)} tokens, not one)"
            tid = int(ids[0])
            unk = getattr(tokenizer, "unk_token_id", None)
            if unk is not None and tid == unk:
                return (f"target token {target!r} is not in the vocabulary (the tokenizer maps it to its unknown "
                        f"token {getattr(tokenizer, 'unk_token', None)!r})")
    if not 0 <= tid < vocab_size:
        return f"target token {target!r} has id {tid}, outside the model's {vocab_size} output logits"
    return tid
