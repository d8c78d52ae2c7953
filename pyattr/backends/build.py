"""Building the extension ``pyattr._C`` against the torch that runs it.

Two routes, one set of flags (this module's, which ``setup.py`` reads by file path, so it
imports nothing of pyattr and imports torch only inside functions):

* ahead of time: ``setup.py`` compiles ``pyattr._C`` when torch is importable while it
  builds (``pip install --no-build-isolation``, as ``make install`` does) and writes
  ``_C_build.json`` beside it: the torch it was built against;
* on first use: a wheel built with build isolation (plain ``pip install``) is pure Python
  and ships the C++ sources as ``pyattr/_csrc``; :func:`load_cached` / :func:`compile`
  build them with ``torch.utils.cpp_extension.load`` into a cache directory keyed by the
  torch version, the Python, the flags and a hash of the sources, once per key.

Environment:
  PYATTR_JIT=0            never compile on first use (the cpp backend is then off unless
                          an ahead-of-time pyattr._C matches torch)
  PYATTR_CACHE_DIR        where first-use builds go (default $XDG_CACHE_HOME/pyattr, else
                          ~/.cache/pyattr)
  PYATTR_FORCE_CUDA       1: compile the CUDA kernels even without a GPU; 0: never
  PYATTR_CPU_CAPABILITY   AVX2 or DEFAULT caps the CPU vector width
  TORCH_CUDA_ARCH_LIST    CUDA architectures (default 8.0;9.0)
  CXX                     the C++ compiler (default c++)

``python -m pyattr.backends.build`` compiles now (retrying a build that failed before)
and prints where the library is, or why it cannot be built.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

BUILD_COMMAND = "python -m pyattr.backends.build"
INFO_NAME = "_C_build.json"  # beside an ahead-of-time pyattr._C, and in each cache directory
SOURCE_SUFFIXES = (".cpp", ".h", ".inc", ".cu", ".cuh")
# the first-use compile of the CPU kernels, measured on 2 cores (README, Install)
EXPECTED = "about 2 minutes on 2 cores"


# --- flags (shared with setup.py) -----------------------------------------------------

def cpu_flags() -> list:
    """The widest at::vec code path the build machine has (AVX-512, else AVX2/FMA, else
    the portable one): the extension is built from source on the machine that runs it.
    PYATTR_CPU_CAPABILITY=AVX2 or DEFAULT caps it."""
    # at::parallel_for is header code over OpenMP: without -fopenmp it runs on one thread.
    # The process already holds torch's libgomp.so.1, which the extension then shares.
    # -ffp-contract=off: no silent FMA contraction, so g - mean(g) of a one-element row is
    # exactly 0 and results match the reference's rounding.
    # -g0: Python's CFLAGS add -g, which doubles the compile time of the at::vec-heavy
    # files (debug info changes no generated code). -Wno-unknown-pragmas: torch's vec
    # headers use `#pragma unroll`, one warning per header per file under -Wall.
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-g0", "-Wno-unknown-pragmas"]
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        info = ""
    level = os.environ.get("PYATTR_CPU_CAPABILITY", "").upper()
    has = lambda *f: all(f" {x}" in info for x in f)  # noqa: E731
    if level in ("", "AVX512") and has("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"):
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
        flags += ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    elif level in ("", "AVX2", "AVX512") and has("avx2", "fma"):
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    else:
        flags += ["-DCPU_CAPABILITY=DEFAULT"]
    return flags


def cuda_home_hint() -> None:
    """Point CUDA_HOME at a full toolkit when `nvcc` on PATH is a wrapper outside it
    (e.g. /usr/local/bin/nvcc with the toolkit in /usr/local/cuda); torch would otherwise
    look for libcudart next to the wrapper."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if not os.path.exists(os.path.join(home, "lib64")) and os.path.exists("/usr/local/cuda/lib64"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"


def nvidia_include_dirs() -> list:
    """CUDA headers that ship in the nvidia-* wheels torch depends on."""
    try:
        import nvidia
    except ImportError:
        return []
    dirs = []
    for base in getattr(nvidia, "__path__", []):
        dirs += sorted(glob.glob(os.path.join(base, "cu*", "include")))
    return dirs


