"""Backend dispatch (README, Backends).

``torch`` (reference, any device) is always available. ``cpp`` and ``cuda`` come from the
compiled extension ``pyattr._C``; ``triton`` from ``pyattr.kernels``. A missing backend is
never an import error: :func:`available_backends` says why it cannot run, and ``auto``
moves on to the next one. A backend the user forces with :func:`backend` or
``PYATTR_BACKEND`` raises if it cannot run the call.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
from dataclasses import dataclass
from typing import Dict, Iterator

import torch

import pyattr.backends.extension as extension

BACKEND_NAMES = ("torch", "cpp", "cuda", "triton")
_CHOICES = BACKEND_NAMES + ("auto",)

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("pyattr_backend", default=None)


class BackendUnavailableError(RuntimeError):
    """A backend was forced (``pyattr.backend(...)`` or ``PYATTR_BACKEND``) but cannot run."""


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend can run here, and why not if it cannot."""

    name: str
    available: bool
    reason: str
    devices: tuple = ()

    def __bool__(self) -> bool:  # pragma: no cover - convenience
        return self.available


def _probe_torch() -> BackendStatus:
    return BackendStatus("torch", True, "reference PyTorch implementation", ("cpu", "cuda"))


def _probe_extension():
    """``(pyattr._C or None, why not)``: :func:`pyattr.backends.extension.load`, which
    takes the pyattr._C built at install when it matches this torch, else compiles the
    C++ sources on first use into a cache (once per torch version), else prints one
    line saying why the kernels are off and how to get them."""
    return extension.load()


def _probe_cpp() -> BackendStatus:
    ext, why = _probe_extension()
    if ext is None:
        return BackendStatus("cpp", False, why)
    name = getattr(ext, "__name__", "pyattr._C")
    if not hasattr(torch.ops.pyattr, "identity_backward"):
        return BackendStatus("cpp", False, f"{name} loaded but registers no CPU kernels")
    return BackendStatus("cpp", True, f"{name} CPU kernels ({extension.ORIGIN})", ("cpu",))


def _probe_cuda() -> BackendStatus:
    if not torch.cuda.is_available():
        return BackendStatus("cuda", False, "no CUDA device visible to torch")
    ext, why = _probe_extension()
    if ext is None:
        return BackendStatus("cuda", False, why)
    if not getattr(ext, "WITH_CUDA", False):
        return BackendStatus("cuda", False, "pyattr._C was built without CUDA sources")
    return BackendStatus("cuda", True, "pyattr._C CUDA kernels", ("cuda",))


def _interpreter_problem(triton) -> str:
    """Why Triton's interpreter (TRITON_INTERPRET=1) cannot run pyattr's kernels here, or
    "": Triton 3.2 (torch 2.6's) passes the configs' warp-specialisation fields to the
    kernels, and the autotuner of Triton 3.2 and 3.3 (torch 2.7's) asks the GPU driver for
    a benchmark function as it is built, which fails without a GPU."""
    version = getattr(triton, "__version__", "0")
    if tuple(int(p) if p.isdigit() else 0 for p in version.split(".")[:2]) < (3, 3):
        return (f"Triton {version}'s interpreter cannot run pyattr's autotuned kernels (a newer Triton can; "
                "on a GPU without TRITON_INTERPRET this one can)")
    try:
        importlib.import_module("pyattr.kernels.identity")  # decorating its kernel builds an autotuner
    except RuntimeError as e:
        return (f"Triton {version}'s autotuner needs a GPU driver, even under TRITON_INTERPRET ({e}); "
                "a newer Triton runs pyattr's kernels on the CPU")
    return ""


def _probe_triton() -> BackendStatus:
    try:
        import triton  # noqa: F401
    except ImportError:
        return BackendStatus("triton", False, "triton is not installed")
    try:
        # kernels/, shipped as pyattr.kernels: a namespace package (no __init__.py, so that
        # the checkout's folder never shadows another top-level `kernels`), read by module
        importlib.import_module("pyattr.kernels._common")
    except ImportError as e:
        return BackendStatus("triton", False, f"pyattr.kernels failed to import ({e})")
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    why = _interpreter_problem(triton) if interp else ""
    if why:
        return BackendStatus("triton", False, why)
    if not torch.cuda.is_available() and not interp:
        return BackendStatus("triton", False, "no CUDA device (set TRITON_INTERPRET=1 to run on CPU)")
    return BackendStatus("triton", True, "Triton kernels", ("cuda", "cpu") if interp else ("cuda",))


def available_backends() -> Dict[str, BackendStatus]:
    """Return ``{name: BackendStatus}`` for ``torch``, ``cpp``, ``cuda``, ``triton``.

    Each status has ``.available`` (bool) and ``.reason`` (str: what it is, or why it
    cannot run here). Probed once per value of ``TRITON_INTERPRET``.
    """
    return dict(_probe_all(os.environ.get("TRITON_INTERPRET")))


