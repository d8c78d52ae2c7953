"""Kernel microbenchmarks: op × provider × dtype × shape × mode.

Providers: ``native`` (autograd without any rule: the floor a rule should reach),
``unfused`` (the rules as separate PyTorch ops, :mod:`pyattr.bench.unfused`),
``pyattr-torch`` (pyattr's reference backend, always measured: the compiled backends'
``ratio_to_torch`` divides by it) and ``pyattr-<backend>`` for every other available
backend that runs on the device.

Bytes-moved model (what the GB/s column divides by), per element of one
``(rows, hidden)`` operand of ``b`` bytes; parameters and per-row statistics are
ignored as negligible:

============== ======== ========
op             forward  backward
============== ======== ========
identity       2 (x→y)  3 (x, dy → dx)
half           3        5 (u, v, dy → du, dv)
gated          3        5 (g, u, dh → dg, du)
layer_norm     2        3 (x, dy → dx)
rms_norm       2        3 (x, dy → dx)
attention      4        4 (q, k, dO → dV; a model only: the op is compute-bound)
============== ======== ========

The providers of one case are timed in turn, one run of each per round
(:func:`time_interleaved`), so that the ratios between them compare runs made under the
same conditions.

``attention`` is the AH-rule's frozen attention core, causal, batch 1, hidden 1024
(``heads = 1024 / head_dim``), at shapes ``(seq, head_dim)``: ``native`` is PyTorch's SDPA
with q, k and v requiring gradients, ``unfused`` the same call with q and k under
``scale_gradient(·, 0)`` (pyattr's path before the frozen core), ``pyattr-*`` the frozen
core (``dV`` only) on each backend. It runs in ``bwd`` mode only, with fewer repeats.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import pyattr
from pyattr.activations import resolve_activation
import pyattr.bench.unfused as unfused

OPS = ("identity", "half", "gated", "layer_norm", "rms_norm", "attention")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "quick_gelu", "relu")
MODES = ("fwd", "bwd", "fwd+bwd")
BYTES_MOVED = {"identity": (2, 3), "half": (3, 5), "gated": (3, 5), "layer_norm": (2, 3), "rms_norm": (2, 3),
               "attention": (4, 4)}
DEFAULT_SHAPES = {"elementwise": (2048, 4096), "norm": (2048, 1024)}
QUICK_SHAPES = {"elementwise": (256, 2048), "norm": (256, 1024)}
# (seq, head_dim) of the attention op; its own list, not set by --shapes
ATTENTION_SHAPES = ((2048, 64), (2048, 128))
QUICK_ATTENTION_SHAPES = ((256, 64),)
ATTENTION_HIDDEN = 1024


@dataclass
class Row:
    op: str
    activation: Optional[str]
    provider: str
    dtype: str
    shape: Tuple[int, int]
    mode: str
    median_ms: float
    p20_ms: float
    p80_ms: float
    saved_bytes: int
    saved_ratio_to_inputs: float
    peak_bytes: Optional[int]
    gbps: float
    frac_of_copy_bandwidth: float
    ratio_to_native: Optional[float] = None
    ratio_to_unfused: Optional[float] = None
    ratio_to_torch: Optional[float] = None  # to the pyattr-torch (reference backend) row of the same case


# --- the functions each provider runs -------------------------------------------------------

def _hf_rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def build(op: str, act: Optional[str], provider: str, shape, dtype, device,
          pool: Optional[Dict[int, torch.Tensor]] = None) -> Tuple[Callable, List[torch.Tensor], int]:
    """Return (forward function, inputs requiring grad, input bytes) for one case.

    ``pool`` shares the input tensors between the providers of a case (the i-th input
    made is the pool's i-th): where a tensor lies in memory moved one op's time by up to
    a quarter here, so each provider drawing its own inputs made a different draw."""
    g = torch.Generator(device="cpu").manual_seed(0)
    made = itertools.count()

    def rnd(*s):
        i = next(made)
        if pool is not None and i in pool:
            return pool[i]
        t = torch.randn(*s, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
        if pool is not None:
            pool[i] = t
        return t

    rows, hidden = shape
    if op in ("identity",):
        x = rnd(rows, hidden)
        ins = [x]
        a = resolve_activation(act)
        fn = {
            "native": lambda: a.fn(x),
            "unfused": lambda: unfused.identity_unfused(x, act),
        }.get(provider, lambda: pyattr.rules.identity_rule(x, act))
    elif op == "half":
        u, v = rnd(rows, hidden), rnd(rows, hidden)
        ins = [u, v]
        fn = {"native": lambda: u * v, "unfused": lambda: unfused.half_unfused(u, v)}.get(
            provider, lambda: pyattr.rules.half_rule(u, v)
        )
    elif op == "gated":
        gt, up = rnd(rows, hidden), rnd(rows, hidden)
        ins = [gt, up]
        a = resolve_activation(act)
        fn = {
            "native": lambda: a.fn(gt) * up,
            "unfused": lambda: unfused.gated_unfused(gt, up, act),
        }.get(provider, lambda: pyattr.ops.gated_activation(gt, up, act))
    elif op == "layer_norm":
        x, w, b = rnd(rows, hidden), rnd(hidden), rnd(hidden)
        ins = [x, w, b]
        fn = {
            "native": lambda: F.layer_norm(x, (hidden,), w, b, 1e-5),
            "unfused": lambda: unfused.layer_norm_unfused(x, w, b, 1e-5),
        }.get(provider, lambda: pyattr.ops.layer_norm(x, w, b, 1e-5))
    elif op == "rms_norm":
        x, w = rnd(rows, hidden), rnd(hidden)
        ins = [x, w]
        fn = {
            "native": lambda: _hf_rms_norm(x, w, 1e-6),
            "unfused": lambda: unfused.rms_norm_unfused(x, w, 1e-6),
        }.get(provider, lambda: pyattr.ops.rms_norm(x, w, 1e-6))
    elif op == "attention":
        fn, ins = _attention(provider, rows, hidden, rnd)
        return fn, ins, 3 * ins[-1].numel() * ins[-1].element_size()  # q, k and v, whichever need grad
    else:
        raise ValueError(f"ops: unknown op {op!r}; expected one of {OPS}")
    in_bytes = sum(t.numel() * t.element_size() for t in ins if t.dim() == 2)
    return fn, ins, in_bytes


def _attention(provider: str, seq: int, head_dim: int, rnd):
    from pyattr.ops.attention import FrozenAttentionFunction
    from pyattr.rules import scale_gradient

    heads = max(1, ATTENTION_HIDDEN // head_dim)
    q, k, v = rnd(1, heads, seq, head_dim), rnd(1, heads, seq, head_dim), rnd(1, heads, seq, head_dim)
    scale = head_dim ** -0.5
    if provider == "native":
        return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)), [q, k, v]
    if provider == "unfused":
        return (lambda: F.scaled_dot_product_attention(scale_gradient(q, 0.0), scale_gradient(k, 0.0), v,
                                                       is_causal=True, scale=scale)), [q, k, v]
    qd, kd = q.detach(), k.detach()

    def frozen():
        def native():
            return F.scaled_dot_product_attention(qd, kd, v, is_causal=True, scale=scale).transpose(1, 2), None

        return FrozenAttentionFunction.apply(v, qd, kd, None, scale, None, True, native)[0]

    return frozen, [v]


def saved_bytes(fn: Callable) -> int:
    """Bytes of the distinct tensors autograd saves for the backward of one forward."""
    seen: Dict[Tuple[int, int], int] = {}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


# --- timing ------------------------------------------------------------------------------------

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(run: Callable, device, warmup: int, repeats: int) -> List[float]:
    """Wall times in ms: CUDA events on GPU, perf_counter on CPU; warm-up excluded."""
    for _ in range(warmup):
        run()
    _sync(device)
    out = []
    if device.type == "cuda":
        for _ in range(repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


def return_freed_memory() -> Optional[str]:
    """Make glibc's malloc map every block of 64 KiB or more on its own and unmap it when
    freed, in this process (a fixed ``M_MMAP_THRESHOLD``: glibc's default raises the
    threshold after the first large free, up to 32 MiB, and serves smaller blocks from a
    heap whose freed holes stay resident): the resident size then follows the tensors alive,
    not the heap's fragmentation. Returns a description for the report, or None where glibc
    is not the allocator (nothing changed)."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        ok = ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 1 << 16) == 1
    except (OSError, AttributeError):
        return None
    return ("glibc malloc mapping every block of 64 KiB or more on its own and unmapping it when freed "
            "(mallopt M_MMAP_THRESHOLD), so the resident size follows the tensors alive") if ok else None


def keep_freed_memory() -> Optional[str]:
    """Make glibc's malloc keep freed memory for reuse, in this process: no ``mmap`` for
    large blocks, no trimming of the heap. By default every tensor above a size threshold
    that glibc moves at run time is mapped fresh and freed to the system, so each run of
    an op pays page faults on its outputs (about half the time of a 32 MiB elementwise op
    here), for one provider or another depending on the order of allocations: the times
    come out bimodal. Reusing freed memory is what CUDA's caching allocator does for the
    GPU rows. Returns a description for the report, or None where glibc is not the
    allocator (nothing changed)."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):
        return None
    return ("glibc malloc with mmap and heap trimming off (mallopt), so freed memory is reused, as CUDA's caching "
            "allocator does: no provider pays page faults on fresh outputs") if ok else None


def copy_bandwidth_gbps(device, nbytes: int = 1 << 27, repeats: int = 10) -> float:
    """Measured device copy bandwidth: (read + write) bytes / time of ``dst.copy_(src)``."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ts = time_ms(lambda: dst.copy_(src), device, 3, repeats)
    return 2 * nbytes / (statistics.median(ts) * 1e-3) / 1e9


def _pct(ts: Sequence[float], q: float) -> float:
    s = sorted(ts)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class _Case:
    """One provider's run of one case, ready to time: ``step()`` is one forward, backward
    or both, to be called inside ``ctx()`` (the provider's backend; ``run()`` does both);
    ``saved``/``in_bytes`` what it keeps."""

    def __init__(self, op, act, provider, shape, dtype, device, mode, pool=None):
        self.op, self.act, self.provider, self.shape, self.dtype, self.mode = op, act, provider, shape, dtype, mode
        backend = provider.split("-", 1)[1] if provider.startswith("pyattr-") else None
        self.ctx = (lambda: pyattr.backend(backend)) if backend else _Null
        with self.ctx():
            fn, ins, self.in_bytes = build(op, act, provider, shape, dtype, device, pool)
            self.saved = saved_bytes(fn)
            y = fn()
            dy = torch.randn_like(y)
        if mode == "fwd":
            step = fn  # with autograd recording, as a relevance pass runs it
        elif mode == "bwd":
            def step():
                torch.autograd.grad(y, ins, dy, retain_graph=True)
        else:
            def step():
                torch.autograd.grad(fn(), ins, dy)
        self.step = step
        self.peak = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            self.run()
            _sync(device)
            self.peak = torch.cuda.max_memory_allocated(device) - base

    def run(self):
        with self.ctx():
            self.step()


def time_interleaved(runs: Sequence[Callable], device, warmup: int, repeats: int,
                     contexts: Optional[Sequence[Callable]] = None) -> List[List[float]]:
    """Wall times in ms of each of ``runs``, taken in turn (one of each per round): slow
    drifts of the machine (another tenant, clock changes) then land on every provider of
    a case alike instead of on whichever ran during them. Each round takes the runs in a
    new order (a seeded shuffle), so that no run always follows the same other one: what
    a run leaves behind (caches full of its data, a heap cut up by its temporaries) cost
    the next one up to a third of its time here, and a fixed order put that cost on the
    same provider every round (the reference backend after the unfused rules, for one).
    ``contexts[i]()`` (a backend scope) is entered around run i's timing, outside the
    timed window."""
    ctxs = contexts or [_Null] * len(runs)
    for run, ctx in zip(runs, ctxs):
        with ctx():
            time_ms(run, device, warmup, 0)
    out: List[List[float]] = [[] for _ in runs]
    order = list(range(len(runs)))
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)
        for i in order:
            with ctxs[i]():
                out[i] += time_ms(runs[i], device, 0, 1)
    return out


