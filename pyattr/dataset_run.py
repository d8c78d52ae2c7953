"""Relevance over a dataset of prompts, stored as Parquet shards with a JSON manifest
(``pyattr run``, :func:`pyattr.run`).

The store is a directory readable with ``pandas.read_parquet(OUT)`` or
``datasets.load_dataset("parquet", data_dir=OUT)``: ``part-RRRRR-SSSSSS.parquet`` shards
(R the torchrun rank, S a per-rank sequence number) and ``_manifest.json`` (a leading
underscore, as the temporary ``.part-….tmp`` files' leading dot, keeps Parquet readers
from taking it for data). One row per prompt:

=====================  =============================================================
``id``                 the prompt's ``id`` field as a string, else its 0-based row in the data
``index``              its 0-based row in the data (shards of one process are in this
                       order; with several ranks, sort by it)
``text``               the prompt
``tokens``             list of token strings (the real tokens, no padding)
``token_relevance``    list of float32, one per token (gradient × input, summed over hidden)
``target_id``          the explained token id (pandas reads it as float when a row has an error)
``target_token``       that token as a string
``target``             the explained logit f(x) (a number, not a token), float64
``conservation_delta`` target − Σ relevance, float64
``error``              null, or why this prompt has no relevance (then the numbers are null)
``seconds``            wall time of the prompt's batch divided by its rows
=====================  =============================================================

On a model whose forward depends on the longest position in its batch (dynamic-NTK
RoPE, Phi-3's LongRoPE), a batch holds rows of one rotary regime only, so every stored row
is what the prompt gives alone; the manifest's ``batch_dependence`` says so (null for
other models).

Safe to kill and rerun: a shard is written under a temporary name and renamed when
complete; a rerun of the same command skips the ids already stored, so a run killed at
any moment and restarted stores every prompt exactly once. Under ``torchrun`` each rank
takes every ``world_size``-th prompt (no sampler padding) and writes its own shards; rank
0 writes the manifest.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from pyattr.integration.config import RelevanceRules
import pyattr.methods._core.positions as P
from pyattr.integration.wrappers import unwrap
from pyattr.methods._core.inputs import input_device

MANIFEST = "_manifest.json"
COLUMNS = ("id", "index", "text", "tokens", "token_relevance", "target_id", "target_token", "target", "conservation_delta", "error", "seconds")


class RunError(ValueError):
    """A data file or output directory that cannot be used (one clear message)."""


@dataclass
class Prompt:
    id: str
    text: Optional[str]
    target: Union[None, str, int] = None   # a token (str) or a token id (int), as given
    error: Optional[str] = None    # a problem found while reading (recorded, not skipped)


@dataclass
class RunSummary:
    """What :func:`run` did on this rank: prompts stored now, skipped as already stored,
    failed (stored with an error), the shards written and the wall time (s)."""

    stored: int
    skipped: int
    failed: int
    shards: List[str]
    seconds: float


# --------------------------------------------------------------------------- reading


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
        return _checked(_from_rows(rows, text_field, target_field, "data"), "data", target_field)
    if not isinstance(data, (str, Path)):
        raise RunError(f"data: expected a file path or a list of strings / dicts, got {type(data).__name__}")
    path = Path(data)
    if not path.is_file():
        raise RunError(f"--data: {str(path)!r} is not a file")
    suffix = path.suffix.lower()
    if suffix == ".json" and path.read_bytes().lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"[":
        try:
            rows = json.loads(path.read_text(encoding="utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RunError(f"--data: {path.name} is not a valid JSON array ({e})") from None
        if not all(isinstance(r, dict) for r in rows):
            raise RunError(f"--data: {path.name}: a JSON array must hold objects")
        prompts = _from_rows(rows, text_field, target_field, path.name)
    elif suffix in (".jsonl", ".json", ".ndjson"):
        prompts = _read_jsonl(path, text_field, target_field)
    elif suffix == ".csv":
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise RunError(f"--data: {path.name} is not UTF-8 (byte {e.start})") from None
        rows = list(csv.DictReader(io.StringIO(text)))
        if rows and text_field not in rows[0]:
            raise RunError(f"--data: {path.name} has no column {text_field!r} (columns: {list(rows[0])}); pass --text-field")
        prompts = _from_rows(rows, text_field, target_field, path.name)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if text_field not in table.column_names:
            raise RunError(f"--data: {path.name} has no column {text_field!r} (columns: {table.column_names}); pass --text-field")
        prompts = _from_rows(table.to_pylist(), text_field, target_field, path.name)
    else:
        raise RunError(f"--data: {path.name}: expected a .jsonl, .csv or .parquet file")
    return _checked(prompts, path.name, target_field)


def _checked(prompts: List[Prompt], name: str, target_field) -> List[Prompt]:
    if not prompts:
        raise RunError(f"--data: {name} holds no prompts")
    seen: set = set()
    for p in prompts:
        if p.id in seen:
            raise RunError(f"--data: the id {p.id!r} appears more than once; ids must be unique (they key the store)")
        seen.add(p.id)
    if target_field is not None and all(p.target is None for p in prompts):
        raise RunError(f"--target: no prompt of {name} has the field {target_field!r}")
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


# --------------------------------------------------------------------------- the store


def _rank_world():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def stored_ids(out: Path) -> set:
    """Ids already in complete shards of ``out`` (all ranks)."""
    import pyarrow.parquet as pq

    ids = set()
    for f in sorted(out.glob("part-*.parquet")):
        ids.update(pq.read_table(f, columns=["id"]).column("id").to_pylist())
    return ids


def _next_seq(out: Path, rank: int) -> int:
    seqs = [int(f.stem.split("-")[2]) for f in out.glob(f"part-{rank:05d}-*.parquet")]
    return max(seqs) + 1 if seqs else 0


def _write_shard(out: Path, rank: int, seq: int, rows: List[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("id", pa.string()), ("index", pa.int64()), ("text", pa.string()), ("tokens", pa.list_(pa.string())),
        ("token_relevance", pa.list_(pa.float32())), ("target_id", pa.int64()), ("target_token", pa.string()),
        ("target", pa.float64()),
        ("conservation_delta", pa.float64()), ("error", pa.string()), ("seconds", pa.float64()),
    ])
    table = pa.Table.from_pylist(rows, schema=schema)
    name = f"part-{rank:05d}-{seq:06d}.parquet"
    tmp = out / f".{name}.tmp"
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out / name)  # atomic: a reader or a rerun sees the whole shard or none
    return name


def _manifest(model, tokenizer, rules, text_field, target_field, data, command, world) -> dict:
    import pyattr
    from pyattr import backends
    from pyattr.explain import _rules_dict

    cfg = getattr(model, "config", None)
    dtype = next((str(p.dtype).replace("torch.", "") for p in model.parameters()), "float32")
    device = str(input_device(model))
    name = getattr(cfg, "_name_or_path", None) or type(model).__name__
    if os.path.isdir(name):  # "./m" and "m" are one model
        name = os.path.realpath(name)
    return {
        "model": name,
        "model_type": getattr(cfg, "model_type", None),
        "rules": _rules_dict(rules),
        "backend": backends.select(torch.device(device), "identity"),
        "dtype": dtype,
        "device": device,
        "device_map": _device_map(model),
        # how rows are batched where the model's forward depends on its batch (None: it does not)
        "batch_dependence": P.describe(model),
        "gradient_checkpointing": any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()),
        "text_field": text_field,
        "target": target_field or "top1",
        "data": os.path.realpath(data) if isinstance(data, (str, Path)) else "in-memory list",
        "world_size": world,
        "pyattr_version": pyattr.__version__,
        "torch_version": torch.__version__,
        "command": command,
        "columns": list(COLUMNS),
    }


def _device_map(model) -> Optional[Dict[str, str]]:
    """accelerate's placement (``from_pretrained(device_map=...)`` / ``dispatch_model``)."""
    dm = getattr(model, "hf_device_map", None)
    return {k: str(v) for k, v in dm.items()} if isinstance(dm, dict) else None


