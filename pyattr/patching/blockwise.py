"""Blockwise patching (``attribution_patching(method="blockwise")``): every node's exact
patching effect, computed from the clean run block by block.

Activation patching runs the whole model once per patched node. The blocks before the node's
own see the clean input either way, so here they are not run again: the node's own block is
re-run on the clean run's recorded input with the node patched (its output changes by ``δ``),
each later block on its recorded input plus the change of the block before it (exactly what
it receives in the patched run: the observed chain, each block's input the previous block's
output, is checked), and the output head (final norm, unembedding, metric) on the last
block's output plus its change, in a forward of the model with every block replayed from
the clean run. Nothing is linearised: the effect is exact patching's (to float rounding, the
rows run in other batch shapes), so it sees composition through every later attention
softmax, norm and MLP (a previous-token head whose output forms an induction head's keys,
Elhage et al. 2021), where attribution patching's linear estimate, whatever the gradient
rule, misses most of it.

Cost: per node, a run of its own block, of each later block and of the output head; patched
nodes of any rows batched ``batch_size`` per run, beside one unpatched copy of each of their
rows in the same run as the reference (:func:`with_references`); a node whose patch changes
nothing (its corrupt value equals its clean one) is not run: its effect is exactly 0, so
identical clean and corrupt inputs give exactly 0. Three cuts, each observed to hold before
it is made: the node's own block replays its attention where the node comes after it (only
the output projection runs: :mod:`pyattr.patching.attention_replay`); every re-run block's
MLP computes from the first position its input changed (:mod:`pyattr.patching.mlp_positions`);
the last block runs its MLP at the metric's positions only (:mod:`pyattr.patching.last_block`).
Against activation patching's whole model per node and per row, that saves the blocks before
each node, the node's block's attention, the MLPs before the change and the per-row forwards:
0.10–0.13 of its time on the toy decoders' heads, 0.15–0.20 on random 2-layer models whose
blocks' arithmetic dominates, 0.27 on 144 heads of a 12-layer model with GPT-2's vocabulary
(``pyattr bench --estimators``; the head runs at the metric's positions only on both sides).
It still grows with nodes × later blocks, where the gradient estimates take a fixed number of
passes.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

import pyattr.architectures as A
import pyattr.methods._core as core
import pyattr.targets as T
from pyattr.methods._core.forward import evaluate_targets, run_model
from pyattr.patching.calls import RecordedCalls, first_output as _first, tensors, with_first_output as _with_first

#: Patched nodes per block run (default of ``batch_size``).
DEFAULT_BATCH = 256
#: a module's hook tables (torch.nn.Module), emptied on a replayed block
_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
          "_forward_hooks_always_called")


class BlockCalls(RecordedCalls):
    """Per block: its recorded call (args, kwargs), its input ``x`` as the block receives it
    (before any other pre-hook, a user's steering hook say: re-running the block through its
    hooks applies them once), its output ``y`` after every forward hook (what the next block
    reads; first tensor, in the graph) and its raw output (for the replay)."""

    caller = "method='blockwise'"

    def __init__(self, blocks: List[nn.Module], attention=None, mlps=None):
        super().__init__(blocks, prepend=True)
        #: each block's MLP from the first position its input changed
        #: (:mod:`pyattr.patching.mlp_positions`; None: whole)
        self.mlps = mlps
        #: the node's own block's attention replayed where it cannot change
        #: (:mod:`pyattr.patching.attention_replay`; None: every block runs whole)
        self.attention = attention
        self.blocks = self.modules
        self.y: List[Optional[torch.Tensor]] = [None] * len(blocks)
        self.raw: list = [None] * len(blocks)
        #: (mlp, positions): the last block's MLP runs at the metric's positions only
        #: (:mod:`pyattr.patching.last_block`; None: the whole block)
        self.cut: Optional[tuple] = None

    @contextlib.contextmanager
    def recording(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(super().recording())
            for part in (self.attention, self.mlps):
                if part is not None:
                    stack.enter_context(part.recording())
            yield self

    @property
    def x(self) -> List[Optional[torch.Tensor]]:
        return self.inputs

    def output(self, i: int, out) -> None:
        self.raw[i] = out
        self.y[i] = _first(out)

    def check(self, model: nn.Module, batch: int) -> None:
        """Every block ran once; each block's input is the previous block's output (nothing
        runs between them, so a block's change is the next one's input change; observed, not
        read off the model type); every tensor of a call is per row (leading dimension the
        batch) or shared (leading dimension 1, or 1-d), so that rows can be selected."""
        if any(c != 1 for c in self.count) or any(x is None for x in self.x):
            raise ValueError(f"method='blockwise': every block must run once on its input tensor in the forward; "
                             f"the blocks ran {self.count} times")
        for i in range(1, len(self.blocks)):
            x, y = self.x[i], self.y[i - 1]
            if x is not y and not (x.shape == y.shape and torch.equal(x, y)):
                raise ValueError(
                    f"method='blockwise' feeds each block's change to the next block, and block {i} of "
                    f"{type(model).__name__} (model_type {A.model_type(model)!r}) does not receive block {i - 1}'s "
                    "output (something runs between them). Use activation_patching or method='relp', 'atp' or 'ig'")
        for i, (args, kwargs) in enumerate(self.calls):
            for name, t in [(f"argument {j}", a) for j, a in enumerate(args)] + list(kwargs.items()):
                for u in tensors(t):
                    if u.dim() >= 2 and u.shape[0] not in (1, batch):
                        raise ValueError(
                            f"method='blockwise' re-runs the blocks on selected rows, and block {i} of "
                            f"{type(model).__name__} takes {name!r} with leading dimension {u.shape[0]} for a batch "
                            f"of {batch} (rows folded with another dimension, as an ALiBi bias folded with the "
                            "heads), which it cannot select. Use activation_patching or method='relp', 'atp' or "
                            "'ig'")

    def release(self) -> None:
        """Drop the recorded calls and tensors (and with them the clean run's graph) now,
        not whenever the cyclic garbage collector gets to them: a later call would
        otherwise allocate its own graph while this one is still held."""
        n = len(self.blocks)
        self.calls, self.inputs, self.y, self.raw = [None] * n, [None] * n, [None] * n, [None] * n
        self.cut = None
        for part in (self.attention, self.mlps):
            if part is not None:
                part.release()

    def run(self, layer: int, idx: torch.Tensor, x: torch.Tensor, batch: int, whole: bool = False,
            ref: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Block ``layer`` on rows ``idx`` of the recorded call with input ``x``; its output
        (the last block's at the metric's positions only, where :attr:`cut` is set and not
        ``whole``: a patch inside its MLP needs every position). ``ref``: the rows' first
        ``len(ref)`` are patched copies of the rows at ``ref``, and nothing is patched inside
        the MLP: the MLP computes from the first position its input changed
        (:mod:`pyattr.patching.mlp_positions`)."""
        from pyattr.patching.last_block import mlp_at

        cut = self.cut if layer == len(self.blocks) - 1 and not whole else None
        if cut is not None:
            part = mlp_at(*cut)
        elif ref is not None and self.mlps is not None and self.mlps.usable(layer):
            part = self.mlps.from_change(layer, idx, len(ref), ref, batch)
        else:
            part = contextlib.nullcontext()
        with part:
            return _first(self.rerun(layer, idx, x, batch))

    def cut_last_mlp(self, model: nn.Module, mlp: nn.Module, pair, fixed, batch: int) -> None:
        """Set :attr:`cut` where it holds: the last block's MLP at the metric's positions
        gives the recorded output there (:func:`pyattr.patching.last_block.checked_cut`),
        and what follows the last block (final norm, head, anyone's hooks on them) reads
        those positions alone: the metric is unchanged, bit for bit, when the last block's
        output changes everywhere else (observed on every row)."""
        from pyattr.methods._core.forward import head_positions
        from pyattr.patching.last_block import checked_cut

        kept = head_positions(model, pair.clean, fixed, pair.clean.kwargs)
        cut = checked_cut(self, mlp, None if kept is None else kept.cpu(), batch)
        if cut is not None:
            idx = torch.arange(batch, device=self.x[-1].device)
            y = self.y[-1].detach()
            g = torch.Generator().manual_seed(0)
            elsewhere = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device, y.dtype)
            elsewhere[:, cut[1].to(y.device)] = 0
            elsewhere *= y.abs().mean().clamp_min(1e-3)
            same = _head(model, pair, fixed, self, idx, torch.zeros_like(y), batch)
            if not torch.equal(_head(model, pair, fixed, self, idx, elsewhere, batch), same):
                cut = None
        self.cut = cut

    @contextlib.contextmanager
    def replay(self, idx: torch.Tensor, batch: int, last_delta: torch.Tensor):
        """Every block returns its recorded output on rows ``idx`` (the last one plus
        ``last_delta``) without computing: a forward of the model then runs only what
        comes before the first and after the last block."""
        last = len(self.blocks) - 1
        saved = []
        for i, blk in enumerate(self.blocks):
            y = self.y[i].detach()[idx.to(self.y[i].device)]
            if i == last:
                y = y + last_delta.to(y.dtype)
            out = _with_first(self.raw[i], y)
            saved.append((blk.__dict__.get("forward"), {h: getattr(blk, h) for h in _HOOKS if hasattr(blk, h)}))
            blk.forward = (lambda out: (lambda *a, **k: out))(out)
            for h in saved[-1][1]:  # the recorded output went through them already
                setattr(blk, h, type(getattr(blk, h))())
        try:
            yield
        finally:
            for blk, (f, hooks) in zip(self.blocks, saved):
                if f is None:
                    del blk.forward
                else:
                    blk.forward = f
                for h, v in hooks.items():
                    setattr(blk, h, v)