@functools.lru_cache(maxsize=4)
def _probe_all(_interpret_flag) -> tuple:
    return tuple({
        "torch": _probe_torch(),
        "cpp": _probe_cpp(),
        "cuda": _probe_cuda(),
        "triton": _probe_triton(),
    }.items())


def _check_name(name: str, source: str) -> str:
    if name not in _CHOICES:
        raise ValueError(f"{source}: unknown backend {name!r}; expected one of {list(_CHOICES)}")
    return name


@contextlib.contextmanager
def backend(name: str) -> Iterator[str]:
    """Force a backend inside the ``with`` block (``"auto"`` restores automatic choice).

    Raises:
        ValueError: unknown backend name.
        BackendUnavailableError: the backend cannot run on this machine.
    """
    _check_name(name, "backend")
    if name != "auto":
        status = available_backends()[name]
        if not status.available:
            raise BackendUnavailableError(f"backend {name!r} is not available: {status.reason}")
    token = _forced.set(name)
    try:
        yield name
    finally:
        _forced.reset(token)


def requested_backend() -> str:
    """The backend asked for by ``backend(...)``, else ``PYATTR_BACKEND``, else ``"auto"``."""
    name = _forced.get()
    if name is not None:
        return name
    env = os.environ.get("PYATTR_BACKEND", "").strip()
    if env:
        return _check_name(env, "PYATTR_BACKEND")
    return "auto"


# Order in which ``auto`` tries backends per device type. CPU: cpp measured faster than
# torch on every op (README, Performance). CUDA: not yet measured on a GPU; the fused
# kernels go first because the reference issues several kernels per rule backward.
_AUTO_ORDER = {"cpu": ("cpp", "torch"), "cuda": ("cuda", "triton", "torch")}


def select(device: torch.device, op: str) -> str:
    """Name of the backend that runs ``op`` for tensors on ``device``.

    Under ``torch.compile`` the selection is made once while tracing (a constant of the
    graph): compile under the backend you want."""
    name = requested_backend()
    if name == "torch":
        return name
    # Every rule backward asks; the answer is a function of the request, the device type
    # and the probes (fixed per TRITON_INTERPRET, unless the probe functions themselves
    # are replaced, which is part of the key). Only successful answers are kept, so an
    # unavailable forced backend raises at every call.
    dev = device.type
    # TRITON_INTERPRET decides whether Triton runs on the CPU; no CPU choice but a forced
    # "triton" can involve Triton, so the CPU skips reading it (a cost in every backward)
    interpret = os.environ.get("TRITON_INTERPRET") if (dev != "cpu" or name == "triton") else None
    key = (name, dev, interpret, available_backends, _probe_all)
    hit = _selected.get(key)
    if hit is None:
        hit = _selected[key] = _select(name, device, op)
    return hit


_selected: Dict[tuple, str] = {}


def _select(name: str, device: torch.device, op: str) -> str:
    if name == "auto":
        for cand in _AUTO_ORDER.get(device.type, ("torch",)):
            if cand == "torch":
                return cand
            st = available_backends()[cand]
            if st.available and device.type in st.devices:
                return cand
        return "torch"
    st = available_backends()[name]
    if not st.available:
        raise BackendUnavailableError(f"backend {name!r} is not available: {st.reason}")
    if device.type not in st.devices:
        raise BackendUnavailableError(
            f"backend {name!r} cannot run {op} on {device.type} tensors (runs on {list(st.devices)})"
        )
    return name


def _kernels_ready() -> None:
    """A background compile made the kernels available: probe and select again."""
    _probe_all.cache_clear()
    _selected.clear()


extension.ON_READY.append(_kernels_ready)

# torch.compile calls select() while tracing and keeps its result, instead of tracing the
# cached probes (their caches and the one-time op registrations they make)
select = torch.compiler.assume_constant_result(select)


def implementation(device: torch.device, op: str):
    """Module implementing the backend functions for ``op`` on ``device``."""
    name = select(device, op)
    if name == "torch":
        import pyattr.backends.reference as reference

        return reference
    if name in ("cpp", "cuda"):
        import pyattr.backends.compiled as compiled

        return compiled
    if name == "triton":
        import pyattr.backends.triton_backend as triton_backend

        return triton_backend
    raise BackendUnavailableError(f"backend {name!r} has no implementation of {op}")


def backward_implementation(device: torch.device, op: str):
    """Module for a rule's backward inside ``autograd.Function.backward``.

    When the backward itself is being recorded (``create_graph=True``: grad mode is on
    inside the backward), the reference formula runs, because autograd can differentiate
    it and the compiled kernels have no derivative of their own; a second backward then
    gives the reference's second-order result on every backend. Otherwise the selected
    backend runs (a forced backend that cannot run still raises).
    """
    if torch.is_grad_enabled():
        select(device, op)
        import pyattr.backends.reference as reference

        return reference
    return implementation(device, op)
