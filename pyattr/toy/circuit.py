"""The circuit of the toy induction decoder, found with plain PyTorch (no pyattr method):
attention-pattern scores, mean ablation and exact activation patching per head.

A head's output here is its slice of the input of ``self_attn.o_proj``, shape
(batch, seq, head_dim): what the head writes to the residual stream before the output
projection mixes heads. The circuit is:

- previous-token heads: layer-0 heads whose mean attention from position p to p − 1 is
  above ``THRESHOLD``;
- induction heads: layer-1 heads whose mean attention from a repeated word to the word
  after its earlier occurrence is above ``THRESHOLD`` and whose exact patching effect on
  the pairs' logit difference is at least ``COPY_SHARE`` of the clean − corrupt gap (a head
  that attends like an induction head but whose output does not carry the copied word is
  not counted).

Ablation and patching confirm them: mean-ablating a circuit head costs accuracy, and the
heads with the largest exact patching effects are the induction heads.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import pyattr.toy.task as task

THRESHOLD = 0.3
COPY_SHARE = 0.1
Head = Tuple[int, int]


def _o_proj(model, layer: int):
    return model.model.layers[layer].self_attn.o_proj


def _shape(model) -> Tuple[int, int, int]:
    cfg = model.config
    return cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads


@contextlib.contextmanager
def replace_heads(model, values: Dict[Head, torch.Tensor]):
    """Replace each listed head's output (input of o_proj, (batch, seq, head_dim) or
    broadcastable to it) for the forwards inside the block."""
    layers, heads, d = _shape(model)
    handles = []
    for layer in range(layers):
        mine = {h: v for (l, h), v in values.items() if l == layer}
        if not mine:
            continue

        def pre(mod, args, mine=mine):
            x = args[0]
            b, s, _ = x.shape
            x = x.reshape(b, s, heads, d).clone()
            for h, v in mine.items():
                x[:, :, h] = v.to(x.dtype).expand(b, s, d)
            return (x.reshape(b, s, heads * d),) + tuple(args[1:])

        handles.append(_o_proj(model, layer).register_forward_pre_hook(pre))
    try:
        yield
    finally:
        for hd in handles:
            hd.remove()


@torch.no_grad()
def head_outputs(model, ids: torch.Tensor) -> torch.Tensor:
    """Every head's output: (layers, heads, batch, seq, head_dim)."""
    layers, heads, d = _shape(model)
    got: List[torch.Tensor] = [None] * layers  # type: ignore[list-item]
    handles = [
        _o_proj(model, layer).register_forward_pre_hook(
            lambda mod, args, layer=layer: got.__setitem__(layer, args[0].detach().clone()))
        for layer in range(layers)
    ]
    try:
        model(input_ids=ids)
    finally:
        for hd in handles:
            hd.remove()
    b, s = ids.shape
    return torch.stack([g.reshape(b, s, heads, d).permute(2, 0, 1, 3) for g in got])


@torch.no_grad()
def attention_scores(model, count: int = 256, seed: int = 5) -> Dict[str, List[List[float]]]:
    """Mean previous-token and induction attention per head, ``[layer][head]``, over
    ``count`` fresh task sequences (eager attention probabilities)."""
    g = torch.Generator().manual_seed(seed)
    ids, determined = task.batch(g, count)
    out = model(input_ids=ids, output_attentions=True)
    n_ = determined.float().argmax(1)  # each row's period
    b, s = ids.shape
    p = torch.arange(s)
    prev, ind = [], []
    for a in out.attentions:  # (batch, heads, seq, seq)
        a = a.float()
        prev.append(a[:, :, p[2:], p[2:] - 1].mean((0, 2)).tolist())
        # a repeated word at p (p > n) attends to p - n + 1: the word after its earlier occurrence
        rows, cols, keep = [], [], []
        for i in range(b):
            n = int(n_[i])
            q = torch.arange(n + 1, s)
            rows.append(torch.full_like(q, i))
            cols.append(q)
            keep.append(q - n + 1)
        r, q, k = torch.cat(rows), torch.cat(cols), torch.cat(keep)
        ind.append(a[r, :, q, k].mean(0).tolist())
    return {"previous_token": prev, "induction": ind}


