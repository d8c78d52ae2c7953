"""What the commands share: the one-line error and the check of an output path."""

from __future__ import annotations

import os
import sys
from pathlib import Path


class UsageError(ValueError):
    """A bad argument: printed as one line (``pyattr CMD: error: ...``), exit status 2."""


def fail(command: str, message: str, status: int = 2) -> int:
    print(f"pyattr {command}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return status


def check_output_path(flag: str, path: str) -> None:
    """Raise :class:`UsageError` unless ``path`` can be written as a file, so that a bad
    output path fails before any model is loaded or any benchmark runs.

    The directory must exist, and the file is opened for appending (and removed again if
    this created it): that is the one test that holds for root, read-only file systems
    and access-control lists alike.
    """
    if not path or not path.strip():
        raise UsageError(f"{flag} needs a file path")
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag}: cannot write {path!r}: it is a directory")
    # a symlink (dangling or not) is written through: probe and clean up its target,
    # never the link itself
    real = Path(os.path.realpath(p)) if p.is_symlink() else p
    parent = real.parent if str(real.parent) else Path(".")
    if not parent.exists():
        raise UsageError(f"{flag}: cannot write {path!r}: directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise UsageError(f"{flag}: cannot write {path!r}: {str(parent)!r} is not a directory")
    existed = real.exists()
    try:
        with open(real, "a"):
            pass
    except OSError as e:
        raise UsageError(f"{flag}: cannot write {path!r}: {e.strerror or e}") from None
    if not existed:
        try:
            os.unlink(real)
        except OSError:
            pass


def model_dir(value: str) -> str:
    """``--model``: a local directory, a bundled name (``minilm``, ``induction``, ``squares``)
    or a Hugging Face Hub id, kept as given; :func:`pyattr.hub.resolve` decides which when
    the command runs (a directory of the same name wins)."""
    return value


def bundled_name(value):
    """The bundled model ``--model`` names, by name or by its install path (``"minilm"``,
    ``"induction"``, ``"squares"``), else None."""
    if value is None:
        return None
    from pyattr.hub import BUNDLED, ModelLoadError, resolve

    try:
        label = resolve(value).label
    except (ModelLoadError, TypeError):
        return None
    return next((b.name for b in BUNDLED if b.label == label), None)


def is_toy(value) -> bool:
    """Whether ``--model`` is the bundled toy induction decoder (by name or by its path)."""
    return bundled_name(value) == "induction"


def check_model(value) -> None:
    """Raise :class:`UsageError` when ``--model`` names a directory that does not exist
    (with close matches: "did you mean"), is not a directory or has no config.json, or a
    hub id the hub cannot give (offline and not in the cache, unreachable, not found,
    gated): before torch is imported, so that a typo fails in a moment."""
    if value is None:
        return
    from pyattr.hub import ModelLoadError, check_source

    try:
        check_source(value)
    except ModelLoadError as e:
        raise UsageError(str(e)) from None


def checkpoint_kind(value):
    """``(kind, architecture)`` of the checkpoint ``--model`` names, read from its
    config.json without loading anything (a local or bundled directory, or a hub id whose
    config is in the local cache), else None. ``kind``: ``"causal LM"``, ``"image
    classifier"``, ``"encoder-decoder"``, ``"sentence encoder"`` (an encoder saved by
    sentence-transformers) or ``"encoder"``."""
    import json

    from pyattr.hub import ModelLoadError, resolve

    try:
        src = resolve(value)
    except (ModelLoadError, TypeError):
        return None
    config = None
    if src.local:
        config = Path(src.location) / "config.json"
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(src.location, "config.json")
            config = Path(hit) if isinstance(hit, str) else None
        except ImportError:
            config = None
    try:
        cfg = json.loads(config.read_text()) if config is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    archs = [a for a in cfg.get("architectures") or () if isinstance(a, str)]
    arch = archs[0] if archs else str(cfg.get("model_type", "unknown"))
    if any(a.endswith("ForImageClassification") for a in archs):
        return "image classifier", arch
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal LM", arch
    if cfg.get("is_encoder_decoder"):
        return "encoder-decoder", arch
    if src.local and any((Path(src.location) / f).is_file() for f in ("modules.json", "sentence_bert_config.json")):
        return "sentence encoder", arch
    return "encoder", arch


def _article(kind: str) -> str:
    """``"a causal LM"``, ``"an image classifier"``, ``"an encoder"``."""
    return ("an " if kind[0] in "aeio" else "a ") + kind
