"""Where a dataset run keeps its results: Parquet shards written atomically, the manifest
(what a resumed run must share with the stored one), and the lock of an output directory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional

import torch

import pyattr.methods._core.positions as P
from pyattr.apps.prompts import Prompt, RunError
from pyattr.methods._core.inputs import input_device

MANIFEST = "_manifest.json"


COLUMNS = ("id", "index", "text", "tokens", "token_relevance", "target_id", "target_token", "target", "conservation_delta", "error", "seconds")


def stored_ids(out: Path) -> set:
    """Ids already in complete shards of ``out`` (all ranks)."""
    import pyarrow.parquet as pq

    ids = set()
    for f in sorted(out.glob("part-*.parquet")):
        ids.update(pq.read_table(f, columns=["id"]).column("id").to_pylist())
    return ids


def next_seq(out: Path, rank: int) -> int:
    seqs = [int(f.stem.split("-")[2]) for f in out.glob(f"part-{rank:05d}-*.parquet")]
    return max(seqs) + 1 if seqs else 0


#: the columns of a run with ``generate``: the per-target columns hold one entry per
#: generated token, ``token_relevance`` one list per generated token
GENERATE_COLUMNS = ("id", "index", "text", "tokens", "generated_text", "token_relevance", "target_id", "target_token",
                    "target", "conservation_delta", "error", "seconds")


def write_shard(out: Path, rank: int, seq: int, rows: List[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if rows and "generated_text" in rows[0]:
        schema = pa.schema([
            ("id", pa.string()), ("index", pa.int64()), ("text", pa.string()), ("tokens", pa.list_(pa.string())),
            ("generated_text", pa.string()), ("token_relevance", pa.list_(pa.list_(pa.float32()))),
            ("target_id", pa.list_(pa.int64())), ("target_token", pa.list_(pa.string())),
            ("target", pa.list_(pa.float64())), ("conservation_delta", pa.list_(pa.float64())),
            ("error", pa.string()), ("seconds", pa.float64()),
        ])
    else:
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


def build_manifest(model, tokenizer, rules, text_field, target_field, data, command, world) -> dict:
    from pyattr._version import __version__
    import pyattr.backends as backends
    from pyattr.apps.explain import _rules_dict

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
        "pyattr_version": __version__,
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
         "max_tokens_per_batch", "generate")


def fingerprint(prompts: List[Prompt]) -> str:
    """SHA-256 of the prompts (ids, texts, targets, in order): an edited data file, or
    another list, is another run."""
    import hashlib

    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.id, p.text, p.target, p.error], ensure_ascii=True).encode())
    return h.hexdigest()


def check_manifest(out: Path, manifest: dict) -> None:
    path = out / MANIFEST
    if not path.exists():
        return
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise RunError(f"out (--out): {str(path)!r} is unreadable; remove it (and the shards) to start over") from None
    same = [k for k in _SAME if k != "max_tokens_per_batch" or manifest.get("dtype") != "float32"]
    diff = [k for k in same if old.get(k) != manifest.get(k)]
    if diff:
        k = diff[0]
        raise RunError(
            f"--out: {str(out)!r} holds a run with another {k} ({old.get(k)!r}, now {manifest.get(k)!r}); "
            "resuming would mix results: use another --out directory"
        )


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def lock_output(out: Path, rank: int):
    """An exclusive lock per rank on ``out``: two runs writing the same rank's shards at
    once would overwrite each other's sequence numbers."""
    import fcntl

    f = open(out / f".lock-{rank:05d}", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise RunError(f"out (--out): another run is writing to {str(out)!r} (rank {rank}); wait for it or use another directory") from None
    return f
