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

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import nn

import pyattr.methods._core as core
import pyattr.methods._core.positions as P
from pyattr.apps.prompts import Prompt, RunError, read_prompts
from pyattr.methods._core.tokens import prompt_ids, target_token_id
from pyattr.apps.store import (
    MANIFEST,
    build_manifest,
    check_manifest,
    fingerprint,
    lock_output,
    next_seq,
    stored_ids,
    write_json,
    write_shard,
)
from pyattr.config import RelevanceRules
from pyattr.integration.wrappers import unwrap
from pyattr.methods._core.inputs import input_device


@dataclass
class RunSummary:
    """What :func:`run` did on this rank: prompts stored now, skipped as already stored,
    failed (stored with an error), the shards written and the wall time (s)."""

    stored: int
    skipped: int
    failed: int
    shards: List[str]
    seconds: float


def _rank_world():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


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
    generate: Optional[int] = None,
) -> RunSummary:
    """Token relevance of every prompt of ``data`` for a causal LM's next-token logit,
    stored in ``out`` (see :mod:`pyattr.apps.run` for the layout and columns).

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
        generate (int, optional): generate this many tokens per prompt (greedy) and explain
            each of them (:func:`pyattr.generation_relevance`): then ``tokens`` holds the
            prompt and the generated tokens, ``generated_text`` the continuation, and
            ``target_id`` / ``target_token`` / ``target`` / ``conservation_delta`` one entry
            per generated token, ``token_relevance`` one list per generated token (the
            relevance matrix, generated × tokens). Steps after an end-of-sequence token are
            not stored.

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

    max_tokens_per_batch = core.check_count("max_tokens_per_batch", max_tokens_per_batch, allow_none=False)
    shard_size = core.check_count("shard_size", shard_size, allow_none=False)
    try:
        generate = core.check_count("generate", generate)
    except ValueError as e:
        raise RunError(str(e)) from None
    if generate is not None and target is not None:
        raise RunError("target: with generate, each generated token is its own target; drop the target field")
    rules = RelevanceRules.all() if rules is None else rules
    rank, world = _rank_world()
    prompts = read_prompts(data, text_field, target)  # a bad file fails before OUT is created
    _check_model(model, rules, generic)  # and so does a model the rules cannot be placed on
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunError(f"out (--out): {str(out)!r} is a file; expected a directory (new or of this run)")
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_output(out, rank)
    try:
        return _run_locked(model, prompts, data, out, tokenizer, text_field, target, rules, max_tokens_per_batch,
                           shard_size, progress, command, rank, world, generic, generate)
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
                shard_size, progress, command, rank, world, generic, generate=None) -> RunSummary:
    from pyattr.methods.relevance import relevance as method
    from pyattr.targets import Logit

    relevance = functools.partial(method, generic=generic)
    if generate is not None:
        relevance = functools.partial(_generation_call, tokenizer=tokenizer, generate=generate)

    manifest = build_manifest(model, tokenizer, rules, text_field, target, data, command, world)
    manifest["data_sha256"] = fingerprint(prompts)
    manifest["max_tokens_per_batch"] = max_tokens_per_batch
    manifest["generate"] = generate
    if generate is not None:
        from pyattr.apps.store import GENERATE_COLUMNS

        manifest["columns"] = list(GENERATE_COLUMNS)
    check_manifest(out, manifest)
    for tmp in out.glob(f".part-{rank:05d}-*.tmp"):  # half-written by a killed run (this rank's lock is ours)
        tmp.unlink()
    if rank == 0:
        if not (out / MANIFEST).exists():
            write_json(out / MANIFEST, {**manifest, "complete": False})
    _barrier(world)
    done = stored_ids(out)
    index = {p.id: i for i, p in enumerate(prompts)}
    mine = [p for i, p in enumerate(prompts) if i % world == rank]
    todo = [p for p in mine if p.id not in done]
    skipped = len(mine) - len(todo)
    t_start = time.perf_counter()
    shards: List[str] = []
    seq = next_seq(out, rank)
    failed = 0
    limit = core.max_positions(model)
    # any id pads (the attention mask hides it); GPT-2 style tokenizers have no pad token
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    encoded: Dict[str, List[int]] = {}
    targets: Dict[str, int] = {}
    problems: Dict[str, str] = {}
    for p in todo:
        err = _encode(p, tokenizer, model, limit, encoded, targets, generate)
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
                    by_id[p.id] = _error_row(p, problems[p.id], 0.0, generate)
            ready = [p for p in chunk if p.id not in problems]
            bar.advance(len(chunk) - len(ready), 0)
            for batch in _batches(ready, encoded, max_tokens_per_batch, model):
                t0 = time.perf_counter()
                results = _relevance_batch(relevance, Logit, model, pad, batch, encoded, targets, rules)
                per = (time.perf_counter() - t0) / len(batch)
                for p, res in zip(batch, results):
                    if isinstance(res, str):
                        by_id[p.id] = _error_row(p, res, per, generate)
                    elif generate is not None:  # the generation call names its tokens itself
                        by_id[p.id] = {**res, "id": p.id, "text": p.text, "error": None, "seconds": per}
                    else:
                        by_id[p.id] = {**res, "tokens": tokenizer.convert_ids_to_tokens(encoded[p.id]),
                                       "target_token": tokenizer.convert_ids_to_tokens([res["target_id"]])[0],
                                       "id": p.id, "text": p.text, "error": None, "seconds": per}
                bar.advance(len(batch), sum(len(encoded[p.id]) for p in batch))
            rows = [{**by_id[p.id], "index": index[p.id]} for p in chunk]
            failed += sum(r["error"] is not None for r in rows)
            shards.append(write_shard(out, rank, seq, rows))
            seq += 1
    finally:
        bar.close()  # also on Ctrl-C: the terminal is restored; a rerun resumes
    _barrier(world)
    if rank == 0:
        total = len(stored_ids(out))
        write_json(out / MANIFEST, {**manifest, "complete": total == len(prompts), "rows": total})
    return RunSummary(stored=len(todo), skipped=skipped, failed=failed, shards=shards,
                      seconds=time.perf_counter() - t_start)


def _barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def _encode(p: Prompt, tokenizer, model, limit, encoded, targets, generate: Optional[int] = None) -> Optional[str]:
    """Tokenise a prompt into ``encoded`` (and its target id into ``targets``), or say why
    it cannot run."""
    if p.error is not None:
        return p.error
    if not p.text.strip():
        return "empty text"
    try:
        ids = prompt_ids(tokenizer, p.text)
    except Exception as e:  # noqa: BLE001 - a tokenizer that refuses this text
        return f"the tokenizer refused the text ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    if not ids:
        return "no tokens after tokenisation"
    if limit is not None and len(ids) > limit:
        return f"{len(ids)} tokens; the model reads at most {limit}"
    if limit is not None and generate is not None and len(ids) + generate - 1 > limit:
        return (f"{len(ids)} tokens and {generate} generated: the model would read {len(ids) + generate - 1} positions "
                f"(all but the last token); it reads at most {limit}")
    if p.target is not None:
        tid = target_token_id(tokenizer, p.target, model.config.vocab_size, p.text)
        if isinstance(tid, str):
            return tid
        targets[p.id] = tid
    encoded[p.id] = ids
    return None


def _error_row(p: Prompt, error: str, seconds: float = 0.0, generate: Optional[int] = None) -> dict:
    row = {"id": p.id, "text": p.text, "tokens": None, "token_relevance": None, "target_id": None,
           "target_token": None, "target": None, "conservation_delta": None, "error": error, "seconds": seconds}
    if generate is not None:
        row["generated_text"] = None
    return row


def _generation_call(model, inputs, target=None, rules=None, *, tokenizer, generate: int):
    """``generation_relevance`` on one batch, returned row by row (the stored columns)."""
    from pyattr.methods.generation import generation_relevance

    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    # generation appends on the right: the batch arrives right-padded, so turn it around
    lengths = mask.sum(1)
    width = ids.shape[1]
    left = torch.zeros_like(ids)
    lmask = torch.zeros_like(mask)
    for i, n in enumerate(lengths.tolist()):
        left[i, width - n:] = ids[i, :n]
        lmask[i, width - n:] = 1
    r = generation_relevance(model, {"input_ids": left, "attention_mask": lmask}, max_new_tokens=generate,
                             rules=rules)
    rows = []
    for i in range(ids.shape[0]):
        steps = int(r.step_mask[i].sum())
        cols = r.attention_mask[i].bool().nonzero()[:, 0]
        cols = cols[cols < r.prompt_width + steps]
        gen = r.generated[i, :steps].tolist()
        rows.append({
            "tokens": tokenizer.convert_ids_to_tokens(r.sequences[i, cols].tolist()),
            "generated_text": tokenizer.decode(gen, skip_special_tokens=True),
            "token_relevance": [[float(v) for v in r.token_relevance[i, t, cols]] for t in range(steps)],
            "target_id": gen,
            "target_token": tokenizer.convert_ids_to_tokens(gen),
            "target": r.target[i, :steps].tolist(),
            "conservation_delta": r.conservation_delta[i, :steps].tolist(),
        })
    return rows


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
    if isinstance(res, list):  # generate mode: the rows are made by _generation_call
        return res
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
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )
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
