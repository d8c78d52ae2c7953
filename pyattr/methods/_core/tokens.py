"""Text to token ids, one reading for the Python methods (text inputs, word targets) and the
command line's applications that explain a next token (``pyattr explain``,
``pyattr generate``, ``pyattr patch``, ``pyattr run``): one reading of a prompt and of a
target token, so that the commands explain the same token for the same text."""

from __future__ import annotations

import unicodedata
from typing import List, Optional, Tuple, Union


def _encode(tokenizer, text: str, markers: str = "observed"):
    """``(ids, appended, offsets)``: the ids the model sees for ``text``, per id whether
    the tokenizer added it (a special token covering no character of the text: a BOS it
    prepends, a ``[SEP]`` or an ``</s>`` it appends; a marker the user typed covers its
    characters), and the offsets (None for a tokenizer without them).

    A text that already holds the markers the tokenizer adds (a chat template's output
    begins with its BOS: Llama 3, Mistral, Gemma) is not given them twice: where the
    tokens the tokenizer adds at the start (or the end) are the very tokens the text itself
    begins (or ends) with, the added ones are left out (:func:`_without_repeated_markers`);
    and for a chat model (a tokenizer with a chat template) a text that holds any of its
    special tokens is markup read as it is, no marker added (a template that writes no
    BOS, as Zephyr's). Either way the ids are those of ``apply_chat_template(...,
    tokenize=True)``. ``markers="tokenizer"``
    keeps exactly what the tokenizer adds (what sentence-transformers, which calls the
    tokenizer on the text as it is, embeds)."""
    try:
        enc = tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, TypeError, ValueError, KeyError):
        enc, offsets = tokenizer(text), None
    ids = list(enc["input_ids"])
    special = enc.get("special_tokens_mask") if hasattr(enc, "get") else None
    if offsets is not None and special is not None:
        appended = [bool(sp) and e <= s for sp, (s, e) in zip(special, offsets)]
    else:
        appended = _added_without_offsets(tokenizer, text, ids)
    if markers == "tokenizer":
        return ids, appended, offsets
    if getattr(tokenizer, "chat_template", None) and _holds_special(tokenizer, ids, appended):
        # a chat model's text that holds its special tokens is markup written to be read as it
        # is (what apply_chat_template(..., tokenize=True) tokenizes: no marker added)
        keep = [not a for a in appended]
        return ([i for i, k in zip(ids, keep) if k], [False] * sum(keep),
                None if offsets is None else [o for o, k in zip(offsets, keep) if k])
    return _without_repeated_markers(ids, appended, offsets)