def jobs() -> int:
    """MAX_JOBS, else the cores this process may use (ninja's own default is cores + 2)."""
    n = os.environ.get("MAX_JOBS", "")
    if not n.isdigit() or int(n) < 1:
        try:
            n = str(len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            n = str(os.cpu_count() or 1)
        os.environ["MAX_JOBS"] = n  # read by torch's ninja build
    return int(n)


def want_cuda(torch, cuda_sources) -> tuple:
    """(build the CUDA kernels?, why). PYATTR_FORCE_CUDA=1 forces them (CI: a CUDA compile
    or link error fails without a GPU), =0 leaves them out; otherwise they are built only
    when torch sees a GPU, since a machine without one can never run them."""
    force = os.environ.get("PYATTR_FORCE_CUDA", "")
    if not cuda_sources:
        return False, "no CUDA sources"
    if force == "1":
        return True, "PYATTR_FORCE_CUDA=1"
    if force == "0":
        return False, "PYATTR_FORCE_CUDA=0"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return False, "no GPU visible (PYATTR_FORCE_CUDA=1 builds them anyway)"
    cuda_home_hint()
    CUDA_HOME = _cpp_extension().CUDA_HOME
    if CUDA_HOME is None or shutil.which("nvcc") is None:
        return False, "a GPU is visible but nvcc / CUDA_HOME is not found"
    return True, "a GPU is visible"


def _cpp_extension():
    """``torch.utils.cpp_extension``, imported without the line it logs or prints (by
    torch version) about where it looks for CUDA, which the user need not see."""
    import io
    import logging

    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension


def sources(src: Path) -> tuple:
    """(C++ sources, CUDA sources) of the extension under ``src`` (csrc/ or pyattr/_csrc)."""
    src = Path(src)
    cpu = sorted(str(p) for p in list(src.glob("*.cpp")) + list(src.glob("cpu/*.cpp")))
    cuda = sorted(str(p) for p in src.glob("cuda/*.cu"))
    return cpu, cuda


# --- what a build is for ----------------------------------------------------------------

def torch_info(torch) -> dict:
    """What a compiled pyattr._C depends on: the exact torch build and the Python."""
    return {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", ""),
        "python": sys.implementation.cache_tag,
    }


def write_info(path, torch, with_cuda: bool, **extra) -> None:
    info = dict(torch_info(torch), with_cuda=bool(with_cuda), **extra)
    Path(path).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")


def mismatch(info: dict, torch) -> str:
    """Why a pyattr._C described by ``info`` (its _C_build.json) cannot run on this torch,
    or "" when it can."""
    now = torch_info(torch)
    if info.get("torch") != now["torch"] or info.get("torch_git", now["torch_git"]) != now["torch_git"]:
        return f"pyattr._C was built against torch {info.get('torch', '?')}, this is torch {now['torch']}"
    if info.get("python", now["python"]) != now["python"]:
        return f"pyattr._C was built for {info['python']}, this is {now['python']}"
    return ""


def source_dir() -> Path | None:
    """The C++ sources: ``pyattr/_csrc`` in an installed wheel, else ``csrc/`` of the
    checkout pyattr is imported from; None when neither is there."""
    pkg = Path(__file__).resolve().parent.parent  # pyattr/
    for cand in (pkg / "_csrc", pkg.parent / "csrc"):
        if (cand / "ops.cpp").is_file():
            return cand
    return None


def source_hash(src: Path) -> str:
    """sha256 of every source and header under ``src`` (names and contents)."""
    h = hashlib.sha256()
    src = Path(src)
    for p in sorted(q for q in src.rglob("*") if q.suffix in SOURCE_SUFFIXES and q.is_file()):
        h.update(p.relative_to(src).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def cache_root() -> Path:
    env = os.environ.get("PYATTR_CACHE_DIR", "").strip()
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pyattr"


def cache_key(torch_version: str, python: str, with_cuda: bool, flags, src_hash: str, torch_git: str = "") -> str:
    """``torch-<version>-<python>-<cpu|cuda>-<12 hex>``: the hex digits hash the sources,
    the flags and torch's exact build, so that a change to any of them builds anew."""
    h = hashlib.sha256("\0".join([src_hash, torch_git, *flags]).encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in ".+_" else "_" for c in torch_version)
    return f"torch-{safe}-{python}-{'cuda' if with_cuda else 'cpu'}-{h}"


class Plan:
    """One first-use build: sources, flags and the cache directory they map to."""

    def __init__(self, torch, src: Path):
        self.src = Path(src)
        self.cpu_sources, cuda_sources = sources(self.src)
        self.with_cuda, self.cuda_why = want_cuda(torch, cuda_sources)
        self.cuda_sources = cuda_sources if self.with_cuda else []
        self.cflags = cpu_flags() + (["-DPYATTR_WITH_CUDA=1"] if self.with_cuda else [])
        self.cuda_flags = ["-O3", "-DPYATTR_WITH_CUDA=1"] if self.with_cuda else []
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0") if self.with_cuda else ""
        info = torch_info(torch)
        self.key = cache_key(info["torch"], info["python"], self.with_cuda,
                             self.cflags + self.cuda_flags + [arch], source_hash(self.src), info["torch_git"])
        self.dir = cache_root() / "ext" / self.key
        self.library = self.dir / "_C.so"
        self.info = self.dir / INFO_NAME
        self.failed = self.dir / "FAILED"
        self.log = self.dir / "build.log"


# --- tools ------------------------------------------------------------------------------

def tool_path() -> str:
    """PATH with the running Python's bin/ and the ninja package's binary first, so that
    a venv's ninja is found although the venv is not activated."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.append(getattr(ninja, "BIN_DIR", os.path.join(os.path.dirname(ninja.__file__), "data", "bin")))
    except ImportError:
        pass
    return os.pathsep.join(dirs + [os.environ.get("PATH", "")])


def missing_tool() -> str:
    """Why the first-use compile cannot start here ("" when it can): no C++ compiler, no
    ninja, or no Python headers."""
    path = tool_path()
    cxx = os.environ.get("CXX", "").strip() or "c++"
    if shutil.which(cxx.split()[0], path=path) is None:
        return f"no C++ compiler found ({cxx!r} is not on PATH; set CXX to name one)"
    if shutil.which("ninja", path=path) is None:
        return "ninja is not found (pip install ninja)"
    include = sysconfig.get_paths().get("include", "")
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return f"the Python headers are missing ({include}/Python.h; e.g. apt-get install python3-dev)"
    return ""


def how_to_get() -> str:
    """What to do to get the kernels, for the one-line notice."""
    return (f"a C++ compiler and ninja (pip install ninja), then `{BUILD_COMMAND}` "
            "or the first use compiles them")


# --- the first-use build ----------------------------------------------------------------

def _import(library: Path):
    """Import the compiled library as ``pyattr._C`` (its ops register as it loads)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pyattr._C", str(library))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["pyattr._C"] = mod
    # the package's attribute, as an import of pyattr._C would set it (through sys.modules:
    # importing pyattr here would make the backends import the package root)
    sys.modules["pyattr"]._C = mod
    return mod


def load_cached(plan: Plan):
    """The cached build of ``plan`` if it is complete (library and info written), else None."""
    if plan.library.is_file() and plan.info.is_file():
        return _import(plan.library)
    return None


def compile(plan: Plan, torch, notice=None):
    """Compile ``plan`` into its cache directory and import it. ``notice(msg)`` is told
    once when the compile starts; returns (module, seconds). Raises RuntimeError with the
    reason when the compile fails (the full log is kept in ``plan.log``), and records the
    failure in ``plan.failed`` so that later processes do not compile again."""
    plan.dir.mkdir(parents=True, exist_ok=True)
    if notice is not None:
        what = "C++ and CUDA kernels (several minutes)" if plan.with_cuda else f"C++ kernels ({EXPECTED})"
        notice(f"pyattr: compiling the {what} against torch {torch.__version__} into {plan.dir}, "
               f"once per torch version ...")
    with _exclusive(plan.dir / ".pyattr-lock"):
        # another process may have finished (or failed) while this one waited
        if plan.info.is_file() and plan.library.is_file():
            return _import(plan.library), 0.0
        if plan.failed.is_file():
            raise RuntimeError(plan.failed.read_text().strip())
        # torch's own lock: before torch 2.15 a file whose existence blocks, left behind by
        # a process killed while compiling; no other pyattr build runs in here now
        try:
            (plan.dir / "lock").unlink()
        except OSError:
            pass
        return _compile_locked(plan, torch)


@contextlib.contextmanager
def _exclusive(path: Path):
    """An advisory lock on ``path`` (released by the kernel if the holder dies)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile_locked(plan: Plan, torch):
    import warnings

    cpp_extension = _cpp_extension()
    old_path = os.environ.get("PATH")
    os.environ["PATH"] = tool_path()
    if plan.with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    jobs()
    t0 = time.monotonic()
    try:
        # torch's warnings (compiler version checks) go to the log, not the user
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cpp_extension.load(
                name="_C",
                sources=plan.cpu_sources + plan.cuda_sources,
                extra_cflags=plan.cflags,
                extra_cuda_cflags=plan.cuda_flags,
                extra_ldflags=["-fopenmp"],
                extra_include_paths=nvidia_include_dirs() if plan.with_cuda else [],
                build_directory=str(plan.dir),
                with_cuda=plan.with_cuda,
                is_python_module=False,  # dlopen only; imported below as pyattr._C
                verbose=False,
            )
    except Exception as e:  # noqa: BLE001 - any failure of the build means: no kernels
        plan.log.write_text(f"{type(e).__name__}: {e}\n")
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        # the compiler's first error, else torch's own message
        first = next((ln for ln in lines if "error:" in ln), lines[0] if lines else type(e).__name__)
        reason = f"compiling pyattr._C failed ({first[:200]}; full log {plan.log})"
        plan.failed.write_text(reason + "\n")
        raise RuntimeError(reason) from None
    finally:
        if old_path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old_path
    seconds = time.monotonic() - t0
    if caught:
        with open(plan.log, "a") as f:
            f.writelines(f"{w.category.__name__}: {w.message}\n" for w in caught)
    write_info(plan.info, torch, plan.with_cuda, seconds=round(seconds, 1), key=plan.key)
    return _import(plan.library), seconds


def main(argv=None) -> int:
    """``python -m pyattr.backends.build``: compile pyattr._C for this torch now."""
    import argparse

    ap = argparse.ArgumentParser(prog=BUILD_COMMAND, description=(
        "Compile pyattr's C++ kernels (pyattr._C) against the installed torch into the cache "
        f"({cache_root()}/ext; PYATTR_CACHE_DIR moves it), retrying a build that failed before."))
    ap.add_argument("--print-dir", action="store_true", help="print the cache directory of this torch and exit")
    args = ap.parse_args(argv)
    import torch

    src = source_dir()
    if src is None:
        print("pyattr: the C++ sources are not shipped with this install (no pyattr/_csrc)", file=sys.stderr)
        return 1
    plan = Plan(torch, src)
    if args.print_dir:
        print(plan.dir)
        return 0
    why = missing_tool()
    if why:
        print(f"pyattr: cannot compile pyattr._C: {why}", file=sys.stderr)
        return 1
    if plan.failed.is_file():
        plan.failed.unlink()
    if plan.info.is_file():
        plan.info.unlink()  # build again: ninja recompiles only what changed
    try:
        _, seconds = compile(plan, torch, notice=lambda m: print(m, file=sys.stderr, flush=True))
    except RuntimeError as e:
        print(f"pyattr: {e}", file=sys.stderr)
        return 1
    print(f"pyattr._C compiled in {seconds:.0f} s: {plan.library}")
    print(f"CUDA kernels {'on' if plan.with_cuda else 'off'}: {plan.cuda_why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