def estimates(model: nn.Module, pair, fixed, flat, sources: List[torch.Tensor], bases: List[torch.Tensor],
              jobs: Sequence, calls: BlockCalls, batch_size: int, clean_value: torch.Tensor) -> torch.Tensor:
    """The patching effect of each job (float64, ``len(jobs)``; jobs as
    :func:`pyattr.patching.activation` plans them): module docstring.

    ``sources[i]``: site i's corrupt activation in the clean layout, ``bases[i]`` its clean
    one (a node is patched by their difference); ``clean_value`` the clean run's metric (the
    replayed output head is checked against it)."""
    batch = pair.clean.input_ids.shape[0]
    out = torch.zeros(len(jobs), dtype=torch.float64)
    order = sorted(range(len(jobs)), key=lambda j: (flat[jobs[j].site].layer, jobs[j].site))
    refs: Dict[tuple, torch.Tensor] = {}  # the output head's unchanged runs, per rows: chunks of one layout share them
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            part = order[start:start + batch_size]
            chunks: Dict[tuple, List[int]] = {}
            for j in part:  # per layer, the nodes whose block can replay its attention apart
                site = flat[jobs[j].site]
                att = calls.attention is not None and calls.attention.usable(site.layer, [site])
                chunks.setdefault((site.layer, att), []).append(j)
            for (layer, att), js in chunks.items():
                out[js] = _chunk(model, pair, fixed, flat, (sources, bases), [jobs[j] for j in js], layer, calls,
                                 batch, refs, clean_value, att)
    return out