def _holds_special(tokenizer, ids, appended) -> bool:
    """Whether the text's own tokens (not the ones the tokenizer added) hold one of its
    special tokens (a BOS, an end-of-turn marker, a role header)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return any(i in special for i, a in zip(ids, appended) if not a)


def encoded_ids(tokenizer, text: str) -> List[int]:
    """The ids the model sees for ``text`` (:func:`_encode`: the markers the tokenizer adds,
    not twice where the text already holds them)."""
    return _encode(tokenizer, text)[0]


def _added_without_offsets(tokenizer, text: str, ids: List[int]) -> List[bool]:
    """Per id, whether the tokenizer added it, for a tokenizer without offsets: the ids
    around the text's own (``add_special_tokens=False``) when they are the text's ids with
    markers before and after; else the end-of-text ids are taken as added."""
    try:
        own = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    except Exception:  # noqa: BLE001 - a tokenizer without the switch
        own = None
    if own:
        for start in range(len(ids) - len(own) + 1):
            if ids[start:start + len(own)] == own:
                return [not start <= i < start + len(own) for i in range(len(ids))]
    end = {getattr(tokenizer, "sep_token_id", None), getattr(tokenizer, "eos_token_id", None)} - {None}
    return [i in end for i in ids]


def _without_repeated_markers(ids, appended, offsets):
    """The added markers at the start (and at the end) left out where the text's own tokens
    next to them are the same ids: the text already carries them."""
    n = len(ids)
    head = 0
    while head < n and appended[head]:
        head += 1
    if head and ids[head:2 * head] == ids[:head] and not any(appended[head:2 * head]):
        ids, appended = ids[head:], appended[head:]
        offsets = None if offsets is None else offsets[head:]
        n -= head
    tail = n
    while tail > 0 and appended[tail - 1]:
        tail -= 1
    k = n - tail
    if k and tail >= k and ids[tail - k:tail] == ids[tail:] and not any(appended[tail - k:tail]):
        ids, appended = ids[:tail], appended[:tail]
        offsets = None if offsets is None else offsets[:tail]
    return ids, appended, offsets


def _drop_appended_end(ids, appended, offsets):
    """Without the markers the tokenizer appended at the end (one id is always kept)."""
    n = len(ids)
    while n > 1 and appended[n - 1]:
        n -= 1
    return ids[:n], appended[:n], (None if offsets is None else offsets[:n])


def prompt_ids(tokenizer, text: str) -> List[int]:
    """The ids of a prompt whose next token is explained or generated: the tokenizer's ids
    without the end-of-text markers it appends (a BERT-style tokenizer's ``[SEP]``, an
    ``</s>``). After such a marker the model would predict what follows the end of a text,
    not the prompt's next word. A marker the user typed in the text stays: the tokenizer's
    offsets tell the two apart. One id is always kept."""
    return _drop_appended_end(*_encode(tokenizer, text))[0]


def target_token_id(tokenizer, target: Union[str, int], vocab_size: int, text: Optional[str] = None
                    ) -> Union[int, str]:
    """A target token → its id, or the reason it cannot be one (a string).

    A string target is the token that follows ``text`` when the tokenizer reads the joint
    text (:func:`continuation_ids`): on a byte-level BPE tokenizer the word after a prompt
    is ``'ĠParis'``, not the vocabulary's bare ``'Paris'`` that tokenizing the word apart
    gives. Without ``text`` (or when the joint text splits it into several tokens), a
    string is the vocabulary entry of that spelling, else the one token the tokenizer
    encodes it to (so ``"5"`` is the token "5", never id 5). A string the tokenizer maps
    to its unknown token is not in the vocabulary (explaining ``<unk>`` instead would be
    a silent wrong answer). An int (a JSON or Parquet number) is an id. The id must be one
    of the model's ``vocab_size`` output logits."""
    if isinstance(target, int):
        tid = target
    else:
        vocab = tokenizer.get_vocab()
        joint = None
        if text is not None and target.strip():
            try:
                joint = continuation_ids(tokenizer, text, target)[1]
            except Exception:  # noqa: BLE001 - no joint reading: the spelling alone decides below
                joint = None
        if joint is not None and len(joint) == 1:
            ids = joint
        elif target in vocab:
            ids = [int(vocab[target])]
        else:
            try:
                ids = tokenizer.encode(target, add_special_tokens=False)
            except Exception as e:  # noqa: BLE001 - a tokenizer that refuses this text
                return f"target token {target!r}: the tokenizer refused it ({type(e).__name__})"
            if joint is not None:
                ids = joint
            if len(ids) != 1:
                where = " after the text" if joint is not None else ""
                return (f"target token {target!r} is not in the vocabulary (it splits into {len(ids)} tokens{where}, "
                        "not one)")
        tid = int(ids[0])
        unk = getattr(tokenizer, "unk_token_id", None)
        if unk is not None and tid == unk and target != getattr(tokenizer, "unk_token", None):
            return (f"target token {target!r} is not in the vocabulary (the tokenizer maps it to its unknown "
                    f"token {getattr(tokenizer, 'unk_token', None)!r})")
    if not 0 <= tid < vocab_size:
        return f"target token {target!r} has id {tid}, outside the model's {vocab_size} output logits"
    return tid


def _separator(text: str, continuation: str) -> str:
    """What joins a text and the words that follow it: one space, except where either side
    has whitespace at the join, before closing or other punctuation (``.``, ``,``, ``)``),
    and between characters of scripts written without spaces (Chinese, Japanese: wide
    characters)."""
    if not text or not continuation or text[-1].isspace() or continuation[0].isspace():
        return ""
    first = continuation[0]
    if unicodedata.category(first) in ("Po", "Pe", "Pf", "Pd"):
        return ""
    if unicodedata.east_asian_width(first) in ("W", "F") or unicodedata.east_asian_width(text[-1]) in ("W", "F"):
        return ""
    return " "


