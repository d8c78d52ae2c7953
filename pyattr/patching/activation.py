"""Activation patching: every node's effect measured, patched runs batched into forwards."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

import pyattr.methods._core as core
import pyattr.methods._core.text as text
import pyattr.targets as T
from pyattr.integration.wrappers import unwrap
from pyattr.methods._core.forward import evaluate_targets, head_free, run_model
from pyattr.patching.nodes import Site, check_nodes, node_sites
from pyattr.patching.pairs import (
    Pair,
    align,
    check_value,
    metric_targets,
    prepare_pair,
    recording_forward,
)
from pyattr.patching.result import PatchingResult, dims
import pyattr.patching.seq2seq as S2P
from pyattr.methods._core.stacks import is_encoder_decoder


@dataclass(frozen=True)
class _Job:
    row: int
    site: int          # index into the flat site list
    position: int      # -1: every valid position (sum_positions)
    unit: int          # head or neuron index; -1 for the whole width


@text.text_inputs("activation_patching", inputs=("clean", "corrupt"), target="metric")
def activation_patching(
    model: nn.Module,
    clean,
    corrupt,
    metric,
    nodes: Union[str, Sequence[str]] = ("residual", "attention", "mlp"),
    *,
    batch_size: Optional[int] = None,
    sample: Optional[int] = None,
    seed: int = 0,
    sum_positions: bool = False,
    alignment: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    corrupt_attention_mask: Optional[torch.Tensor] = None,
    progress: bool = True,
    generic: bool = False,
    tokenizer=None,
    decoder_input_ids=None,
    corrupt_decoder_input_ids=None,
    decoder_attention_mask: Optional[torch.Tensor] = None,
) -> PatchingResult:
    """The exact effect of each single-node patch: ``metric(clean run with the node's
    activation taken from the corrupt run) − metric(clean run)`` (the ground truth that
    :func:`attribution_patching` estimates).

    Each patched run is one row of a batched forward of ``batch_size`` rows, all patches
    of one clean row, compared with an unpatched forward of the same rows (so identical
    clean and corrupt inputs give exactly 0). Runs without gradient and without rules,
    in eval mode.

    ``model``, ``clean``, ``corrupt``, ``metric``, ``nodes``, ``sum_positions``,
    ``alignment``, ``attention_mask`` and ``corrupt_attention_mask`` are as in
    :func:`attribution_patching`; with ``sum_positions`` a node is patched at every
    position at once.

    Args:
        batch_size (int, optional): patched runs per forward. Default 32.
        sample (int, optional): patch only this many ``"neurons"`` nodes per row, drawn
            uniformly without replacement (``seed``); the others hold NaN and
            ``result.sampled["neurons"]`` marks those patched. Other node types are
            always patched in full.
        seed (int): seed of the neuron sample. Default 0.
        progress (bool): a transient progress bar on stderr (on a terminal, after ~1 s).
        generic (bool): for an architecture without a rule map, the nodes structural
            discovery reads off the module graph, as in :func:`attribution_patching`.
        tokenizer (optional): the model's Hugging Face tokenizer, for text inputs and
            the result's ``tokens`` (each token as a string). ``clean`` and ``corrupt``
            may be texts. ``model`` may be a hub id, a directory or a bundled name, and
            ``rules`` a shorthand (``"all"``, ``"attnlrp"``, ``"ln"``, ``"none"``), as
            for :func:`pyattr.relevance`.
        decoder_input_ids (optional): on an encoder–decoder model, the clean run's target
            prefix, as in :func:`attribution_patching` (nodes on both stacks).
        corrupt_decoder_input_ids (optional): the corrupt run's, as there.
        decoder_attention_mask (Tensor[batch, target_len], optional): as there.

    Returns:
        PatchingResult with ``method="exact"``.

    Raises:
        ValueError: as :func:`attribution_patching`; ``batch_size`` or ``sample`` < 1.
        RuntimeError: a call under ``torch.inference_mode()``.
    """
    model = unwrap(model)
    if is_encoder_decoder(model) or any(v is not None for v in (decoder_input_ids, corrupt_decoder_input_ids,
                                                                decoder_attention_mask)):
        return S2P.patching(model, clean, corrupt, metric, nodes, "exact", "activation_patching",
                            sum_positions=sum_positions, alignment=alignment, attention_mask=attention_mask,
                            corrupt_attention_mask=corrupt_attention_mask, decoder_input_ids=decoder_input_ids,
                            corrupt_decoder_input_ids=corrupt_decoder_input_ids,
                            decoder_attention_mask=decoder_attention_mask, tokenizer=tokenizer,
                            batch_size=batch_size, unsupported=(("sample", sample),))
    from pyattr.methods._core.progress import Progress

    node_list = check_nodes(nodes)
    if not isinstance(sum_positions, bool):
        raise TypeError(f"sum_positions must be a bool, got {sum_positions!r}")
    batch_size = core.check_count("batch_size", batch_size) or 32
    sample = core.check_count("sample", sample)
    if sample is not None and "neurons" not in node_list:
        raise ValueError(f"sample: a sample is taken of 'neurons' nodes only, and nodes={tuple(node_list)} has none")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    sites = node_sites(model, node_list, generic)
    flat = [s for n in node_list for s in sites[n]]
    caller = "activation_patching"
    pair = prepare_pair(model, clean, corrupt, alignment, attention_mask, corrupt_attention_mask, caller,
                        generic=generic)
    batch, seq = pair.clean.input_ids.shape
    tgts = metric_targets(metric, batch)
    with torch.no_grad(), core.inference_state(model):
        value, acts_c, fixed = recording_forward(model, pair.clean, tgts, flat, grad=False)
        value_x, _, _ = recording_forward(model, pair.corrupt, fixed, flat, grad=False,
                                 metric="optional" if alignment is not None else "required")
        widths = [a.shape[-1] for a in acts_c]
        del acts_c
        shapes, jobs_per_row, sampled = _plan(flat, node_list, widths, pair.valid, batch, seq, sum_positions, sample, seed)
        out = {n: torch.full((batch, *shapes[n]), float("nan") if n in sampled else 0.0, dtype=torch.float64)
               for n in node_list}
        n_forwards = sum(math.ceil(len(j) / batch_size) for j in jobs_per_row)
        bar = Progress(n_forwards, "activation patching") if progress else None
        done = 0
        try:
            for row, jobs in enumerate(jobs_per_row):
                # per chunk size: the unpatched metric and the corrupt activations of forwards
                # of that many copies of this row, so that a patched run differs from its
                # reference only by the patch (identical inputs give exactly 0 in any dtype)
                copies: Dict[int, Tuple[torch.Tensor, List[torch.Tensor]]] = {}
                for start in range(0, len(jobs), batch_size):
                    chunk = jobs[start:start + batch_size]
                    n = len(chunk)
                    if n not in copies:
                        copies[n] = _copies(model, pair, fixed, flat, row, n, float(value[row]))
                    reference, sources = copies[n]
                    vals = _patched_forward(model, pair, fixed, flat, sources, row, chunk)
                    eff = (vals - reference).cpu()
                    for j, job in enumerate(chunk):
                        out[flat[job.site].node][_index(row, flat[job.site], job, sum_positions)] = eff[j]
                    done += 1
                    if bar is not None:
                        bar.advance(done)
        finally:
            if bar is not None:
                bar.close()
    keep = pair.valid if not sum_positions else pair.valid.any(1)
    for n in node_list:  # no node at padding / unaligned positions: 0, sampled or not
        m = keep.view(batch, 1, *keep.shape[1:], *([1] * (out[n].dim() - 1 - keep.dim())))
        out[n] = torch.where(m, out[n], torch.zeros((), dtype=out[n].dtype))
    return PatchingResult(
        effects={n: out[n].float() for n in node_list},
        dims={n: dims(n, sum_positions) for n in node_list},
        clean_metric=value.double(),
        corrupt_metric=value_x.double(),
        method="exact",
        sampled=sampled,
    )


def _index(row: int, site: Site, job: _Job, sum_positions: bool):
    idx = (row, site.layer) + (() if sum_positions else (job.position,))
    return idx + ((job.unit,) if job.unit >= 0 else ())


def _plan(flat, node_list, widths, valid, batch, seq, sum_positions, sample, seed):
    """The patched runs, per clean row; the result shapes; the neuron sample masks."""
    n_layers = {n: sum(1 for s in flat if s.node == n) for n in node_list}
    shapes: Dict[str, Tuple[int, ...]] = {}
    units: Dict[str, int] = {}
    for i, s in enumerate(flat):
        units[s.node] = s.heads if s.node == "heads" else widths[i] if s.node == "neurons" else 0
    for n in node_list:
        shapes[n] = (n_layers[n],) + (() if sum_positions else (seq,)) + ((units[n],) if units[n] else ())
    sampled: Dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(int(seed))
    jobs_per_row: List[List[_Job]] = []
    for row in range(batch):
        positions = [-1] if sum_positions else [int(p) for p in valid[row].nonzero().flatten()]
        if sum_positions and not bool(valid[row].any()):
            positions = []
        jobs: List[_Job] = []
        for n in node_list:
            idxs = [i for i, s in enumerate(flat) if s.node == n]
            if n == "neurons" and sample is not None:
                cand = [(i, p, u) for i in idxs for p in positions for u in range(units[n])]
                pick = torch.randperm(len(cand), generator=gen)[:sample].sort().values.tolist()
                mask = sampled.setdefault(n, torch.zeros((batch, *shapes[n]), dtype=torch.bool))
                for c in pick:
                    i, p, u = cand[c]
                    jobs.append(_Job(row, i, p, u))
                    mask[_index(row, flat[i], jobs[-1], sum_positions)] = True
                continue
            for i in idxs:
                for p in positions:
                    if units[n]:
                        jobs += [_Job(row, i, p, u) for u in range(units[n])]
                    else:
                        jobs.append(_Job(row, i, p, -1))
        jobs_per_row.append(jobs)
    return shapes, jobs_per_row, sampled


def _copies(model, pair: Pair, fixed, flat, row: int, n: int, clean_value: float):
    """``(unpatched metric, corrupt activations in the clean layout)`` of forwards of ``n``
    copies of clean / corrupt row ``row``."""
    reference = _patched_forward(model, pair, fixed, flat, None, row, [None] * n)
    # a metric that reads per-row data of the original batch (a callable closing over a
    # tensor of ids, say) gives other values on copies of one row: refuse, never mix rows
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    tol = max(1e-4, 16 * torch.finfo(dtype).eps) * max(1.0, abs(clean_value))
    if not bool(torch.isfinite(reference).all()) or float((reference - clean_value).abs().max()) > tol:
        raise ValueError(
            f"metric: on {n} copies of clean row {row} it gives {reference[:3].tolist()}…, but {clean_value} on the "
            "batch; activation patching runs each row as copies of itself, so a callable metric must compute each "
            "row from that row alone. For per-row ids or references use a pyattr.targets target (Logit(ids), "
            "LogitDiff(a, b), Cosine(reference)), which follows the rows"
        )
    idx = torch.full((n,), row, dtype=torch.long)
    _, acts, _ = recording_forward(model, core.select_rows(pair.corrupt, idx), fixed, flat, grad=False, metric="skip")
    index = pair.index[row:row + 1].expand(n, -1)
    return reference, [align(a, index) for a in acts]


def job_mask(site: Site, jobs: Sequence[_Job], valid: torch.Tensor, seq: int, width: int) -> torch.Tensor:
    """Bool ``(len(jobs), seq, width)``: where each job patches its site's activation (its
    unit, a head's slice, a neuron or the whole width; at its position, or for position -1
    at every position where its row of ``valid`` (``(len(jobs), seq)``) is set)."""
    dev = valid.device
    unit_of = torch.arange(width, device=dev)
    if site.node == "heads":
        unit_of = unit_of // (width // site.heads)
    u = torch.tensor([job.unit for job in jobs], dtype=torch.long, device=dev)[:, None]
    cols = (u < 0) | (unit_of[None] == u)
    p = torch.tensor([job.position for job in jobs], dtype=torch.long, device=dev)[:, None]
    at = torch.where(p >= 0, torch.arange(seq, device=dev)[None] == p, valid.bool())
    return at[:, :, None] & cols[:, None, :]


def patch_copies(site: Site, jobs: Sequence[Tuple[int, _Job]], sources: torch.Tensor, valid: torch.Tensor,
                 base: Optional[torch.Tensor] = None):
    """The tap body that patches a batch of copies: copy ``j`` of each ``(j, job)`` takes the
    job's unit (head slice, neuron, or the whole width) from ``sources[j]``, at the job's
    position or, for position -1, at every position where ``valid[j]`` is set. With
    ``base`` (the clean activations the sources were recorded beside) the unit gets
    ``sources[j] − base[j]`` added instead: a corrupt value equal to the clean one leaves
    the copy's own activation untouched, bit for bit, whatever the batch it ran in."""

    copies = [j for j, _ in jobs]
    leading = copies == list(range(len(copies)))  # the first copies in order: a slice, not a gather

    def fn(t):
        # one masked update for every copy at once (a Python step per copy cost more than the
        # block on small models): the same elementwise sum or copy as unit by unit
        dev = t.device
        rows = slice(0, len(copies)) if leading else torch.tensor(copies, dtype=torch.long, device=dev)
        mask = job_mask(site, [job for _, job in jobs], valid.to(dev)[rows], t.shape[1], t.shape[-1])
        old = t[rows]
        src = sources.to(dev)[rows]
        if base is None:
            put = src.to(t.dtype)
        else:
            b = base.to(dev)[rows]
            # in the activations' own dtype where all agree: one correctly rounded difference,
            # as float64's then cast (0 where they are equal either way)
            diff = src - b if src.dtype == b.dtype == t.dtype else src.double() - b.double()
            put = old + diff.to(t.dtype)
        new = t.clone()
        new[rows] = torch.where(mask, put, old)
        return new

    return fn