# what a resumed run must share with the stored one: the results would mix otherwise (in
# bfloat16 / float16 a row's numbers depend on its batch's padding by up to ~1 %, hence the
# budget; in float32 by ~1e-7, and a smaller budget after running out of memory is fine)
_SAME = ("model", "model_type", "rules", "dtype", "text_field", "target", "data", "data_sha256",
         "max_tokens_per_batch")


def _fingerprint(prompts: List[Prompt]) -> str:
    """SHA-256 of the prompts (ids, texts, targets, in order): an edited data file, or
    another list, is another run."""
    import hashlib

    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.id, p.text, p.target, p.error], ensure_ascii=True).encode())
    return h.hexdigest()


def _check_manifest(out: Path, manifest: dict) -> None:
    path = out / MANIFEST
    if not path.exists():
        return
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise RunError(f"--out: {str(path)!r} is unreadable; remove it (and the shards) to start over") from None
    same = [k for k in _SAME if k != "max_tokens_per_batch" or manifest.get("dtype") != "float32"]
    diff = [k for k in same if old.get(k) != manifest.get(k)]
    if diff:
        k = diff[0]
        raise RunError(
            f"--out: {str(out)!r} holds a run with another {k} ({old.get(k)!r}, now {manifest.get(k)!r}); "
            "resuming would mix results: use another --out directory"
        )


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the run


