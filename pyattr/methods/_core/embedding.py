"""Sentence embeddings as the model's checkpoint defines them, for context attribution on
retrieval models (an encoder such as all-MiniLM-L6-v2 scoring a passage against a query).

What makes the embedding is read from the checkpoint (observe, don't re-derive): a
sentence-transformers checkpoint declares its modules in ``modules.json`` and its pooling in
the Pooling module's ``config.json``; its ``sentence_bert_config.json`` gives the length it
truncates to and whether it lower-cases; ``config_sentence_transformers.json`` the prompts
``encode_query`` and ``encode_document`` put before a text, and the similarity. A checkpoint
whose embedding pyattr cannot reproduce (a Dense layer, max or last-token pooling, a prompt
left out of the pooling, a similarity other than the cosine) is refused by name, as is a
checkpoint that declares no pooling unless the caller names one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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


@dataclass(frozen=True)
class SentenceEmbedding:
    """What a sentence-transformers checkpoint makes of a text, as far as it changes the
    embedding: the pooling, the lengths it truncates to, the prompts ``encode_query`` and
    ``encode_document`` put before the text, and lower-casing."""

    pooling: str
    max_len: Optional[int] = None
    query_prompt: str = ""
    document_prompt: str = ""
    lower_case: bool = False
    #: the prompt plain ``encode`` puts before every text (``default_prompt_name``'s)
    default_prompt: str = ""
    #: the tokenizer's own limit applies (no ``max_seq_length`` declared: sentence-transformers
    #: reads ``model_max_length``, capped at ``max_position_embeddings``)
    tokenizer_limit: bool = False
    #: per-role caps (``query_length`` / ``document_length``, a ``max_length`` of its processing)
    query_max: Optional[int] = None
    document_max: Optional[int] = None

    def text(self, text: str, role: str) -> Tuple[str, int]:
        """``(what the model reads, the prompt's length in characters)`` for a query, a
        document or a plain ``encode`` (``role``: ``"query"``, ``"document"``, ``"encode"``):
        the prompt, then the text, both lower-cased where the checkpoint says (as
        sentence-transformers lower-cases what it tokenizes)."""
        prompt = {"query": self.query_prompt, "document": self.document_prompt}.get(role, self.default_prompt)
        read = prompt + text
        if self.lower_case:
            if len(read.lower()) != len(read):
                raise ValueError(f"{'query' if role == 'query' else 'inputs'}: the checkpoint lower-cases its texts "
                                 "(do_lower_case), which changes this text's length, so its sources' character "
                                 "offsets would not carry over; pass a text whose lower case is as long")
            read = read.lower()
        return read, len(prompt)

    def limit(self, role: str, model: nn.Module, tokenizer) -> Tuple[Optional[int], str]:
        """``(tokens, where it is declared)``: the longest input the checkpoint embeds without
        truncating it, for ``role`` (``"query"``, ``"document"``, ``"encode"``)."""
        found = []
        if self.max_len is not None:
            found.append((int(self.max_len), "max_seq_length"))
        elif self.tokenizer_limit:
            n = getattr(tokenizer, "model_max_length", None)
            if isinstance(n, int) and n < 10 ** 9:
                found.append((n, "the tokenizer's model_max_length"))
            pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
            if isinstance(pos, int) and pos > 0:
                found.append((pos, "max_position_embeddings"))
        cap = {"query": self.query_max, "document": self.document_max}.get(role)
        if cap is not None:
            found.append((int(cap), f"{role}_length"))
        return min(found) if found else (None, "")


#: sentence_bert_config.json keys read here, and what they may hold without changing the
#: embedding pyattr reproduces (any other key, or value, is refused by name)
_BERT_KEYS = {"max_seq_length", "do_lower_case", "query_length", "document_length", "tokenizer_args",
              "processor_kwargs", "processing_kwargs", "model_args", "config_args", "transformer_task",
              "modality_config", "module_output_name", "cache_dir", "backend"}
_LENGTH_KEYS = {"max_length", "truncation", "padding"}
_SIMILARITIES = {"cosine": "cosine", "cos_sim": "cosine", "dot": "dot", "dot_product": "dot", "dot_score": "dot"}


def _read_bert_config(bert: dict) -> dict:
    """What a ``sentence_bert_config.json`` declares that changes the embedding: the length
    caps and lower-casing; what pyattr does not reproduce raises ``ValueError`` naming it."""
    unknown = sorted(k for k, v in bert.items() if k not in _BERT_KEYS and v not in (None, False, {}, []))
    if unknown:
        raise ValueError(f"model: the checkpoint's sentence_bert_config.json sets {unknown}, which pyattr does not "
                         "reproduce; context_attribution's query= reads max_seq_length, do_lower_case, the length "
                         "caps and a feature-extraction Transformer")
    task = bert.get("transformer_task")
    modality = bert.get("modality_config")
    if task not in (None, "feature-extraction") or bert.get("module_output_name") not in (None, "token_embeddings") or (
            modality not in (None, {}) and modality != {"text": {"method": "forward",
                                                              "method_output_name": "last_hidden_state"}}):
        raise ValueError(f"model: the checkpoint's Transformer module is not a plain feature extractor "
                         f"(transformer_task={task!r}, modality_config={modality!r}); context_attribution's query= "
                         "pools the encoder's last hidden state")
    caps = []
    for holder in ("tokenizer_args", "processor_kwargs"):
        args = bert.get(holder) or {}
        other = sorted(set(args) - {"model_max_length", "do_lower_case"})
        if other:
            raise ValueError(f"model: the checkpoint's sentence_bert_config.json {holder} sets {other}, which pyattr "
                             "does not reproduce")
        if isinstance(args.get("model_max_length"), int):
            caps.append(args["model_max_length"])
    proc = bert.get("processing_kwargs") or {}
    for part, kw in proc.items():
        other = sorted(set(kw or {}) - _LENGTH_KEYS) if isinstance(kw, dict) else [part]
        if part not in ("text", "common") or other:
            raise ValueError(f"model: the checkpoint's processing_kwargs set {part}: {other or kw!r}, which pyattr "
                             "does not reproduce (it reads a text max_length)")
        if isinstance(kw.get("max_length"), int) and kw.get("truncation", True) is not False:
            caps.append(kw["max_length"])
    max_len = bert.get("max_seq_length")
    lower = bool(bert.get("do_lower_case", False)) or any(
        bool((bert.get(h) or {}).get("do_lower_case", False)) for h in ("tokenizer_args", "processor_kwargs"))
    return {"max_len": min([m for m in [max_len] + caps if isinstance(m, int)], default=None),
            "tokenizer_limit": max_len is None and not caps, "lower_case": lower,
            "query_max": bert.get("query_length"), "document_max": bert.get("document_length")}


def _modes(conf: dict) -> List[str]:
    """The pooling modes of a Pooling configuration: sentence-transformers' ``pooling_mode``
    (a name or a list, its current form) or the ``pooling_mode_*`` flags (the older one)."""
    mode = conf.get("pooling_mode")
    if isinstance(mode, str):
        return [mode]
    if isinstance(mode, (list, tuple)):
        return [str(m) for m in mode]
    return [m for key, m in _MODES.items() if conf.get(key)]


def _st_prompts(config: dict) -> Tuple[str, str, str]:
    """``(query prompt, document prompt, default prompt)`` as the installed sentence-transformers resolves
    them for ``encode_query`` / ``encode_document`` from the checkpoint's ``prompts`` and
    ``default_prompt_name``: the ``"query"`` prompt; the first of ``"document"``,
    ``"passage"``, ``"corpus"``; else the default prompt. sentence-transformers 6 starts
    from empty ``"query"`` and ``"document"`` prompts (its ``_default_prompts``), so a
    checkpoint's ``"passage"`` prompt or default prompt no longer reaches them there; the
    installed version's own defaults are read (none without sentence-transformers)."""
    try:
        from sentence_transformers import SentenceTransformer

        defaults = dict(getattr(SentenceTransformer, "_default_prompts", None) or {})
    except Exception:  # noqa: BLE001 - not installed, or failing to import
        defaults = {}
    prompts = {k: "" for k in defaults}
    prompts.update({k: v for k, v in (config.get("prompts") or {}).items() if isinstance(v, str)})
    default = config.get("default_prompt_name")
    fallback = prompts.get(default, "") if isinstance(default, str) else ""
    query = prompts["query"] if "query" in prompts else fallback
    doc = next((prompts[k] for k in ("document", "passage", "corpus") if k in prompts), fallback)
    return query, doc, fallback


def checkpoint_embedding(model: nn.Module, pooling: Optional[str]) -> SentenceEmbedding:
    """The embedding a sentence-embedding checkpoint defines (:class:`SentenceEmbedding`),
    read from its sentence-transformers files: ``modules.json`` (a Transformer, a Pooling,
    a Normalize: any other module is refused by name), the Pooling's ``config.json``,
    ``sentence_bert_config.json`` (``max_seq_length``, ``do_lower_case``) and
    ``config_sentence_transformers.json`` (``prompts``, ``default_prompt_name``,
    ``similarity_fn_name``).

    Args:
        pooling: ``"mean"`` / ``"cls"`` to override the checkpoint, or None to read it.

    Raises:
        ValueError: ``pooling`` not one of :data:`POOLINGS`; a checkpoint whose pooling is
            not one of them, that excludes its prompt from the pooling (``include_prompt``
            false), that has modules pyattr does not reproduce (a Dense layer, a Router), or
            whose similarity is not the cosine (``similarity_fn_name`` other than
            ``cosine``, or ``dot`` without a Normalize module); no pooling declared and none
            given.
    """
    if pooling is not None and pooling not in POOLINGS:
        raise ValueError(f"pooling: expected one of {list(POOLINGS)} or None (read from the checkpoint), got {pooling!r}")
    cfg = _checkpoint_file(model, "sentence_bert_config.json")
    read = _read_bert_config(json.loads(cfg.read_text())) if cfg is not None else {"tokenizer_limit": True}
    st = _checkpoint_file(model, "config_sentence_transformers.json")
    st_config = json.loads(st.read_text()) if st is not None else {}
    query_prompt, document_prompt, default_prompt = _st_prompts(st_config)

    def spec(pooling):
        return SentenceEmbedding(pooling, read.get("max_len"), query_prompt, document_prompt,
                                 read.get("lower_case", False), default_prompt, read["tokenizer_limit"],
                                 read.get("query_max"), read.get("document_max"))

    modules = _checkpoint_file(model, "modules.json")
    if modules is None:
        if pooling is None:
            raise ValueError("pooling: the checkpoint declares no sentence-transformers pooling (no modules.json); "
                             "name the pooling its embeddings use: pooling='mean' or 'cls'")
        return spec(pooling)
    entries = json.loads(modules.read_text())
    kinds = [e.get("type", "") for e in entries]
    at = next((i for i, k in enumerate(kinds) if k.endswith(".Pooling")), len(kinds))
    before = [k for k in kinds[:at] if not k.endswith(".Transformer")]
    extra = [k for k in kinds[at + 1:] if k not in _SCALE_FREE and not k.endswith(".Normalize")]
    if before or extra:
        where = f"{before} before" if before else f"{extra} after"
        raise ValueError(f"model: the checkpoint's embedding passes {where} its pooling, which pyattr does not "
                         "reproduce; context_attribution's query= supports a Transformer, a Pooling and a Normalize")
    named = st_config.get("similarity_fn_name") or "cosine"
    similarity = _SIMILARITIES.get(named, named)
    normalised = any(k.endswith(".Normalize") for k in kinds[at + 1:])
    if similarity != "cosine" and not (similarity == "dot" and normalised):
        raise ValueError(f"model: the checkpoint compares embeddings by similarity_fn_name={named!r}"
                         f"{' without a Normalize module' if similarity == 'dot' else ''}; context_attribution's "
                         "query= scores the cosine similarity (or the dot product of normalised embeddings)")
    pool_dir = next((e.get("path", "") for e in entries if e.get("type", "").endswith(".Pooling")), None)
    conf_file = _checkpoint_file(model, f"{pool_dir}/config.json") if pool_dir else None
    conf = json.loads(conf_file.read_text()) if conf_file is not None else None
    if conf is not None and conf.get("include_prompt", True) is False and (query_prompt or document_prompt
                                                                            or default_prompt):
        raise ValueError("model: the checkpoint's pooling leaves its prompt tokens out (include_prompt: false), which "
                         "pyattr does not reproduce; context_attribution's query= pools every token")
    if pooling is None:
        if conf is None:
            raise ValueError("pooling: the checkpoint's modules.json names no Pooling configuration pyattr can read; "
                             "name the pooling: pooling='mean' or 'cls'")
        on = _modes(conf) or ["mean"]  # no mode set: sentence-transformers' Pooling defaults to the mean
        if len(on) != 1 or on[0] not in POOLINGS:
            raise ValueError(f"model: the checkpoint pools by {on}; pyattr reproduces one of {list(POOLINGS)}")
        pooling = on[0]
    return spec(pooling)


def checkpoint_pooling(model: nn.Module, pooling: Optional[str]) -> Tuple[str, Optional[int]]:
    """``(pooling, max_seq_length)`` of a sentence-embedding checkpoint
    (:func:`checkpoint_embedding`, whose errors it raises)."""
    spec = checkpoint_embedding(model, pooling)
    return spec.pooling, spec.max_len


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
