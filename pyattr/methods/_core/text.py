"""Text in, words out (DESIGN §11): strings and a tokenizer instead of token ids, a word as
the target, ``rules=`` shorthands, a model named by a hub id or a bundled name, and the
tokens of the explained inputs as strings on the result.

What the tokenizer decides is read back from it (observe, don't re-derive): the ids of a
text are the tokenizer's own, a word target is the first token of the word as the
tokenizer reads it after the text (:func:`pyattr.methods._core.tokens.continuation_ids`), and
each token's string is what the tokenizer's own decoding adds for it
(:func:`pyattr.methods._core.words._pieces`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import nn

from pyattr._module_state import kept_state
from pyattr._validation import refuse_meta
from pyattr.config import RelevanceRules, rules_from
from pyattr.methods._core.id_lists import _pad_rows, ids_from_lists
from pyattr.methods._core.stacks import refuse_encoder_decoder

#: ``rules=`` shorthands, as the command line's ``--rules`` reads them
def is_text(inputs) -> bool:
    """A string, or a non-empty list / tuple of strings."""
    return isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and len(inputs) > 0
                                       and all(isinstance(t, str) for t in inputs))


def _causal(model: nn.Module) -> bool:
    """Whether the model predicts a next token (a causal LM: transformers' ``can_generate``
    and an output embedding), so that a text is a prompt whose next token is explained."""
    can = getattr(model, "can_generate", None)
    try:
        gen = bool(can()) if callable(can) else False
    except Exception:  # noqa: BLE001 - a model whose can_generate fails cannot generate
        gen = False
    cfg = getattr(model, "config", None)
    return gen and not getattr(cfg, "is_encoder_decoder", False)


def encode(tokenizer, texts: Sequence[str], model: nn.Module, caller: str, *, left: Optional[bool] = None,
           name: str = "inputs") -> dict:
    """``{"input_ids", "attention_mask"}`` of ``texts``: the tokenizer's ids of each text;
    for a causal LM without the end-of-text markers the tokenizer appends (a prompt whose
    next token is explained, :func:`pyattr.methods._core.tokens.prompt_ids`). Rows of different
    lengths are padded on the tokenizer's ``padding_side`` (``left`` overrides it: a
    prompt to generate from is left-padded); the pad id is the tokenizer's, else its
    end-of-text id, else 0 (masked out either way). Errors name the argument ``name``."""
    from pyattr.methods._core.tokens import _encode

    if tokenizer is None:
        raise ValueError(f"{caller}(): inputs are text; pass tokenizer= (the model's tokenizer) to read them")
    causal = _causal(model)
    rows = []
    for i, text in enumerate(texts):
        if not text.strip():
            raise ValueError(f"{name}: text {i} is empty")
        if causal:
            from pyattr.methods._core.tokens import prompt_ids

            ids = prompt_ids(tokenizer, text)
        else:
            ids = _encode(tokenizer, text)[0]
        if not ids:
            raise ValueError(f"{name}: text {i} has no tokens after tokenisation")
        rows.append([int(t) for t in ids])
    _check_vocabulary(model, tokenizer, rows, name)
    return _pad_rows(rows, tokenizer, (getattr(tokenizer, "padding_side", "right") == "left") if left is None else left)


def _embedding_rows(model: nn.Module) -> Optional[int]:
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        emb = None
    rows = getattr(emb, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


def _check_vocabulary(model: nn.Module, tokenizer, rows: List[List[int]], name: str) -> None:
    """A text's ids must be rows of the model's input embedding: an id past them means the
    tokenizer is not the model's (read as ids, the text would name other tokens)."""
    n = _embedding_rows(model)
    top = max((max(r) for r in rows if r), default=-1)
    if n is not None and top >= n:
        raise ValueError(f"{name}: the tokenizer reads the text as ids up to {top}, but {type(model).__name__}'s input "
                         f"embedding has {n} rows (ids 0..{n - 1}); is tokenizer= this model's tokenizer?")


def _row_texts(tokenizer, ids: torch.Tensor, mask: Optional[torch.Tensor]) -> List[str]:
    """Each row's real tokens decoded (the text a word target continues, for id inputs),
    special tokens included: a word after ids that end with one (a chat template's
    ``<|end_header_id|>``) is read after it, as it is after the same text."""
    out = []
    for r in range(ids.shape[0]):
        row = ids[r] if mask is None else ids[r][mask[r].bool()]
        out.append(tokenizer.decode([int(t) for t in row], skip_special_tokens=False,
                                    clean_up_tokenization_spaces=False))
    return out


def _vocab_size(model: nn.Module) -> Optional[int]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return None