def run(
    model: nn.Module,
    data: Union[str, Path, Sequence],
    out: Union[str, Path],
    *,
    tokenizer,
    text_field: str = "text",
    target: Optional[str] = None,
    rules: Optional[RelevanceRules] = None,
    max_tokens_per_batch: int = 4096,
    shard_size: int = 256,
    progress: bool = True,
    command: Optional[str] = None,
    generic: bool = False,
) -> RunSummary:
    """Token relevance of every prompt of ``data`` for a causal LM's next-token logit,
    stored in ``out`` (see :mod:`pyattr.dataset_run` for the layout and columns).

    Args:
        model (nn.Module): a Hugging Face causal LM (any device and dtype; the rule
            backwards accumulate in float32).
        data: a ``.jsonl`` / ``.csv`` / ``.parquet`` path, or a list of strings / dicts.
        out (str | Path): the results directory (created; an existing run of the same
            configuration is resumed, one of another configuration refused).
        tokenizer: the model's tokenizer.
        text_field (str): the field holding each prompt. Default ``"text"``.
        target (str, optional): a field holding each prompt's target token (a token
            string of one token, or an integer id); default: the top-1 next token.
        rules (RelevanceRules, optional): default ``RelevanceRules.all()``.
        max_tokens_per_batch (int): rows × padded length per forward; prompts are sorted
            by length first, so little is padding. Default 4096.
        shard_size (int): rows per Parquet shard. Default 256.
        progress (bool): a rich progress bar on stderr with prompts/s, tokens/s and ETA
            (on a terminal only).
        command (str, optional): recorded in the manifest.
        generic (bool): structural rule installation for an architecture without a rule
            map (see :func:`pyattr.use_relevance_rules`). Default False.

    Returns:
        RunSummary for this rank.

    Raises:
        RunError: unusable data (see :func:`read_prompts`), an ``out`` that holds another
            run or that another run is writing to (a lock per rank), bad
            ``max_tokens_per_batch`` / ``shard_size``, a model whose architecture has
            no rule map (without ``generic``): all before ``out`` is created.

    Per prompt, an empty text, a text longer than the model reads, or an unknown target
    token is stored with its ``error``; the run goes on.
    """
    model = unwrap(model)
    import pyattr.methods._core as core

    max_tokens_per_batch = core.check_count("max_tokens_per_batch", max_tokens_per_batch, allow_none=False)
    shard_size = core.check_count("shard_size", shard_size, allow_none=False)
    rules = RelevanceRules.all() if rules is None else rules
    rank, world = _rank_world()
    prompts = read_prompts(data, text_field, target)  # a bad file fails before OUT is created
    _check_model(model, rules, generic)  # and so does a model the rules cannot be placed on
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock(out, rank)
    try:
        return _run_locked(model, prompts, data, out, tokenizer, text_field, target, rules, max_tokens_per_batch,
                           shard_size, progress, command, rank, world, generic)
    finally:
        lock.close()


def _check_model(model, rules, generic: bool) -> None:
    """The rule plan, once: an architecture without a rule map is one error for the run,
    not an error stored in every row."""
    from pyattr.integration.errors import RelevanceRuleUnsupportedError
    from pyattr.integration.scope import plan

    try:
        plan(model, rules, generic)
    except RelevanceRuleUnsupportedError as e:
        raise RunError(f"model: {e}") from None


