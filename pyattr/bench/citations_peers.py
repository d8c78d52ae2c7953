"""The real ContextCite library (``context-cite``, MadryLab; Cohen-Wang et al. 2024) run on
the examples of ``pyattr bench --citations`` (:mod:`pyattr.bench.citations`), so that the
benchmark can show it beside pyattr's own methods where it is installed. It is never a
dependency of pyattr: :func:`contextcite_available` tells whether it can be imported, and
importing this module does not import it.

How an example (:class:`pyattr.toy.context.ContextExample`) is given to ContextCite 0.0.4's
``ContextCiter`` (its public constructor and ``get_attributions``):

- **context**: the example's source texts (:meth:`ContextExample.source_texts`, 3 words
  each) joined by single spaces; **query**: the query word (the prompt's last token).
- **sources**: a subclass of ``context_cite.context_partitioner.BaseContextPartitioner``
  whose sources are exactly the example's sources (``partitioner=``, which overrides
  ``source_type``; its built-in sentence / word splitters would give 1 or 12 sources). An
  ablated context is the kept sources joined by single spaces.
- **prompt**: ``prompt_template=``:data:`PROMPT_TEMPLATE` (``"{context} {query}"``) and,
  on a copy of the tokenizer (the caller's is not changed), the chat template
  :data:`CHAT_TEMPLATE` (``<s>``, a space, the user message): the toy tokenizer has none,
  and ContextCiter always applies one, then encodes the text with
  ``add_special_tokens=False``. The toy tokenizer splits on whitespace and reads ``<s>``
  as its special token, so the prompt is ``<s>`` + the kept sources' words + the query
  word: a dropped source's tokens are taken out and the rest close up, as
  :func:`pyattr.methods._core.ablation.ablated_rows` does.
- **response**: ContextCiter generates it with ``generate_kwargs={"max_new_tokens": 1,
  "do_sample": False}``: one greedy token, the example's answer (the benchmark's examples
  are the ones the model answers itself, :func:`pyattr.toy.context.answered`).
- **ablations**: ``num_ablations=ablations`` and ContextCiter's own masks (mask ``i`` drawn
  by ``numpy.random.RandomState(i)``, each source kept with probability 1/2), its
  ``batch_size`` (default 1, ContextCiter's own: one unpadded sequence per forward; a
  larger batch is left-padded, which leaves a rotary-position model's values as they are)
  and its default solver (``LassoRegression``: sklearn ``Lasso(alpha=0.01)`` on standardised
  masks, fit to the response's logit-probability). ``seed=s`` other than 0 draws the
  masks with ContextCite's own ``context_cite.utils.get_masks_and_logit_probs`` at
  ``base_seed=s`` (ContextCiter has no seed option; ``seed=0`` is its unchanged path).

What ``verify=True`` checks, on every forward ContextCite runs (a forward pre-hook on the
model) and on the masks and values ContextCiter keeps in its cache:

- the generation forward's input is exactly ``example.prompt``; the response ContextCite
  attributes is exactly ``[example.answer]``; its sources are the example's source texts;
- no ablation forward is given position ids, and its rows, left padding taken off by the
  attention mask, equal, in order, pyattr's
  :func:`~pyattr.methods._core.ablation.ablated_rows` of ContextCite's own keep-masks:
  ContextCite fits on the very token sequences pyattr's ablation methods and the
  benchmark's truth run;
- its per-ablation log-probabilities equal pyattr's
  :func:`~pyattr.methods._core.ablation.response_logprobs` of the same masks (to 1e-4).
  (pyattr computes the log-softmax in float64, so ``log p − log(1 − p)`` of a near-certain
  answer keeps its precision: before it did, float32 rounding moved logit-probabilities
  near 11 by up to about 5e-3).

All of it held with ContextCite 0.0.4, transformers 5.25 and torch 2.13 on both toy
decoders, the benchmark's 100 examples each, at 32 and at 256 ablations, with
``batch_size`` 1 and 64 (whose scores agree to 1e-3) and with ``seed=7``.

ContextCite prints a progress bar and, on CPU, an autocast warning per call; ``quiet=True``
(default) keeps stdout and stderr in a buffer during the call. Importing ``context_cite``
also tries to download nltk's ``punkt_tab`` (offline it fails quietly; only its sentence
splitter, unused here, needs it).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import io
import weakref
from typing import List, Tuple

import torch

#: The chat template ContextCiter is given (on a copy of the tokenizer).
CHAT_TEMPLATE = "{{ bos_token }} {{ messages[0]['content'] }}"
#: The prompt template ContextCiter is given.
PROMPT_TEMPLATE = "{context} {query}"

_TOKENIZERS = weakref.WeakKeyDictionary()


def contextcite_available() -> bool:
    """Whether ContextCite (``import context_cite``) can be imported here."""
    try:
        with _silenced(True):
            importlib.import_module("context_cite")
    except Exception:
        return False
    return True


@contextlib.contextmanager
def _silenced(quiet: bool):
    """stdout and stderr kept in a buffer while ``quiet``."""
    if not quiet:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _tokenizer(tokenizer):
    """A copy of ``tokenizer`` with :data:`CHAT_TEMPLATE` (cached per tokenizer)."""
    try:
        return _TOKENIZERS[tokenizer]
    except (KeyError, TypeError):
        pass
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    try:
        _TOKENIZERS[tokenizer] = tok
    except TypeError:
        pass
    return tok


@functools.lru_cache(maxsize=None)
def _classes():
    """(partitioner class, citer class for a seed), built on first use of ContextCite."""
    import numpy as np
    from context_cite import ContextCiter
    from context_cite.context_partitioner import BaseContextPartitioner
    from context_cite.utils import get_masks_and_logit_probs

    class SourcePartitioner(BaseContextPartitioner):
        """Given sources, joined by single spaces; an ablated context joins the kept ones."""

        def __init__(self, sources: List[str]) -> None:
            super().__init__(" ".join(sources))
            self._sources = list(sources)

        @property
        def num_sources(self) -> int:
            return len(self._sources)

        def split_context(self) -> None:
            pass

        def get_source(self, index: int) -> str:
            return self._sources[index]

        def get_context(self, mask=None) -> str:
            keep = np.ones(self.num_sources, dtype=bool) if mask is None else np.asarray(mask, bool)
            return " ".join(s for s, k in zip(self._sources, keep) if k)

    class SeededCiter(ContextCiter):
        """ContextCiter whose masks start at ``base_seed`` (ContextCiter's own: 0)."""

        base_seed = 0

        def _compute_masks_and_logit_probs(self) -> None:
            self._cache["reg_masks"], self._cache["reg_logit_probs"] = get_masks_and_logit_probs(
                self.model, self.tokenizer, self.num_ablations, self.num_sources, self._get_prompt_ids,
                self._response_ids, self.ablation_keep_prob, self.batch_size, base_seed=self.base_seed)

    return SourcePartitioner, ContextCiter, SeededCiter


def contextcite_scores(model, tokenizer, example, ablations: int, seed: int = 0, *,
                       batch_size: int = 1, verify: bool = False,
                       quiet: bool = True) -> Tuple[torch.Tensor, int]:
    """ContextCite's scores of ``example``'s sources for its answer (see the module docstring).

    Args:
        model: the toy decoder (a ``LlamaForCausalLM``) the example was answered by.
        tokenizer: its tokenizer (``pyattr.toy.load()[1]``); not modified.
        example (pyattr.toy.context.ContextExample): one benchmark example.
        ablations: ContextCiter's ``num_ablations``.
        seed: 0 for ContextCiter's own masks; otherwise its mask draw at ``base_seed=seed``.
        batch_size: ContextCiter's ``batch_size`` (ablated prompts per forward, left-padded).
        verify: check every forward's token ids against pyattr's ablated rows, and the
            log-probabilities against pyattr's (see the module docstring).
        quiet: keep ContextCite's progress bar and warnings off stdout / stderr.

    Returns:
        (scores, forwards): Tensor[S] float64, one score per source; the model forwards
        ContextCite ran (``ceil(ablations / batch_size)`` + 1, the generation of the
        response).

    Raises:
        ImportError: ContextCite is not installed. ValueError: ``ablations`` < 2.
        RuntimeError: ``verify`` found a difference.
    """
    if not isinstance(ablations, int) or ablations < 2:
        raise ValueError(f"ablations: expected an int >= 2, got {ablations!r}")
    with _silenced(quiet):
        Partitioner, Citer, Seeded = _classes()
    tok = _tokenizer(tokenizer)
    vocab = tokenizer.get_vocab()
    inv = {i: w for w, i in vocab.items()}
    sources = example.source_texts(vocab)
    query = inv[example.prompt[-1]]
    partitioner = Partitioner(sources)
    kwargs = dict(partitioner=partitioner, num_ablations=ablations, prompt_template=PROMPT_TEMPLATE,
                  generate_kwargs={"max_new_tokens": 1, "do_sample": False}, batch_size=batch_size)
    if seed == 0:
        citer = Citer(model, tok, partitioner.context, query, **kwargs)
    else:
        citer = Seeded(model, tok, partitioner.context, query, **kwargs)
        citer.base_seed = int(seed)

    calls = []

    def record(module, args, kw):
        if not verify:
            calls.append(None)
            return
        ids = kw.get("input_ids", args[0] if args else None).detach().cpu()
        mask = kw.get("attention_mask")
        mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.detach().cpu().bool()
        calls.append(([r[m].tolist() for r, m in zip(ids, mask)], kw.get("position_ids") is not None))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with _silenced(quiet):
            scores = citer.get_attributions(verbose=False)
    finally:
        handle.remove()
    scores = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)

    if verify:
        _verify(model, citer, example, sources, calls)
    return scores, len(calls)


