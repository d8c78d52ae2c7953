"""The report ``pyattr generate`` shows: one sequence's tokens, how many of them are the
context, and each generated step's relevance over them (decoders: the prompt; encoder–
decoders: the source and the decoder's start)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional


@dataclass
class GenerationReport:
    model: str
    tokens: List[str]             # every column of the (one-row) sequence, padding excluded
    prompt_tokens: int            # how many of them are the prompt
    generated_text: str
    matrix: List[List[float]]     # (generated, tokens)
    targets: List[float]
    deltas: List[float]
    target_kind: str
    seconds: float
    backend: str
    batch_targets: int
    source_tokens: Optional[int] = None  # an encoder–decoder: the source's columns; the decoder's inputs follow

    def to_json(self) -> dict:
        out = {"model": self.model, "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
               "generated_text": self.generated_text, "target": self.target_kind,
               "target_values": self.targets, "conservation_delta": self.deltas,
               "token_relevance": self.matrix, "wall_time_s": self.seconds, "backend": self.backend,
               "batch_targets": self.batch_targets}
        if self.source_tokens is not None:
            out["source_tokens"] = self.source_tokens
        return out

    def position(self, i: int) -> str:
        """Column ``i`` in words: its index, and on an encoder–decoder its side."""
        if self.source_tokens is None:
            return str(i)
        return f"source {i}" if i < self.source_tokens else f"decoder {i - self.source_tokens}"

    def top_sources(self, step: int, k: int = 3):
        own = self.prompt_tokens + step
        row = self.matrix[step][:own]
        order = sorted(range(own), key=lambda i: -row[i])[:k]
        return [(i, self.tokens[i], row[i]) for i in order]