def _chunk(model, pair, fixed, flat, sources, chunk: list, layer: int, calls: BlockCalls, batch: int,
           refs: Dict[tuple, torch.Tensor], clean_value: torch.Tensor, replay: bool = False) -> torch.Tensor:
    from pyattr.patching.activation import patch_copies

    out = torch.zeros(len(chunk), dtype=torch.float64)
    moved = [k for k, on in enumerate(_moves(flat, sources, chunk, pair.valid)) if on]
    if not moved:
        return out
    chunk = [chunk[k] for k in moved]
    dev = calls.x[layer].device
    idx = torch.tensor([j.row for j in chunk], dtype=torch.long, device=dev)
    ext, ref = with_references(idx)
    by_site: Dict[int, list] = {}
    for k, job in enumerate(chunk):
        by_site.setdefault(job.site, []).append((k, job))
    used = sorted(by_site)

    def fn_for(n):
        i = used[n]
        src, base = sources[0][i], sources[1][i]
        return patch_copies(flat[i], by_site[i], src[idx.to(src.device)], pair.valid[idx.to(pair.valid.device)],
                            base=base[idx.to(base.device)])

    last = layer == len(calls.blocks) - 1
    whole = calls.cut is not None and last and any(inside_cut(calls.cut[0], flat[i]) for i in used)
    mlp = calls.mlps.mlps[layer] if calls.mlps is not None else None
    inside = mlp is not None and any(inside_cut(mlp, flat[i]) for i in used)
    with core.taps([(flat[i].module, flat[i].where) for i in used], fn_for), \
            calls.attention.replaying(layer, ext, batch) if replay else contextlib.nullcontext():
        y = calls.run(layer, ext, calls.x[layer].detach()[ext], batch, whole, None if inside else ref)
    # the node's block's output, patched minus clean (its row's unpatched copy in the same run)
    out[moved] = downstream(model, pair, fixed, calls, idx, layer, y[:len(idx)] - y[ref], batch, refs, clean_value)
    return out


