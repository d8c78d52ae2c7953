"""Perturbation curves: how fast the explained value falls when the tokens an explanation
ranks first are removed, and ABPC (AttnLRP, Achtibat et al., ICML 2024, §4.1).

For each row the real (non-padding) tokens are ranked by relevance. At level j of
``steps`` the first ``round(j / steps · n)`` of them are perturbed (``n`` the row's real
tokens) and the target is evaluated again; every level of every row is one row of a
batched forward, so a row's whole curve costs ``(steps + 1) / batch_size`` forwards.
"""

from __future__ import annotations

from pyattr._repr import summary_repr
from pyattr.results import ResultViews

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Union

import torch
from torch import nn

import pyattr.methods._core as core
import pyattr.methods._core.text as text
import pyattr.methods._core.groups as G
import pyattr.methods._core.positions as P
import pyattr.targets as T
from pyattr.evaluate.levels import checked_relevance, perturbed_masks
from pyattr.evaluate.perturbation_seq2seq import seq2seq_curve
from pyattr.integration.wrappers import unwrap
from pyattr.methods._core.stacks import is_encoder_decoder
from pyattr.methods._core.forward import evaluate_targets, run_model

ORDERS = ("morf", "lerf", "insertion")
PERTURBATIONS = ("zero_embedding", "pad", "mask", "mean_embedding")
#: perturbed copies per forward when the caller gives no ``batch_size``
DEFAULT_BATCH = 64


@dataclass
class PerturbationCurve(ResultViews):
    """Output of :func:`perturbation_curve`.

    Attributes:
        fractions (Tensor[steps + 1], float64): share of each row's real tokens perturbed
            (``morf`` / ``lerf``) or restored (``insertion``) at each level, 0 … 1.
        values (Tensor[batch, steps + 1], float64): the target at each level (level 0 is
            the unperturbed input for ``morf`` / ``lerf``, the fully perturbed one for
            ``insertion``).
        auc (Tensor[batch], float64): area under each row's curve over ``fractions``
            (trapezoid rule), in the target's units.
        order, perturbation (str): as called.
    """

    __repr__ = summary_repr

    fractions: torch.Tensor
    values: torch.Tensor
    auc: torch.Tensor
    order: str
    perturbation: str

    def plot(self, path: Union[str, Path, None] = None, labels: Optional[List[str]] = None,
             title: Optional[str] = None):
        """The curves (one line per row, their mean in black): with ``path``, written as a
        PNG there (returns None); without, a matplotlib figure (as every result's ``plot()``)."""
        if path is None:
            return ResultViews.plot(self)
        plot_curves([self], path, labels=labels, title=title)


