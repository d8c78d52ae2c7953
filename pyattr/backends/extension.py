"""Loading the compiled extension ``pyattr._C`` (once): its ops, their fake (meta) and
batching rules. Its own module, so that the compiled backend can load it without
importing the backend registry that imports the compiled backend.

Where ``pyattr._C`` comes from, first match wins (:mod:`pyattr.backends.build`):

1. the one built at install (``setup.py`` with torch importable: ``pip install
   --no-build-isolation``, ``make install``), when its ``_C_build.json`` names the torch
   running now. One built against another torch is never imported: it could load and
   register its ops with another ABI, and would keep the first-use build from
   registering the ``pyattr`` ops in this process;
2. the first-use build in the cache for this torch, compiled now if it is not there (and
   ``PYATTR_JIT`` is not ``0``), with one line on stderr while it compiles.

When neither gives it, the cpp and cuda backends are off (``available_backends()`` says
why), pyattr runs on the torch backend, and one line on stderr, once per process, says
why and how to get the kernels.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path


def _build():
    """:mod:`pyattr.backends.build`, imported when first needed: importing it with the
    package would make ``python -m pyattr.backends.build`` warn that it is already loaded."""
    import pyattr.backends.build as build

    return build


NOTICE = "pyattr: the C++ kernels are off, running on the torch backend: {why}. To get them: {how}."

# set once pyattr._C is loaded and its ops have fake and batching rules
LOADED = False
# where the loaded pyattr._C came from ("built at install", "compiled on first use ...")
ORIGIN = ""
_noticed = False


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


def _find():
    """``(module, origin, why, how)``: pyattr._C and where it came from, or None with why
    it is not there and how to get it."""
    build = _build()
    import torch

    loaded = sys.modules.get("pyattr._C")
    if loaded is not None:  # loaded before: an earlier load(), the build command, an import
        return loaded, ORIGIN or _origin(loaded, torch), "", ""
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
    if src is None:
        return None, "", f"{installed}, and this install ships no C++ sources to compile", (
            "reinstall pyattr from its source (pip install --no-build-isolation <checkout or sdist>)")
    plan = build.Plan(torch, src)
    try:
        mod = build.load_cached(plan)
    except (ImportError, OSError) as e:
        return None, "", f"{installed}; its cached build {plan.library} failed to load ({e})", (
            f"remove {plan.dir}, then {rebuild}")
    if mod is not None:
        return mod, f"compiled on first use for torch {torch.__version__}, {plan.dir}", "", ""
    if os.environ.get("PYATTR_JIT", "").strip() == "0":
        return None, "", f"{installed}, and compiling it on first use is off (PYATTR_JIT=0)", (
            f"{rebuild}, or unset PYATTR_JIT")
    if plan.failed.is_file():
        return None, "", f"{installed}; {plan.failed.read_text().strip()}", (
            f"fix that, then {rebuild} (it retries)")
    missing = build.missing_tool()
    if missing:
        return None, "", f"{installed}, and it cannot be compiled here: {missing}", build.how_to_get()
    try:
        mod, _ = build.compile(plan, torch, notice=_say)
    except RuntimeError as e:
        return None, "", f"{installed}; {e}", f"fix that, then {rebuild} (it retries)"
    return mod, f"compiled on first use for torch {torch.__version__}, {plan.dir}", "", ""


@functools.lru_cache(maxsize=None)
def load() -> tuple[object | None, str]:
    """``(pyattr._C, "")``, or ``(None, why not)`` after the one-line notice."""
    global LOADED, ORIGIN
    _C, origin, why, how = _find()
    if _C is None:
        notice(why, how)
        return None, why
    import pyattr.backends._fake as _fake
    import pyattr.backends._vmap as _vmap

    _fake.register()
    _vmap.register("pyattr")  # torch.vmap and is_grads_batched run the kernels batched
    ORIGIN = origin
    LOADED = True
    return _C, ""
