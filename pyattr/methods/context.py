"""Context attribution: which sources of the prompt (documents, sentences, lines) a response
rests on, one score per source (and per response span where asked).

Methods (``method=``; measured against each other by ``pyattr bench --citations``,
:mod:`pyattr.bench.citations`, whose table is in docs/tutorials/context.md):

- ``"foldover"`` (default): ContextCite's linear surrogate (Cohen-Wang et al. 2024,
  "ContextCite: Attributing model generation to context", §2.2: a linear model from a
  source keep-mask to the response's logit-probability, fit on ablated prompts) fit by
  least squares on a fold-over design (every random mask and its complement; all ``2^S``
  masks when that is fewer), so each score is free of the even-order interactions between
  sources that random masks average out only slowly; plus half of a second least-squares
  fit to the ablated outcomes' ranks, scaled to the first fit's largest score; all ``2^S``
  masks up to 6 sources, else 64 or ``4(S+1)`` (:func:`default_foldover`). The rank
  fit credits the sources that order the ablations below the top one (the source the
  model's query matches on, where the answer source's large effect drowns them in the
  squared error): on both toy decoders it lifts LDS above 256 random ablations' at 17
  forwards (the table in docs/tutorials/context.md).
- ``"contextcite"``: ContextCite's own recipe: ``ablations`` random masks (64 by default, each
  source kept with probability 1/2), Lasso (``alpha`` 0.01) on the standardised masks and the
  response's logit-probability per response token (:func:`contextcite_fit`).
- ``"loo"``: leave-one-out, one forward per source: the drop in log-probability when the
  source alone is removed.
- ``"attnlrp"``, ``"relevance"``, ``"gradient"``: token relevance of each response token's
  log-probability (teacher-forced, :func:`pyattr.generation_relevance`) under AttnLRP
  attention (relevance through queries and keys as well as values; Achtibat et al. 2024,
  ICML), the default rules, or no rules (gradient × input), summed over each source's
  tokens: one forward and backward per ``batch_targets`` response tokens.
- ``"attention"``: attention weights from the positions that predict the response to each
  source, averaged over layers and heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import nn

import pyattr.methods._core.ablation as A
import pyattr.methods._core.context_inputs as CI
import pyattr.methods._core.embedding as E
import pyattr.methods._core.sources as S
import pyattr.methods.seq2seq_context as S2C
from pyattr.methods._core.stacks import is_encoder_decoder
from pyattr._module_state import kept_state
from pyattr._repr import summary_repr
from pyattr.results import ResultViews

METHODS = ("foldover", "contextcite", "loo", "attnlrp", "relevance", "gradient", "attention")
#: chosen by ``pyattr bench --citations``: the best LDS at the fewest forwards (docs/tutorials/context.md)
DEFAULT_METHOD = "foldover"
ABLATION_METHODS = ("foldover", "contextcite", "loo")
#: the rank fit's share in ``foldover`` (measured: docs/tutorials/context.md)
RANK_WEIGHT = 0.5
#: ContextCite's Lasso strength (its ``lasso_alpha`` default)
CONTEXTCITE_ALPHA = 0.01
#: ContextCite's default number of ablations (``ContextCiter(num_ablations=64)``)
CONTEXTCITE_ABLATIONS = 64


@dataclass
class ContextAttributionResult(ResultViews):
    """Output of :func:`context_attribution`.

    Attributes:
        scores (Tensor[batch, sources] or Tensor[batch, spans, sources], float64): one score
            per source (NaN past a row's last source). Ablation methods: the change in the
            response's logit-probability (``contextcite``; ``foldover`` with its rank term,
            on the same scale) or log-probability (``loo``) the source's presence makes, in
            nats; relevance methods: the source's relevance summed over its tokens;
            ``attention``: attention weight (see :attr:`score_unit`).
        sources (list[list[str]]): each row's sources as text (``"tokens a:b"`` without a tokenizer).
        source_ranges (list[list[tuple[int, int]]]): each source's token range in the prompt.
        response (list[str | None]): each row's response as text (None without a tokenizer).
        response_ids (list[list[int]]): each row's response tokens.
        spans (list[tuple[int, int]] | None): the response token spans scored (None: the whole response).
        value (Tensor[batch] or Tensor[batch, spans], float64): the outcome with every
            source kept: the response's log-probability (nats), or for a sentence-embedding
            model the cosine similarity of the prompt's embedding with the query's.
        method (str); ablations (int): forwards per row the method ran (0 for relevance methods).
        outcome (str): ``"logprob"`` (a causal LM's response) or ``"cosine"`` (an embedding
            model's similarity to ``query=``; ``response`` then holds the query).
        response_tokens (list[list[str]] | None): with ``tokenizer=``, each response token as
            the tokenizer's decoding writes it (the views name each span by them).
    """

    __repr__ = summary_repr

    scores: torch.Tensor
    sources: List[List[str]]
    source_ranges: List[List[Tuple[int, int]]]
    response: List[Optional[str]]
    response_ids: List[List[int]]
    value: torch.Tensor
    method: str
    ablations: int
    spans: Optional[List[Tuple[int, int]]] = None
    outcome: str = "logprob"
    response_tokens: Optional[List[List[Optional[str]]]] = None

    @property
    def score_unit(self) -> str:
        """What a score measures, in words (for views and the command line)."""
        what = "the passage's cosine similarity to the query" if self.outcome == "cosine" else None
        if self.method in ("foldover", "contextcite"):
            return (f"the source's weight in a linear fit of {what}" if what else
                    "the source's weight in a linear fit of the response's logit-probability (nats)")
        if self.method == "loo":
            return f"{what or 'the response log-probability (nats)'} lost without the source"
        if self.method == "attention":
            return "attention weight on the source's tokens"
        return f"relevance of {what or 'the response log-probability'}, summed over the source's tokens"

    def value_text(self, row: int = 0, span: Optional[int] = None) -> str:
        """The outcome with every source kept, in words (``"log-probability -0.01"``): of
        the whole response, or of response span ``span``."""
        v = self.value[row]
        v = float(v if v.dim() == 0 else v[span] if span is not None else v.sum())
        return f"{'cosine similarity' if self.outcome == 'cosine' else 'log-probability'} {v:.4g}"

    def top(self, k: int = 1, row: int = 0) -> List[Tuple[str, float]]:
        """The ``k`` highest-scoring sources of ``row`` (of the whole response) as (text, score)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        s = self.scores[row] if self.scores.dim() == 2 else self.scores[row].sum(0)
        n = len(self.sources[row])
        order = s[:n].argsort(descending=True)[:k].tolist()
        return [(self.sources[row][i], float(s[i])) for i in order]


def _logit_prob(lp: torch.Tensor) -> torch.Tensor:
    """log p − log(1 − p) (ContextCite's target), finite for p within float64 of 0 or 1."""
    return lp - torch.log(-torch.expm1(lp).clamp(max=-1e-300))


def default_foldover(sources: int) -> int:
    """``foldover``'s default number of ablations: every one of the ``2^S`` keep-masks where
    that is at most 64 (up to 6 sources: the exact least-squares fit, the same for every
    seed), else ContextCite's default budget of 64 or four per weight, whichever is more
    (measured: with 6 sources and 16 masks the top source changed with the seed)."""
    return min(2 ** min(sources, 30), max(64, 4 * (sources + 1)))


def _masks(method, ablations, seed, n_src):
    """The keep-masks a method runs, the full context first."""
    g = torch.Generator().manual_seed(seed)
    full = torch.ones(1, n_src, dtype=torch.bool)
    if method == "loo":
        drop = torch.ones(n_src, n_src, dtype=torch.bool)
        drop[torch.arange(n_src), torch.arange(n_src)] = False
        return torch.cat([full, drop])
    if method == "foldover":
        count = ablations if ablations is not None else default_foldover(n_src)
        return torch.cat([full, A.paired_masks(g, count, n_src)])
    return torch.cat([full, A.random_masks(g, ablations if ablations is not None else CONTEXTCITE_ABLATIONS, n_src)])


def _fit(method, masks, v, link, tokens=None):
    """Scores (Tensor[spans, sources]) from the outcomes ``v`` (Tensor[n, spans]) of ``masks``
    (the full context first); ``link`` maps an outcome to the scale the surrogate is linear
    on; ``tokens``: each span's number of response tokens (``contextcite`` fits per token)."""
    if method == "loo":
        return (v[0][None] - v[1:]).T
    x = masks[1:].double()
    if method == "contextcite":
        return contextcite_fit(x, link(v[1:]), tokens)
    w = A.lasso(x, link(v[1:]), 0.0)[0]
    # the answer source's large effect dominates the squared error of the fit above, so the
    # sources that order the intermediate ablations get too little weight; a fit to the
    # outcomes' ranks (Spearman's own transform) weighs every ablation alike
    ranks = v[1:].argsort(0).argsort(0).double()
    wr = A.lasso(x, ranks, 0.0)[0]
    top = w.abs().amax(0, keepdim=True)
    wr = wr / wr.abs().amax(0, keepdim=True).clamp(min=1e-300) * top
    return (w + RANK_WEIGHT * wr).T


def contextcite_fit(x: torch.Tensor, y: torch.Tensor, tokens=None) -> torch.Tensor:
    """ContextCite's surrogate fit (its ``LassoRegression.fit``, Cohen-Wang et al. 2024, §2.2
    and the released code): the keep-masks standardised per source (mean 0, standard
    deviation 1, a constant column left at 0), the outcome divided by the number of response
    tokens it spans, Lasso with ``alpha`` 0.01 and an intercept, the weights scaled back to
    the masks' 0/1 scale and multiplied by the number of tokens.

    Args:
        x (Tensor[n, sources]): the keep-masks as 0/1. y (Tensor[n, spans]): the outcomes.
        tokens (list[int], optional): each span's response tokens (None: 1 each, the
            embedding similarity's case).

    Returns:
        Tensor[spans, sources], float64.
    """
    x = x.double()
    std = x.std(0, unbiased=False)
    scale = torch.where(std > 0, std, torch.ones_like(std))  # a constant column: scale 1, as StandardScaler's
    n = torch.ones(y.shape[1], dtype=torch.float64) if tokens is None else torch.tensor(tokens, dtype=torch.float64)
    w = A.lasso((x - x.mean(0)) / scale, y.double() / n, CONTEXTCITE_ALPHA)[0]  # (sources, spans)
    return (w / scale[:, None] * n).T


def _ablation_scores(model, prompt, ranges, response, spans, method, ablations, seed, batch_size, prefix=None):
    """``prefix``: an encoder–decoder's decoder start (the prompt is then its source)."""
    masks = _masks(method, ablations, seed, len(ranges))
    v = A.response_logprobs(model, prompt, ranges, response, masks, spans, batch_size) if prefix is None else \
        S2C.response_logprobs(model, prompt, ranges, prefix, response, masks, spans, batch_size)
    return _fit(method, masks, v, _logit_prob, [b - a for a, b in spans]), v[0], masks.shape[0]


def _embedding_scores(model, prompt, ranges, query, pooling, method, ablations, seed, batch_size):
    """Scores of an embedding model's prompt sources for its cosine similarity to ``query``."""
    qemb = E.embed(model, [query], pooling)[0]
    if method in ABLATION_METHODS:
        masks = _masks(method, ablations, seed, len(ranges))
        emb = E.embed(model, A.ablated_rows(prompt, ranges, [], masks), pooling, batch_size)
        v = E.cosine(emb, qemb)[:, None]
        # the similarity is bounded but not a probability: the surrogate is linear in it
        return _fit(method, masks, v, lambda t: t), v[0], masks.shape[0]
    if method == "attention":
        ids = torch.tensor([list(prompt)], device=next(model.parameters()).device)
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True)
        att = _mean_attention(out)
        rows = att[:1] if pooling == "cls" else att       # the positions the embedding pools
        per = torch.stack([rows[:, a:b].sum(-1) for a, b in ranges], -1).mean(0)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        full = E.cosine(E.pool(hidden.double(), torch.ones_like(ids), pooling).cpu(), qemb)
        return per[None], full, 1
    from pyattr.config import RelevanceRules
    from pyattr.methods.relevance import relevance
    from pyattr.targets import Cosine

    rules = {"attnlrp": RelevanceRules.all("attnlrp"), "relevance": None, "gradient": RelevanceRules()}[method]
    # the LN-rule on the metric's own normalisation, as pyattr explain does, where rules are on
    target = Cosine(qemb.float(), pooling=pooling, constant_norm=method != "gradient")
    res = relevance(model, torch.tensor([list(prompt)]), target=target, rules=rules)
    tok = res.token_relevance[0].double()
    if method == "gradient" and float(tok.abs().max()) <= 1e-6 * max(float(res.target.abs().max()), 1e-12):
        # a LayerNorm right after the embeddings makes each token's output independent of its own
        # embedding's scale, so x · ∂f/∂x is 0 token by token: what is left is rounding
        raise ValueError(f"method='gradient': gradient × input is zero on {type(model).__name__} up to rounding (its "
                         "embeddings pass a LayerNorm, which no token's own scale changes); use 'relevance' or "
                         "'attnlrp', whose LN-rule passes relevance through that norm")
    per = torch.stack([tok[a:b].sum() for a, b in ranges])
    return per[None], res.target.double().reshape(1), 0