def _row(case: "_Case", ts: Sequence[float], device, copy_bw) -> Row:
    op, shape, dtype, mode = case.op, case.shape, case.dtype, case.mode
    med = statistics.median(ts)
    n = shape[0] * (ATTENTION_HIDDEN if op == "attention" else shape[1]) * torch.empty((), dtype=dtype).element_size()
    fw, bw = BYTES_MOVED[op]
    moved = {"fwd": fw, "bwd": bw, "fwd+bwd": fw + bw}[mode] * n
    gbps = moved / (med * 1e-3) / 1e9
    sb, in_bytes = case.saved, case.in_bytes
    return Row(
        op=op, activation=case.act, provider=case.provider, dtype=str(dtype).replace("torch.", ""),
        shape=tuple(shape), mode=mode, median_ms=med, p20_ms=_pct(ts, 0.2), p80_ms=_pct(ts, 0.8), saved_bytes=sb,
        saved_ratio_to_inputs=sb / in_bytes if in_bytes else 0.0, peak_bytes=case.peak, gbps=gbps,
        frac_of_copy_bandwidth=gbps / copy_bw if copy_bw else 0.0,
    )


def measure_case(op, act, providers, shape, dtype, device, mode, warmup, repeats, copy_bw) -> List[Row]:
    """One row per provider of one case, their runs interleaved (:func:`time_interleaved`)."""
    pool: Dict[int, torch.Tensor] = {}  # one set of inputs for every provider
    cases_ = [_Case(op, act, p, shape, dtype, device, mode, pool) for p in providers]
    times = time_interleaved([c.step for c in cases_], device, warmup, repeats, [c.ctx for c in cases_])
    return [_row(c, ts, device, copy_bw) for c, ts in zip(cases_, times)]


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def providers_for(device) -> List[str]:
    """native, unfused, pyattr-torch, then every other backend available on the device."""
    out = ["native", "unfused", "pyattr-torch"]
    for name, st in pyattr.available_backends().items():
        if name != "torch" and st.available and device.type in st.devices:
            out.append(f"pyattr-{name}")
    return out


