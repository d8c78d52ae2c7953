"""Token ids as Python lists, as a tokenizer returns them without ``return_tensors``
(``apply_chat_template(..., tokenize=True)`` with or without ``return_dict``), made the
tensors every method reads; and rows of ids padded to one width as the tokenizer would."""

from __future__ import annotations

from typing import List, Optional

import torch


def _int_list(v) -> bool:
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(
        isinstance(t, int) and not isinstance(t, bool) for t in v)


def _rows_of(v) -> Optional[List[List[int]]]:
    """``v`` as rows of ints: one list of ints (one row) or a list of them; else None."""
    if _int_list(v):
        return [list(v)]
    if isinstance(v, (list, tuple)) and v and all(_int_list(r) for r in v):
        return [list(r) for r in v]
    return None


def ids_from_lists(inputs, tokenizer, left: Optional[bool], name: str = "inputs"):
    """Token ids given as Python lists, as a tokenizer returns them without
    ``return_tensors`` (``apply_chat_template(..., tokenize=True)``, with or without
    ``return_dict``): a list of ints is one row, a list of such lists one row each (padded
    on the tokenizer's side, with its attention mask, where their lengths differ), a mapping
    (a ``BatchEncoding``) has each such value turned into a tensor. Anything else is
    returned as it is."""
    rows = _rows_of(inputs)
    if rows is not None:
        return _rows_to_inputs(rows, None, tokenizer, left, name)
    if not (hasattr(inputs, "keys") and "input_ids" in inputs and _rows_of(inputs["input_ids"]) is not None):
        return inputs
    rows = _rows_of(inputs["input_ids"])
    mask = _rows_of(inputs.get("attention_mask")) if hasattr(inputs, "get") else None
    out = _rows_to_inputs(rows, mask, tokenizer, left, name)
    for key in inputs.keys():
        if key in ("input_ids", "attention_mask"):
            continue
        value = inputs[key]
        other = _rows_of(value)
        if other is not None:
            if [len(r) for r in other] != [len(r) for r in rows] or len({len(r) for r in rows}) != 1:
                raise ValueError(f"{name}: {key!r} holds Python lists whose rows do not line up with input_ids; give "
                                 "the tokenizer's output as tensors (return_tensors='pt')")
            value = torch.tensor(other, dtype=torch.long)
        out[key] = value
    return out


def _rows_to_inputs(rows: List[List[int]], mask: Optional[List[List[int]]], tokenizer, left, name: str) -> dict:
    if mask is not None and [len(r) for r in mask] != [len(r) for r in rows]:
        raise ValueError(f"{name}: attention_mask's rows do not have input_ids' lengths")
    if len({len(r) for r in rows}) == 1:
        ids = torch.tensor(rows, dtype=torch.long)
        out = {"input_ids": ids}
        if mask is not None:
            out["attention_mask"] = torch.tensor(mask, dtype=torch.long)
        return out
    if tokenizer is None:
        raise ValueError(f"{name}: rows of token ids of different lengths ({sorted({len(r) for r in rows})}); pass "
                         "tokenizer= (its pad id and padding side pad them), or pad them with an attention_mask")
    if mask is not None:  # ragged rows with a mask: the real tokens are where it is 1
        rows = [[t for t, k in zip(r, m) if k] for r, m in zip(rows, mask)]
    return _pad_rows(rows, tokenizer, (getattr(tokenizer, "padding_side", "right") == "left") if left is None else left)


def _pad_rows(rows: List[List[int]], tokenizer, left: bool) -> dict:
    """Id rows padded to one width (on the left or the right) with their attention mask;
    the pad id is the tokenizer's, else its end-of-text id, else 0 (masked out either way)."""
    width = max(len(r) for r in rows)
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = getattr(tokenizer, "eos_token_id", None) if pad is None else pad
    pad = 0 if pad is None else int(pad)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, sl] = torch.tensor(r, dtype=torch.long)
        mask[i, sl] = 1
    return {"input_ids": ids, "attention_mask": mask}