def _patched_forward(model, pair: Pair, fixed, flat, sources, row: int, chunk) -> torch.Tensor:
    """Metric of ``len(chunk)`` copies of clean row ``row``, copy j patched by ``chunk[j]``
    (``None``: unpatched) with the activations of copy j in ``sources``."""
    k = len(chunk)
    batch = pair.clean.input_ids.shape[0]
    idx = torch.full((k,), row, dtype=torch.long)
    sub = core.select_rows(pair.clean, idx)
    tg = [t.rows(idx, batch) for t in fixed]
    by_site: Dict[int, List[Tuple[int, _Job]]] = {}
    for j, job in enumerate(chunk):
        if job is not None:
            by_site.setdefault(job.site, []).append((j, job))
    used = sorted(by_site)
    valid = pair.valid[row]

    def fn_for(n):
        site_i = used[n]
        return patch_copies(flat[site_i], by_site[site_i], sources[site_i], valid.expand(k, -1))

    mods: dict = {}
    with core.taps([(flat[i].module, flat[i].where) for i in used], fn_for), \
            core.record_modules(model, T.module_paths(tg), mods):
        fwd = run_model(model, sub, tg, mods, keep_logits=head_free(model, [flat[i].module for i in used]))
    try:
        value, _, _ = evaluate_targets(tg, fwd, False)
        value = check_value(value, k)
    except (IndexError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"metric: failed on {k} copies of clean row {row} ({type(e).__name__}: {e}); activation patching runs "
            "each row as copies of itself, so a callable metric must compute each row from that row alone; for "
            "per-row ids or references use a pyattr.targets target (Logit(ids), LogitDiff(a, b), Cosine(reference))"
        ) from e
    return value.double()
