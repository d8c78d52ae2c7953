"""Clean / corrupt pairs: inputs checked and lined up (``alignment``), the metric, and the
recording forward that reads every node's activation."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional

import torch

import pyattr.methods._core as core
import pyattr.methods._core.groups as G
import pyattr.methods._core.positions as P
import pyattr.targets as T
from pyattr._validation import refuse_meta_model
from pyattr.methods._core.forward import evaluate_targets, head_free, leaf, run_model
from pyattr.patching.nodes import Site


@dataclass
class Pair:
    clean: core.Prepared
    corrupt: core.Prepared
    index: torch.Tensor    # (batch, seq) corrupt position of each clean position (-1: none)
    valid: torch.Tensor    # (batch, seq) bool: a node exists (real clean token with a counterpart)


def prepare_pair(model, clean, corrupt, alignment, clean_mask, corrupt_mask, caller, alignable: bool = True,
                 generic: bool = False) -> Pair:
    """Clean and corrupt checked and lined up. ``alignable`` False (EAP-IG, which
    interpolates position by position): clean and corrupt must line up as they are."""
    refuse_meta_model(model, caller)
    for name, value in (("clean", clean), ("corrupt", corrupt)):
        if core.is_pixels(value):
            raise TypeError(
                f"{caller}: {name} is an image (pixel_values); patching aligns token sequences, and "
                "image inputs are supported by relevance(), layer_relevance() and integrated_gradients()"
            )
    pc = core.prepare(model, clean, clean_mask, caller, generic, name="clean")
    px = core.prepare(model, corrupt, corrupt_mask, caller, generic, name="corrupt")
    for name, prep in (("clean", pc), ("corrupt", px)):
        if G.row_groups(model, prep) is not None:
            raise ValueError(
                f"{caller}: the rows of {name} have lengths for which {type(model).__name__}'s rotary embedding "
                f"computes different frequencies ({P.describe(model).split(';')[0]}), so a row batched with the "
                "others would not compute what it computes alone; patch rows of one rotary regime per call "
                "(pyattr.relevance, layer_relevance and integrated_gradients group such rows themselves)"
            )
    (bc, sc), (bx, sx) = pc.input_ids.shape, px.input_ids.shape
    if bc != bx:
        raise ValueError(f"clean has {bc} rows and corrupt {bx}; patching pairs row i of clean with row i of corrupt")
    mc = torch.ones(bc, sc, dtype=torch.bool) if pc.attention_mask is None else pc.attention_mask.bool().cpu()
    mx = torch.ones(bx, sx, dtype=torch.bool) if px.attention_mask is None else px.attention_mask.bool().cpu()
    if alignment is None and not alignable and (sc != sx or not torch.equal(mc, mx)):
        if caller == "attribution_patching":
            raise ValueError(
                "clean and corrupt differ in length or in their attention masks; method='ig' interpolates the input "
                "embeddings position by position, so they must have the same length and mask (alignment= is not "
                "possible there; method='atp' or 'relp' take alignment=)"
            )
        what = ("a node circuit patches position p of the clean run with position p of the corrupt run"
                if caller == "circuit_search" else
                "an edge (or a node of a node circuit) joins position p of one run to position p of the other")
        diff = f"differ in length ({sc} and {sx} tokens)" if sc != sx else "differ in their attention masks"
        raise ValueError(
            f"{caller}: clean and corrupt {diff}; {what}, so they must have the same length and mask (with token "
            "ids and masks, give both attention_mask= and corrupt_attention_mask=)"
        )
    if alignment is None:
        if sc != sx:
            raise ValueError(
                f"clean and corrupt have different lengths ({sc} and {sx} tokens); patching pairs position p "
                "with position p, so pass alignment= (LongTensor[batch, clean_seq]: the corrupt position of "
                "each clean position, -1 for none)"
            )
        if not torch.equal(mc, mx):
            row = int((mc != mx).any(1).nonzero()[0, 0])
            raise ValueError(
                f"clean and corrupt attention masks differ in row {row}; patching pairs position p with "
                "position p, so the real tokens must line up, or pass alignment= (LongTensor[batch, "
                "clean_seq]: the corrupt position of each clean position, -1 for none)"
            )
        index = torch.arange(sc).expand(bc, sc).clone()
        valid = mc.clone()
    else:
        if not isinstance(alignment, torch.Tensor) or alignment.dtype not in (torch.int64, torch.int32):
            raise TypeError("alignment must be an integer tensor of shape (batch, clean_seq)")
        index = alignment.detach().to("cpu", torch.long)
        if index.dim() == 1:
            index = index.expand(bc, -1)
        if tuple(index.shape) != (bc, sc):
            raise ValueError(f"alignment of shape {tuple(alignment.shape)} must be (batch, clean_seq) = {(bc, sc)}")
        if bool(((index < -1) | (index >= sx)).any()):
            raise ValueError(f"alignment: positions must be in [0, {sx}) (the corrupt length) or -1 for none")
        valid = (index >= 0) & mc
        gathered = torch.gather(mx, 1, index.clamp_min(0))
        if bool((valid & ~gathered).any()):
            raise ValueError("alignment: a real clean token is aligned to a padding position of corrupt")
    return Pair(pc, px, index, valid)


def metric_targets(metric, batch: int):
    if metric is None:
        raise ValueError("metric is required: a callable(output) -> Tensor[batch] or a pyattr.targets target")
    tgts, several = T.normalize(metric, batch)
    if several:
        raise ValueError("metric must be one target (one value per row), not k targets")
    return tgts


def check_row_metric(model, prep: core.Prepared, fixed, clean_value: torch.Tensor, caller: str) -> None:
    """The metric of each row must not depend on the other rows of its batch: methods that
    run rows in other batches (repeated, partial) would otherwise give numbers that depend
    on ``batch_size``. Checked on the last row alone and on the batch in reverse order,
    against the clean run's metric (to float noise)."""
    batch = prep.input_ids.shape[0]
    if batch < 2:
        return
    want_all = clean_value.detach().double().cpu()
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    for idx in (torch.tensor([batch - 1]), torch.arange(batch - 1, -1, -1)):
        tg = [t.rows(idx, batch) for t in fixed]
        mods: dict = {}
        try:
            with torch.no_grad(), core.record_modules(model, T.module_paths(tg), mods):
                fwd = run_model(model, core.select_rows(prep, idx.to(prep.input_ids.device)), tg, mods, keep_logits=True)
                got = check_value(evaluate_targets(tg, fwd, False)[0], len(idx)).detach().double().cpu()
        except (IndexError, RuntimeError, TypeError, ValueError) as e:
            raise ValueError(
                f"metric: {caller} runs rows in other batches, so the metric must compute each row from that row alone, "
                f"and on rows {idx.tolist()[:4]}{'…' if len(idx) > 4 else ''} run apart it failed ({type(e).__name__}: "
                f"{e}). For per-row ids or references use a pyattr.targets target (Logit(ids), LogitDiff(a, b), "
                "Cosine(reference)), which follows the rows") from e
        want = want_all[idx]
        tol = max(1e-4, 16 * torch.finfo(dtype).eps) * want.abs().nan_to_num(0.0).clamp_min(1.0)
        bad = ~(((got - want).abs() <= tol) | (got.isnan() & want.isnan()))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"metric: row {int(idx[i])} gives {float(got[i]):.6g} in a batch of rows {idx.tolist()[:4]}"
                f"{'…' if len(idx) > 4 else ''} and {float(want[i]):.6g} in the whole batch; {caller} runs rows in other "
                "batches, so the metric must compute each row from that row alone. For per-row ids or references use a "
                "pyattr.targets target (Logit(ids), LogitDiff(a, b), Cosine(reference)), which follows the rows")