def _relevance_scores(model, prompt, ranges, response, spans, method):
    from pyattr.config import RelevanceRules
    from pyattr.methods.generation import generation_relevance

    from pyattr.architectures import refuse_one_forward_of_steps

    refuse_one_forward_of_steps(model, "context_attribution")  # the steps' relevance, as generation's
    rules = {"attnlrp": RelevanceRules.all("attnlrp"), "relevance": None, "gradient": RelevanceRules()}[method]
    res = generation_relevance(model, torch.tensor([list(prompt)]), continuation=torch.tensor(list(response)),
                               target="logprob", rules=rules)
    tok = res.token_relevance[0].double()                   # (generated, seq)
    per = torch.stack([tok[:, a:b].sum(-1) for a, b in ranges], -1)
    lp = res.target[0]
    return (torch.stack([per[a:b].sum(0) for a, b in spans]), torch.stack([lp[a:b].sum() for a, b in spans]))


def _mean_attention(out) -> torch.Tensor:
    """Tensor[seq, seq]: the first row's attention weights averaged over layers and heads."""
    if not getattr(out, "attentions", None) or any(a is None for a in out.attentions):
        raise ValueError("method='attention': the model returned no attention weights (load it with "
                         "attn_implementation='eager', or call model.set_attn_implementation('eager'))")
    if getattr(out, "ngram_attentions", None) is not None:  # ProphetNet: logits from a predicting stream
        raise ValueError("method='attention': the model's logits come from its predicting streams, whose attention "
                         "is not the tokens' own (ProphetNet); use 'attnlrp' or 'relevance'")
    return torch.stack([a[0].double().mean(0) for a in out.attentions]).mean(0).cpu()


