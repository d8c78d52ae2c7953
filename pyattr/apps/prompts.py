"""Prompts for a dataset run: JSON lines, CSV, Parquet or an in-memory list, each prompt
with its id, text and optional target, checked before anything runs."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Union


class RunError(ValueError):
    """A data file or output directory that cannot be used (one clear message)."""


@dataclass
class Prompt:
    id: str
    text: Optional[str]
    target: Union[None, str, int] = None   # a token (str) or a token id (int), as given
    error: Optional[str] = None    # a problem found while reading (recorded, not skipped)


def read_prompts(data: Union[str, Path, Sequence], text_field: str = "text", target_field: Optional[str] = None) -> List[Prompt]:
    """Prompts from a ``.jsonl`` / ``.json`` (one object per line), ``.csv`` or ``.parquet``
    file, or a list of strings / dicts.

    A JSON line that is not UTF-8, not valid JSON, not an object, or lacks ``text_field``
    becomes a prompt with an ``error`` (stored as such, never skipped silently). A CSV or
    Parquet file without the column, an empty file, or an unknown extension raise
    :class:`RunError`.
    """
    if hasattr(data, "to_dict") and hasattr(data, "columns"):  # a pandas DataFrame
        data = data.to_dict("records")
    if isinstance(data, (list, tuple)):
        bad = [i for i, d in enumerate(data) if not isinstance(d, (str, dict))]
        if bad:
            raise RunError(f"data: item {bad[0]} is a {type(data[bad[0]]).__name__}; expected strings or dicts")
        rows = [{text_field: d} if isinstance(d, str) else d for d in data]
        return _checked(_from_rows(rows, text_field, target_field, "data"), "data", target_field, text_field)
    if not isinstance(data, (str, Path)):
        raise RunError(f"data: expected a file path or a list of strings / dicts, got {type(data).__name__}")
    path = Path(data)
    if not path.is_file():
        raise RunError(f"data (--data): {str(path)!r} is not a file")
    suffix = path.suffix.lower()
    if suffix == ".json" and path.read_bytes().lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"[":
        try:
            rows = json.loads(path.read_text(encoding="utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RunError(f"data (--data): {path.name} is not a valid JSON array ({e})") from None
        if not all(isinstance(r, dict) for r in rows):
            raise RunError(f"data (--data): {path.name}: a JSON array must hold objects")
        prompts = _from_rows(rows, text_field, target_field, path.name)
    elif suffix in (".jsonl", ".json", ".ndjson"):
        prompts = _read_jsonl(path, text_field, target_field)
    elif suffix == ".csv":
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise RunError(f"data (--data): {path.name} is not UTF-8 (byte {e.start})") from None
        rows = list(csv.DictReader(io.StringIO(text)))
        if rows and text_field not in rows[0]:
            raise RunError(f"data (--data): {path.name} has no column {text_field!r} (columns: {list(rows[0])}); pass text_field= (--text-field)")
        prompts = _from_rows(rows, text_field, target_field, path.name)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if text_field not in table.column_names:
            raise RunError(f"data (--data): {path.name} has no column {text_field!r} (columns: {table.column_names}); pass text_field= (--text-field)")
        prompts = _from_rows(table.to_pylist(), text_field, target_field, path.name)
    else:
        raise RunError(f"data (--data): {path.name}: expected a .jsonl, .csv or .parquet file")
    return _checked(prompts, path.name, target_field, text_field)


def _checked(prompts: List[Prompt], name: str, target_field, text_field: str) -> List[Prompt]:
    if not prompts:
        raise RunError(f"data (--data): {name} holds no prompts")
    if all(p.error is not None and p.error.endswith(f"field {text_field!r} missing") for p in prompts):
        raise RunError(f"data (--data): no row of {name} has the field {text_field!r}; pass text_field= "
                       "(--text-field)")
    seen: set = set()
    for p in prompts:
        if p.id in seen:
            raise RunError(f"data (--data): the id {p.id!r} appears more than once; ids must be unique (they key the store)")
        seen.add(p.id)
    if target_field is not None and all(p.target is None for p in prompts):
        raise RunError(f"target (--target): no prompt of {name} has the field {target_field!r}")
    return prompts


def _read_jsonl(path: Path, text_field, target_field) -> List[Prompt]:
    prompts: List[Prompt] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f):
            if n == 0 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
                raw = raw[3:]
            if not raw.strip():
                continue
            fallback = str(len(prompts))  # the prompt's 0-based row, blank lines not counted
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                prompts.append(Prompt(fallback, None, error=f"line {n + 1}: not UTF-8 (byte {e.start})"))
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                prompts.append(Prompt(fallback, None, error=f"line {n + 1}: not JSON ({e.msg})"))
                continue
            if not isinstance(obj, dict):
                prompts.append(Prompt(fallback, None, error=f"line {n + 1}: not a JSON object"))
                continue
            prompts.append(_prompt(obj, fallback, text_field, target_field, f"line {n + 1}"))
    return prompts


def _from_rows(rows, text_field, target_field, where) -> List[Prompt]:
    return [_prompt(r, str(i), text_field, target_field, f"row {i}") for i, r in enumerate(rows)]


def _unicode_ok(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:  # lone surrogates ("\\ud800" in JSON)
        return False


def _prompt(obj: dict, fallback: str, text_field, target_field, where) -> Prompt:
    pid = obj.get("id")
    pid = fallback if pid is None or pid == "" else str(pid)
    if not _unicode_ok(pid):
        pid = pid.encode("utf-8", "backslashreplace").decode("utf-8")
    text = obj.get(text_field)
    if not isinstance(text, str):
        why = "missing" if text is None else f"not a string ({type(text).__name__})"
        return Prompt(pid, None, error=f"{where}: field {text_field!r} {why}")
    if not _unicode_ok(text):
        return Prompt(pid, text.encode("utf-8", "backslashreplace").decode("utf-8"),
                      error=f"{where}: field {text_field!r} is not valid Unicode (a lone surrogate)")
    target = None
    if target_field is not None:
        target = obj.get(target_field)
        if target is None or target == "":
            return Prompt(pid, text, error=f"{where}: target field {target_field!r} missing or empty")
        if isinstance(target, bool) or not isinstance(target, (int, str)):
            return Prompt(pid, text, target="?", error=f"{where}: target {target!r} is neither a token nor an integer id")
    return Prompt(pid, text, target)
