"""Sentence embeddings as the model's checkpoint defines them, for context attribution on
retrieval models (an encoder such as all-MiniLM-L6-v2 scoring a passage against a query).

The pooling is read from the checkpoint (observe, don't re-derive): a sentence-transformers
checkpoint declares its modules in ``modules.json`` and its pooling in the Pooling module's
``config.json``; its ``sentence_bert_config.json`` gives the length it truncates to. A
checkpoint whose embedding pyattr cannot reproduce (a Dense layer after the pooling, max or
last-token pooling) is refused, as is a checkpoint that declares no pooling unless the
caller names one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

#: the poolings reproduced here (sentence-transformers' ``pooling_mode_*`` names in brackets)
POOLINGS = ("mean", "cls")
_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
          "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
          "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
#: modules after the pooling that leave the cosine similarity unchanged
_SCALE_FREE = ("sentence_transformers.models.Normalize",)


_LOOKED_UP: Dict[Tuple[str, str], Optional[Path]] = {}


def _checkpoint_file(model: nn.Module, name: str) -> Optional[Path]:
    """A file of the model's checkpoint: its local directory, the hub cache, or (for a hub
    model whose files are in the cache, not offline) the hub itself; None where absent."""
    where = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not where:
        return None
    local = Path(where) / name
    if local.is_file():
        return local
    if Path(where).is_dir():
        return None
    key = (str(where), name)
    if key not in _LOOKED_UP:  # a hub lookup once per process, not once per call
        _LOOKED_UP[key] = _hub_file(str(where), name)
    return _LOOKED_UP[key]


def _hub_file(repo: str, name: str) -> Optional[Path]:
    try:
        from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return None
    try:
        got = try_to_load_from_cache(repo, name)
        has_model = isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except Exception:  # a name that is no repo id
        return None
    if isinstance(got, str):
        return Path(got)
    if got is not None or not has_model or constants.HF_HUB_OFFLINE:
        # the cache records that the repo has no such file; or the model did not come from
        # the hub cache (nothing to ask the hub about); or the hub is off
        return None
    # transformers fetches the model's own files, not the sentence-transformers ones: this small file
    try:
        return Path(hf_hub_download(repo, name, etag_timeout=5))
    except Exception:  # no such file in the repo, or the hub cannot be reached
        return None


def checkpoint_pooling(model: nn.Module, pooling: Optional[str]) -> Tuple[str, Optional[int]]:
    """``(pooling, max_seq_length)`` of a sentence-embedding checkpoint.

    Args:
        pooling: ``"mean"`` / ``"cls"`` to override the checkpoint, or None to read it.

    Raises:
        ValueError: ``pooling`` not one of :data:`POOLINGS`; a checkpoint whose pooling is
            not one of them or that has modules after the pooling that change the cosine
            similarity (a Dense layer); no pooling declared and none given.
    """
    if pooling is not None and pooling not in POOLINGS:
        raise ValueError(f"pooling: expected one of {list(POOLINGS)} or None (read from the checkpoint), got {pooling!r}")
    max_len = None
    cfg = _checkpoint_file(model, "sentence_bert_config.json")
    if cfg is not None:
        max_len = json.loads(cfg.read_text()).get("max_seq_length")
    modules = _checkpoint_file(model, "modules.json")
    if modules is None:
        if pooling is None:
            raise ValueError("pooling: the checkpoint declares no sentence-transformers pooling (no modules.json); "
                             "name the pooling its embeddings use: pooling='mean' or 'cls'")
        return pooling, max_len
    entries = json.loads(modules.read_text())
    kinds = [e.get("type", "") for e in entries]
    after = kinds[next((i for i, k in enumerate(kinds) if k.endswith(".Pooling")), len(kinds)) + 1:]
    extra = [k for k in after if k not in _SCALE_FREE]
    if extra:
        raise ValueError(f"model: the checkpoint's embedding passes {extra} after its pooling, which pyattr does not "
                         "reproduce; context_attribution's query= supports a Transformer, a Pooling and a Normalize")
    if pooling is not None:
        return pooling, max_len
    pool_dir = next((e.get("path", "") for e in entries if e.get("type", "").endswith(".Pooling")), None)
    conf = _checkpoint_file(model, f"{pool_dir}/config.json") if pool_dir else None
    if conf is None:
        raise ValueError("pooling: the checkpoint's modules.json names no Pooling configuration pyattr can read; "
                         "name the pooling: pooling='mean' or 'cls'")
    on = [m for key, m in _MODES.items() if json.loads(conf.read_text()).get(key)]
    if len(on) != 1 or on[0] not in POOLINGS:
        raise ValueError(f"model: the checkpoint pools by {on}; pyattr reproduces one of {list(POOLINGS)}")
    return on[0], max_len


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    if pooling == "cls":
        return hidden[:, 0]
    m = mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1)


@torch.no_grad()
def embed(model: nn.Module, rows: Sequence[Sequence[int]], pooling: str, batch_size: int = 64) -> torch.Tensor:
    """Pooled embeddings (float64, on the CPU) of id rows, right-padded in batches: padding is
    masked out of attention and of the mean, and every real token keeps its position."""
    device = next(model.parameters()).device
    out: List[torch.Tensor] = []
    for lo in range(0, len(rows), batch_size):
        chunk = rows[lo:lo + batch_size]
        width = max(len(x) for x in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, x in enumerate(chunk):
            ids[i, :len(x)] = torch.as_tensor(list(x))
            mask[i, :len(x)] = 1
        res = model(input_ids=ids.to(device), attention_mask=mask.to(device))
        hidden = res.last_hidden_state if hasattr(res, "last_hidden_state") else res[0]
        out.append(pool(hidden.double(), mask.to(device), pooling).cpu())
    return torch.cat(out)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of rows of ``a`` with the vector ``b`` (float64)."""
    return (a @ b) / (a.norm(dim=-1) * b.norm()).clamp(min=1e-300)