def cases(ops: Sequence[str], activations: Sequence[str]):
    for op in ops:
        if op in ("identity", "gated"):
            for a in activations if op == "identity" else activations[:1]:
                yield op, a
        else:
            yield op, None


def run_suite(
    device: torch.device,
    ops: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Optional[Dict[str, Tuple[int, int]]] = None,
    modes: Sequence[str] = MODES,
    activations: Sequence[str] = ACTIVATIONS,
    warmup: int = 3,
    repeats: int = 10,
    progress: bool = True,
) -> Tuple[float, List[Row]]:
    shapes = shapes or DEFAULT_SHAPES
    attention_shapes = shapes.get("attention", ATTENTION_SHAPES)
    copy_bw = copy_bandwidth_gbps(device)
    providers = providers_for(device)
    plan = [
        (op, a, shape, dt, m)
        for op, a in cases(ops, activations)
        for dt in dtypes
        for shape in (attention_shapes if op == "attention" else [shapes["norm" if op.endswith("norm") else "elementwise"]])
        for m in (("bwd",) if op == "attention" else modes)
    ]
    rows: List[Row] = []
    bar = _progress(len(plan) * len(providers)) if progress else None
    try:
        for op, a, shape, dt, m in plan:
            few = op == "attention"  # one backward takes 0.1-2 s on a CPU at seq 2048
            rows += measure_case(op, a, providers, shape, dt, device, m, 1 if few else warmup,
                                 max(3, repeats // 3) if few else repeats, copy_bw)
            if bar:
                bar.advance(len(providers))
    finally:
        if bar:
            bar.close()
    index = {(r.op, r.activation, r.dtype, r.shape, r.mode, r.provider): r for r in rows}
    for r in rows:
        nat = index.get((r.op, r.activation, r.dtype, r.shape, r.mode, "native"))
        unf = index.get((r.op, r.activation, r.dtype, r.shape, r.mode, "unfused"))
        ref = index.get((r.op, r.activation, r.dtype, r.shape, r.mode, "pyattr-torch"))
        r.ratio_to_native = r.median_ms / nat.median_ms if nat else None
        r.ratio_to_unfused = r.median_ms / unf.median_ms if unf else None
        r.ratio_to_torch = r.median_ms / ref.median_ms if ref else None
    return copy_bw, rows


class _progress:
    """A rich progress bar on stderr (plain counter when rich is missing)."""

    def __init__(self, total: int):
        try:
            from rich.progress import Progress

            self._p = Progress(transient=True)
            self._p.start()
            self._t = self._p.add_task("benchmarking", total=total)
        except ImportError:  # pragma: no cover
            self._p = None

    def advance(self, n: int = 1):
        if self._p:
            self._p.advance(self._t, n)

    def close(self):
        if self._p:
            self._p.stop()


def rows_as_dicts(rows: List[Row]) -> List[dict]:
    out = []
    for r in rows:
        d = asdict(r)
        d["shape"] = list(r.shape)
        out.append(d)
    return out
