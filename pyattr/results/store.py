"""``result.save(path)`` / ``pyattr.load(path)``: one safetensors file, no pickle.

The tensors go in as safetensors tensors; everything else (the result's class, its
scalars, strings, tokens, nested results, the rule coverage) goes in as JSON in the
file's metadata, tensors referenced by key. Loading builds only classes pyattr defines
and lists here (:data:`LOADABLE`): a file cannot name any other code to run."""

from __future__ import annotations

import importlib
import json
import math
import os
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, Dict

import torch

FORMAT = "pyattr-result/1"

#: classes a file may ask for: ``"module:Class"``
LOADABLE = frozenset({
    "pyattr.methods.relevance:RelevanceResult",
    "pyattr.methods.layer_relevance:LayerRelevanceResult",
    "pyattr.methods.layer_relevance:LayerRelevance",
    "pyattr.methods.integrated_gradients:AttributionResult",
    "pyattr.methods.generation:GenerationRelevanceResult",
    "pyattr.methods.context:ContextAttributionResult",
    "pyattr.methods.capture:Captured",
    "pyattr.methods.capture:GradientCapture",
    "pyattr.patching.result:PatchingResult",
    "pyattr.patching.edges:EdgeAttributionResult",
    "pyattr.patching.circuit:CircuitFaithfulness",
    "pyattr.evaluate.perturbation:PerturbationCurve",
    "pyattr.integration.audit:RelevanceAudit",
    "pyattr.integration.audit:ModuleGap",
    "pyattr.config:RelevanceRuleCoverage",
    "pyattr.config:RelevanceRules",
})


def _name(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


class _Encoder:
    def __init__(self):
        self.tensors: Dict[str, torch.Tensor] = {}

    def __call__(self, v: Any):
        if isinstance(v, torch.Tensor):
            key = f"t{len(self.tensors)}"
            self.tensors[key] = v.detach().to("cpu").contiguous().clone()
            return {"__tensor__": key}
        if hasattr(type(v), "_pyattr_restore"):  # a record with state of its own (capture)
            name = _name(v)
            if name not in LOADABLE:
                raise TypeError(f"save(): cannot store a {type(v).__name__} (not a pyattr result type)")
            return {"__state__": name, "state": self(v._pyattr_state())}
        if is_dataclass(v) and not isinstance(v, type):
            name = _name(v)
            if name not in LOADABLE:
                raise TypeError(f"save(): cannot store a {type(v).__name__} (not a pyattr result type)")
            return {"__dataclass__": name, "fields": {f.name: self(getattr(v, f.name)) for f in fields(v)}}
        if isinstance(v, dict):
            return {"__dict__": [[self(k), self(x)] for k, x in v.items()]}
        if isinstance(v, tuple):
            return {"__tuple__": [self(x) for x in v]}
        if isinstance(v, list):
            return [self(x) for x in v]
        if isinstance(v, float) and not math.isfinite(v):
            return {"__float__": repr(v)}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise TypeError(f"save(): cannot store a value of type {type(v).__name__}")


def save(result, path) -> str:
    """Write ``result`` to ``path`` (a ``.safetensors`` file; the suffix is added when
    missing) and return the path written."""
    from safetensors.torch import save_file

    given = os.path.expanduser(os.fspath(path))
    if os.path.isdir(given):
        raise ValueError(f"save(): {given!r} is a directory; pass a file path (e.g. {os.path.join(given, 'result')!r})")
    path = given if given.endswith(".safetensors") else given + ".safetensors"
    if os.path.isdir(path):
        raise ValueError(f"save(): {path!r} is a directory; pass a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"save(): directory {parent!r} does not exist")
    enc = _Encoder()
    doc = enc(result)
    save_file(enc.tensors, path, metadata={"format": FORMAT, "pyattr": json.dumps(doc)})
    return path


def _loadable(name: str):
    if name not in LOADABLE:
        raise _Refused(f"load(): the file asks for class {name!r}, which is not a pyattr result type")
    return name.split(":")


class _Malformed(ValueError):
    """A file whose metadata does not describe what ``save()`` writes."""


class _Refused(ValueError):
    """A file that asks for what :func:`load` does not build (its message is the whole error)."""


def _decode(v, tensors):
    if isinstance(v, list):
        return [_decode(x, tensors) for x in v]
    if not isinstance(v, dict):
        return v
    if "__tensor__" in v:
        key = v["__tensor__"]
        if not isinstance(key, str) or key not in tensors:
            raise _Malformed(f"its metadata refers to tensor {key!r}, which the file does not hold")
        return tensors[key]
    if "__tuple__" in v:
        return tuple(_decode(x, tensors) for x in v["__tuple__"])
    if "__dict__" in v:
        return {_decode(k, tensors): _decode(x, tensors) for k, x in v["__dict__"]}
    if "__float__" in v:
        return float(v["__float__"])
    if "__state__" in v:
        module, cls = _loadable(v["__state__"])
        return getattr(importlib.import_module(module), cls)._pyattr_restore(_decode(v["state"], tensors))
    if "__dataclass__" in v:
        name = v["__dataclass__"]
        module, cls = _loadable(name)
        kind = getattr(importlib.import_module(module), cls)
        values = {k: _decode(x, tensors) for k, x in v["fields"].items()}
        declared = {f.name for f in fields(kind)}
        unknown = sorted(set(values) - declared)
        if unknown:  # only the class's own fields: a file cannot set other attributes (methods)
            raise _Malformed(f"it gives {cls} fields it does not have: {unknown}")
        known = {f.name for f in fields(kind) if f.init}
        missing = sorted(f.name for f in fields(kind) if f.init and f.name not in values
                         and f.default is MISSING and f.default_factory is MISSING)
        if missing:
            raise _Malformed(f"it lacks fields of {cls}: {missing}")
        obj = kind(**{k: x for k, x in values.items() if k in known})
        for k, x in values.items():  # fields that are not constructor arguments
            if k not in known:
                object.__setattr__(obj, k, x)
        return obj
    raise _Refused("load(): malformed file (an object without a known tag)")


def load(path):
    """Read a result written by ``result.save(path)``: the same class, with equal tensors,
    tokens and fields.

    Raises:
        FileNotFoundError: no such file. ValueError: not a file ``save()`` wrote.
    """
    from safetensors import safe_open

    path = os.path.expanduser(os.fspath(path))
    if not os.path.exists(path) and os.path.exists(path + ".safetensors"):
        path += ".safetensors"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load(): no file {path!r}")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"load(): {path!r} is not a safetensors file ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT or "pyattr" not in meta:
        found = meta.get("format")
        other = f" (its format is {found!r}; this pyattr reads {FORMAT!r})" if str(found).startswith("pyattr-result") \
            else ""
        raise ValueError(f"load(): {path!r} is a safetensors file but not a pyattr result (save() writes those){other}")
    try:
        doc = json.loads(meta["pyattr"])
    except ValueError as e:
        raise ValueError(f"load(): {path!r}: its pyattr metadata is not valid JSON ({e}); the file was changed after "
                         "save()") from None
    if not isinstance(doc, dict) or not ("__dataclass__" in doc or "__state__" in doc):
        raise ValueError(f"load(): {path!r}: its pyattr metadata holds no result object; the file was changed after "
                         "save()")
    try:
        return _decode(doc, tensors)
    except _Malformed as e:
        raise ValueError(f"load(): {path!r}: {e}; the file was changed after save()") from None
    except _Refused:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"load(): {path!r}: malformed pyattr metadata ({type(e).__name__}: {e}); the file was "
                         "changed after save()") from None