def _verify(model, citer, example, sources, calls) -> None:
    import pyattr.methods._core.ablation as A

    def fail(what):
        raise RuntimeError(f"ContextCite's forwards differ from pyattr's: {what}")

    if citer.sources != sources:
        fail(f"sources {citer.sources} != {sources}")
    if list(citer._response_ids) != [example.answer]:
        fail(f"response ids {list(citer._response_ids)} != {[example.answer]}")
    if not calls or calls[0][0] != [list(example.prompt)]:
        fail(f"generation input {calls[0][0] if calls else None} != prompt {list(example.prompt)}")
    masks = torch.as_tensor(citer._masks)
    expected = A.ablated_rows(example.prompt, example.ranges, [example.answer], masks)
    rows = [r for ids, _ in calls[1:] for r in ids]
    if any(pos for _, pos in calls[1:]):
        fail("an ablation forward was given position ids")
    if len(rows) != len(expected):
        fail(f"{len(rows)} ablated rows, expected {len(expected)}")
    for i, (got, row) in enumerate(zip(rows, expected)):
        if got != row:
            fail(f"ablation {i} (keep {masks[i].tolist()}): {got} != {row}")
    # and the values: ContextCite's per-ablation log-probability (from its logit-probability,
    # float32) against pyattr's response_logprobs of the same masks
    cc = torch.nn.functional.logsigmoid(torch.as_tensor(citer._logit_probs, dtype=torch.float64)).sum(1)
    ours = A.response_logprobs(model, example.prompt, example.ranges, [example.answer], masks,
                               [(0, 1)])[:, 0]
    if not torch.allclose(cc, ours, rtol=1e-4, atol=1e-4):
        fail(f"log-probabilities differ by up to {float((cc - ours).abs().max()):.3g}")
