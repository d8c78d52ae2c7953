"""Source ablations as batched forwards, and the linear surrogates fit on them.

A keep-mask ``m ∈ {0, 1}^S`` over a prompt's ``S`` sources gives the prompt with every
dropped source's tokens taken out (ContextCite, Cohen-Wang et al. 2024, §2: a source is
ablated by removing it from the context), the response appended after it. Its value is the
response's log-probability under the model, summed per response span.

The ablated prompts are right-padded: under a causal mask no real token attends to a pad
after it, and every kept token keeps the position the model gives it in the ablated text,
so the values are the model's own for each ablated text, whatever its position encoding.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import nn

import pyattr.architectures as A


def ablated_rows(prompt: Sequence[int], ranges: Sequence[Tuple[int, int]], response: Sequence[int],
                 masks: torch.Tensor) -> List[List[int]]:
    """One id list per keep-mask row: ``prompt`` without the dropped sources, then ``response``."""
    drop = torch.zeros(masks.shape[0], len(prompt), dtype=torch.bool)
    for s, (a, b) in enumerate(ranges):
        drop[:, a:b] |= ~masks[:, s].bool()[:, None]
    ids = torch.as_tensor(list(prompt))
    return [ids[~d].tolist() + list(response) for d in drop]


@torch.no_grad()
def response_logprobs(model: nn.Module, prompt: Sequence[int], ranges: Sequence[Tuple[int, int]],
                      response: Sequence[int], masks: torch.Tensor, spans: Sequence[Tuple[int, int]],
                      batch_size: int = 64) -> torch.Tensor:
    """The response's log-probability (float64, natural log) per keep-mask and span.

    Args:
        prompt: the prompt's token ids; ranges: each source's ``(start, end)`` in it.
        response: the response's token ids (at least one).
        masks (BoolTensor[n, S]): keep-masks, one row per ablation.
        spans: ``(start, end)`` ranges of response tokens.
        batch_size: ablated prompts per forward.

    Returns:
        Tensor[n, len(spans)], float64.
    """
    from pyattr.methods._core.context_inputs import joint_ids

    joint_ids(model, prompt, response)  # the length check: the prompt with every source kept reads the most
    rows = ablated_rows(prompt, ranges, response, masks)
    device = next(model.parameters()).device
    r = len(response)
    out = torch.empty(len(rows), len(spans), dtype=torch.float64)
    resp = torch.as_tensor(list(response), device=device)
    pad = 0
    for idx in _chunks(model, rows, batch_size):
        chunk = [rows[i] for i in idx]
        width = max(len(x) for x in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, x in enumerate(chunk):
            ids[i, :len(x)] = torch.as_tensor(x)
            mask[i, :len(x)] = 1
        kw = {} if bool(mask.all()) and A.streams_decoder(model) is not None else {"attention_mask": mask.to(device)}
        logits = model(input_ids=ids.to(device), **kw).logits
        lengths = torch.as_tensor([len(x) for x in chunk], device=device)
        # the logit that predicts response token t sits one position before it
        pos = (lengths - r - 1)[:, None] + torch.arange(r, device=device)[None]
        # float64: the logit-probability log p − log(1 − p) of a near-certain token is a small
        # difference of large terms, which float32 rounds away
        picked = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])).double().log_softmax(-1)
        lp = picked.gather(-1, resp[None, :, None].expand(len(chunk), -1, 1))[..., 0].double().cpu()
        for j, (a, b) in enumerate(spans):
            out[idx, j] = lp[:, a:b].sum(-1)
    return check_values(out)


def check_values(out: torch.Tensor) -> torch.Tensor:
    """``out`` (Tensor[ablations, spans]) when every value is finite; else ValueError: a fit
    of NaN gives NaN scores (or an error inside the solver) with no number to read."""
    bad = ~torch.isfinite(out)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"context_attribution(): the model's log-probability of the response is not finite (NaN or inf) on "
            f"ablation {i} of {out.shape[0]}, so no source can be scored (some models' eager attention masks give NaN "
            "in float64: transformers' left-padded eager attention, ProphetNet with any attention mask; try float32)")
    return out


def _chunks(model: nn.Module, rows: List[List[int]], batch_size: int) -> List[torch.Tensor]:
    """The rows' indices per forward: ``batch_size`` at a time; for a model whose logits
    depend on its input's length (ProphetNet's predicting streams, where a padded row is not
    the row alone) only rows of one length share a forward, unpadded (no mask: ProphetNet's
    own mask gives NaN in float64)."""
    if A.streams_decoder(model) is None:
        return [torch.arange(lo, min(lo + batch_size, len(rows))) for lo in range(0, len(rows), batch_size)]
    by_length: dict = {}
    for i, x in enumerate(rows):
        by_length.setdefault(len(x), []).append(i)
    return [torch.tensor(g[lo:lo + batch_size]) for g in by_length.values() for lo in range(0, len(g), batch_size)]


def random_masks(generator: torch.Generator, count: int, sources: int, keep: float = 0.5) -> torch.Tensor:
    """BoolTensor[count, sources]: each source kept with probability ``keep`` (ContextCite's
    ablation distribution)."""
    return torch.rand(count, sources, generator=generator, dtype=torch.float64) < keep


def paired_masks(generator: torch.Generator, count: int, sources: int) -> torch.Tensor:
    """``count`` keep-masks as antithetic pairs (a random mask and its complement), every
    source kept in exactly half of them; all ``2^S`` masks when ``count >= 2^S``.

    Why: in a least-squares fit on a design closed under complement, each source's
    coefficient is free of every even-order interaction between sources (a fold-over
    design, Box & Hunter 1961), which random masks only average out slowly.
    """
    if sources < 31 and count >= 2 ** sources:
        codes = torch.arange(2 ** sources)
        return (codes[:, None] >> torch.arange(sources)[None]) & 1 == 1
    half = random_masks(generator, (count + 1) // 2, sources)
    return torch.cat([half, ~half])[:count]


def lasso(x: torch.Tensor, y: torch.Tensor, alpha: float, iterations: int = 500,
          tol: float = 1e-10) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(weights[S, k], intercept[k])`` minimising ``‖y − x w − b‖² / (2n) + alpha ‖w‖₁`` per
    column of ``y`` (coordinate descent, float64; ``alpha = 0`` is least squares).

    Args:
        x (Tensor[n, S]): the keep-masks as 0/1; y (Tensor[n, k]): the values.
    """
    x = x.double()
    y = y.double()
    n, s = x.shape
    xm, ym = x.mean(0), y.mean(0)
    xc, yc = x - xm, y - ym
    if alpha == 0:
        # least squares solved directly (the minimum-norm solution where the masks do not
        # determine every weight): what coordinate descent converges to, without its
        # S × iterations Python steps, which cost more than the model's forwards on small
        # models with many sources
        w = torch.linalg.lstsq(xc, yc, driver="gelsd").solution
        return w, ym - xm @ w
    norms = (xc ** 2).sum(0) / n
    w = torch.zeros(s, y.shape[1], dtype=torch.float64)
    resid = yc.clone()
    for _ in range(iterations):
        biggest = 0.0
        for j in range(s):
            if norms[j] <= 0:
                continue
            old = w[j].clone()
            rho = (xc[:, j:j + 1] * resid).sum(0) / n + norms[j] * old
            new = torch.sign(rho) * torch.clamp(rho.abs() - alpha, min=0) / norms[j]
            resid -= xc[:, j:j + 1] * (new - old)[None]
            w[j] = new
            biggest = max(biggest, float((new - old).abs().max()))
        if biggest < tol:
            break
    return w, ym - xm @ w