def _moves(flat, sources, chunk: list, valid: torch.Tensor) -> List[bool]:
    """Per job: whether its patch changes its site's activation at all (the corrupt and the
    clean value differ somewhere in its unit and positions). One that does not has effect
    exactly 0 and is not run."""
    from pyattr.patching.activation import job_mask

    moves = [False] * len(chunk)
    by_site: Dict[int, List[int]] = {}
    for k, job in enumerate(chunk):
        by_site.setdefault(job.site, []).append(k)
    for i, ks in by_site.items():
        src, base = sources[0][i], sources[1][i]
        rows = torch.tensor([chunk[k].row for k in ks], dtype=torch.long, device=src.device)
        differs = src[rows] != base.to(src.device)[rows]
        mask = job_mask(flat[i], [chunk[k] for k in ks], valid.to(src.device)[rows], src.shape[1], src.shape[-1])
        for k, on in zip(ks, (differs & mask).flatten(1).any(1).tolist()):
            moves[k] = on
    return moves


def with_references(idx: torch.Tensor):
    """``(ext, ref)``: the rows ``idx`` of a batch of copies with one unpatched copy of each
    distinct row appended (``ext``), and for each copy the index in ``ext`` of its row's
    unpatched copy (``ref``). Run in the same call, the unpatched copy is the reference its
    patched copies are compared with, bit for bit alike where the patch changes nothing (as
    activation patching keeps an unpatched copy in each batch); a separate reference run of
    every copy doubled the blocks' work."""
    rows, inverse = torch.unique(idx, return_inverse=True)
    return torch.cat([idx, rows]), len(idx) + inverse


def inside_cut(mlp: nn.Module, site) -> bool:
    """A node patched inside the cut MLP (its neurons, its input), which reads or writes
    every position: the last block then runs whole for it."""
    within = any(site.module is m for m in mlp.modules() if m is not mlp)
    return within or (site.module is mlp and site.where == "input")


def downstream(model, pair, fixed, calls: BlockCalls, idx: torch.Tensor, layer: int, change: torch.Tensor,
               batch: int, refs: Dict[tuple, torch.Tensor], clean_value: torch.Tensor) -> torch.Tensor:
    """The metric's change (float64, cpu, per row of ``idx``) when block ``layer``'s output
    changes by ``change`` on those rows: each later block re-run on its recorded input plus
    the change before it (beside an unchanged copy of each row, :func:`with_references`),
    then the output head on the last block's output plus its change."""
    ext, ref = with_references(idx)
    n = len(idx)
    for later in range(layer + 1, len(calls.blocks)):  # each later block receives the change before it
        x_l = calls.x[later].detach()[ext]
        carried = torch.cat([change, change.new_zeros((len(ext) - n, *change.shape[1:]))])
        y = calls.run(later, ext, x_l + carried.to(x_l.dtype), batch, ref=ref)
        change = y[:n] - y[ref]
    rows = tuple(idx.tolist())
    if ("head", rows) not in refs:
        refs[("head", rows)] = _head(model, pair, fixed, calls, idx, torch.zeros_like(change), batch)
        check_reference(refs[("head", rows)], clean_value, idx, change.dtype)
    return _head(model, pair, fixed, calls, idx, change, batch) - refs[("head", rows)]


def _head(model, pair, fixed, calls: BlockCalls, idx: torch.Tensor, carried: torch.Tensor, batch: int) -> torch.Tensor:
    """``M(y_last + carried)`` on rows ``idx`` (float64, cpu): the model's forward with every
    block replayed from the clean run, so only the output head (final norm, unembedding,
    metric) computes."""
    from pyattr.patching.pairs import check_value

    sub = core.select_rows(pair.clean, idx)
    tg = [t.rows(idx, batch) for t in fixed]
    mods: dict = {}
    try:
        with calls.replay(idx, batch, carried), _only_final_outputs(model), \
                core.record_modules(model, T.module_paths(tg), mods):
            fwd = run_model(model, sub, tg, mods, keep_logits=True)  # the head at the metric's positions only
        value, _, _ = evaluate_targets(tg, fwd, False)
        return check_value(value, len(idx)).double().cpu()
    except (AttributeError, IndexError, KeyError, RuntimeError, TypeError, ValueError) as e:
        raise ValueError(_METRIC_HELP + f" It failed there ({type(e).__name__}: {e})") from e