def word_target(model: nn.Module, tokenizer, word: str, texts: List[str], name: str = "target"):
    """A word → one token id per row: the first token of ``word`` as the tokenizer reads it
    after each row's text (a causal LM's next-token logit), or a class label of
    ``config.label2id`` (a classifier).

    Raises:
        ValueError: the word is several tokens after the text (explain each with
            :func:`pyattr.generation_relevance` and ``continuation=``), not in the
            vocabulary, or the model has neither a language-model head nor that label.
    """
    from pyattr.methods._core.tokens import target_token_id

    labels = getattr(getattr(model, "config", None), "label2id", None) or {}
    vocab = _vocab_size(model) if _causal(model) else None
    if vocab is None:
        # transformers names every config's labels LABEL_0, LABEL_1 by default: only a
        # checkpoint's own names are worth listing
        named = sorted(w for w in labels if not (w.startswith("LABEL_") and w[6:].isdigit()))
        have = f"; its labels are {named}" if named else ""
        raise ValueError(f"{name}={word!r}: a word names a next-token logit or a class label, but "
                         f"{type(model).__name__} has no language-model head{have}")
    if tokenizer is None:
        raise TypeError(f"{name} must be None, a token id, a list of ids, a word (with tokenizer=), a target object or "
                        f"a callable, got str {word!r} without a tokenizer")
    if not word:
        raise ValueError(f"{name}: the word is empty (''); a word target names a token, e.g. {name}='Paris'")
    ids = []
    for text in texts:
        tid = target_token_id(tokenizer, word, vocab, text=text)
        if isinstance(tid, str):
            if "splits into 0 tokens" in tid:  # whitespace the tokenizer drops (a byte-level one keeps '\n')
                raise ValueError(f"{name}: the tokenizer reads the word {word!r} as no token; a word target names a "
                                 f"token, e.g. {name}='Paris'")
            if "splits into" in tid:
                tid += ("; to explain each token of a continuation, use pyattr.generation_relevance(model, text, "
                        "continuation=..., tokenizer=tok)")
            raise ValueError(f"{name}: {tid}")
        ids.append(int(tid))
    return ids


def token_strings(tokenizer, ids: torch.Tensor, mask: Optional[torch.Tensor] = None) -> List[List[Optional[str]]]:
    """Per row, every column's token as a string: what the tokenizer's own decoding of the
    row adds for that token (``" Paris"``; a byte of a multi-byte character adds ``""``,
    the token that completes it the whole character); special and pad tokens by their
    vocabulary name (``"[CLS]"``, ``"<s>"``); None at padding (``mask`` 0)."""
    from pyattr.methods._core.words import _pieces

    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out = []
    ids2 = ids.reshape(-1, ids.shape[-1])
    for r in range(ids2.shape[0]):
        row = [int(t) for t in ids2[r]]
        real = [True] * len(row) if mask is None else [bool(m) for m in mask.reshape(-1, ids.shape[-1])[r]]
        strings: List[Optional[str]] = [None] * len(row)
        run: List[int] = []
        for c in range(len(row) + 1):
            if c < len(row) and real[c] and row[c] not in special and row[c] >= 0:
                run.append(c)
                continue
            for j, piece in zip(run, _pieces(tokenizer, [row[j] for j in run])):
                strings[j] = piece
            run = []
            if c < len(row):
                strings[c] = None if not real[c] or row[c] < 0 else (tokenizer.convert_ids_to_tokens([row[c]])[0] or "")
        out.append(strings)
    return out


@dataclass
class TextCall:
    """A call with its text read: the model, the token inputs and target the method
    takes, and the tokenizer whose strings the result's ``tokens`` hold."""

    model: nn.Module
    inputs: object
    target: object
    rules: Optional[RelevanceRules]
    tokenizer: object
    texts: Optional[List[str]] = None


