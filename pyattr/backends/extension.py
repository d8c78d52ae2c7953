"""Loading the compiled kernels (once): their ops, their fake (meta) and batching rules.
Its own module, so that the compiled backend can load it without importing the backend
registry that imports the compiled backend.

Where the kernels come from, first match wins (:mod:`pyattr.backends.build`,
:mod:`pyattr.backends.stable`):

1. ``pyattr._C`` built at install (``setup.py`` with torch importable: ``pip install
   --no-build-isolation``, ``make install``), when its ``_C_build.json`` names the torch
   running now. One built against another torch is never imported: it could load and
   register its ops with another ABI, and would keep another build from registering the
   ``pyattr`` ops in this process;
2. the first-use build of ``pyattr._C`` in the cache for this torch (compiled before, by
   an earlier process or ``python -m pyattr.backends.build``);
3. ``pyattr._C_stable``, the CPU kernels prebuilt over torch's stable ABI and shipped in
   the package: no compiler, torch 2.10 or newer, Linux x86-64. It has every kernel but
   the two attention ones (the AH-rule's and AttnLRP's attention backward then run on the
   torch backend) and no C++ autograd nodes;
4. else (an older torch, another platform) ``pyattr._C`` is compiled in the background,
   with one line on stderr when it starts and one when it is ready; until then pyattr
   runs on the torch backend (the same numbers, slower), and the calls after that on
   the kernels. ``PYATTR_JIT=0`` turns that off.

When nothing gives the kernels, the cpp and cuda backends are off (``available_backends()``
says why), pyattr runs on the torch backend, and one line on stderr, once per process,
says why and how to get the kernels.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import platform
import sys
import threading
from pathlib import Path


def _build():
    """:mod:`pyattr.backends.build`, imported when first needed: importing it with the
    package would make ``python -m pyattr.backends.build`` warn that it is already loaded."""
    import pyattr.backends.build as build

    return build


def _stable():
    """:mod:`pyattr.backends.stable` (what the stable library needs), imported when first needed."""
    import pyattr.backends.stable as stable

    return stable


STABLE = "pyattr._C_stable"
NOTICE = "pyattr: the C++ kernels are off, running on the torch backend: {why}. To get them: {how}."

# set once pyattr._C (or pyattr._C_stable) is loaded and its ops have fake and batching rules
LOADED = False
# where the loaded kernels came from ("built at install", "compiled on first use ...",
# "prebuilt ...")
ORIGIN = ""
# what the loaded library has beyond the elementwise and norm kernels (pyattr._C: both)
HAS_ATTENTION = False
HAS_AUTOGRAD_NODES = False
# called (no arguments) when a background compile has made the kernels available
ON_READY: list = []
_noticed = False
_background: threading.Thread | None = None


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def notice(why: str, how: str) -> None:
    """The one-line notice that the kernels are off (once per process)."""
    global _noticed
    if _noticed:
        return
    _noticed = True
    _say(NOTICE.format(why=" ".join(why.split()), how=" ".join(how.split())))


def installed_library() -> Path | None:
    """The ``pyattr._C`` file installed beside pyattr, or None (a pure-Python install)."""
    try:
        spec = importlib.util.find_spec("pyattr._C")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    return Path(spec.origin)


def check_installed(library: Path, torch) -> str:
    """Why the installed ``library`` must not be imported under this torch ("" when it
    may): its ``_C_build.json`` names another torch, or is missing. A library built
    against another torch can import without an error and run with another ABI (one
    built for torch 2.14.1 imports under 2.15.0), so without that file it is not tried."""
    build = _build()
    info_path = Path(library).parent / build.INFO_NAME
    try:
        info = json.loads(info_path.read_text())
    except FileNotFoundError:
        return (f"pyattr._C has no {build.INFO_NAME} beside it (built by an older setup.py), "
                "so the torch it was built against is unknown")
    except (OSError, ValueError) as e:
        return f"pyattr._C's {info_path.name} is unreadable ({e})"
    return build.mismatch(info, torch)


def _origin(mod, torch) -> str:
    """Where a pyattr._C that is already imported came from: the first-use cache or the install."""
    build = _build()
    path = Path(getattr(mod, "__file__", "") or ".").resolve()
    if path.parent.parent == (build.cache_root() / "ext").resolve():
        return f"compiled on first use for torch {torch.__version__}, {path.parent}"
    return "built at install"


def _stable_origin(mod) -> str:
    return (f"prebuilt over torch's stable ABI for torch >= {_stable().TARGET[0]}.{_stable().TARGET[1]}, "
            f"{getattr(mod, 'CPU_CAPABILITY', '?')} code path; no attention kernels")


def _load_stable(torch):
    """``(pyattr._C_stable, "")``, or ``(None, why not)``: the prebuilt library, where it fits."""
    stable = _stable()
    if not stable.supported(torch.__version__):
        t = stable.TARGET
        return None, f"the prebuilt kernels need torch >= {t[0]}.{t[1]} (this is {torch.__version__})"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the prebuilt kernels are for Linux x86-64 (this is {sys.platform} {platform.machine()})"
    try:
        spec = importlib.util.find_spec(STABLE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None, "this install ships no prebuilt kernels (pyattr._C_stable)"
    if hasattr(torch.ops.pyattr, "identity_backward"):
        # another build registered the pyattr ops in this process (a second definition of
        # the namespace from a static initializer would end the process)
        return None, "another build of pyattr's kernels registered its ops in this process"
    try:
        return importlib.import_module(STABLE), ""
    except (ImportError, OSError) as e:  # e.g. a C library older than the one it was built against
        return None, f"the prebuilt pyattr._C_stable failed to load ({e})"


def _find():
    """``(module, origin, why, how)``: the kernels' library and where it came from, or None
    with why it is not there and how to get it (a background compile may have started)."""
    build = _build()
    import torch

    for name in ("pyattr._C", STABLE):
        loaded = sys.modules.get(name)
        if loaded is not None:  # loaded before: an earlier load(), the build command, an import
            origin = _stable_origin(loaded) if name == STABLE else _origin(loaded, torch)
            return loaded, ORIGIN or origin, "", ""
    library = installed_library()
    if library is None:
        installed = "pyattr._C is not built (a pure-Python install)"
    else:
        installed = check_installed(library, torch)
        if not installed:
            try:
                return importlib.import_module("pyattr._C"), "built at install", "", ""
            except ImportError as e:  # e.g. a library it links against changed
                installed = f"pyattr._C failed to load ({e})"
            except OSError as e:  # a shared library it links against is missing
                installed = f"pyattr._C failed to load ({e})"
    rebuild = f"`{build.BUILD_COMMAND}` compiles them for torch {torch.__version__}"
    src = build.source_dir()
    plan = build.Plan(torch, src) if src is not None else None
    if plan is not None:
        try:
            mod = build.load_cached(plan)
        except (ImportError, OSError) as e:
            return None, "", f"{installed}; its cached build {plan.library} failed to load ({e})", (
                f"remove {plan.dir}, then {rebuild}")
        if mod is not None:
            return mod, f"compiled on first use for torch {torch.__version__}, {plan.dir}", "", ""
    mod, no_stable = _load_stable(torch)
    if mod is not None:
        return mod, _stable_origin(mod), "", ""
    installed = f"{installed}; {no_stable}"
    if plan is None:
        return None, "", f"{installed}, and this install ships no C++ sources to compile", (
            "reinstall pyattr from its source (pip install --no-build-isolation <checkout or sdist>)")
    if os.environ.get("PYATTR_JIT", "").strip() == "0":
        return None, "", f"{installed}, and compiling it on first use is off (PYATTR_JIT=0)", (
            f"{rebuild}, or unset PYATTR_JIT")
    if plan.failed.is_file():
        return None, "", f"{installed}; {plan.failed.read_text().strip()}", (
            f"fix that, then {rebuild} (it retries)")
    missing = build.missing_tool()
    if missing:
        return None, "", f"{installed}, and it cannot be compiled here: {missing}", build.how_to_get()
    _compile_in_background(plan, torch)
    return None, "", f"{installed}; compiling pyattr._C in the background", (
        f"wait for the line saying the kernels are ready, or {rebuild} and waits")


def _compile_in_background(plan, torch) -> None:
    """Compile ``plan`` in a daemon thread (once per process), with a line on stderr when it
    starts and one when it ends; the kernels are used from then on."""
    global _background, _noticed
    if _background is not None:
        return
    build = _build()
    _noticed = True  # this line, not the "kernels are off" one
    what = "C++ and CUDA kernels (several minutes)" if plan.with_cuda else f"C++ kernels ({build.EXPECTED})"
    _say(f"pyattr: compiling the {what} against torch {torch.__version__} in the background, once per torch "
         f"version, into {plan.dir}; until they are ready pyattr runs on the torch backend (the same numbers, "
         "slower)")

    def run():
        try:
            mod, seconds = build.compile(plan, torch)
        except RuntimeError as e:
            _say(f"pyattr: {e}; pyattr stays on the torch backend")
            return
        except Exception as e:  # noqa: BLE001 - a thread's exception would only be printed
            _say(f"pyattr: compiling the C++ kernels failed ({type(e).__name__}: {e}); pyattr stays on the "
                 "torch backend")
            return
        _activate(mod, f"compiled on first use for torch {torch.__version__}, {plan.dir}")
        load.cache_clear()
        for hook in list(ON_READY):
            hook()
        _say(f"pyattr: the C++ kernels are ready (compiled in {seconds:.0f} s); pyattr uses them from now on")

    _background = threading.Thread(target=run, name="pyattr-compile", daemon=True)
    _background.start()


def wait(timeout: float | None = None) -> bool:
    """Wait for a background compile started in this process (if any) to end; True when
    the kernels are loaded then."""
    if _background is not None:
        _background.join(timeout)
    return LOADED


def _activate(mod, origin: str) -> None:
    """Fake and batching rules for the loaded library's ops, and what it has."""
    global LOADED, ORIGIN, HAS_ATTENTION, HAS_AUTOGRAD_NODES
    import torch

    import pyattr.backends._fake as _fake
    import pyattr.backends._vmap as _vmap

    _fake.register()
    _vmap.register("pyattr")  # torch.vmap and is_grads_batched run the kernels batched
    HAS_ATTENTION = hasattr(torch.ops.pyattr, "attention_dv")
    HAS_AUTOGRAD_NODES = hasattr(mod, "layer_norm_rule") and hasattr(mod, "identity_rule")
    ORIGIN = origin
    LOADED = True


@functools.lru_cache(maxsize=None)
def load() -> tuple[object | None, str]:
    """``(library, "")``, or ``(None, why not)`` after the one-line notice."""
    _C, origin, why, how = _find()
    if _C is None:
        notice(why, how)
        return None, why
    _activate(_C, origin)
    return _C, ""
