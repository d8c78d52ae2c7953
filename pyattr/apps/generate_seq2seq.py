"""``pyattr generate`` on an encoder–decoder model (a translation or summarisation model):
the source is the text, the model generates (or a continuation is given as the target),
and each generated token is explained over the source and the decoder's inputs before it.
The report is :class:`~pyattr.apps.generation_report.GenerationReport`'s, with the source and the
decoder's start as its "prompt" columns, so the terminal, JSON, HTML and PNG views serve
both kinds of model."""

from __future__ import annotations

import time
from typing import Optional

import torch

from pyattr.apps.explain import ExplainError, check_prompt
from pyattr.apps.generation_report import GenerationReport
from pyattr.config import RelevanceRules


def encoder_decoder_checkpoint(name_or_path) -> bool:
    """The checkpoint ``name_or_path`` (a bundled name, a directory or a hub id) says
    ``is_encoder_decoder`` in its config; False where its config cannot be read (the
    causal-LM path then reports what is wrong)."""
    from pyattr.hub import ModelLoadError, resolve

    try:
        src = resolve(name_or_path)
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(src.location), local_files_only=src.local)
    except (ModelLoadError, OSError, ValueError, TypeError, KeyError):
        return False
    return bool(getattr(cfg, "is_encoder_decoder", False))


def run_seq2seq(model, tok, label: str, text: str, max_new_tokens: Optional[int], continuation: Optional[str],
                target: str, rules: RelevanceRules, batch_targets: Optional[int]):
    from pyattr.methods.generation import generation_relevance

    src = [int(i) for i in tok(text)["input_ids"]]  # the source as the tokenizer makes it, its markers included
    check_prompt("--text", src, model, tok)
    kw = {}
    if continuation is not None:
        ids = [int(i) for i in tok(text_target=continuation)["input_ids"]]
        if not continuation.strip() or all(i in set(tok.all_special_ids) for i in ids):
            raise ExplainError("--continuation has no tokens after tokenisation")
        kw["continuation"] = torch.tensor([ids])
    else:
        kw["max_new_tokens"] = max_new_tokens
    t0 = time.perf_counter()
    try:
        r = generation_relevance(model, torch.tensor([src]), rules=rules, batch_targets=batch_targets, target=target,
                                 **kw)
    except ValueError as e:
        raise ExplainError(str(e)) from None
    seconds = time.perf_counter() - t0
    steps = int(r.step_mask[0].sum())
    width = r.prefix_width
    n_src = len(src)
    dec = r.sequences[0, :width + steps].tolist()
    tokens = tok.convert_ids_to_tokens(src) + tok.convert_ids_to_tokens(dec)
    matrix = []
    for t in range(steps):
        row = r.source_relevance[0, t].tolist() + r.target_relevance[0, t, :width + t].tolist()
        matrix.append(row + [0.0] * (len(tokens) - len(row)))
    return GenerationReport(
        model=label, tokens=tokens, prompt_tokens=n_src + width,
        generated_text=tok.decode(dec[width:], skip_special_tokens=True), matrix=matrix,
        targets=r.target[0, :steps].tolist(), deltas=r.conservation_delta[0, :steps].tolist(), target_kind=target,
        seconds=seconds, backend=r.backend, batch_targets=min(steps, batch_targets or steps), source_tokens=n_src)
