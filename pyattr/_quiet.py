"""transformers' own loading noise (its progress bars, its warnings) off while pyattr loads a
checkpoint, and as the user had it afterwards. Its own module: the hub loader and the toy
loaders both use it."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def quiet_transformers():
    """transformers' own progress bars ("Loading weights") and warnings off while pyattr
    loads a checkpoint, as they were before afterwards: every bundled and hub load looks
    the same (downloads keep huggingface_hub's bars)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers missing: the caller says so
        yield
        return
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