@torch.no_grad()
def _attention_scores(model, prompt, ranges, response, spans):
    ids = CI.joint_ids(model, prompt, response)
    out = model(input_ids=ids, output_attentions=True)
    att = _mean_attention(out)
    p = len(prompt)
    rows = att[p - 1:p - 1 + len(response)]
    per = torch.stack([rows[:, a:b].sum(-1) for a, b in ranges], -1)
    lp = out.logits[0, p - 1:p - 1 + len(response)].double().log_softmax(-1).cpu()
    lp = lp.gather(-1, torch.tensor(list(response))[:, None])[:, 0]
    return (torch.stack([per[a:b].sum(0) for a, b in spans]), torch.stack([lp[a:b].sum() for a, b in spans]))


def _rows(model, tokenizer, rows, per_sources, per_response, embedding, method, spans, ablations, seed,
          batch_size, max_new_tokens, spec):
    """Each row's scores, source texts and ranges, response text and ids, value; the forwards
    (``spec``: an embedding model's :class:`~pyattr.methods._core.embedding.SentenceEmbedding`)."""
    scores, texts, ranges_all, resp_text, resp_ids, values, cost = [], [], [], [], [], [], 0
    pooling = spec.pooling if spec is not None else None
    for row, (inp, src, resp) in enumerate(zip(rows, per_sources, per_response)):
        encdec = is_encoder_decoder(model)
        if encdec:  # the sources are in the encoder's input; the response is the decoder's
            (prompt, offsets, special, text), joint_resp = S2C.source_of(model, tokenizer, inp), None
        else:
            prompt, offsets, special, text, joint_resp = CI.prompt_of(model, tokenizer, inp, resp, "inputs",
                                                                      embedding, spec)
        ranges = S.resolve(src, text, offsets, special, len(prompt))
        if method in ABLATION_METHODS and sum(b - a for a, b in ranges) == len(prompt):
            raise ValueError(f"sources: row {row}'s sources cover every token of the prompt, so the ablation that "
                             "drops them all leaves no input; keep at least one token outside the sources (a start-of-text "
                             "token, the question) or give sources that leave it out")
        if method == "foldover" and ablations is not None and (ablations < len(ranges) + 1 or ablations % 2):
            raise ValueError(f"ablations: method='foldover' fits one weight per source and an intercept by least "
                             f"squares on pairs of masks: an even number >= {len(ranges) + 1} for row {row}'s "
                             f"{len(ranges)} sources, got {ablations}")
        if embedding:
            r_ids = CI.query_ids(model, tokenizer, resp, row, spec)
            for name, role, ids in (("inputs", "document", prompt), ("query", "query", r_ids)):
                max_len, where = spec.limit(role, model, tokenizer)
                if max_len is not None and len(ids) > max_len:
                    raise ValueError(f"{name}[{row}]: {len(ids)} tokens, more than the {max_len} the checkpoint "
                                     f"embeds ({where}; sentence-transformers truncates there); shorten the text")
            sc, val, n = _embedding_scores(model, prompt, ranges, r_ids, pooling, method, ablations, seed, batch_size)
            if method in ABLATION_METHODS:
                cost = max(cost, n)
        else:
            prefix = None
            if encdec:
                prefix, r_ids = S2C.response_of(model, tokenizer, prompt, resp, max_new_tokens, row)
            else:
                r_ids = joint_resp if joint_resp is not None else CI.response_ids(model, prompt, resp,
                                                                                  max_new_tokens, row)
            if not r_ids:
                raise ValueError(f"response[{row}]: the model generated no token to explain")
            sp = CI.check_spans(spans, len(r_ids))
            if method in ABLATION_METHODS:
                sc, val, n = _ablation_scores(model, prompt, ranges, r_ids, sp, method, ablations, seed, batch_size,
                                              prefix)
                cost = max(cost, n)
            elif method == "attention":
                sc, val = (_attention_scores(model, prompt, ranges, r_ids, sp) if prefix is None else
                           S2C.attention_scores(model, prompt, ranges, prefix, r_ids, sp))
            else:
                sc, val = (_relevance_scores(model, prompt, ranges, r_ids, sp, method) if prefix is None else
                           S2C.relevance_scores(model, prompt, ranges, prefix, r_ids, sp, method))
        scores.append(sc)
        values.append(val)
        ranges_all.append(ranges)
        resp_ids.append(r_ids)
        if tokenizer is not None:
            texts.append([text[offsets[a][0]:offsets[b - 1][1]] if text is not None and offsets is not None
                          else tokenizer.decode(prompt[a:b]) for a, b in ranges])
            resp_text.append(resp if isinstance(resp, str) else tokenizer.decode(r_ids, skip_special_tokens=embedding))
        else:
            texts.append([f"tokens {a}:{b}" for a, b in ranges])
            resp_text.append(None)
    return scores, texts, ranges_all, resp_text, resp_ids, values, cost