def resolve(model, inputs, tokenizer, caller: str, *, target=None, rules=None, left: Optional[bool] = None,
            word_target_ok: bool = True, inputs_name: str = "inputs") -> TextCall:
    """Read a call's text: ``model`` a hub id / bundled name / directory (loaded with its
    tokenizer, :func:`pyattr.hub.load_pretrained`), ``inputs`` a string or list
    of strings (``tokenizer=`` needed), ``target`` a word or list of words (one per row),
    ``rules`` a shorthand. Everything else passes through unchanged."""
    named = None
    if isinstance(model, (str,)) or hasattr(model, "__fspath__"):
        from pyattr.hub import load_pretrained

        named = model
        loaded, model = load_pretrained(model, causal=None)  # the checkpoint's own class, its head included
        tokenizer = loaded if tokenizer is None else tokenizer
    if tokenizer is not None and not callable(tokenizer):
        raise TypeError(f"tokenizer must be a Hugging Face tokenizer (callable), got {type(tokenizer).__name__}")
    rules = rules_from(rules)
    texts = None
    inputs = ids_from_lists(inputs, tokenizer, left, inputs_name)
    if is_text(inputs):
        if tokenizer is None and named is not None:
            raise ValueError(f"{caller}(): inputs are text, but the model {str(named)!r} came without a tokenizer "
                             f"({type(model).__name__}); pass tokenizer=, or the inputs the model reads "
                             "(pixel_values for an image model)")
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        inputs = encode(tokenizer, texts, model, caller, left=left, name=inputs_name)
    elif isinstance(inputs, (list, tuple)) and inputs and any(isinstance(t, str) for t in inputs):
        raise TypeError(f"{inputs_name}: a list of texts must hold only strings")
    if word_target_ok and isinstance(target, (list, tuple)) and any(
            isinstance(t, (list, tuple)) and any(isinstance(w, str) for w in t) for t in target):
        raise TypeError(f"target: words in nested lists ({list(target)!r}) are not read; give one word per row, or "
                        "k targets per row as token ids (LongTensor[batch, k])")
    if word_target_ok and isinstance(target, (list, tuple)) and any(isinstance(t, str) for t in target) \
            and not all(isinstance(t, str) for t in target):
        raise TypeError(f"target: a list mixes words and other targets ({list(target)!r}); give one word per row "
                        "or one token id per row, not both")
    if word_target_ok and (isinstance(target, str) or (isinstance(target, (list, tuple)) and target
                                                       and all(isinstance(t, str) for t in target))):
        target = _word_targets(model, tokenizer, target, inputs, texts)
    return TextCall(model, inputs, target, rules, tokenizer, texts)


def _word_targets(model, tokenizer, target, inputs, texts):
    """A word or one word per row → a class id (a classifier's label) or one token id per row."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return target  # a target-side word: read with text_target= (pyattr.methods.seq2seq)
    words = [target] if isinstance(target, str) else list(target)
    labels = getattr(getattr(model, "config", None), "label2id", None) or {}
    if not _causal(model) and all(w in labels for w in words):
        ids = [int(labels[w]) for w in words]
        rows = _batch(inputs)
        if not isinstance(target, str) and rows is not None and len(ids) != rows:
            raise ValueError(f"target: {len(ids)} labels for {rows} input rows (one label per row)")
        return ids[0] if isinstance(target, str) else ids
    if not _causal(model):  # no next token to name: the error says what the model has
        word_target(model, tokenizer, next(w for w in words if w not in labels), [])
    if texts is None:
        ids, mask = _ids_and_mask(inputs)
        if ids is None:
            raise ValueError(f"target={target!r}: a word target needs text or token-id inputs")
        texts = _row_texts(tokenizer, ids, mask) if tokenizer is not None else [""] * ids.shape[0]
    if isinstance(target, str):
        return word_target(model, tokenizer, target, texts)
    if len(words) != len(texts):
        raise ValueError(f"target: {len(words)} words for {len(texts)} input rows (one word per row)")
    return [word_target(model, tokenizer, w, [t])[0] for w, t in zip(words, texts)]


def _batch(inputs) -> Optional[int]:
    """The number of rows of token ids or pixel values (a tensor or a mapping), else None."""
    x = inputs
    if hasattr(inputs, "keys"):
        x = next((inputs[k] for k in ("input_ids", "pixel_values", "inputs_embeds") if k in inputs), None)
    if isinstance(x, torch.Tensor) and x.dim() >= 1:
        floating = x.is_floating_point()
        return int(x.shape[0]) if x.dim() >= (2 if not floating else 3) else 1
    return None


def _ids_and_mask(inputs):
    if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point():
        ids = inputs if inputs.dim() == 2 else inputs.reshape(1, -1)
        return ids, None
    if hasattr(inputs, "keys") and "input_ids" in inputs:
        ids = inputs["input_ids"]
        ids = ids if ids.dim() == 2 else ids.reshape(1, -1)
        mask = inputs.get("attention_mask") if hasattr(inputs, "get") else None
        return ids, _new_tokens(mask, ids)
    return None, None


def _new_tokens(mask, ids: torch.Tensor) -> Optional[torch.Tensor]:
    """The part of ``mask`` over the new tokens ``ids`` (a mask over a key/value cache and
    the new tokens has more columns: the new tokens are the last ones)."""
    if not isinstance(mask, torch.Tensor) or not mask.numel() or mask.numel() % ids.shape[0]:
        return None
    mask = mask.reshape(ids.shape[0], -1)
    return mask[:, -ids.shape[1]:] if mask.shape[1] >= ids.shape[1] else None


def attach_tokens(result, tokenizer, ids: Optional[torch.Tensor], mask: Optional[torch.Tensor] = None):
    """Set ``result.tokens`` to the strings of ``ids`` (where a tokenizer was given) and
    return the result."""
    if tokenizer is not None and ids is not None and not ids.is_floating_point() and hasattr(result, "tokens"):
        result.tokens = token_strings(tokenizer, ids.detach().cpu(), None if mask is None else mask.detach().cpu())
    return result


def finish(result, call: TextCall, ids: Optional[torch.Tensor], mask: Optional[torch.Tensor] = None):
    """The result with ``tokens`` (and ``target_tokens`` for token-id targets) as strings,
    where the call has a tokenizer; a classifier's class names in ``target_tokens``."""
    tok = call.tokenizer
    if tok is None:
        return _class_names(result, call.model)
    attach_tokens(result, tok, ids, mask)
    tids = getattr(result, "target_ids", None)
    if not (hasattr(result, "target_tokens") and isinstance(tids, torch.Tensor) and tids.numel()):
        return result
    if not _causal(call.model):
        return _class_names(result, call.model)
    from pyattr.methods._core.words import _pieces

    # the target token as the tokenizer's decoding spells it after the row's text (' owl',
    # not the bare 'owl' decoding the id alone gives a SentencePiece vocabulary)
    rows = ids.reshape(-1, ids.shape[-1]) if ids is not None else None
    real = None if mask is None or rows is None else mask.reshape(rows.shape).bool()

    def word(tid: int, row: int) -> str:
        before = [] if rows is None or row >= rows.shape[0] else \
            [int(t) for t in (rows[row] if real is None else rows[row][real[row]])][-8:]
        return _pieces(tok, before + [tid])[-1]

    if tids.dim() == 0:
        result.target_tokens = word(int(tids), 0)
    elif tids.dim() == 1:
        result.target_tokens = [word(int(t), r) for r, t in enumerate(tids.tolist())]
    else:
        result.target_tokens = [[word(int(t), r) for r, t in enumerate(k)] for k in tids.tolist()]
    return result


