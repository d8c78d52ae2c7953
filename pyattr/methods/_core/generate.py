"""What ``model.generate`` produced: the generated ids, and which steps exist, observed
from the stopping criteria ``generate`` itself builds and consults (DESIGN §10), never
re-derived from the ids."""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import List, Optional, Tuple

import torch
from torch import nn


def _eos_ids(model, generate_kwargs: Optional[dict] = None) -> List[int]:
    """An end-of-sequence id to pad finished rows with, where the caller names no pad: the
    caller's ``generate_kwargs`` first, then the generation config, then the config. Only a
    pad choice: which steps exist is observed (:class:`_StopRecord`), never read from it."""
    gc = (generate_kwargs or {}).get("generation_config") or getattr(model, "generation_config", None)
    eos = (generate_kwargs or {}).get("eos_token_id", getattr(gc, "eos_token_id", None))
    if eos is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


class _StopRecord:
    """What ``generate``'s own stopping criteria decided, step by step.

    transformers builds one ``StoppingCriteriaList`` per call (``_get_stopping_criteria``:
    max length, max time, the end-of-sequence ids of the generation config in force,
    ``stop_strings``, the caller's ``stopping_criteria``) and calls it once after each
    step on the sequences so far; a row it marks done is finished, and what the row gets
    afterwards (pad tokens, or free tokens where no end-of-sequence criterion exists) is
    filler. The record wraps that list for one call, so the steps kept are the ones
    ``generate`` itself counted, whatever stopped it; pyattr never re-derives the stop
    from the ids (issue 31: ``stop_strings``, custom criteria and a passed
    ``GenerationConfig`` were explained as generated steps)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.done: List[torch.Tensor] = []

    def __enter__(self):
        from transformers import StoppingCriteriaList

        build = getattr(type(self.model), "_get_stopping_criteria", None)
        if not callable(build):
            raise ValueError(
                f"model: cannot observe where {type(self.model).__name__}.generate stops (its generation has no "
                "transformers _get_stopping_criteria); pass continuation= with the generated tokens instead")
        record = self.done

        class Recorded(StoppingCriteriaList):
            def __call__(self, input_ids, scores, **kwargs):
                done = super().__call__(input_ids, scores, **kwargs)
                record.append(torch.as_tensor(done).detach().to("cpu", torch.bool).reshape(-1).clone())
                return done

        def wrapped(*args, **kwargs):
            built = build(self.model, *args, **kwargs)
            if self.built:  # a nested generate (a draft model that is this model): not the call explained
                return built
            self.built = True
            return Recorded(built)

        self.built = False
        self.had = "_get_stopping_criteria" in vars(self.model)
        self.saved = vars(self.model).get("_get_stopping_criteria")
        self.model._get_stopping_criteria = wrapped
        return self

    def __exit__(self, *exc):
        if self.had:
            self.model._get_stopping_criteria = self.saved
        else:
            del self.model._get_stopping_criteria
        return False

    def steps(self, batch: int, generated: int) -> torch.Tensor:
        """BoolTensor[batch, generated]: step ``t`` exists where no earlier step finished the row."""
        if generated and len(self.done) < generated:
            raise ValueError(
                f"model: {type(self.model).__name__}.generate produced {generated} steps but its stopping criteria "
                f"were consulted {len(self.done)} times, so where each row stopped cannot be observed; pass "
                "continuation= with the generated tokens instead")
        steps = torch.ones(batch, generated, dtype=torch.bool)
        if generated > 1:
            done = torch.stack(self.done[: generated - 1], 1)  # (batch, generated - 1): done after step t
            if done.shape[0] != batch:
                raise ValueError(f"model: generate's stopping criteria saw {done.shape[0]} rows, the prompt has {batch}")
            steps[:, 1:] = ~done.cumsum(1).bool()
        return steps


#: generation modes whose loop adds several tokens per consultation of the stopping
#: criteria (assisted and prompt-lookup decoding): where a row stopped cannot be read back
_MULTI_TOKEN = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def _refuse_model_inputs(model: nn.Module, kw: dict) -> None:
    """A tensor in ``generate_kwargs`` that the model's forward takes (``pixel_values``,
    ``token_type_ids``, …) would change what is generated, while the explained forward runs
    on the ids alone: refused, so the explanation is of the generation that ran."""
    import inspect

    try:
        params = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        params = set()
    for key, value in kw.items():
        if isinstance(value, torch.Tensor) and key in params:
            raise ValueError(f"generate_kwargs: {key} is an input of {type(model).__name__}'s forward; the steps are "
                             "explained from the prompt's ids alone, so a generation conditioned on it would be "
                             "explained without it")


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    """``model.eval()`` for the block; every module's ``training`` flag restored after."""
    training = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, t in training:
            m.training = t


def generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
             generate_kwargs: Optional[dict], prefix: Optional[list] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``model.generate`` on left-padded ``ids`` (greedy unless ``generate_kwargs`` say
    otherwise, also where the model's generation config samples, which is then warned
    about; one sequence per prompt): the generated ids
    (batch, generated) and which steps exist (BoolTensor, the same shape), as
    ``generate``'s own stopping criteria decided (:class:`_StopRecord`).

    Raises:
        ValueError: a length in ``generate_kwargs`` (``max_new_tokens`` / ``max_length``, or a
            passed ``GenerationConfig`` whose ``max_new_tokens`` differs from the argument):
            the argument decides how many steps are generated and checked; beams or several
            sequences per prompt, from the arguments or the model's generation config;
            assisted or prompt-lookup decoding.

    ``prefix`` (a list, encoder–decoder models): receives the decoder's columns before the
    generated ones (its start token), as many as ``generate`` returned before the steps its
    stopping criteria were consulted for.
    """
    model = getattr(model, "_orig_mod", model)  # torch.compile: generate on the module itself
    kw = dict(generate_kwargs or {})
    _refuse_model_inputs(model, kw)
    for key in ("max_new_tokens", "max_length"):
        if key in kw:
            raise ValueError(f"generate_kwargs: {key} is given by max_new_tokens= of generation_relevance "
                             f"(the steps explained and checked against the model's length); drop it from "
                             "generate_kwargs")
    gc = kw.get("generation_config")
    if gc is not None:  # the caller's config decides all but the length, which is ours
        if getattr(gc, "max_new_tokens", None) not in (None, max_new_tokens):
            raise ValueError(f"generate_kwargs: the GenerationConfig says max_new_tokens={gc.max_new_tokens}, "
                             f"the argument max_new_tokens={max_new_tokens}; give one length")
        gc = copy.deepcopy(gc)
        gc.max_new_tokens, gc.max_length = max_new_tokens, None
        kw["generation_config"] = gc
    else:
        if "do_sample" not in kw and getattr(getattr(model, "generation_config", None), "do_sample", False):
            warnings.warn("generation_relevance generates greedily; model.generation_config has do_sample=True, so "
                          "model.generate would sample: pass generate_kwargs={'do_sample': True} to sample as it does",
                          UserWarning, stacklevel=4)
        kw = {"max_new_tokens": max_new_tokens, "do_sample": False, **kw}
    # what generate will use: the arguments, then the passed config, then the model's own
    effective = gc if gc is not None else getattr(model, "generation_config", None)

    def setting(name):
        v = kw.get(name, getattr(effective, name, None))
        return 1 if v is None else v

    if setting("num_return_sequences") != 1 or setting("num_beams") != 1:
        raise ValueError(f"generate_kwargs: one sequence per prompt (num_beams 1, num_return_sequences 1); the "
                         f"generation in force has num_beams={setting('num_beams')}, num_return_sequences="
                         f"{setting('num_return_sequences')} (pass them in generate_kwargs to override the model's "
                         "generation config)")
    multi = [k for k in _MULTI_TOKEN if kw.get(k, getattr(effective, k, None)) not in (None, False)]
    if multi:
        raise ValueError(f"generate_kwargs: {multi[0]} (assisted / prompt-lookup decoding adds several tokens per "
                         "step, so where each row stopped cannot be observed); generate without it, or pass "
                         "continuation= with the generated tokens")
    if "pad_token_id" not in kw and getattr(effective, "pad_token_id", None) is None:
        # any id pads: the steps kept are the ones generate reports finished or not (_StopRecord)
        pad = getattr(model.config, "pad_token_id", None)
        eos = _eos_ids(model, generate_kwargs)
        kw["pad_token_id"] = pad if pad is not None else (eos[0] if eos else 0)
    from pyattr.integration.quantized import bitsandbytes_kept_for_gradients

    # bitsandbytes' 4-bit layers keep the layout the explaining backward needs
    # in eval mode, as the passes that explain the steps run (a model left in training mode
    # would sample its dropout into the continuation)
    with torch.no_grad(), _eval_mode(model), bitsandbytes_kept_for_gradients(model), _StopRecord(model) as record:
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    out = out.sequences if hasattr(out, "sequences") else out
    if prefix is not None:  # an encoder–decoder returns the decoder's sequence: its start, then the steps
        start = out.shape[1] - len(record.done)
        if start < 1:
            raise ValueError(f"model: {type(model).__name__}.generate returned {out.shape[1]} columns for "
                             f"{len(record.done)} steps, so the decoder's start cannot be observed")
        prefix.append(out[:, :start])
        gen = out[:, start:]
    else:
        gen = out[:, ids.shape[1]:]
    return gen, record.steps(gen.shape[0], gen.shape[1]).to(gen.device)
