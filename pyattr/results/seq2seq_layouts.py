"""How the encoder–decoder results lay themselves out: the source and the target prefix as
two token heatmaps per row (relevance, integrated gradients), and per row of a generation
two matrices (each generated token over the source; over the decoder's inputs before it)."""

from __future__ import annotations

from typing import List, Optional

import torch

from pyattr.results.colours import num
from pyattr.results.layout_rows import _left_out, _rows_k, _take, _target_word, _value, _what
from pyattr.results.panels import Matrix, Tokens


def _names(tokens, row: int, ids: torch.Tensor) -> List[Optional[str]]:
    """Row ``row``'s token strings (None at padding), else ``#i``."""
    if tokens is not None and row < len(tokens) and len(tokens[row]) == ids.shape[-1]:
        return list(tokens[row])
    return [f"#{i}" for i in range(ids.shape[-1])]


def stream_panels(streams: Optional[torch.Tensor], k, r: int) -> List:
    """Row ``r``'s relevance on the streams a model appends after the tokens (ProphetNet's
    predicting streams, ``stream_relevance``): part of the conservation sum, so the view
    shows it beside the tokens; none for other models."""
    if streams is None:
        return []
    s = (streams[k] if k is not None else streams)[r].double()      # (streams, seq)
    labels = [f"stream {j + 1} · {p}" for j in range(s.shape[0]) for p in range(s.shape[1])]
    return [Tokens(f"row {r} · the model's predicting streams (inputs without a token; Σ {num(float(s.sum()), '.4g')})",
                   labels, s.flatten().tolist(), "relevance", label_name="stream_input", index_name="stream_position",
                   row=r, target_set=k)]


def _two_sides(result, src: torch.Tensor, tgt: torch.Tensor, name: str, delta, delta_name: str, limit,
               streams: Optional[torch.Tensor] = None) -> List:
    panels, shown = [], 0
    pairs = _rows_k(src, 2)
    for k, r in _take(pairs, limit):
        shown += 1
        s = (src[k] if k is not None else src)[r].double()
        t = (tgt[k] if k is not None else tgt)[r].double()
        head = (f"row {r}" + (f" · target set {k}" if k is not None else "") +
                f" · target{_target_word(result, k, r)} = {num(_value(result.target, k, r), '.4g')} · "
                f"{delta_name} {num(_value(delta, k, r), '.3g')}")
        panels.append(Tokens(f"{head} · source (Σ {num(float(s.sum()), '.4g')})",
                             _names(result.source_tokens, r, s), s.tolist(), name, label_name="source_token",
                             index_name="source_position", row=r, target_set=k))
        panels.append(Tokens(f"row {r} · target prefix (Σ {num(float(t.sum()), '.4g')})",
                             _names(getattr(result, "decoder_tokens", None), r, t), t.tolist(), name,
                             label_name="decoder_token", index_name="decoder_position", row=r, target_set=k))
        panels += stream_panels(streams, k, r)
    return _left_out(shown, len(pairs), _what(src, 2)) + panels


def seq2seq_relevance(result, limit) -> List:
    return _two_sides(result, result.source_relevance, result.target_relevance, "relevance",
                      result.conservation_delta, "conservation delta", limit, getattr(result, "stream_relevance", None))


def seq2seq_attribution(result, limit) -> List:
    return _two_sides(result, result.source_attribution, result.target_attribution, "attribution",
                      result.convergence_delta, "convergence delta", limit)


def seq2seq_generation(result, limit) -> List:
    panels = []
    width, batch = result.prefix_width, result.sequences.shape[0]
    for r in _take(list(range(batch)), limit):
        seq = _names(result.sequence_tokens, r, result.sequences[r])
        src = _names(result.source_tokens, r, result.source_ids[r])
        cols = [j for j, s in enumerate(src) if s is not None]
        steps = [t for t in range(result.step_mask.shape[1]) if bool(result.step_mask[r, t])]
        rows = [f"{t}: {seq[width + t] or ''}" for t in steps]
        panels.append(Matrix(f"row {r} · each generated token (rows) over the source (columns)", rows,
                             [src[j] for j in cols],
                             [[float(result.source_relevance[r, t, j]) for j in cols] for t in steps],
                             "step", "source_token", row=r))
        inputs = list(range(result.target_relevance.shape[2]))
        panels.append(Matrix(f"row {r} · each generated token (rows) over the decoder's inputs before it (cells "
                             "at or after the step are not its inputs)", rows, [seq[j] or "" for j in inputs],
                             [[float(result.target_relevance[r, t, j]) if j < width + t else None for j in inputs]
                              for t in steps], "step", "decoder_token", row=r))
    return _left_out(len(panels) // 2, batch) + panels