def _class_names(result, model):
    """``target_tokens`` of a classifier's class ids: the names of ``config.id2label``
    (none where they are transformers' defaults, ``LABEL_0``…)."""
    tids = getattr(result, "target_ids", None)
    names = getattr(getattr(model, "config", None), "id2label", None) or {}
    if not (hasattr(result, "target_tokens") and isinstance(tids, torch.Tensor) and tids.numel() and names) \
            or _causal(model) or all(str(v).startswith("LABEL_") for v in names.values()):
        return result
    name = lambda t: str(names.get(int(t), names.get(str(int(t)), int(t))))  # noqa: E731
    result.target_tokens = name(tids) if tids.dim() == 0 else [name(t) for t in tids.tolist()] if tids.dim() == 1 \
        else [[name(t) for t in k] for k in tids.tolist()]
    return result


#: the methods that explain encoder–decoder models (methods/seq2seq.py, methods/seq2seq_generation.py)
SEQ2SEQ_CALLERS = ("relevance", "generation_relevance", "integrated_gradients", "layer_relevance",
                   "perturbation_curve",
                   "attribution_patching", "activation_patching")


def text_inputs(caller: str, *, inputs: Sequence[str] = ("inputs",), target: Optional[str] = "target",
                left: Optional[bool] = None, tokens_of=None):
    """Decorate a method whose signature has ``model``, the ``inputs`` arguments named,
    ``tokenizer`` (and ``target`` / ``rules`` where named): text, a word target, a rules
    shorthand and a model name are read (:func:`resolve`) before the method runs, and the
    result gets ``tokens`` from the first inputs argument's ids (``tokens_of(result)`` →
    ``(ids, mask)`` where the result holds other ids, e.g. a generated sequence)."""
    import functools
    import inspect

    def deco(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as e:  # bind's message names no function
                raise TypeError(f"{caller}() {e}") from None
            a = bound.arguments
            cont = a.get("continuation")
            for i, name in enumerate(inputs):  # a text's mask is the tokenizer's
                mask_name = "attention_mask" if i == 0 else f"{name}_attention_mask"
                if is_text(a.get(name)) and a.get(mask_name) is not None:
                    raise ValueError(f"{mask_name}: the {name} argument is text, whose attention mask the tokenizer "
                                     f"gives; pass {mask_name}= only with token ids")
            if isinstance(cont, (list, tuple)) and any(isinstance(c, str) for c in cont) and not is_text(cont):
                raise TypeError(f"continuation: a list mixes texts and token ids ({list(cont)!r}); give one text per "
                                "prompt or one id list per prompt, not both")
            if cont is not None and is_text(cont) and not is_text(a.get(inputs[0])):
                raise ValueError(f"continuation: a text continuation is tokenized together with its prompt, so "
                                 f"{inputs[0]} must be text too (got {type(a.get(inputs[0])).__name__}); pass the "
                                 "prompt as a string, or the continuation as token ids")
            if "tokenizer" in a or "tokenizer" in sig.parameters:
                if a.get("tokenizer") is None:  # a framework's wrapper reads text with its own tokenizer
                    from pyattr.integration.wrappers import framework_tokenizer

                    a["tokenizer"] = framework_tokenizer(a["model"])
            if caller not in SEQ2SEQ_CALLERS:
                refuse_encoder_decoder(a["model"], caller)
            named = isinstance(a["model"], str) or hasattr(a["model"], "__fspath__")
            # an encoder–decoder's source is read as the tokenizer pads it (not left-padded as a
            # prompt) and its continuation as target text, apart from it (methods/seq2seq_generation.py)
            encdec = bool(getattr(getattr(a["model"], "config", None), "is_encoder_decoder", False))
            side = None if encdec else left
            text_cont = (cont is not None and is_text(cont) and is_text(a.get(inputs[0])) and not encdec)
            if text_cont:  # prompts and continuations tokenized together (generation)
                if a.get("tokenizer") is None and not named:
                    raise ValueError(f"{caller}(): a text continuation needs tokenizer=")
            call = resolve(a["model"], a[inputs[0]] if not text_cont else None, a.get("tokenizer"), caller,
                           target=a.get(target) if target else None, rules=a.get("rules"), left=side,
                           word_target_ok=target is not None, inputs_name=inputs[0])
            if (text_cont or (left and is_text(a.get(inputs[0])))) and \
                    getattr(getattr(call.model, "config", None), "is_encoder_decoder", False):
                # a model named by a string turned out an encoder–decoder: its source read as above
                texts = [a[inputs[0]]] if isinstance(a[inputs[0]], str) else list(a[inputs[0]])
                call.inputs, call.texts, text_cont = encode(call.tokenizer, texts, call.model, caller), texts, False
            if text_cont:
                if call.tokenizer is None:
                    raise ValueError(f"{caller}(): a text continuation needs tokenizer= (the model "
                                     f"{str(a['model'])!r} came without one)")
                from pyattr.methods._core.tokens import prompt_and_continuation

                texts = [a[inputs[0]]] if isinstance(a[inputs[0]], str) else list(a[inputs[0]])
                call.inputs, a["continuation"] = prompt_and_continuation(call.tokenizer, texts, cont)
                real = [r[m.bool()].tolist() for r, m in zip(call.inputs["input_ids"], call.inputs["attention_mask"])]
                _check_vocabulary(call.model, call.tokenizer, real + a["continuation"], inputs[0])
                call.texts = texts
            if caller not in SEQ2SEQ_CALLERS:
                refuse_encoder_decoder(call.model, caller)
            a["model"], a[inputs[0]] = call.model, call.inputs
            if "tokenizer" in sig.parameters:
                a["tokenizer"] = call.tokenizer
            if target and target in sig.parameters:
                a[target] = call.target
            if "rules" in sig.parameters:
                a["rules"] = call.rules
            for name in inputs[1:]:
                a[name] = ids_from_lists(a.get(name), call.tokenizer, left, name)
                if is_text(a.get(name)):
                    a[name] = encode(call.tokenizer, [a[name]] if isinstance(a[name], str) else list(a[name]),
                                     call.model, caller, left=left, name=name)
            # the model as the call found it: a forward may change the model it runs on
            # (BigBird switches itself to full attention on a short input, for every later call)
            refuse_meta(a["model"], a, caller)
            with kept_state(a["model"]) if isinstance(a["model"], nn.Module) else contextlib.nullcontext():
                result = fn(*bound.args, **bound.kwargs)
            if getattr(result, "own_tokens", False):  # an encoder–decoder result fills both sides' tokens itself
                return result
            if call.tokenizer is None:
                return _class_names(result, call.model)
            ids, mask = tokens_of(result) if tokens_of is not None else _ids_and_mask(call.inputs)
            if mask is None and ids is not None:
                mask = _new_tokens(a.get("attention_mask"), ids)
            return finish(result, call, ids, mask)

        return wrapper

    return deco
