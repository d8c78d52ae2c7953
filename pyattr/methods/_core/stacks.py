"""Which stacks a model has: encoder–decoder models are refused by the methods that read
one stack (fail closed), before they would read the encoder alone."""

from __future__ import annotations

from torch import nn

import pyattr.architectures as A


def is_encoder_decoder(model) -> bool:
    """The model is an encoder–decoder (``config.is_encoder_decoder``)."""
    return isinstance(model, nn.Module) and bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def refuse_encoder_decoder(model, caller: str) -> None:
    """Fail closed: methods written for one stack would read the encoder alone (or fail
    deep inside the model) on an encoder–decoder model."""
    if is_encoder_decoder(model):
        raise ValueError(
            f"{caller}(): {type(model).__name__} is an encoder–decoder model (model type {A.model_type(model)!r}); "
            f"{caller} reads one stack and does not support it yet. relevance(model, inputs, "
            "decoder_input_ids=...) explains a decoder-side target over the source and the target prefix")