@torch.no_grad()
def _accuracy(model, ids, determined) -> float:
    pred = model(input_ids=ids).logits[:, :-1].argmax(-1)
    mask = determined[:, :-1]
    return (pred[mask] == ids[:, 1:][mask]).float().mean().item()


@torch.no_grad()
def mean_ablation(model, heads: Optional[Sequence[Head]] = None, count: int = 256,
                  seed: int = 6) -> Dict[str, object]:
    """Accuracy on fresh task sequences with nothing ablated, with each head mean-ablated
    (its output replaced by its mean over the batch and positions), and with ``heads``
    ablated together."""
    g = torch.Generator().manual_seed(seed)
    ids, determined = task.batch(g, count)
    outs = head_outputs(model, ids)
    mean = outs.mean((2, 3))  # (layers, heads, head_dim)
    layers, n_heads, _ = _shape(model)
    per = [[0.0] * n_heads for _ in range(layers)]
    for layer in range(layers):
        for h in range(n_heads):
            with replace_heads(model, {(layer, h): mean[layer, h]}):
                per[layer][h] = _accuracy(model, ids, determined)
    out: Dict[str, object] = {"clean": _accuracy(model, ids, determined), "per_head": per}
    if heads is not None:
        with replace_heads(model, {tuple(hd): mean[hd[0], hd[1]] for hd in heads}):
            out["circuit"] = _accuracy(model, ids, determined)
    return out


def pair_tensors(pairs: Sequence[task.Pair]):
    """(clean ids, corrupt ids, answer ids, alternative ids) of a list of pairs."""
    clean = torch.tensor([p.clean for p in pairs])
    corrupt = torch.tensor([p.corrupt for p in pairs])
    return clean, corrupt, torch.tensor([p.answer for p in pairs]), torch.tensor([p.alternative for p in pairs])


@torch.no_grad()
def logit_diff(model, ids, answer, alternative) -> torch.Tensor:
    """logit(answer) − logit(alternative) at the last position, (batch,) float64."""
    logits = model(input_ids=ids).logits[:, -1].double()
    return logits.gather(1, answer[:, None])[:, 0] - logits.gather(1, alternative[:, None])[:, 0]


@torch.no_grad()
def head_patching(model, pairs: Sequence[task.Pair]) -> torch.Tensor:
    """Exact activation patching per head: the change of logit(answer) − logit(alternative)
    when one head's output at every position is taken from the corrupt run, (pairs,
    layers, heads) float64. One forward per head."""
    clean, corrupt, answer, alternative = pair_tensors(pairs)
    base = logit_diff(model, clean, answer, alternative)
    bad = head_outputs(model, corrupt)
    layers, n_heads, _ = _shape(model)
    out = torch.zeros(len(pairs), layers, n_heads, dtype=torch.float64)
    for layer in range(layers):
        for h in range(n_heads):
            with replace_heads(model, {(layer, h): bad[layer, h]}):
                out[:, layer, h] = logit_diff(model, clean, answer, alternative) - base
    return out


def analyse(model, pairs_count: int = 64, seed: int = 7) -> Dict[str, object]:
    """The circuit and the evidence for it (JSON-ready)."""
    scores = attention_scores(model)
    g = torch.Generator().manual_seed(seed)
    pp = task.pairs(g, pairs_count)
    patch = head_patching(model, pp).mean(0)
    clean, corrupt, answer, alternative = pair_tensors(pp)
    gap = (logit_diff(model, clean, answer, alternative) - logit_diff(model, corrupt, answer, alternative)).mean()
    prev = [[0, h] for h, v in enumerate(scores["previous_token"][0]) if v > THRESHOLD]
    ind = [[1, h] for h, v in enumerate(scores["induction"][1])
           if v > THRESHOLD and abs(patch[1, h].item()) >= COPY_SHARE * abs(gap.item())]
    ablation = mean_ablation(model, [tuple(h) for h in prev + ind])
    return {
        "previous_token_heads": prev,
        "induction_heads": ind,
        "threshold": THRESHOLD,
        "copy_share": COPY_SHARE,
        "scores": scores,
        "mean_ablation_accuracy": ablation,
        "head_patching_mean": patch.tolist(),
        "clean_logit_diff_mean": logit_diff(model, clean, answer, alternative).mean().item(),
        "corrupt_logit_diff_mean": logit_diff(model, corrupt, answer, alternative).mean().item(),
    }