def area(values: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """Trapezoid area under ``values`` (…, levels) over ``fractions`` (levels,), float64."""
    return torch.trapezoid(values.double(), fractions.double().to(values.device), dim=-1)


def _token_relevance(relevance, shape) -> torch.Tensor:
    for name in ("token_relevance", "token_attribution"):  # RelevanceResult, AttributionResult
        if hasattr(relevance, name):
            relevance = getattr(relevance, name)
            break
    r = relevance
    if not isinstance(r, torch.Tensor):
        raise TypeError(f"relevance must be a Tensor[batch, seq] or a result with token_relevance / "
                        f"token_attribution, "
                        f"got {type(relevance).__name__}")
    return checked_relevance(r, shape)


def _check(order: str, perturbation: str, steps) -> int:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if perturbation not in PERTURBATIONS:
        raise ValueError(f"perturbation must be one of {PERTURBATIONS}, got {perturbation!r}")
    return core.check_count("steps", steps, allow_none=False)


def _replacement_id(model: nn.Module, perturbation: str, token_id) -> Optional[int]:
    if token_id is not None and perturbation not in ("pad", "mask"):
        raise ValueError(f"token_id is used by perturbation='pad' or 'mask', not {perturbation!r}")
    if perturbation == "mask" and token_id is None:
        raise ValueError("perturbation='mask' needs token_id= (the tokenizer's mask_token_id)")
    if perturbation == "pad" and token_id is None:
        token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        if token_id is None:
            raise ValueError(f"perturbation='pad' needs a pad token: {type(model).__name__}'s config has no "
                             "pad_token_id; pass token_id= (e.g. the tokenizer's pad or eos id)")
    if token_id is None:
        return None
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(token_id, bool) or not isinstance(token_id, (int, torch.Tensor)) or (
            isinstance(token_id, torch.Tensor) and (token_id.dim() or token_id.is_floating_point())):
        import numbers

        if not (isinstance(token_id, numbers.Integral) and not isinstance(token_id, bool)):
            raise ValueError(f"token_id must be an int token id, got {token_id!r}")
    token_id = int(token_id)
    if token_id < 0 or (isinstance(vocab, int) and token_id >= vocab):
        raise ValueError(f"token_id must be in [0, {vocab}) (config.vocab_size), got {token_id}")
    return token_id


@text.text_inputs("perturbation_curve")
@torch.no_grad()
def perturbation_curve(model: nn.Module, inputs, relevance, target=None, *, order: str = "morf",
                       perturbation: str = "zero_embedding", steps: int = 20, batch_size: Optional[int] = None,
                       token_id: Optional[int] = None, attention_mask: Optional[torch.Tensor] = None,
                       tokenizer=None, decoder_input_ids=None,
                       decoder_attention_mask: Optional[torch.Tensor] = None) -> PerturbationCurve:
    """The target as the tokens are perturbed in the order of their relevance.

    Args:
        model (nn.Module): a Hugging Face model pyattr supports (as :func:`pyattr.relevance`).
        inputs: token ids (LongTensor[batch, seq]), a tokenizer output, or ``pixel_values``
            (``"zero_embedding"`` / ``"mean_embedding"`` only: an image has no token ids to
            replace), as :func:`pyattr.relevance`.
        relevance (Tensor[batch, seq] | RelevanceResult | AttributionResult): the explanation
            to score, one value per token (``token_relevance`` / ``token_attribution``);
            padding is never perturbed.
        target: one target per row, as :func:`pyattr.relevance`. ``None``, a top-1
            ``Logit()`` or a ``LogitDiff`` with top-1 ids are fixed to the unperturbed
            input's prediction, so every level measures the same token.
        order: ``"morf"`` (most relevant first), ``"lerf"`` (least relevant first) or
            ``"insertion"`` (start from every real token perturbed, restore the most
            relevant first).
        perturbation: ``"zero_embedding"`` (the perturbed positions' vectors are set to 0
            where the embeddings enter the first block, the point relevance is measured at;
            AttnLRP's choice), ``"pad"`` (the token id becomes ``token_id``, default
            ``config.pad_token_id``), ``"mask"`` (the id becomes ``token_id``, required) or
            ``"mean_embedding"`` (the input embedding module's output at a perturbed token
            becomes the mean of what that module outputs over every id of its table, scale
            included: Gemma's √hidden; for an image, a perturbed patch's patch embedding
            becomes the mean patch embedding of that image, its position embedding still
            added, and [CLS], which holds nothing of the image, is not ranked or perturbed).
            Whatever the perturbation, the attention mask, the positions and the position
            the model pools its output from stay those of the unperturbed input: a
            sequence classifier that pools at the last token that is not the pad token
            (Llama's, GPT-2's, … with ``pad_token_id`` = eos) reads, at every level, the
            position it read on the unperturbed input (observed on that forward), not the
            one replacing a token by the pad id would move it to; likewise a model that
            pools inside itself at a token of the ids (CLIP's text tower: its
            ``pooler_output`` is the row of ``last_hidden_state`` at the first end-of-text
            token, or at ``argmax(input_ids)`` with the legacy ``eos_token_id == 2``) keeps
            the row it took on the unperturbed input, and ``text_embeds`` projects that row.
        steps (int): levels after level 0; fractions are ``j / steps``. Default 20.
        batch_size (int, optional): perturbed copies per forward (default 64).
        token_id (int, optional): see ``perturbation``.
        attention_mask (Tensor[batch, seq], optional): 1 for real tokens.
        tokenizer (optional): the model's Hugging Face tokenizer, for text inputs, a word
            ``target`` (as :func:`pyattr.relevance`), and the result's ``tokens`` (each
            token as a string). ``model`` may be a hub id, a directory or a bundled
            name, and ``rules`` a shorthand (``"all"``, ``"attnlrp"``, ``"ln"``,
            ``"none"``), as for :func:`pyattr.relevance`.
        decoder_input_ids (optional): on an encoder–decoder model, the target prefix the
            decoder reads (ids, text with ``tokenizer=``, or from ``labels`` in the inputs),
            as :func:`pyattr.relevance`; ``relevance`` is then the source's
            (``source_relevance`` of its result, Tensor[batch, source_len]) and the source
            tokens are perturbed, the decoder's inputs kept
            (:mod:`pyattr.evaluate.perturbation_seq2seq`).
        decoder_attention_mask (Tensor[batch, target_len], optional): 1 for the target
            prefix's real tokens, as :func:`pyattr.relevance`.

    Returns:
        PerturbationCurve (``fractions`` (steps + 1,), ``values`` (batch, steps + 1),
        ``auc`` (batch,), float64).

    Raises:
        ValueError / TypeError: unknown order or perturbation, ``steps`` < 1, relevance of
            another shape or with NaN / inf, k targets per row, ``"pad"`` without a pad
            token, ``"mask"`` without ``token_id``, ``"pad"`` / ``"mask"`` on image inputs;
            ``"pad"`` / ``"mask"`` where the position the model pools from cannot be
            observed (a pooled output found at several identical positions; a model whose
            forward pools at a token of the ids, run more than once or returning no
            ``last_hidden_state`` / ``pooler_output``).
    """
    steps = _check(order, perturbation, steps)
    batch_size = core.check_count("batch_size", batch_size) or DEFAULT_BATCH
    model = unwrap(model)
    if is_encoder_decoder(model) or decoder_input_ids is not None or decoder_attention_mask is not None:
        if not is_encoder_decoder(model):
            raise ValueError(f"decoder_input_ids / decoder_attention_mask: {type(model).__name__} is not an "
                             "encoder–decoder model (config.is_encoder_decoder is false)")
        values = seq2seq_curve(model, inputs, relevance, target, order, perturbation, steps, batch_size,
                               _replacement_id(model, perturbation, token_id), attention_mask, decoder_input_ids,
                               decoder_attention_mask, tokenizer, _vocabulary_mean)
        fractions = torch.arange(steps + 1, dtype=torch.float64) / steps
        return PerturbationCurve(fractions, values, area(values, fractions), order, perturbation)
    prep = core.prepare(model, inputs, attention_mask, "perturbation_curve")
    ids = prep.input_ids
    batch, seq = ids.shape
    rel = _token_relevance(relevance, (batch, seq)).to(ids.device)
    replace_id = _replacement_id(model, perturbation, token_id)
    if replace_id is not None and prep.patch_grid is not None:
        raise ValueError(f"perturbation={perturbation!r} replaces token ids, and the inputs are an image; "
                         "use 'zero_embedding' or 'mean_embedding'")
    tgts, several = T.normalize(target, batch)
    if several:
        raise ValueError("target: a perturbation curve scores one target per row, got k targets per row")
    real = (prep.attention_mask.bool() if prep.attention_mask is not None
            else torch.ones(batch, seq, dtype=torch.bool, device=ids.device))
    if perturbation == "mean_embedding" and prep.patch_grid is not None:
        real = real.clone()
        real[:, 0] = False  # [CLS]: a learned vector, no patch of the image to replace
    levels = perturbed_masks(rel, real, order, steps)
    values = torch.empty(batch, steps + 1, dtype=torch.float64)
    with core.inference_state(model):
        store: dict = {}
        # where the model pools from, when it chooses it from the ids (a sequence classifier's
        # last non-pad token, CLIP's first end-of-text token) is observed on the unperturbed
        # input and kept at every level; a perturbation that leaves the ids as they are
        # leaves it where it is
        observe = P.observe_pooling(model, poolers=True) if replace_id is not None else contextlib.nullcontext()
        with core.record_modules(model, T.module_paths(tgts), store), observe as pooled:
            fwd = run_model(model, prep, tgts, store, keep_logits=True)
        if pooled is not None:
            pooled.read(fwd.output).refuse_unseen(f"perturbation={perturbation!r}")
        _, _, fixed = evaluate_targets(tgts, fwd, False)
        mean = _vocabulary_mean(model) if perturbation == "mean_embedding" and prep.patch_grid is None else None
        groups = G.row_groups(model, prep) or [torch.arange(batch)]
        for rows in groups:
            pairs = torch.cartesian_prod(rows, torch.arange(steps + 1)).reshape(-1, 2)
            for chunk in pairs.split(batch_size):
                r, lv = chunk[:, 0], chunk[:, 1]
                keep = contextlib.nullcontext() if pooled is None else pooled.keep(r)
                out = _perturbed_values(model, prep, fixed, r, levels[r.to(ids.device), lv.to(ids.device)],
                                        perturbation, replace_id, mean, keep)
                values[r, lv] = out.double().cpu()
    fractions = torch.arange(steps + 1, dtype=torch.float64) / steps
    return PerturbationCurve(fractions, values, area(values, fractions), order, perturbation)


#: token ids per call of the input embedding module while averaging its output over the table
_MEAN_CHUNK = 8192


def _vocabulary_mean(model: nn.Module) -> torch.Tensor:
    """The mean of what the input embedding module outputs over every id of its table
    (float64, (hidden,)): the module itself run on the ids, in chunks, so that a scale it
    applies (Gemma's √hidden) or any other transform of its weight is in the mean.
    ``model``: the model (its ``get_input_embeddings()``) or the embedding module itself."""
    emb = model if isinstance(model, nn.Embedding) or not callable(getattr(model, "get_input_embeddings", None)) \
        else model.get_input_embeddings()
    rows = getattr(emb, "num_embeddings", None)
    if not isinstance(rows, int):
        w = getattr(emb, "weight", None)
        rows = int(w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() == 2 else None
    if not isinstance(rows, int):
        rows = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"perturbation='mean_embedding' averages the input embedding over its table, and "
                         f"{type(emb).__name__} names no number of rows (num_embeddings, weight, config.vocab_size)")
    p = next(iter(emb.parameters()), None)
    device = p.device if p is not None and p.device.type != "meta" else torch.device("cpu")
    total = None
    for start in range(0, rows, _MEAN_CHUNK):
        out = emb(torch.arange(start, min(start + _MEAN_CHUNK, rows), device=device)[None])
        part = out.reshape(-1, out.shape[-1]).double().sum(0)
        total = part if total is None else total + part
    return total / rows


def _patch_mean_tap(emb: nn.Module, mask: torch.Tensor, grid):
    """The tap of ``"mean_embedding"`` on an image: each perturbed patch's patch embedding
    (the output of the input embedding module, ``mask`` over [CLS] + the patches) becomes
    the mean patch embedding of its image."""
    rows, cols = grid
    patches = mask[:, 1:]

    def fn(t):
        if t.dim() == 3 and t.shape[1] == rows * cols:                  # (batch, patches, hidden): ViT
            m = patches[..., None]
            mean = t.double().mean(1, keepdim=True).to(t.dtype)
        elif t.dim() == 4 and tuple(t.shape[-2:]) == (rows, cols):      # (batch, hidden, rows, cols): CLIP's Conv2d
            m = patches.reshape(-1, 1, rows, cols)
            mean = t.double().mean((-2, -1), keepdim=True).to(t.dtype)
        else:
            raise ValueError(
                f"perturbation='mean_embedding': the input embedding module {type(emb).__name__} returns shape "
                f"{tuple(t.shape)}, not one vector per patch of the {rows}×{cols} grid, so the perturbed patches "
                "cannot be found in it; use 'zero_embedding'")
        return torch.where(m.to(t.device), mean, t)

    return core.tap(emb, "output", fn, once=True)


def _perturbed_values(model, prep, targets, rows: torch.Tensor, mask: torch.Tensor, perturbation: str,
                      replace_id: Optional[int], mean: Optional[torch.Tensor] = None,
                      keep=None) -> torch.Tensor:
    """The targets of rows ``rows`` with the tokens of ``mask`` (len(rows), seq) perturbed
    (``mean``: the vocabulary mean of ``"mean_embedding"`` on tokens; ``keep``: a context
    in which the model pools these rows where the unperturbed forward pooled them,
    :meth:`pyattr.methods._core.positions.PooledPositions.keep`)."""
    batch = prep.input_ids.shape[0]
    sub = core.select_rows(prep, rows.to(prep.input_ids.device))
    tg = [t.rows(rows, batch) for t in targets]
    kwargs = dict(sub.kwargs)
    if replace_id is not None:
        kwargs["input_ids"] = sub.input_ids.masked_fill(mask, replace_id)
        tap = _no_tap()
    elif perturbation == "zero_embedding":
        tap = core.tap(sub.entry, sub.where, lambda t: t.masked_fill(mask[..., None], 0.0), once=True)
    elif sub.patch_grid is not None:  # mean_embedding on an image
        tap = _patch_mean_tap(model.get_input_embeddings(), mask, sub.patch_grid)
    else:  # mean_embedding
        tap = core.tap(model.get_input_embeddings(), "output",
                       lambda t: torch.where(mask[..., None], mean.to(device=t.device, dtype=t.dtype), t), once=True)
    store: dict = {}
    # the pooled position is kept after the targets' recording hooks: a target reading the
    # head itself reads what it computed
    with tap, core.record_modules(model, T.module_paths(tg), store), (keep or contextlib.nullcontext()):
        fwd = run_model(model, sub, tg, store, kwargs, keep_logits=True)
    value, _, _ = evaluate_targets(tg, fwd, False)
    return value


class _no_tap:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def abpc(model: nn.Module, inputs, relevance, target=None, **kw) -> torch.Tensor:
    """Area between the perturbation curves, AUC(LeRF) − AUC(MoRF), per row (Tensor[batch],
    float64; AttnLRP, Achtibat et al., ICML 2024, §4.1). Larger is better: removing the
    tokens ranked most relevant should lower the target fast, removing those ranked least
    relevant slowly. ``kw`` as :func:`perturbation_curve` (``order`` is set here)."""
    if "order" in kw:
        raise TypeError("abpc() sets order itself (lerf and morf); drop order=")
    lerf = perturbation_curve(model, inputs, relevance, target, order="lerf", **kw)
    morf = perturbation_curve(model, inputs, relevance, target, order="morf", **kw)
    return lerf.auc - morf.auc


def plot_curves(curves: List[PerturbationCurve], path: Union[str, Path], labels: Optional[List[str]] = None,
                title: Optional[str] = None) -> None:
    """One PNG with the mean curve of each of ``curves`` (rows as thin lines when one curve)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for i, c in enumerate(curves):
        x = c.fractions.numpy()
        if len(curves) == 1:
            for row in c.values:
                ax.plot(x, row.numpy(), color="tab:blue", alpha=0.25, lw=0.8)
        label = labels[i] if labels else f"{c.order} ({c.perturbation})"
        ax.plot(x, c.values.mean(0).numpy(), lw=2, label=f"{label}: AUC {c.auc.mean().item():.3g}",
                color="black" if len(curves) == 1 else None)
    ax.set_xlabel("fraction of tokens perturbed" if curves[0].order != "insertion" else "fraction of tokens restored")
    ax.set_ylabel("target")
    if title:
        ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
