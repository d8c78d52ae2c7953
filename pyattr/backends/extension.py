"""Loading the compiled extension ``pyattr._C`` (once): its ops, their fake (meta) and
batching rules. Its own module, so that the compiled backend can load it without
importing the backend registry that imports the compiled backend."""

from __future__ import annotations

import functools
import importlib

@functools.lru_cache(maxsize=None)
def load() -> tuple[object | None, str]:
    try:
        _C = importlib.import_module("pyattr._C")  # the compiled extension (setup.py)
    except ImportError as e:  # not built, or built against another torch
        return None, f"extension pyattr._C is not built or failed to load ({e})"
    except OSError as e:  # a shared library it links against is missing
        return None, f"extension pyattr._C failed to load ({e})"
    import pyattr.backends._fake as _fake
    import pyattr.backends._vmap as _vmap

    _fake.register()
    _vmap.register("pyattr")  # torch.vmap and is_grads_batched run the kernels batched
    global LOADED
    LOADED = True
    return _C, ""


# set once pyattr._C is loaded and its ops have fake and batching rules
LOADED = False