_METRIC_HELP = (
    "metric: method='blockwise' evaluates the metric on forwards that replay the blocks (their recorded "
    "outputs, the last one changed) for selected rows, so the metric must compute each row from that row alone "
    "and read only what follows the last block (logits, the final hidden state), not hidden_states, attentions "
    "or router logits of the blocks. For per-row ids or references use a pyattr.targets target (Logit(ids), "
    "LogitDiff(a, b), Cosine(reference)), which follows the rows; or use method='relp', 'atp' or 'ig'."
)
#: output flags whose outputs come from inside the blocks (replayed: not the patched run's)
_BLOCK_OUTPUTS = ("output_hidden_states", "output_attentions", "output_router_logits")


@contextlib.contextmanager
def _only_final_outputs(model: nn.Module):
    """The config's flags for outputs read inside the blocks off while the blocks are
    replayed: a metric that reads them fails there instead of reading replayed values."""
    cfg = getattr(model, "config", None)
    old = {f: getattr(cfg, f) for f in _BLOCK_OUTPUTS if cfg is not None and getattr(cfg, f, None)}
    for f in old:
        setattr(cfg, f, False)
    try:
        yield
    finally:
        for f, v in old.items():
            setattr(cfg, f, v)


def check_reference(reference: torch.Tensor, clean: torch.Tensor, rows: torch.Tensor, dtype) -> None:
    """The replayed forward of unchanged rows must give the clean run's metric (to float
    noise): else the metric reads other rows or what the replay does not reproduce."""
    want = clean.double().cpu()[rows.cpu()]
    tol = max(1e-4, 16 * torch.finfo(dtype).eps) * want.abs().clamp_min(1.0)
    if not bool(torch.isfinite(want).all()):
        raise ValueError(f"metric: the clean run's metric is not finite on row(s) "
                         f"{sorted(set(rows[~torch.isfinite(want)].tolist()))} ({want[~torch.isfinite(want)][:3].tolist()}); "
                         "nothing can be estimated from it")
    if not bool(((reference - want).abs() <= tol).all()):
        bad = int(((reference - want).abs() > tol).nonzero()[0, 0])
        raise ValueError(_METRIC_HELP + f" On row {int(rows[bad])} the replay gives {float(reference[bad])}, the clean "
                         f"run {float(want[bad])}.")


def check_metric(model: nn.Module, tgts, calls: BlockCalls) -> None:
    """The output head is run with the blocks replayed: a metric read inside a block
    (``ModuleOutput`` of a module in one) would read nothing there."""
    from pyattr.methods._core.taps import resolve_module

    inside = {id(m) for blk in calls.blocks for m in blk.modules()}
    for path in T.module_paths(tgts):
        if id(resolve_module(model, path, "target")) in inside:
            raise ValueError(f"metric: method='blockwise' reads the metric after the last block, and it reads module "
                             f"{path!r} inside a block; use method='relp' or 'atp', or a metric on the model's output")


def effects(model, pair, fixed, flat, node_list, sources, bases, widths, calls: BlockCalls,
            sum_positions: bool, batch_size: int, clean_value: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Every node's patching effect, float32 ``(batch, layer, position[, unit])`` per node
    type (0 at padding and unaligned positions)."""
    from pyattr.patching.activation import _index, _plan

    batch, seq = pair.clean.input_ids.shape
    shapes, jobs_per_row, _ = _plan(flat, node_list, widths, pair.valid, batch, seq, sum_positions, None, 0)
    jobs = [j for js in jobs_per_row for j in js]
    values = estimates(model, pair, fixed, flat, sources, bases, jobs, calls, batch_size, clean_value)
    out = {n: torch.zeros((batch, *shapes[n]), dtype=torch.float64) for n in node_list}
    for job, v in zip(jobs, values):
        out[flat[job.site].node][_index(job.row, flat[job.site], job, sum_positions)] = v
    return {n: out[n].float() for n in node_list}