def _run_locked(model, prompts, data, out: Path, tokenizer, text_field, target, rules, max_tokens_per_batch,
                shard_size, progress, command, rank, world, generic) -> RunSummary:
    from pyattr.methods.relevance import relevance as method
    from pyattr.targets import Logit

    relevance = functools.partial(method, generic=generic)

    manifest = _manifest(model, tokenizer, rules, text_field, target, data, command, world)
    manifest["data_sha256"] = _fingerprint(prompts)
    manifest["max_tokens_per_batch"] = max_tokens_per_batch
    _check_manifest(out, manifest)
    for tmp in out.glob(f".part-{rank:05d}-*.tmp"):  # half-written by a killed run (this rank's lock is ours)
        tmp.unlink()
    if rank == 0:
        if not (out / MANIFEST).exists():
            _write_json(out / MANIFEST, {**manifest, "complete": False})
    _barrier(world)
    done = stored_ids(out)
    index = {p.id: i for i, p in enumerate(prompts)}
    mine = [p for i, p in enumerate(prompts) if i % world == rank]
    todo = [p for p in mine if p.id not in done]
    skipped = len(mine) - len(todo)
    t_start = time.perf_counter()
    shards: List[str] = []
    seq = _next_seq(out, rank)
    failed = 0
    from pyattr.explain import _max_positions

    limit = _max_positions(model)
    # any id pads (the attention mask hides it); GPT-2 style tokenizers have no pad token
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    encoded: Dict[str, List[int]] = {}
    targets: Dict[str, int] = {}
    problems: Dict[str, str] = {}
    for p in todo:
        err = _encode(p, tokenizer, model, limit, encoded, targets)
        if err is not None:
            problems[p.id] = err
    bar = _RunProgress(len(todo), sum(len(v) for v in encoded.values()), progress)
    # shards hold consecutive prompts in input order (a single process's store reads back in
    # input order); within a shard, prompts are batched by length (little padding)
    try:
        for start in range(0, len(todo), shard_size):
            chunk = todo[start:start + shard_size]
            by_id: Dict[str, dict] = {}
            for p in chunk:
                if p.id in problems:
                    by_id[p.id] = _error_row(p, problems[p.id])
            ready = [p for p in chunk if p.id not in problems]
            bar.advance(len(chunk) - len(ready), 0)
            for batch in _batches(ready, encoded, max_tokens_per_batch, model):
                t0 = time.perf_counter()
                results = _relevance_batch(relevance, Logit, model, pad, batch, encoded, targets, rules)
                per = (time.perf_counter() - t0) / len(batch)
                for p, res in zip(batch, results):
                    by_id[p.id] = _error_row(p, res, per) if isinstance(res, str) else \
                        {**res, "tokens": tokenizer.convert_ids_to_tokens(encoded[p.id]),
                         "target_token": tokenizer.convert_ids_to_tokens([res["target_id"]])[0],
                         "id": p.id, "text": p.text, "error": None, "seconds": per}
                bar.advance(len(batch), sum(len(encoded[p.id]) for p in batch))
            rows = [{**by_id[p.id], "index": index[p.id]} for p in chunk]
            failed += sum(r["error"] is not None for r in rows)
            shards.append(_write_shard(out, rank, seq, rows))
            seq += 1
    finally:
        bar.close()  # also on Ctrl-C: the terminal is restored; a rerun resumes
    _barrier(world)
    if rank == 0:
        total = len(stored_ids(out))
        _write_json(out / MANIFEST, {**manifest, "complete": total == len(prompts), "rows": total})
    return RunSummary(stored=len(todo), skipped=skipped, failed=failed, shards=shards,
                      seconds=time.perf_counter() - t_start)


