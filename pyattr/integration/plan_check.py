"""``generic=True`` fails closed: the structural plan is checked on a probe before it answers.

A model without a rule map gets its rules from structural discovery, which can miss a
nonlinearity (a form it does not know) or leave a component native with a reason. Before
a generic scope yields, the plan is run with every rule on (the attention mode asked for,
else the AH-rule) on a probe of the model — random token ids (or pixels) of its own
vocabulary, seeded, eight positions — under the per-module conservation audit
(:mod:`pyattr.integration.audit`), with its biases' share measured. Then:

- a module whose own computation loses relevance where the plan neither placed a rule nor
  declared a loss is a refusal (:class:`RelevanceRuleUnsupportedError`) naming the
  module, its class and the measured gap;
- a loss the plan declared (a component left native with its reason, listed in the
  coverage's ``skipped``) is a refusal too, unless the caller opted in with
  ``generic="partial"``: then the scope runs and :class:`PartialRelevanceWarning` (a
  ``warnings.warn``) names the components and the measured gap.

The verdict is kept per model instance, rule set and the state it was measured on
(:func:`checked_state`: parameters that require grad, dtypes, attention implementation,
forwards replaced on the instance); the probe runs again when any of them changed. Mapped
architectures are not probed: their table is the plan, and their tests its check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from typing import Callable, Dict, Iterator, Optional, Tuple

from pyattr._module_state import kept_state
import torch
from torch import nn

import pyattr.architectures as A
from pyattr._module_forward import forward_of
from pyattr.config import RelevanceRules
from pyattr.integration.audit import ModuleAudit, RelevanceAudit, bypassed_activations
from pyattr.integration.errors import RelevanceRuleUnsupportedError

MODES = (False, True, "partial")
PROBE_LENGTH = 8

_VERDICTS: "weakref.WeakKeyDictionary[nn.Module, Dict[tuple, tuple]]" = weakref.WeakKeyDictionary()


class PartialRelevanceWarning(UserWarning):
    """``generic="partial"``: relevance is not conserved through components the structural
    plan left native (named in the message, with the measured gap)."""


def check_mode(generic) -> object:
    """``generic`` as given, when it is one of False, True, ``"partial"``."""
    if not any(generic is m or (isinstance(m, str) and generic == m) for m in MODES):
        raise ValueError(f"generic must be False, True or 'partial' (accept the losses the plan declares, with a "
                         f"warning), got {generic!r}")
    return generic


def probe_rules(rules: RelevanceRules) -> RelevanceRules:
    """Every rule on, with the caller's attention mode (off included: a caller who turns
    the attention rule off chose the softmax's native gradient, and the losses there are
    declared "attention rule off", which the check accepts)."""
    return dataclasses.replace(RelevanceRules.all(), attention=rules.attention)


def probe_inputs(model: nn.Module) -> dict:
    """Seeded model inputs of the model's own kind: token ids of its vocabulary, or
    pixels of its image size (``main_input_name``)."""
    g = torch.Generator().manual_seed(0)
    cfg = getattr(model, "config", None)
    main = getattr(model, "main_input_name", "input_ids")
    p = next((t for t in model.parameters() if t.device.type != "meta"), None)
    device = p.device if p is not None else torch.device("cpu")
    if main == "input_ids":
        emb = A.input_embeddings(model)
        vocab = getattr(emb, "num_embeddings", None) or getattr(cfg, "vocab_size", None) or getattr(
            getattr(cfg, "text_config", None), "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 2:
            raise RelevanceRuleUnsupportedError(
                f"generic=True: the plan check cannot make probe token ids for {type(model).__name__} "
                "(no input embeddings with num_embeddings, no config.vocab_size)")
        ids = torch.randint(min(4, vocab - 1), vocab, (1, PROBE_LENGTH), generator=g).to(device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if main == "pixel_values":
        vc = getattr(cfg, "vision_config", None) or cfg
        size = getattr(vc, "image_size", None)
        size = (size, size) if isinstance(size, int) else tuple(size or ())
        ch = getattr(vc, "num_channels", 3)
        if len(size) != 2:
            raise RelevanceRuleUnsupportedError(
                f"generic=True: the plan check cannot make probe pixels for {type(model).__name__} (no config.image_size)")
        dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
        return {"pixel_values": torch.randn(1, ch, *size, generator=g, dtype=torch.float64).to(device, dtype)}
    raise RelevanceRuleUnsupportedError(
        f"generic=True: the plan check has no probe for {type(model).__name__}'s main input {main!r} "
        "(it makes token ids and pixels); without the check a generic answer could be silently wrong")


def _entry(model: nn.Module) -> Tuple[nn.Module, str]:
    arch = A.arch_of(model, True)
    if arch is not None and arch.entry is not None:
        mod = A.get_submodule(model, A.join(A.base_prefix(model), arch.entry[0]))
        if isinstance(mod, nn.Module):
            return mod, "input"
    emb = A.input_embeddings(model)
    if not isinstance(emb, nn.Module):
        # pixels: relevance enters at the first module the probe's pixels flow into
        raise RelevanceRuleUnsupportedError(
            f"generic=True: no entry for {type(model).__name__} (discovery found none: "
            f"{arch.refusal('entry') if arch is not None else 'no blocks'}; no input embeddings)")
    return emb, "output"


def _first(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
    return None


def run_probe(model: nn.Module, pl, installed: Callable) -> RelevanceAudit:
    """The audit of ``pl`` (a planner with every rule on) on the probe, installed with
    ``installed(model, pl)``."""
    module, where = _entry(model)
    absorbed = list(pl.cov.by_kind.get("attention", []))
    exempt = {}
    if pl.rules.attention == "attnlrp":
        note = "AttnLRP's softmax keeps its native gradient: not conservative by design"
        exempt = {p.rsplit(".", 1)[0]: note for p in absorbed if "." in p}
    audit = None

    def leaf(t):  # called during the forward, when the audit below exists
        x = t.detach().requires_grad_(True)
        audit.entered(x)
        return x

    def pre(mod, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return (leaf(args[0]),) + tuple(args[1:]), kwargs
        key = next((k for k in ("hidden_states", "input", "x", "inputs_embeds") if isinstance(kwargs.get(k), torch.Tensor)),
                   None)
        if key is not None:
            kwargs = {**kwargs, key: leaf(kwargs[key])}
        return args, kwargs

    def post(mod, args, out):
        t = _first(out)
        return leaf(t) if isinstance(t, torch.Tensor) and out is t else None

    inputs = probe_inputs(model)
    training = {m: m.training for m in model.modules()}
    model.eval()
    handle = (module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True) if where == "input"
              else module.register_forward_hook(post, prepend=True))
    try:
        with torch.enable_grad(), kept_state(model), installed(model, pl):
            audit = ModuleAudit(model, absorbed, exempt, bypassed_activations(model))
            audit.__enter__()
            out = model(**inputs, **({"use_cache": False} if _takes(model, "use_cache") else {}))
            y = _first(out)
            if y is None or not y.requires_grad:
                raise RelevanceRuleUnsupportedError(
                    f"generic=True: the plan check's probe output of {type(model).__name__} does not depend on the "
                    "entry (no floating output carries gradient)")
            g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
            return audit.finish(y, g.to(y.device, y.dtype))
    finally:
        if audit is not None:
            audit.__exit__(None, None, None)
        handle.remove()
        for m, t in training.items():
            m.training = t


def _takes(model: nn.Module, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _declared(path: str, reasons: Dict[str, str]) -> Optional[str]:
    """The declared loss that explains a leak at ``path``, the most specific first: at the
    module, at a direct child (a fused q/k/v projection declared, the loss shows in the
    attention's own softmax), at an enclosing module (a mixture-of-experts block)."""
    parts = path.split(".") if path else []
    if path in reasons:
        return path
    depth = len(parts) + 1
    child = next((p for p in reasons if p.startswith(path + "." if path else "") and len(p.split(".")) == depth), None)
    if child is not None:
        return child
    for i in range(len(parts) - 1, -1, -1):
        p = ".".join(parts[:i])
        if p in reasons:
            return p
    return None


def _hooks(m: nn.Module) -> tuple:
    """The hook functions a module carries now (forward, pre-forward, backward): a hook added
    after a verdict (one that edits an output) is another plan."""
    return tuple(tuple(getattr(m, name, {}).values()) for name in
                 ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"))


def checked_state(model: nn.Module) -> tuple:
    """What a verdict was measured on, besides the rule set: a cached verdict holds only
    for this. The modules themselves (a module swapped in is another plan), each one's
    forward where it is replaced on the instance (pyattr's own rule forwards excepted) and
    the hooks it carries,
    which parameters require grad (a trainable parameter takes part in the forward's
    products as a tensor with gradient), the parameters' dtypes and devices, and the
    attention implementation."""
    mods = tuple((id(m), type(m), forward_of(m), _hooks(m)) for m in model.modules())
    params = tuple((p.requires_grad, p.dtype, p.device.type) for p in model.parameters())
    cfg = getattr(model, "config", None)
    return mods, params, getattr(cfg, "_attn_implementation", None), getattr(cfg, "_experts_implementation", None)


def verdict(model: nn.Module, rules: RelevanceRules, installed: Callable, plan: Callable) -> tuple:
    """``("ok",)`` | ``("undeclared", message)`` | ``("declared", message)`` for ``model``."""
    key = (dataclasses.astuple(probe_rules(rules)), checked_state(model))
    kept = _VERDICTS.setdefault(model, {})
    if key in kept:
        return kept[key]
    pl = plan(model, probe_rules(rules))
    try:
        audit = run_probe(model, pl, installed)
    except RelevanceRuleUnsupportedError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the probe means the plan is unchecked
        raise RelevanceRuleUnsupportedError(
            f"generic=True: the plan check's probe forward of {type(model).__name__} failed "
            f"({type(e).__name__}: {' '.join(str(e).split())[:300]}); without the check a generic answer could be "
            "silently wrong") from e
    name = type(model).__name__
    undeclared, declared = [], []
    for m in audit.leaks:
        why = _declared(m.path, pl.cov.reasons)
        if why is not None and "attention rule off" in pl.cov.reasons[why]:
            continue  # the caller's choice
        (declared if why else undeclared).append((m, why))

    def show(items):
        return "; ".join(f"{m.path or '<model>'!r} ({m.cls}) loses {m.own_gap:.3g} of {m.scale:.3g}"
                         for m, _ in items[:4]) + (f"; and {len(items) - 4} more" if len(items) > 4 else "")

    def show_declared(items):
        groups: Dict[str, float] = {}
        for m, p in items:
            groups[p] = groups.get(p, 0.0) + m.own_gap
        parts = [f"{p or '<model>'!r} ({classes.get(p, '?')}) loses {gap:.3g}: {pl.cov.reasons[p]}"
                 for p, gap in list(groups.items())[:3]]
        return "; ".join(parts) + (f"; and {len(groups) - 3} more" if len(groups) > 3 else "")

    classes = {n: type(m).__name__ for n, m in model.named_modules()}
    if undeclared:
        v = ("undeclared", f"generic=True: relevance is not conserved on {name} where the structural plan placed no "
             f"rule: {show(undeclared)} (measured on a probe forward, relevance in + bias − out of the module's own "
             "code). pyattr cannot show that every nonlinearity on the path got its rule, so it refuses; "
             "pyattr.audit(model, inputs, generic=True) shows every module's balance, RelevanceRules() gives "
             "plain gradients.")
    elif declared:
        v = ("declared", f"generic: the structural plan leaves components of {name} native and relevance is not "
             f"conserved through them: {show_declared(declared)} (measured on a probe forward; total gap "
             f"{audit.gap:.3g} of a target of {audit.target:.3g}).")
    else:
        v = ("ok",)
    kept[key] = v
    return v


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside pyattr (and contextlib): the
    caller's line, whichever method opened the scope."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and (os.path.abspath(frame.f_code.co_filename).startswith(root)
                                 or frame.f_code.co_filename.endswith("contextlib.py")):
        frame, level = frame.f_back, level + 1
    return level


_UNCHECKED = [0]


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """For :func:`pyattr.audit`, which measures the plan itself: no plan check inside."""
    _UNCHECKED[0] += 1
    try:
        yield
    finally:
        _UNCHECKED[0] -= 1


def check(model: nn.Module, rules: RelevanceRules, generic, installed: Callable, plan: Callable) -> None:
    """Raise or warn per the verdict (see the module docstring)."""
    if _UNCHECKED[0]:
        return
    v = verdict(model, rules, installed, plan)
    if v[0] == "undeclared":
        raise RelevanceRuleUnsupportedError(v[1])
    if v[0] == "declared":
        if generic == "partial":
            warnings.warn(PartialRelevanceWarning(v[1] + " generic='partial' accepts this loss."),
                          stacklevel=_caller_level())
        else:
            raise RelevanceRuleUnsupportedError(v[1] + " Pass generic='partial' to accept it (with a warning), or "
                                                       "RelevanceRules() for plain gradients.")

