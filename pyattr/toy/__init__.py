"""A small trained decoder whose mechanism is known: ground truth for explanations.

``load()`` returns a 2-layer Llama trained (``python -m pyattr.toy.train``) to continue a
repeated segment of words by induction, its tokenizer, and its circuit (two previous-token
heads in layer 0, two induction heads in layer 1; ``circuit.json``, found by
:mod:`pyattr.toy.circuit`). It ships in the package (about 0.4 MB) and loads offline.
"""

from __future__ import annotations

import json
from pathlib import Path

#: The directory of the shipped model (``save_pretrained`` layout plus ``circuit.json``).
INDUCTION_DIR = Path(__file__).resolve().parent / "induction"
#: The name ``pyattr explain / patch / generate --model`` accept for it.
INDUCTION_NAME = "induction"


def load(path=None):
    """(model, tokenizer, circuit) of the toy induction decoder, model in eval mode, float32,
    eager attention. ``path``: a directory written by ``python -m pyattr.toy.train``
    (default: the shipped one)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = Path(path) if path is not None else INDUCTION_DIR
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(path)
    circuit = json.loads((path / "circuit.json").read_text())
    return model, tok, circuit
