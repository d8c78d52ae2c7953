"""The real ContextCite library (``context-cite``, MadryLab; Cohen-Wang et al. 2024) run on
the examples of ``pyattr bench --citations`` (:mod:`pyattr.bench.citations`), so that the
benchmark can show it beside pyattr's own methods where it is installed. It is never a
dependency of pyattr: :func:`contextcite_available` tells whether it can be imported, and
nothing here imports it before :func:`contextcite_scores` is called.

How an example (:class:`pyattr.toy.context.ContextExample`) is given to ContextCite 0.0.4's
``ContextCiter`` (its public constructor and ``get_attributions``):

- **context**: the example's source texts (:meth:`ContextExample.source_texts`, 3 words
  each) joined by single spaces; **query**: the query word (the prompt's last token).
- **sources**: a ``context_cite.context_partitioner.BaseContextPartitioner`` subclass whose sources are
  exactly the example's sources (``partitioner=``, which overrides ``source_type``; its
  built-in sentence / word splitters would give 1 or 12 sources). An ablated context is the
  kept sources joined by single spaces.
- **prompt**: ``prompt_template="{context} {query}"`` and, on a copy of the tokenizer (the
  caller's is not changed), the chat template ``"{{ bos_token }} {{ content }}"`` (the toy
  tokenizer has none; ContextCiter always applies one and encodes its text with
  ``add_special_tokens=False``). The toy tokenizer splits on whitespace and reads ``<s>``
  as its special token, so the prompt is ``<s>`` + the kept sources' words + the query
  word: every dropped source's tokens are taken out and the rest close up, as
  :func:`pyattr.methods._core.ablation.ablated_rows` does.
- **response**: ContextCiter generates it with ``generate_kwargs={"max_new_tokens": 1,
  "do_sample": False}``: one greedy token, the example's answer (the benchmark's examples
  are the ones the model answers itself, :func:`pyattr.toy.context.answered`).
- **ablations**: ``num_ablations=ablations``, ContextCiter's own masks (mask ``i`` drawn by
  ``numpy.random.RandomState(i)``, each source kept with probability 1/2), its default
  ``batch_size=1`` (one unpadded sequence per forward: a larger batch is left-padded, and
  the Llama models then give the padded rows other positions than the ablated text's own),
  and its default solver (``LassoRegression``: sklearn ``Lasso(alpha=0.01)`` on
  standardised masks, target the response's logit-probability). ``seed=s`` other than 0
  draws the masks with ContextCite's own ``context_cite.utils.get_masks_and_logit_probs``
  at ``base_seed=s`` (ContextCiter has no seed option; ``seed=0`` is its unchanged path).

What is checked (``verify=True``, on every forward ContextCite runs, through a forward
pre-hook on the model): the generation forward's input is exactly ``example.prompt``, the
response ContextCite attributes is exactly ``[example.answer]``, ContextCite's sources are
the example's source texts, every ablated forward is one unpadded row (attention mask all
ones, no position ids passed), and the rows equal, in order, pyattr's
:func:`~pyattr.methods._core.ablation.ablated_rows` of ContextCite's own keep-masks: the
log-probabilities ContextCite fits on are those of the very token sequences pyattr's
ablation methods and the benchmark's truth use; and ContextCite's per-ablation
log-probabilities equal :func:`~pyattr.methods._core.ablation.response_logprobs` of the
same masks (to 1e-4). (Its logit-probabilities agree with pyattr's to about 2e-5 where
the logit is below 5, and differ by up to about 5e-3 where it nears 11: pyattr derives
``log p − log(1 − p)`` from a float32 log-softmax, ContextCite takes the answer's logit
minus the log-sum-exp of the others, which keeps ``1 − p`` exact.) Measured with ContextCite 0.0.4,
transformers 5.25 and torch 2.13 on both toy decoders, 100 examples each at 32 and 256
ablations: every sequence equal.

ContextCite prints a progress bar per call and, on CPU, an autocast warning per call;
``quiet=True`` (default) keeps them off stderr during the call. Importing ``context_cite``
also tries to download nltk's ``punkt_tab`` (it fails quietly offline; only its sentence
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
            keep = np.ones(self.num_sources, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
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
                       verify: bool = False, quiet: bool = True) -> Tuple[torch.Tensor, int]:
    """ContextCite's scores of ``example``'s sources for its answer (see the module docstring).

    Args:
        model: the toy decoder (a ``LlamaForCausalLM``) the example was answered by.
        tokenizer: its tokenizer (``pyattr.toy.load()[1]``); not modified.
        example (pyattr.toy.context.ContextExample): one benchmark example.
        ablations: ContextCiter's ``num_ablations``.
        seed: 0 for ContextCiter's own masks; otherwise its mask draw at ``base_seed=seed``.
        verify: check every forward's token ids against pyattr's ablated rows (raises
            ``RuntimeError`` on a difference).
        quiet: keep ContextCite's progress bar and warnings off stderr.

    Returns:
        (scores, forwards): Tensor[S] float64, one score per source; the model forwards
        ContextCite ran (``ablations`` + 1, the generation of the response).

    Raises:
        ImportError: ContextCite is not installed. ValueError: ``ablations`` < 1.
    """
    if not isinstance(ablations, int) or ablations < 1:
        raise ValueError(f"ablations: expected an int >= 1, got {ablations!r}")
    with _silenced(quiet):
        Partitioner, Citer, Seeded = _classes()
    tok = _tokenizer(tokenizer)
    vocab = tokenizer.get_vocab()
    inv = {i: w for w, i in vocab.items()}
    sources = example.source_texts(vocab)
    query = inv[example.prompt[-1]]
    partitioner = Partitioner(sources)
    kwargs = dict(partitioner=partitioner, num_ablations=ablations, prompt_template=PROMPT_TEMPLATE,
                  generate_kwargs={"max_new_tokens": 1, "do_sample": False})
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
        ids = kw.get("input_ids", args[0] if args else None)
        mask = kw.get("attention_mask")
        calls.append((ids.detach().cpu().tolist(), None if mask is None else bool(mask.all()),
                      kw.get("position_ids") is not None))

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
    if len(calls) != citer.num_ablations + 1:
        fail(f"{len(calls)} forwards, expected {citer.num_ablations} ablations + 1 generation")
    gen_ids = calls[0][0]
    if gen_ids != [list(example.prompt)]:
        fail(f"generation input {gen_ids} != prompt {list(example.prompt)}")
    masks = torch.as_tensor(citer._masks)
    expected = A.ablated_rows(example.prompt, example.ranges, [example.answer], masks)
    for i, ((ids, full_mask, has_pos), row) in enumerate(zip(calls[1:], expected)):
        if len(ids) != 1 or full_mask is False or has_pos:
            fail(f"ablation {i}: {len(ids)} rows, attention mask all ones: {full_mask}, position ids: {has_pos}")
        if ids[0] != row:
            fail(f"ablation {i} (keep {masks[i].tolist()}): {ids[0]} != {row}")
    # and the values: ContextCite's per-ablation log-probability (from its logit-probability,
    # float32) against pyattr's response_logprobs of the same masks
    cc = torch.nn.functional.logsigmoid(torch.as_tensor(citer._logit_probs, dtype=torch.float64).sum(1))
    ours = A.response_logprobs(model, example.prompt, example.ranges, [example.answer], masks, [(0, 1)])[:, 0]
    if not torch.allclose(cc, ours, rtol=1e-4, atol=1e-4):
        fail(f"log-probabilities differ by up to {float((cc - ours).abs().max()):.3g}")