def _lock(out: Path, rank: int):
    """An exclusive lock per rank on ``out``: two runs writing the same rank's shards at
    once would overwrite each other's sequence numbers."""
    import fcntl

    f = open(out / f".lock-{rank:05d}", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise RunError(f"--out: another run is writing to {str(out)!r} (rank {rank}); wait for it or use another directory") from None
    return f


def _barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def _encode(p: Prompt, tokenizer, model, limit, encoded, targets) -> Optional[str]:
    """Tokenise a prompt into ``encoded`` (and its target id into ``targets``), or say why
    it cannot run."""
    if p.error is not None:
        return p.error
    if not p.text.strip():
        return "empty text"
    try:
        ids = tokenizer(p.text)["input_ids"]
    except Exception as e:  # noqa: BLE001 - a tokenizer that refuses this text
        return f"the tokenizer refused the text ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    if not ids:
        return "no tokens after tokenisation"
    if limit is not None and len(ids) > limit:
        return f"{len(ids)} tokens; the model reads at most {limit}"
    if p.target is not None:
        tid = _target_id(tokenizer, p.target, model)
        if isinstance(tid, str):
            return tid
        targets[p.id] = tid
    encoded[p.id] = ids
    return None


def _target_id(tokenizer, target, model):
    """A target token (a string: the vocabulary entry, else its single-token encoding, so
    "5" is the token "5", never id 5) or an integer id (a JSON number, a Parquet integer)
    → the id, or why it cannot be one."""
    vocab = model.config.vocab_size
    if isinstance(target, int):
        tid = target
    else:
        v = tokenizer.get_vocab()
        if target in v:
            tid = int(v[target])
        else:
            try:
                ids = tokenizer.encode(target, add_special_tokens=False)
            except Exception as e:  # noqa: BLE001
                return f"target {target!r}: the tokenizer refused it ({type(e).__name__})"
            if len(ids) != 1:
                return f"target {target!r} is {len(ids)} tokens, not one"
            tid = int(ids[0])
    if not 0 <= tid < vocab:
        return f"target id {tid} is outside the model's {vocab} logits"
    return tid


def _error_row(p: Prompt, error: str, seconds: float = 0.0) -> dict:
    return {"id": p.id, "text": p.text, "tokens": None, "token_relevance": None, "target_id": None,
            "target_token": None, "target": None, "conservation_delta": None, "error": error, "seconds": seconds}


def _batches(prompts: List[Prompt], encoded, budget: int, model=None):
    """Prompts sorted by length, grouped so that rows × longest ≤ budget (a longer prompt
    alone when it exceeds the budget by itself). On a model whose forward depends on the
    longest position in the batch (dynamic-NTK / LongRoPE, :mod:`pyattr.methods._core.positions`), a
    batch never mixes rows of two regimes, so each row computes what it computes alone."""
    order = sorted(prompts, key=lambda p: len(encoded[p.id]))
    dependent = model is not None and P.depends_on_batch(model)
    batch: List[Prompt] = []
    key = None
    for p in order:
        n = len(encoded[p.id])
        k = P.regime_keys(model, [n])[0] if dependent else None
        if batch and ((len(batch) + 1) * n > budget or k != key):
            yield batch
            batch = []
        batch.append(p)
        key = k
    if batch:
        yield batch


def _relevance_batch(relevance, Logit, model, pad, batch, encoded, targets, rules):
    """One relevance call for the batch; if it fails, each prompt alone (so one bad prompt
    is recorded with its error and the others still get their relevance)."""
    try:
        return _call(relevance, Logit, model, pad, batch, encoded, targets, rules)
    except Exception as e:  # noqa: BLE001 - recorded per prompt below
        if len(batch) == 1:
            return [f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"]
    out = []
    for p in batch:
        out += _relevance_batch(relevance, Logit, model, pad, [p], encoded, targets, rules)
    return out


def _call(relevance, Logit, model, pad, batch, encoded, targets, rules):
    device = input_device(model)
    seqs = [encoded[p.id] for p in batch]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
    target = None
    if batch[0].id in targets:  # with a target field every prompt that runs has one
        target = Logit([targets[p.id] for p in batch])
    res = relevance(model, {"input_ids": ids, "attention_mask": mask}, target=target, rules=rules)
    out = []
    for i, s in enumerate(seqs):
        out.append({
            "tokens": None,  # filled by the caller (it holds the tokenizer)
            "token_relevance": [float(v) for v in res.token_relevance[i, :len(s)].float().cpu()],
            "target_id": int(res.target_ids[i]),
            "target": float(res.target[i]),
            "conservation_delta": float(res.conservation_delta[i]),
        })
    return out


class _RunProgress:
    """rich progress on stderr (a terminal only): prompts, prompts/s, tokens/s, ETA."""

    def __init__(self, total: int, tokens: int, enabled: bool):
        import sys

        self.bar = None
        self.tokens = 0
        self.t0 = time.perf_counter()
        if not enabled or not sys.stderr.isatty() or total == 0:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        except ImportError:
            return
        self.bar = Progress(TextColumn("relevance"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
                            console=Console(file=sys.stderr), transient=True)
        self.bar.start()
        self.task = self.bar.add_task("run", total=total, rate="")
        self.done = 0

    def advance(self, prompts: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is None:
            return
        self.done += prompts
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.update(self.task, completed=self.done,
                        rate=f"{self.done / dt:.1f} prompts/s, {self.tokens / dt:.0f} tokens/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