def continuation_ids(tokenizer, text: str, continuation: str) -> Tuple[List[int], List[int]]:
    """The ids of a prompt and of a continuation that follows it, as the tokenizer reads
    the joint text: ``text`` then ``continuation``, one space between them unless either
    side already has whitespace at the join, the continuation starts with punctuation, or
    a side is a script written without spaces (:func:`_separator`). Tokenized apart, a byte-level BPE tokenizer
    (GPT-2, Llama 3, Qwen) reads the continuation's first word without its leading space
    (``'owl'`` for the joint text's ``'Ġowl'``), another token with another logit.

    The split is the tokenizer's own: its character offsets (a fast tokenizer) put each
    token on the side where it starts; without offsets, the joint ids must begin with the
    prompt's own ids. The end-of-text markers the tokenizer appends are dropped, as in
    :func:`prompt_ids`.

    Raises:
        ValueError: the continuation has no tokens, or a token spans the join (the
            tokenizer reads the end of the text and the start of the continuation as one
            token, so no split gives the prompt and the continuation).
    """
    sep = _separator(text, continuation)
    joint = text + sep + continuation
    boundary = len(text)
    ids, appended, offsets = _drop_appended_end(*_encode(tokenizer, joint))
    special = appended
    if offsets is not None:
        split = len(ids)
        for i, ((start, end), sp) in enumerate(zip(offsets, special)):
            if sp:
                continue
            if start >= boundary or (start < boundary and end > boundary and joint[start:boundary].isspace()):
                split = i
                break
            if end > boundary:
                raise ValueError(f"continuation: the tokenizer reads {joint[start:end]!r} across the end of the text "
                                 "and the start of the continuation as one token; start the continuation at a word")
    else:
        alone = prompt_ids(tokenizer, text)
        if ids[: len(alone)] != alone:
            raise ValueError("continuation: the joint text's tokens do not begin with the text's own tokens (the "
                             "tokenizer merges across the join); start the continuation at a word")
        split = len(alone)
    prompt, cont = ids[:split], ids[split:]
    if not cont:
        raise ValueError("continuation has no tokens")
    refuse_unknown(tokenizer, cont, continuation, "continuation")
    return prompt, cont


def refuse_unknown(tokenizer, ids, text: str, name: str) -> None:
    """A ValueError where the tokenizer read part of ``text`` (tokenized to ``ids``) as its
    unknown token: the log-probability explained would be that of ``<unk>``, not of the text (a
    text that spells the unknown token itself is taken)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    word = getattr(tokenizer, "unk_token", None)
    if unk is None or unk not in [int(i) for i in ids] or (word and word in text):
        return
    raise ValueError(f"{name}: the tokenizer reads part of {text!r} as its unknown token {word!r}, so the "
                     f"log-probability explained would be that of {word!r}, not of the text; use words in the "
                     "tokenizer's vocabulary, or pass token ids")


def check_token_count(name: str, n_tokens: int, model, tokenizer) -> None:
    """Raise ValueError when a text named ``name`` tokenizes to nothing but the tokenizer's
    markers, or to more tokens than the model's positions."""
    from pyattr.methods._core.inputs import max_positions

    specials = tokenizer.num_special_tokens_to_add() if hasattr(tokenizer, "num_special_tokens_to_add") else 0
    if n_tokens <= specials:
        raise ValueError(f"{name} has no tokens the model can read after tokenisation")
    limit = max_positions(model)
    if limit is not None and n_tokens > limit:
        raise ValueError(f"{name} is {n_tokens} tokens long; the model reads at most {limit}")


def prompt_and_continuation(tokenizer, texts: List[str], continuation) -> tuple:
    """``(inputs, continuation ids)`` of prompts and text continuations as the tokenizer
    reads each joint text (:func:`pyattr.methods._core.tokens.continuation_ids`): the prompts
    left-padded, one id list per row for the continuations."""
    from pyattr.methods._core.id_lists import _pad_rows

    conts = [continuation] * len(texts) if isinstance(continuation, str) else list(continuation)
    if len(conts) != len(texts):
        raise ValueError(f"continuation: {len(conts)} texts for {len(texts)} prompts (one per prompt)")
    prompts, ids = [], []
    for i, (text, cont) in enumerate(zip(texts, conts)):
        if not text.strip():
            raise ValueError(f"inputs: text {i} is empty")
        try:
            p, c = continuation_ids(tokenizer, text, cont)
        except ValueError as e:
            raise ValueError(f"continuation {cont!r}: {e}") from None
        prompts.append([int(t) for t in p])
        ids.append([int(t) for t in c])
    return _pad_rows(prompts, tokenizer, left=True), ids