def context_attribution(model: nn.Module, inputs, sources, *, response=None, max_new_tokens: Optional[int] = None,
                        tokenizer=None, method: Optional[str] = None, spans=None, ablations: Optional[int] = None,
                        seed: int = 0, batch_size: int = 64, query=None,
                        pooling: Optional[str] = None) -> ContextAttributionResult:
    """Score each source of a prompt's context for a response, or for a retrieval model's
    match with a query.

    Args:
        model (nn.Module): a Hugging Face causal LM; an encoder–decoder with its
            language-model head (T5, BART, Marian, …: the sources are spans of the source,
            the encoder's input, and the response is on the decoder side, its inputs the
            model's own teacher-forcing shift of it; :mod:`pyattr.methods.seq2seq_context`);
            or a sentence-embedding model (an encoder without a language-model head, such as
            all-MiniLM-L6-v2) with ``query=``. Or its name: a bundled model (``"induction"``,
            ``"translation"``, ``"minilm"``), a local directory or a hub id, loaded with its tokenizer.
        inputs (str | list[str] | LongTensor[seq] | LongTensor[1, seq]): the prompt (context
            and query; for an embedding model the passage), a list of prompts (a batch), or
            one prompt's token ids.
        sources: ``"sentence"``, ``"line"``, ``"paragraph"`` or ``"word"`` (the prompt split so,
            by the tokenizer's character offsets), a list of text spans of the prompt in
            order (whole words first: "cat" in "a cat", not "category"; part of a word's token
            is refused), or a list of token ranges ``(start, end)``; for a batch, one per row
            (a split name applies to every row). Tokens in no source (the query, a system
            line, ``[CLS]``/``[SEP]``) are always kept.
        response (str | LongTensor | list[int] | list, optional): the response to explain
            (teacher-forced; on an encoder–decoder a text is read as the target side,
            ``text_target=``, with the markers the tokenizer adds); or ``max_new_tokens=``
            to generate it (greedy; the steps ``generate`` ran, observed from its stopping
            criteria). For a batch, a list is one
            entry per prompt (a text, a list of ids, a tensor, or an int: a one-token
            response), and a tensor or a single text is every prompt's response.
        tokenizer (optional): the model's tokenizer, for text inputs and the views.
        method (str, optional): one of :data:`METHODS` (default :data:`DEFAULT_METHOD`); see
            the module docstring for each, with its source.
        spans (optional): ``"tokens"`` (one score row per response token) or a list of
            response token ranges; default: the whole response.
        ablations (int, optional): ablated prompts per row for ``foldover`` (default
            ``min(2^S, max(64, 4(S+1)))``, :func:`default_foldover`) and ``contextcite``
            (default 64, ContextCite's).
        seed (int): the seed of the random keep-masks. batch_size (int): ablated prompts per forward.
        query (str | LongTensor | list, optional): for a sentence-embedding model, the text
            the prompt is retrieved for (one for every row, or one per row): the outcome is
            the cosine similarity of the prompt's pooled embedding with the query's (the
            sentence-transformers similarity), each source scored for it. Not with a causal LM.
        pooling (str, optional): ``"mean"`` or ``"cls"``; default: read from the
            checkpoint's sentence-transformers configuration (``modules.json`` and its
            Pooling module), which must declare one where this is None.

    Returns:
        ContextAttributionResult (``outcome`` ``"cosine"`` with ``query=``: ``response`` then
        holds the query, ``value`` the similarity).

    Raises:
        ValueError: an encoder–decoder model without a language-model head; an unknown method, bad sources (a split name not in ``sentence``,
            ``line``, ``paragraph``, ``word``; a span not in the prompt; a range outside it;
            overlapping sources), no response and no ``max_new_tokens``, both, bad spans,
            ``ablations`` < 2, a batch whose sources, responses or queries do not match its
            length; ``query=`` with a causal LM, with ``response=``/``max_new_tokens=`` or
            ``spans=``; an embedding model without ``query=``; a pooling pyattr does not
            reproduce or none declared; a prompt longer than the checkpoint's
            ``max_seq_length`` (its embeddings would truncate it).
    """
    if is_encoder_decoder(model) and not CI.has_lm_head(model):
        raise ValueError(f"model: {type(model).__name__} is an encoder–decoder model without a language-model head; "
                         "context_attribution explains a response its decoder generates (load the "
                         "conditional-generation class: T5ForConditionalGeneration, MarianMTModel, …)")
    model, tokenizer = CI.named_model(model, tokenizer, query)
    method = DEFAULT_METHOD if method is None else method
    if method not in METHODS:
        raise ValueError(f"method: expected one of {list(METHODS)}, got {method!r}")
    if ablations is not None and (isinstance(ablations, bool) or not isinstance(ablations, int) or ablations < 2):
        raise ValueError(f"ablations: expected an int >= 2, got {ablations!r}")
    if ablations is not None and method not in ("foldover", "contextcite"):
        raise ValueError(f"ablations: only method='foldover' and 'contextcite' draw ablations; method={method!r} "
                         "takes none")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)):
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        raise ValueError(f"model: {type(model).__name__} takes {model.main_input_name}, not token ids; "
                         "context_attribution scores the sources of a text")
    if response is not None and max_new_tokens is not None:
        raise ValueError("context_attribution: give response= or max_new_tokens=, not both")
    embedding = not CI.has_lm_head(model)
    if query is not None:
        if not embedding:
            raise ValueError("query: scores a sentence-embedding model's match with a query; this model has a "
                             "language-model head: give the response it explains with response= or max_new_tokens=")
        if response is not None or max_new_tokens is not None:
            raise ValueError("query: give query= (an embedding model) or response=/max_new_tokens= (a causal LM), "
                             "not both")
        if spans is not None:
            raise ValueError("spans: an embedding model's similarity has no response tokens to split; leave spans=None")
    elif embedding:
        raise ValueError(f"model: {type(model).__name__} has no language-model head; for a sentence-embedding model "
                         "give query= (the text the prompt is retrieved for)")
    if pooling is not None and not embedding:
        raise ValueError("pooling: only a sentence-embedding model (query=) pools; a causal LM's response needs none")
    batch = isinstance(inputs, (list, tuple)) and bool(inputs) and isinstance(inputs[0], str)
    rows = list(inputs) if batch else [inputs]
    # in a batch: a split name, or one list of token ranges, is every row's; otherwise one entry per row
    shared = isinstance(sources, str) or (isinstance(sources, (list, tuple)) and bool(sources) and isinstance(
        sources[0], (tuple, list)) and len(sources[0]) == 2 and all(isinstance(v, int) for v in sources[0]))
    per_sources = [sources] * len(rows) if (not batch or shared) else list(sources)
    if batch and not shared and any(isinstance(s, str) and s not in S.SPLITS for s in per_sources):
        raise ValueError("sources: in a batch, one entry per prompt (a split name, or that prompt's list of text "
                         "spans or token ranges), or one split name or list of token ranges for every prompt; got "
                         f"{sources!r}")
    answer = query if embedding else response
    # a list of texts is one per prompt, also where the prompt is one (then a length error)
    per_row = isinstance(answer, (list, tuple)) and (batch or (bool(answer) and isinstance(answer[0], str)))
    per_response = list(answer) if per_row else [answer] * len(rows)
    for name, got in (("sources", per_sources), ("query" if embedding else "response", per_response)):
        if len(got) != len(rows):
            raise ValueError(f"{name}: one per prompt ({len(rows)}), got {len(got)}")
    spec = E.checkpoint_embedding(model, pooling) if embedding else None
    from pyattr.methods._core.passes import inference_state

    # eval mode for every forward (dropout off: the ablated runs compare with each other), restored after;
    # the model's structure and settings as the call found them (BigBird switches itself to full attention
    # on a short input)
    with inference_state(model), kept_state(model):
        parts = _rows(model, tokenizer, rows, per_sources, per_response, embedding, method, spans, ablations,
                      seed, batch_size, max_new_tokens, spec)
    scores, texts, ranges_all, resp_text, resp_ids, values, cost = parts
    span_lists = {tuple(map(tuple, CI.check_spans(spans, len(r)))) for r in resp_ids} if spans is not None else set()
    if len(span_lists) > 1:
        raise ValueError("spans: the rows' responses differ in length, so their spans differ; give spans=None or "
                         "rows with responses of one length")
    width = max(s.shape[-1] for s in scores)
    out = torch.full((len(rows), len(scores[0]), width), float("nan"), dtype=torch.float64)
    for i, s in enumerate(scores):
        out[i, :, :s.shape[-1]] = s
    value = torch.stack(values).double()
    if spans is None:
        out, value = out[:, 0], value[:, 0]
    toks = None
    if tokenizer is not None and not embedding:
        from pyattr.methods._core.text import token_strings

        toks = [token_strings(tokenizer, torch.tensor([ids]))[0] for ids in resp_ids]
    return ContextAttributionResult(out, texts, ranges_all, resp_text, resp_ids, value, method, cost,
                                    None if spans is None else CI.check_spans(spans, len(resp_ids[0])),
                                    "cosine" if embedding else "logprob", toks)
