"""Small trained models whose mechanism is known: ground truth for explanations.

``load()`` returns a 2-layer Llama trained (``python -m pyattr.toy.train``) to continue a
repeated segment of words by induction, its tokenizer, and its circuit (two previous-token
heads in layer 0, two induction heads in layer 1; ``circuit.json``, found by
:mod:`pyattr.toy.circuit`). It ships in the package (about 0.4 MB) and loads offline.

``load_squares()`` returns a 2-layer ViT image classifier trained (``python -m
pyattr.toy.vision``) to name the colour of the one square in a 32 × 32 image, and its image
processor: the evidence for its class is the patches the square covers (about 0.1 MB).

``load_translation()`` returns a 2 + 2-layer Marian encoder–decoder trained (``python -m
pyattr.toy.translation``) to translate a sentence word for word into upper case, in
reverse order, and its tokenizer: each output word's evidence is one known source word
(about 0.7 MB).
"""

from __future__ import annotations

import json
from pathlib import Path

#: The directory of the shipped model (``save_pretrained`` layout plus ``circuit.json``).
INDUCTION_DIR = Path(__file__).resolve().parent / "induction"
#: A second induction decoder, the same architecture and task trained independently
#: (``python -m pyattr.toy.train DIR --seed 1``): what a result on one trained model
#: cannot owe to its particular weights is checked on both (``toy.load(toy.INDUCTION_B_DIR)``).
INDUCTION_B_DIR = Path(__file__).resolve().parent / "induction_b"
#: A 4-layer induction decoder, the same task and width (``python -m pyattr.toy.train DIR
#: --layers 4``): estimates measured on a model where several blocks lie between a node and
#: the output. Training found no head that passes the circuit thresholds alone (its
#: ``circuit.json`` lists none: the mechanism is spread over heads and layers).
INDUCTION_4L_DIR = Path(__file__).resolve().parent / "induction_4l"
#: The name ``pyattr explain / patch / generate --model`` accept for it.
INDUCTION_NAME = "induction"
#: The directory of the shipped image classifier (``save_pretrained`` layout plus its
#: ``preprocessor_config.json``).
SQUARES_DIR = Path(__file__).resolve().parent / "squares"
#: The directory of the shipped translation model (an encoder–decoder, ``save_pretrained``
#: layout plus its tokenizer and ``training.json``).
TRANSLATION_DIR = Path(__file__).resolve().parent / "translation"
#: A 4-layer induction decoder, the same task and width (``python -m pyattr.toy.train DIR
#: --layers 4``): estimates measured on a model where several blocks lie between a node and
#: the output. Training found no head that passes the circuit thresholds alone (its
#: ``circuit.json`` lists none: the mechanism is spread over heads and layers).
INDUCTION_4L_DIR = Path(__file__).resolve().parent / "induction_4l"
#: The name ``pyattr explain --model`` accepts for it.
SQUARES_NAME = "squares"


def load(path=None):
    """(model, tokenizer, circuit) of the toy induction decoder, model in eval mode, float32,
    eager attention. ``path``: a directory written by ``python -m pyattr.toy.train``
    (default: the shipped one; ``INDUCTION_B_DIR`` the second one, ``INDUCTION_4L_DIR`` the
    4-layer one)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from pyattr._quiet import quiet_transformers

    path = Path(path) if path is not None else INDUCTION_DIR
    with quiet_transformers():  # no "Loading weights" bar, as pyattr.relevance("induction", ...) shows none
        model = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        tok = AutoTokenizer.from_pretrained(path)
    from pyattr.toy.known import KnownCircuit

    circuit = KnownCircuit(json.loads((path / "circuit.json").read_text()))
    return model, tok, circuit


def load_translation(path=None):
    """(model, tokenizer) of the toy translation model (a 2 + 2-layer Marian that
    translates a sentence into upper-case words in reverse order, so target step ``t`` of
    ``n`` words is aligned to source word ``n − 1 − t``; see :mod:`pyattr.toy.translation`),
    model in eval mode, float32. ``path``: a directory written by ``python -m
    pyattr.toy.translation`` (default: the shipped one)."""
    from pyattr.toy.translation import load as _load

    return _load(path)


def load_squares(path=None):
    """(model, image processor) of the toy image classifier (classes red, green, blue: the
    colour of the one square in the image; see :mod:`pyattr.toy.vision`), model in eval
    mode, float32. ``path``: a directory written by ``python -m pyattr.toy.vision``
    (default: the shipped one)."""
    from transformers import AutoImageProcessor, ViTForImageClassification

    from pyattr._quiet import quiet_transformers

    path = Path(path) if path is not None else SQUARES_DIR
    with quiet_transformers():
        model = ViTForImageClassification.from_pretrained(path).eval()
        return model, AutoImageProcessor.from_pretrained(path)
