"""The ``pyattr explain`` job: relevance of each token for a model's output.

Two targets:

* a sentence pair on a sentence-embedding model (default: the bundled
  all-MiniLM-L6-v2): the cosine similarity of the mean-pooled embeddings. The vector
  norms are frozen (LN-rule) and the dot product is split with the Half-rule, so the
  similarity is conserved down to the embeddings up to what biases absorb;
* a causal LM: the next-token logit of a text (top-1 or a chosen token).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import torch

import pyattr.hub as _hub
from pyattr.backends import available_backends
import pyattr.apps.contention as _contention
import pyattr.methods._core as core
from pyattr.config import RelevanceRules
from pyattr.methods._core.tokens import check_token_count, prompt_ids, target_token_id
from pyattr.methods.relevance import relevance

DEFAULT_PAIR = (
    "A man is playing a guitar on stage.",
    "Someone performs music with a guitar in front of an audience.",
)
DEFAULT_TEXT = "The capital of France is"


class ExplainError(Exception):
    """A user-facing error: printed as one line, without a traceback."""


@dataclass
class Segment:
    text: str
    tokens: List[str]
    relevance: List[float]


@dataclass
class Explanation:
    mode: str
    model: str
    target_description: str
    target: float
    relevance_sum: float
    conservation_delta: float
    wall_time_s: float
    backend: str
    rules: dict
    segments: List[Segment] = field(default_factory=list)
    installed: int = 0
    has_bias: Optional[bool] = None  # None: not known
    contention: Optional[_contention.Contention] = None  # CPU conditions of the timed pass
    # image mode: the patch grid (rows, cols) of the segment's tokens after [CLS], and
    # where the relevance map over the image was written
    patch_grid: Optional[tuple] = None
    image_png: Optional[str] = None
    # the bare overlay (PNG bytes, no title or colour bar): what the HTML page lays its
    # hover grid on; not in the JSON
    image_overlay: Optional[bytes] = field(default=None, repr=False)

    @property
    def conserved(self) -> bool:
        return abs(self.conservation_delta) <= 1e-4 * max(abs(self.target), 1e-12)

    @property
    def conservation_note(self) -> str:
        """Why ``target − Σ relevance`` is not zero, naming the causes that apply."""
        if self.conserved:
            return "conserved: relevance sums to the target"
        rules = self.rules or {}
        causes = []
        if rules.get("attention") == "attnlrp":
            causes.append("the AttnLRP rule does not conserve relevance (it scales the q, k, v gradients by ¼, ¼, ½)")
        off = [name for key, name in _RULE_NAMES if key in rules and rules[key] is False]
        if off:
            causes.append(f"relevance is not conserved where a rule is off ({', '.join(off)})")
        if self.has_bias is not False:
            causes.append("biases absorb relevance")
        if not causes:
            causes.append("relevance is lost in modules that carry no rule")
        return "; ".join(causes)

    def to_json(self) -> dict:
        out = {
            "mode": self.mode,
            "model": self.model,
            "target_description": self.target_description,
            "target": _unsigned_zero(self.target),
            "relevance_sum": _unsigned_zero(self.relevance_sum),
            "conservation_delta": _unsigned_zero(self.conservation_delta),
            "conservation_note": self.conservation_note,
            "wall_time_s": self.wall_time_s,
            "contention": self.contention.to_json() if self.contention is not None else None,
            "backend": self.backend,
            "rules": self.rules,
            "rules_installed": self.installed,
            "segments": [
                {"text": s.text, "tokens": s.tokens, "relevance": [_unsigned_zero(v) for v in s.relevance]}
                for s in self.segments
            ],
        }
        if self.patch_grid is not None:
            out["patch_grid"] = list(self.patch_grid)
            out["image_png"] = self.image_png
        return out


_RULE_NAMES = (
    ("normalization", "LN-rule"),
    ("activation", "Identity-rule"),
    ("multiplicative_gate", "Half-rule"),
    ("attention", "AH-rule"),
)


def _unsigned_zero(v: float) -> float:
    """-0.0 becomes 0.0 (so JSON never shows ``-0.0``); every other value is unchanged."""
    return v + 0.0


def _offline():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def bundled_model_dir() -> Path:
    """The directory of the bundled all-MiniLM-L6-v2."""
    try:
        return next(b for b in _hub.BUNDLED if b.name == "minilm").where()
    except _hub.ModelLoadError as e:
        raise ExplainError(str(e)) from None


def _check_dir(path: Path) -> None:
    try:
        _hub.check_dir(Path(path))
    except _hub.ModelLoadError as e:
        raise ExplainError(str(e)) from None


_TOKENIZER_FILES = _hub.TOKENIZER_FILES
_config_type = _hub.config_type


def model_label(name_or_path) -> str:
    """How every output names a model: a bundled one by its name (``induction (bundled)``,
    whether given by name or by its install path), a hub id or directory as given."""
    try:
        return _hub.resolve(name_or_path).label
    except _hub.ModelLoadError:
        return str(name_or_path)


def _source(name_or_path) -> "_hub.Source":
    """Where ``--model`` points; offline (``HF_HUB_OFFLINE=1`` unless set) for a local or
    bundled model, the hub left reachable for a hub id."""
    try:
        src = _hub.resolve(name_or_path)
    except _hub.ModelLoadError as e:
        raise ExplainError(str(e)) from None
    if src.local:
        _offline()
    else:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return src


def _load(path, causal: bool, dtype: torch.dtype = torch.float32, placement: Optional[dict] = None):
    """The tokenizer and model of a local directory, a bundled name or a hub id
    (:func:`pyattr.hub.load_pretrained`, its errors as :class:`ExplainError`). ``placement``:
    accelerate's loading arguments (``device_map``, ``max_memory``, ``offload_folder``) for
    a model placed over devices, the CPU and the disk."""
    _source(path)
    try:
        return _hub.load_pretrained(path, causal=causal, dtype=dtype, placement=placement)
    except _hub.ModelLoadError as e:
        raise ExplainError(str(e)) from None


def _has_bias(model) -> bool:
    """Whether any bias is nonzero (a zero bias absorbs no relevance)."""
    with torch.no_grad():
        return any(
            name.rsplit(".", 1)[-1] == "bias" and bool(p.count_nonzero()) for name, p in model.named_parameters()
        )


def _tokens(tok, ids) -> List[str]:
    return tok.convert_ids_to_tokens([int(i) for i in ids])


def _rules_dict(rules: RelevanceRules) -> dict:
    return {
        "normalization": rules.normalization,
        "activation": rules.activation,
        "multiplicative_gate": rules.multiplicative_gate,
        "attention": rules.attention,
        "routing": rules.routing,
    }


def _check_text(name: str, text: Optional[str]) -> str:
    if text is None or not text.strip():
        raise ExplainError(f"{name} is empty; give some text to explain")
    return text


def check_prompt(name: str, ids: List[int], model, tok) -> None:
    """A causal prompt's ids (:func:`pyattr.methods._core.tokens.prompt_ids`, the appended end-of-text
    markers already dropped): at least one token that is not special, and no longer than
    the model reads."""
    if not ids or all(i in set(tok.all_special_ids) for i in ids):
        raise ExplainError(f"{name} has no tokens the model can read after tokenisation")
    limit = core.max_positions(model)
    if limit is not None and len(ids) > limit:
        raise ExplainError(f"{name} is {len(ids)} tokens long; the model reads at most {limit}")


def _check_tokens(name: str, n_tokens: int, model, tok) -> None:
    try:
        check_token_count(name, n_tokens, model, tok)
    except ValueError as e:
        raise ExplainError(str(e)) from None


def explain_pair(
    text_a: str, text_b: str, model_dir: Optional[Path] = None, rules: Optional[RelevanceRules] = None,
    generic: bool = False,
) -> Explanation:
    """Relevance of each token of two sentences for their embeddings' cosine similarity
    (``generic``: an encoder without a rule map, through structural discovery)."""
    _check_text("--text", text_a)
    _check_text("--pair", text_b)
    monitor = _contention.start()  # the window spans the load too: long enough to measure
    path = bundled_model_dir() if model_dir is None else model_dir
    tok, model = _load(path, causal=False)
    rules = RelevanceRules.all() if rules is None else rules
    from pyattr.methods.similarity import pair_batch, pair_cosine

    try:  # the checkpoint's embedding and each text as sentence-transformers' encode reads it
        enc, pooling = pair_batch(model, tok, text_a, text_b, names=("--text", "--pair"))
    except ValueError as e:
        msg = str(e)
        raise ExplainError(msg if msg.startswith(("--text", "--pair")) else f"--pair: {msg}") from None
    mask = enc["attention_mask"]
    cosine = pair_cosine(mask, pooling)

    available_backends()  # probe (imports, extension load) outside the timed pass
    t0 = time.perf_counter()
    res = relevance(model, dict(enc), target=cosine, rules=rules, generic=generic)
    wall = time.perf_counter() - t0
    cond = monitor.stop()
    segs = []
    for row, text in enumerate((text_a, text_b)):
        real = mask[row].bool()  # the tokenizer may pad on either side
        ids = enc["input_ids"][row, real]
        segs.append(Segment(text, _tokens(tok, ids), [float(v) for v in res.token_relevance[row, real]]))
    total = float(res.relevance.double().sum())
    return Explanation(
        mode="pair",
        model=model_label(path),
        target_description=f"cosine similarity of the {'mean' if pooling == 'mean' else 'CLS'}-pooled sentence "
                           "embeddings",
        target=float(res.target),
        relevance_sum=total,
        conservation_delta=float(res.conservation_delta),
        wall_time_s=wall,
        backend=res.backend,
        rules=_rules_dict(rules),
        segments=segs,
        installed=len(res.coverage.installed),
        has_bias=_has_bias(model),
        contention=cond,
    )


def _target_id(tok, target: str, vocab_size: int, text: Optional[str] = None) -> int:
    """The id of the target token that follows ``text`` (:func:`pyattr.methods._core.tokens.target_token_id`)."""
    tid = target_token_id(tok, target, vocab_size, text)
    if isinstance(tid, str):
        raise ExplainError(tid)
    return tid


def explain_causal(
    model_dir: Path,
    text: str,
    target: Optional[str] = None,
    rules: Optional[RelevanceRules] = None,
    generic: bool = False,
) -> Explanation:
    """Relevance of each token of ``text`` for the next-token logit (top-1 or ``target``)."""
    _check_text("--text", text)
    monitor = _contention.start()  # the window spans the load too: long enough to measure
    tok, model = _load(model_dir, causal=True)
    rules = RelevanceRules.all() if rules is None else rules
    vocab_size = int(getattr(model.config, "vocab_size", 0) or len(tok))
    tid = _target_id(tok, target, vocab_size, text) if target is not None else None
    ids = prompt_ids(tok, text)
    check_prompt("--text", ids, model, tok)
    enc = {"input_ids": torch.tensor([ids])}
    available_backends()  # probe (imports, extension load) outside the timed pass
    t0 = time.perf_counter()
    res = relevance(model, enc, target=tid, rules=rules, generic=generic)
    wall = time.perf_counter() - t0
    cond = monitor.stop()
    chosen = int(res.target_ids[0])
    name = tok.convert_ids_to_tokens([chosen])[0]
    seg = Segment(text, _tokens(tok, ids), [float(v) for v in res.token_relevance[0]])
    return one_row_explanation(
        "causal", model_label(model_dir), f"next-token logit of {name!r} (id {chosen}{', top-1' if tid is None else ''})",
        res, model, rules, wall, cond, [seg])


def one_row_explanation(mode: str, model_name: str, description: str, res, model, rules: RelevanceRules,
                        wall: float, cond, segments: List[Segment], **extra) -> Explanation:
    """The :class:`Explanation` of row 0 of a relevance result."""
    return Explanation(
        mode=mode,
        model=model_name,
        target_description=description,
        target=float(res.target[0]),
        relevance_sum=float(res.relevance.double().sum()),
        conservation_delta=float(res.conservation_delta[0]),
        wall_time_s=wall,
        backend=res.backend,
        rules=_rules_dict(rules),
        segments=segments,
        installed=len(res.coverage.installed),
        has_bias=_has_bias(model),
        contention=cond,
        **extra,
    )