def check_value(value: torch.Tensor, batch: int) -> torch.Tensor:
    if value.dim() != 1 or value.shape[0] != batch:
        raise ValueError(f"metric must give one value per row, shape ({batch},), got shape {tuple(value.shape)}")
    return value


def align(act: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Corrupt activations (batch, seq_x, …) → clean layout (batch, seq_c, …)."""
    idx = index.clamp_min(0).to(act.device)
    idx = idx.view(*idx.shape, *([1] * (act.dim() - 2))).expand(*idx.shape, *act.shape[2:])
    return torch.gather(act, 1, idx)


@contextlib.contextmanager
def _recording(sites: List[Site], store: List[Optional[torch.Tensor]], check: List[int], versions: List[int]):
    def fn_for(i):
        def fn(t):
            check[i] += 1
            # a node at a module's input is the value as that module receives it: an alias, so
            # a target read from the same tensor before it (the previous block's output) is
            # not downstream of the node (exact patching there leaves it unchanged too)
            alias = t.view_as(t) if sites[i].where == "input" and t.requires_grad else None
            store[i] = t if alias is None else alias
            versions[i] = t._version
            return alias

        return fn

    with core.taps([(s.module, s.where) for s in sites], fn_for):
        yield


def _check_once(sites: List[Site], calls: List[int]) -> None:
    for s, c in zip(sites, calls):
        if c != 1:
            raise ValueError(f"nodes: {s.path!r} ran {c} times in one forward pass; patching needs modules that run once")


def _check_recorded(sites: List[Site], store: List[torch.Tensor], versions: List[int], rows: tuple) -> None:
    """Every recorded activation is per (row, position) and still the module's own value."""
    for s, t, v in zip(sites, store, versions):
        if tuple(t.shape[:2]) != rows or t.dim() < 3:
            raise ValueError(
                f"nodes: {s.path!r} gives a tensor of shape {tuple(t.shape)} at its {s.where}, not (batch {rows[0]}, "
                f"position {rows[1]}, …): the model reshapes its rows there (e.g. flattens batch and positions), "
                f"so the {s.node!r} node cannot be patched per position")
        if t._version != v:
            raise ValueError(
                f"nodes: {s.path!r}: its {s.where} was changed in place later in the forward pass (code after the "
                "hook edits that tensor: `out += other`, an inplace activation), so the recorded activation would "
                f"not be the module's {s.where}; the {s.node!r} node cannot be read there")


def _head_cut(model, prep: core.Prepared, tgts, sites: List[Site], metric: str) -> bool:
    """Whether the head may run at the metric's positions only (``logits_to_keep``): not
    for an optional metric, which may name a position this input lacks (it reads NaN
    there), nor where the positions cannot be read on this input (a skipped metric)."""
    if metric == "optional" or not head_free(model, [s.module for s in sites]):
        return False
    try:
        T.logit_positions(tgts, prep.input_ids, prep.attention_mask)
    except (IndexError, ValueError):
        return False
    return True


def recording_forward(model, prep: core.Prepared, tgts, sites: List[Site], grad: bool, metric: str = "required",
                      cut: bool = True):
    """One forward recording every site's activation: ``(metric value, activations, fixed
    targets)``.

    The entry embeddings are a leaf that requires grad in both the clean and the corrupt
    run, so both run the same kernels (a clean and a corrupt copy of one input give
    bit-identical activations). ``metric``: ``"required"``; ``"optional"`` (a metric that
    cannot be read on this input, e.g. an absolute position beyond a shorter corrupt
    input under an alignment, gives NaN); ``"skip"``. ``cut``: the head may run at the
    metric's positions only (off where the caller's other runs read the full head, as the
    edge graph's: one identical input must give one value)."""
    store: List[Optional[torch.Tensor]] = [None] * len(sites)
    calls = [0] * len(sites)
    mods: dict = {}
    versions: List[int] = [0] * len(sites)
    with core.tap(prep.entry, prep.where, lambda t: leaf(t), once=True), _recording(sites, store, calls, versions), \
            core.record_modules(model, T.module_paths(tgts), mods):
        fwd = run_model(model, prep, tgts, mods, keep_logits=cut and _head_cut(model, prep, tgts, sites, metric))
    _check_once(sites, calls)
    _check_recorded(sites, store, versions, tuple(prep.input_ids.shape[:2]))
    batch = prep.input_ids.shape[0]
    value, fixed = None, tgts
    if metric == "skip":
        pass
    elif metric == "optional":
        try:
            value, _, fixed = evaluate_targets(tgts, fwd, False)
            value = check_value(value, batch)
        except (ValueError, IndexError):
            value = torch.full((batch,), float("nan"), dtype=torch.float64)
    else:
        value, _, fixed = evaluate_targets(tgts, fwd, False)
        value = check_value(value, batch)
    if not grad:
        store = [s.detach() for s in store]
        value = None if value is None else value.detach()
    return value, store, fixed
