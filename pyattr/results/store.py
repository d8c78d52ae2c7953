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
import types
import typing
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
    "pyattr.methods.seq2seq:Seq2SeqRelevanceResult",
    "pyattr.methods.seq2seq_generation:Seq2SeqGenerationResult",
    "pyattr.methods.seq2seq_ig:Seq2SeqAttributionResult",
    "pyattr.methods.context:ContextAttributionResult",
    "pyattr.methods.capture:Captured",
    "pyattr.methods.capture:GradientCapture",
    "pyattr.patching.result:PatchingResult",
    "pyattr.patching.edges:EdgeAttributionResult",
    "pyattr.patching.circuit:CircuitFaithfulness",          # files written before it moved
    "pyattr.patching.circuit_result:CircuitFaithfulness",
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
        _check_types(kind, cls, values)
        obj = kind(**{k: x for k, x in values.items() if k in known})
        for k, x in values.items():  # fields that are not constructor arguments
            if k not in known:
                object.__setattr__(obj, k, x)
        problem = _SHAPES.get(cls, lambda o: None)(obj)
        if problem:
            raise _Malformed(f"{cls}: {problem}")
        return obj
    raise _Refused("load(): malformed file (an object without a known tag)")


def _conforms(v, hint) -> bool:
    """Whether ``v`` is of the annotated type ``hint`` (tensors, numbers, strings, lists,
    tuples, dicts, optional and union types, pyattr's own classes; anything the annotation
    does not pin down passes)."""
    if hint is Any or isinstance(hint, (str, typing.ForwardRef)):
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is getattr(types, "UnionType")):
        return any(_conforms(v, a) for a in args)
    if hint is type(None):
        return v is None
    if hint is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if origin in (list, typing.List):
        return isinstance(v, list) and (not args or all(_conforms(x, args[0]) for x in v))
    if origin in (tuple, typing.Tuple):
        if not isinstance(v, (tuple, list)):
            return False
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            return not args or all(_conforms(x, args[0]) for x in v)
        return len(v) == len(args) and all(_conforms(x, a) for x, a in zip(v, args))
    if origin in (dict, typing.Dict):
        return isinstance(v, dict) and (not args or all(_conforms(k, args[0]) and _conforms(x, args[1])
                                                        for k, x in v.items()))
    if origin is not None:
        return isinstance(v, origin)
    return isinstance(v, hint) if isinstance(hint, type) else True


def _check_types(kind, cls: str, values: dict) -> None:
    """Each field the file gives is of the type the class declares."""
    try:
        hints = typing.get_type_hints(kind)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: nothing to check against
        return
    for name, v in values.items():
        hint = hints.get(name)
        if hint is not None and not _conforms(v, hint):
            want = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
            got = f"a tensor of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else \
                f"{type(v).__name__} {v!r}"[:80]
            raise _Malformed(f"{cls}.{name} must be {want}, the file holds {got}")


def _shape(t) -> tuple:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()


def _relevance_shapes(r) -> Any:
    """RelevanceResult: token_relevance (…, batch, seq), relevance (…, batch, seq, hidden),
    target and conservation_delta (…, batch) or a scalar, tokens one row of seq per batch row."""
    tok = _shape(r.token_relevance)
    if len(tok) not in (2, 3):
        return f"token_relevance must be (batch, seq) or (k, batch, seq), the file holds {tok}"
    if _shape(r.relevance)[:-1] != tok:
        return f"relevance {_shape(r.relevance)} does not extend token_relevance {tok} by a hidden dimension"
    return _targets(r, tok[:-1]) or _tokens(r, tok[-2:])


def _targets(r, lead: tuple) -> Any:
    for name in ("target", "conservation_delta", "baseline_target"):
        t = getattr(r, name, None)
        if t is not None and _shape(t) not in (lead, ()):
            return f"{name} must be shaped {lead} (or a scalar), the file holds {_shape(t)}"
    return None


def _tokens(r, batch_seq: tuple) -> Any:
    tokens = getattr(r, "tokens", None)
    if tokens is None:
        return None
    if len(tokens) != batch_seq[0] or any(len(row) != batch_seq[1] for row in tokens):
        return f"tokens must be {batch_seq[0]} rows of {batch_seq[1]} strings, as the relevance is laid out"
    return None


def _attribution_shapes(r) -> Any:
    a = _shape(r.attribution)
    if len(a) < 2:
        return f"attribution must be (batch, seq, hidden) or the layer's shape, the file holds {a}"
    if r.token_attribution is not None and _shape(r.token_attribution) != a[:-1]:
        return f"token_attribution {_shape(r.token_attribution)} is not attribution {a} summed over its last dimension"
    for name in ("convergence_delta", "target", "baseline_target"):
        if _shape(getattr(r, name)) not in (a[:1], ()):
            return f"{name} must be shaped {a[:1]}, the file holds {_shape(getattr(r, name))}"
    return None


def _generation_shapes(r) -> Any:
    seq = _shape(r.sequences)
    tok = _shape(r.token_relevance)
    if len(seq) != 2 or len(tok) != 3 or tok[0] != seq[0] or tok[2] != seq[1]:
        return f"token_relevance {tok} must be (batch, generated, seq) for sequences {seq}"
    for name in ("target", "conservation_delta", "step_mask"):
        if _shape(getattr(r, name)) != tok[:2]:
            return f"{name} must be shaped {tok[:2]}, the file holds {_shape(getattr(r, name))}"
    if _shape(r.attention_mask) != seq:
        return f"attention_mask must be shaped {seq}, the file holds {_shape(r.attention_mask)}"
    return None


def _context_shapes(r) -> Any:
    sc = _shape(r.scores)
    rows = len(r.sources)
    if len(sc) not in (2, 3) or sc[0] != rows or len(r.source_ranges) != rows:
        return f"scores {sc} must have one row per prompt ({rows}) of sources (per response span)"
    if any(len(a) != len(b) or len(a) > sc[-1] for a, b in zip(r.sources, r.source_ranges)):
        return "sources and source_ranges must be one range per source, within the scores' width"
    return None


def _layer_shapes(r) -> Any:
    a = _shape(r.activation)
    if _shape(r.gradient) != a or _shape(r.relevance) != a:
        return f"activation {a}, gradient {_shape(r.gradient)} and relevance {_shape(r.relevance)} must be one shape"
    return None


def _curve_shapes(r) -> Any:
    f, v = _shape(r.fractions), _shape(r.values)
    if len(f) != 1 or len(v) != 2 or v[1] != f[0] or _shape(r.auc) != v[:1]:
        return f"values {v} must be (batch, {f[0] if f else '?'} fractions) and auc (batch,), auc holds {_shape(r.auc)}"
    return None


#: per class, the shapes its fields must agree on (a message where they do not)
_SHAPES = {"RelevanceResult": _relevance_shapes, "AttributionResult": _attribution_shapes,
           "GenerationRelevanceResult": _generation_shapes, "ContextAttributionResult": _context_shapes,
           "LayerRelevance": _layer_shapes, "PerturbationCurve": _curve_shapes}


def load(path):
    """Read a result written by ``result.save(path)``: the same class, with equal tensors,
    tokens and fields.

    Every field is checked against the type its class declares (a tensor where a tensor is
    declared, a string, a list of strings…), and the main results' tensors against each
    other's shapes (``token_relevance`` (batch, seq) under ``relevance`` (batch, seq,
    hidden), targets (batch,), tokens one string per position).

    Raises:
        FileNotFoundError: no such file. ValueError: not a file ``save()`` wrote (its
            fields of the wrong type or shape included), naming the field.
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
