"""The zoo: ``generic=True`` over every model class in transformers' own mappings.

For each (mapping, model type) of transformers' causal-LM, masked-LM, sequence-
classification and image-classification mappings, a tiny random model is built in float64
(:mod:`pyattr.bench.zoo_build`: seed 0, eval mode, hidden 32, 2 layers, weight matrices at
standard deviation 0.2 so that nonlinearities leave their linear regime; biases zeroed so
that LRP conservation is exact when every nonlinearity has its rule) and
``pyattr.relevance(model, x, generic=True)`` is checked four ways: with the rules off
(``rules=RelevanceRules()``) against plain autograd gradient × input at the same entry;
with the rules on, Σ relevance against the target; the user's own scope
(``use_relevance_rules(model, generic=True)`` around their forward and backward) with the
parameters left trainable against it; and a padded row (left for decoders, right for
encoders; a decoder whose forward takes no position ids must refuse left padding, and is
then padded on the right) against the row alone. Encoder–decoder entries are checked the
same four ways at both entries (:mod:`pyattr.bench.zoo_seq2seq`). Statuses:

- ``right``: rules off = autograd (relative 1e-5), Σ relevance = target (1e-6 of |target|
  or of Σ|relevance|, whichever is larger: relevance is float32), the trainable scope =
  ``pyattr.relevance`` (relative 1e-5), and the padded row equals the row alone;
- ``refused``: pyattr raised (ValueError, TypeError, NotImplementedError or
  RelevanceRuleUnsupportedError) from its own code, naming a module, class or role;
- ``unclear refusal``: the same, but the message names none of them;
- ``wrong``: a number came back that fails a check, with no error (the detail says whether
  a warning was emitted);
- ``crash``: any other exception during pyattr's call, one raised inside transformers or
  torch, or an entry whose pyattr calls run past the time limit;
- ``declared``: a mapped architecture whose loss its rule map documents (coverage names
  it: a classification head's ``torch.tanh``, Gemma 2's logit soft-capping);
- ``transformers``: the model itself is not pad-invariant, or gives a non-finite output;
- ``not buildable``: the tiny config or model cannot be made or run here (extra
  libraries, a config that needs more than sizes, float64 kernels).

Run: ``python -m pyattr.bench.zoo [--only TYPE,...] [--json OUT] [--markdown OUT]``; the
table in the docs (docs/reference/zoo.md) is its ``--markdown`` output.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
import traceback
import warnings
from typing import Dict, List, Optional

import torch

MAPPINGS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
            "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES")
STATUSES = ("right", "declared", "refused", "unclear refusal", "wrong", "crash", "transformers", "not buildable")
#: what the slow test allows no entry to be
BAD = ("wrong", "crash", "unclear refusal")
#: seconds: an entry's build (then ``not buildable``), and the whole entry (then ``crash``)
SEQ, BUILD_S, TIMEOUT_S = 7, 20, 60
#: words that name a role in a refusal (besides module paths and class names)
ROLES = ("role", "entry", "embedding", "attention", "mlp", "norm", "gate", "residual", "position", "head",
         "pooler", "activation", "layout", "pad", "token", "input", "expert", "block", "vision", "patch")


def entries(only: Optional[List[str]] = None) -> List[tuple]:
    """``(mapping, model_type, class name)`` over the mappings (each pair once)."""
    from transformers.models.auto import modeling_auto

    out = []
    for name in MAPPINGS:
        for mt, cls in getattr(modeling_auto, name).items():
            if only and mt not in only:
                continue
            out.append((name.replace("MODEL_FOR_", "").replace("_MAPPING_NAMES", "").lower(), mt,
                        cls if isinstance(cls, str) else cls[0]))
    return out


def _from_pyattr(e: BaseException) -> bool:
    tb = traceback.extract_tb(e.__traceback__)
    return bool(tb) and "/pyattr/" in tb[-1].filename.replace("\\", "/")


def classify(mapping: str, model_type: str, cls_name: str, phase: Optional[dict] = None) -> Dict[str, str]:
    """One entry's status and a one-line detail (``phase["now"]`` says which step runs:
    ``"build"`` or ``"pyattr"``, for the time limit of :func:`run`)."""
    import pyattr
    import pyattr.architectures as A
    from pyattr.bench import zoo_build as B
    from pyattr.bench import zoo_seq2seq
    from pyattr.methods._core.stacks import is_encoder_decoder

    phase = {} if phase is None else phase
    row = dict(mapping=mapping, model_type=model_type, cls=cls_name)
    phase["now"] = "build"
    try:
        model, x = B.build(mapping, model_type, cls_name, SEQ)
        B.zero_biases(model)
    except Exception as e:  # noqa: BLE001 - anything that stops the build or a plain forward
        return {**row, "status": "not buildable", "detail": f"{type(e).__name__}: {_short(e)}"}
    pixels = x.is_floating_point()
    with torch.no_grad():
        out = model(x, **_plain_kwargs(model))
    y = _logits(out)
    if not torch.isfinite(y).all():
        return {**row, "status": "transformers", "detail": "non-finite output in float64"}
    tid = int(y[0, -1].argmax() if y.dim() == 3 else y[0].argmax())
    phase["now"] = "pyattr"
    if "rearm" in phase:
        phase["rearm"]()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # an encoder–decoder is checked the same four ways at both of its entries
            two = is_encoder_decoder(model)
            phase["step"] = "rules off: "
            off = (zoo_seq2seq.rules_off if two else _rules_off)(pyattr, model, x, tid)
            phase["step"] = ""
            r = pyattr.relevance(model, x, target=tid, generic=True)
            phase["step"] = "trainable scope: "
            scope = (zoo_seq2seq.trainable_scope if two else _trainable_scope)(model, x, tid, r)
            phase["step"] = "padded: "
            pad = zoo_seq2seq.padded(pyattr, model, x, r, tid) if two else \
                None if pixels else _padded(pyattr, model, x, r, tid, phase)
            if two:
                return {**row, **zoo_seq2seq.verdict(r, off, scope, pad)}
    except (ValueError, TypeError, NotImplementedError, pyattr.RelevanceRuleUnsupportedError) as e:
        if _from_pyattr(e):
            return {**row, **_refusal(e, model, phase.get("step", ""))}
        return {**row, "status": "crash", "detail": f"{type(e).__name__} in {_where(e)}: {_short(e)}"}
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "crash", "detail": f"{type(e).__name__} in {_where(e)}: {_short(e)}"}
    warned = [str(w.message)[:80] for w in caught if issubclass(w.category, pyattr.PartialRelevanceWarning)]
    also = f"; warned: {warned[0]}" if warned else "; no warning"
    if off is not None:
        return {**row, "status": "wrong", "detail": off + also}
    if scope is not None:
        return {**row, "status": "wrong", "detail": scope + also}
    t, d = float(r.target.abs().max()), float(r.conservation_delta.abs().max())
    # relevance is float32: its sum is exact to ~6e-8 of Σ|relevance|, which exceeds the
    # target where the tokens' relevance cancels
    if not d <= 1e-6 * max(t, float(r.relevance.double().abs().sum()), 1e-12):
        if A.model_type(model) in A.ARCHITECTURES and any("not conserved" in why for why in r.coverage.reasons.values()):
            return {**row, "status": "declared", "detail": f"conservation |delta| {d:.3g} for |target| {t:.3g}; "
                    + next(f"{p}: {w}" for p, w in r.coverage.reasons.items() if "not conserved" in w)[:160]}
        return {**row, "status": "wrong", "detail": f"conservation |delta| {d:.3g} for |target| {t:.3g}" + also}
    if pad is not None:
        return {**row, **pad}
    return {**row, "status": "right", "detail": f"|delta|/|target| {d / max(t, 1e-300):.1e}{phase.get('padding', '')}"}


def _plain_kwargs(model) -> dict:
    from pyattr.bench.zoo_build import _takes

    return {"use_cache": False} if _takes(model, "use_cache") else {}


def _logits(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, dict)) or hasattr(out, "to_tuple") else out


def _at_entry(model, x, tid: int, scope=None):
    """``(leaf, value)``: one forward of ``model`` on ``x`` (inside ``scope`` where given)
    with the entry pyattr reads made a leaf (as pyattr taps it, its first call), and the
    target logit; the caller differentiates ``value`` inside the same ``with``."""
    from pyattr.methods._core.inputs import entry_module
    from pyattr.methods._core.taps import tap

    entry, where = entry_module(model, generic=True)
    xs = []

    def leaf(t):
        xs.append(t.detach().requires_grad_(True))
        return xs[-1]

    name = "pixel_values" if x.is_floating_point() else "input_ids"
    with tap(entry, where, leaf, once=True):
        y = _logits(model(**{name: x}, **_plain_kwargs(model)))
    return xs[0], (y[0, -1, tid] if y.dim() == 3 else y[0, tid])


def _rules_off(pyattr, model, x, tid: int) -> Optional[str]:
    """Rules off (``RelevanceRules()``) against plain autograd gradient × input at the entry
    pyattr reads (its first call, as pyattr taps it): None when equal, else the detail."""
    r0 = pyattr.relevance(model, x, target=tid, rules=pyattr.RelevanceRules(), generic=True)
    with torch.enable_grad():
        leaf, value = _at_entry(model, x, tid)
        (g,) = torch.autograd.grad(value, leaf)
    want = (leaf.detach() * g).double()
    have = r0.relevance.double()
    scale = float(want.abs().max()) + 1e-300
    if have.shape != want.shape:
        return f"rules off: relevance shaped {tuple(have.shape)}, autograd's {tuple(want.shape)}"
    err = float((have - want).abs().max())
    t0, t1 = float(r0.target.reshape(-1)[0]), float(value)
    if not (err <= 1e-5 * scale and abs(t0 - t1) <= 1e-9 * (1 + abs(t1))):
        return (f"rules off differs from autograd gradient × input by {err:.3g} (max |relevance| {scale:.3g}); "
                f"target {t0:.6g} vs {t1:.6g}")
    return None


def scope_relevance(model, x, tid: int):
    """``(relevance at the entry, target)`` as a user computes it: ``use_relevance_rules(model,
    generic=True)`` around their own forward and ``backward()``, the parameters as they are
    (trainable, as every loaded model's), the gradient read at the entry pyattr reads."""
    from pyattr import use_relevance_rules

    with torch.enable_grad(), use_relevance_rules(model, generic=True):
        leaf, value = _at_entry(model, x, tid)
        value.backward()
    model.zero_grad(set_to_none=True)
    return (leaf * leaf.grad).detach().double(), float(value.detach())


def _trainable_scope(model, x, tid: int, r) -> Optional[str]:
    """The user's own scope with the parameters as loaded (trainable, but for the few a model
    freezes itself: :func:`scope_relevance`) against ``pyattr.relevance`` (which freezes
    them all): None when equal, else the detail."""
    have, _ = scope_relevance(model, x, tid)
    want = r.relevance.double()
    if have.shape != want.shape:
        return f"trainable scope: relevance shaped {tuple(have.shape)}, pyattr.relevance's {tuple(want.shape)}"
    err = float((have - want).abs().max())
    scale = float(want.abs().max()) + 1e-300
    if not err <= 1e-5 * scale:
        return (f"the user's scope with trainable parameters differs from pyattr.relevance by {err:.3g} (max "
                f"|relevance| {scale:.3g}; Σ {float(have.sum()):.6g} vs {float(want.sum()):.6g})")
    return None


def _refusal(e: BaseException, model, step: str) -> Dict[str, str]:
    """``refused`` when the message names a module path, a module class or a role, else
    ``unclear refusal``."""
    msg = " ".join(str(e).split())
    low = msg.lower()
    names = {type(m).__name__ for m in model.modules()} | {n for n, _ in model.named_modules() if "." in n}
    clear = len(msg) >= 40 and (any(n in msg for n in names) or any(w in low for w in ROLES))
    return {"status": "refused" if clear else "unclear refusal", "detail": f"{step}{type(e).__name__}: {msg[:240]}"}


def _padded(pyattr, model, x, r, tid: int, note: Optional[dict] = None) -> Optional[Dict[str, str]]:
    """A row padded (left for decoders, right for encoders) against the row alone: None
    when equal, else the status (``transformers`` when the model itself is not pad-invariant).

    Equal means: the target, and the relevance of the real tokens per hidden dimension to a
    relative 1e-5 of the largest, or to 1000× the model's own pad noise where that is larger
    (GPT-Neo computes attention in float32; at most 1e-3), and no relevance on the pad tokens."""
    import inspect

    causal = _decoder(model)
    pad = torch.full((1, 2), int(getattr(model.config, "pad_token_id", 0) or 0), dtype=x.dtype)
    ids = torch.cat([pad, x], 1) if causal else torch.cat([x, pad], 1)
    mask = torch.ones_like(ids)
    if causal:
        mask[:, :2] = 0
    else:
        mask[:, -2:] = 0
    real = slice(2, None) if causal else slice(0, x.shape[1])
    try:
        rp = pyattr.relevance(model, {"input_ids": ids, "attention_mask": mask}, target=tid, generic=True)
    except (ValueError, TypeError, NotImplementedError, pyattr.RelevanceRuleUnsupportedError) as e:
        if not _from_pyattr(e):
            raise
        if "is not finite" in str(e) and _not_finite(model, ids, mask):  # pyattr refused the model's own NaN
            return {"status": "transformers", "detail": "the model's own output with an attention mask (the padded "
                    "row) is not finite in float64 (pyattr refuses it)"}
        if not (causal and "pad on the right" in str(e)):
            return _refusal(e, model, "padded: ")
        # left padding refused as it should be (the forward takes no position ids): the
        # row padded on the right instead, as such a model is batched
        causal = False
        if note is not None:
            note["padding"] = "; left padding refused (no position_ids), padded on the right"
        ids, mask, real = torch.cat([x, pad], 1), torch.ones(1, x.shape[1] + 2, dtype=x.dtype), slice(0, x.shape[1])
        mask[:, -2:] = 0
        if _not_finite(model, ids, mask):
            return {"status": "transformers", "detail": "the model's own output with an attention mask (the padded "
                    "row) is not finite in float64 (pyattr refuses it)"}
        rp = pyattr.relevance(model, {"input_ids": ids, "attention_mask": mask}, target=tid, generic=True)
    # the model's own pad noise: its output padded (positions counted along the mask where
    # its forward names position_ids) against alone
    kw = {"input_ids": ids, "attention_mask": mask}
    named = "position_ids" in inspect.signature(model.forward).parameters
    if named:
        kw["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone, padded = _logits(model(x, **_plain_kwargs(model))), _logits(model(**kw, **_plain_kwargs(model)))
    if alone.dim() == 3:
        padded = padded[:, real]
    noise = float((alone - padded).abs().max()) / (float(alone.abs().max()) + 1e-300) if alone.shape == padded.shape \
        else float("inf")
    a, b = r.relevance[0].double(), rp.relevance[0, real].double()
    big = float(a.abs().max()) + 1e-300
    rest = rp.relevance[0].double().clone()
    rest[real] = 0
    err = max(float((a - b).abs().max()), float(rest.abs().max())) / big
    t0, t1 = float(r.target.reshape(-1)[0]), float(rp.target.reshape(-1)[0])
    terr = abs(t0 - t1) / (abs(t0) + 1e-300)
    if max(err, terr) <= max(1e-5, min(1e-3, 1e3 * noise)):
        return None
    if not torch.isfinite(padded).all():
        return {"status": "transformers", "detail": "the model's own output with an attention mask (the padded row) "
                "is not finite in float64"}
    if not noise <= 1e-6:  # NaN included
        if causal and not named:  # positions shift under left padding: a refusal was due
            return {"status": "wrong", "detail": "left-padded row differs from the row alone and "
                    f"{type(model).__name__}.forward takes no position_ids (its own output shifts too), not refused"}
        return {"status": "transformers", "detail": f"the model's own output padded differs from alone by {noise:.2g} "
                "of its largest (positions counted along the mask where its forward takes position_ids)"}
    return {"status": "wrong", "detail": f"padded row differs from the row alone by {err:.3g} of the largest "
                                         f"relevance (target by {terr:.2g}; the model's own pad noise {noise:.1g})"}


def _not_finite(model, ids: torch.Tensor, mask: torch.Tensor) -> bool:
    """The model's own output on the padded row (a plain forward) is not finite."""
    with torch.no_grad():
        return not bool(torch.isfinite(_logits(model(input_ids=ids, attention_mask=mask, **_plain_kwargs(model)))).all())


def _decoder(model) -> bool:
    """Left padding for decoders: a causal-LM class, a config marked ``is_decoder``, or a
    model type transformers maps to a causal LM but not to a masked LM (Llama's
    sequence-classification head)."""
    from transformers.models.auto import modeling_auto as M

    mt = getattr(model.config, "model_type", None)
    return (bool(getattr(model.config, "is_decoder", False)) or "CausalLM" in type(model).__name__
            or (mt in M.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mt not in M.MODEL_FOR_MASKED_LM_MAPPING_NAMES))


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:240]


def _where(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    return f"{tb[-1].filename.rsplit('/', 2)[-2]}/{tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else "?"


class _Timeout(BaseException):  # not caught by the handlers of a build or a call
    pass


def run(only: Optional[List[str]] = None, timeout_s: int = TIMEOUT_S, build_s: int = BUILD_S) -> List[Dict[str, str]]:
    """Every entry classified: a build over ``build_s`` seconds is ``not buildable``, pyattr's
    calls over ``timeout_s`` seconds a ``crash``."""
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []

    def alarm(signum, frame):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, alarm)
    try:
        for mapping, mt, cls in entries(only):
            t = time.perf_counter()
            phase = {"rearm": lambda: signal.alarm(timeout_s)}
            signal.alarm(build_s)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    row = classify(mapping, mt, cls, phase)
            except _Timeout:
                slow = phase.get("now") == "build"
                row = dict(mapping=mapping, model_type=mt, cls=cls, status="not buildable" if slow else "crash",
                           detail=f"too slow: build over {build_s} s" if slow else
                           f"{phase.get('step', '')}pyattr's calls over {timeout_s} s")
            finally:
                signal.alarm(0)
            row["seconds"] = round(time.perf_counter() - t, 2)
            rows.append(row)
    finally:
        signal.signal(signal.SIGALRM, old)
    return rows


def counts(rows) -> Dict[str, int]:
    return {s: sum(r["status"] == s for r in rows) for s in STATUSES}


LEGEND = [
    "Each entry of transformers' causal-LM, masked-LM, sequence-classification and image-classification "
    "mappings is built tiny (hidden 32, 2 layers, vocabulary 128, 32×32 images, 64×64 for models in stages; `pyattr/bench/zoo_build.py`) in "
    "float64 with seed 0 and weight matrices at standard deviation 0.2, its biases zeroed, and "
    "`pyattr.relevance(model, x, generic=True)` is checked four ways: rules off against plain autograd "
    "gradient × input at the same entry, Σ relevance against the target with the rules on, the user's own "
    "scope (`use_relevance_rules(model, generic=True)` around their forward and backward, the parameters "
    "left trainable as loaded) against it, and a padded row (left for decoders, right for encoders) against "
    "the row alone (a decoder whose forward takes no position ids must refuse left padding; it is then padded on "
    "the right). Encoder–decoder entries are checked the same four ways at both entries (the source and the target "
    "prefix; the decoder's inputs the model's own shift of the source; `pyattr/bench/zoo_seq2seq.py`). Mixture-of-"
    "experts models run transformers' `batched_mm` experts (its `grouped_mm` has no float64 kernel).",
    "",
    "- **right**: all four hold (1e-5 relative rules off, 1e-6 conservation, 1e-5 the user's scope, 1e-5 "
    "padded).",
    "- **declared**: a mapped architecture whose documented loss its coverage names.",
    "- **refused**: pyattr raised ValueError, TypeError, NotImplementedError or "
    "RelevanceRuleUnsupportedError from its own code, naming a module, class or role "
    "(`rules off:` / `trainable scope:` / `padded:` say which call).",
    "- **unclear refusal**: the same, naming none of them.",
    "- **wrong**: a number came back that fails a check, with no error (the detail says whether a warning was "
    "emitted).",
    "- **crash**: any other exception, one raised inside transformers or torch, or pyattr's calls over the time "
    "limit.",
    "- **transformers**: the model itself is not pad-invariant, or not finite, in float64 (plain forwards).",
    "- **not buildable**: the tiny config or model cannot be made or run here (extra "
    "libraries, sizes the config does not take, float32-only kernels, a build over the time limit).",
]


def markdown(rows, seconds: float) -> str:
    import transformers

    c = counts(rows)
    lines = ["# The zoo: `generic=True` over transformers' mappings", "",
             "Regenerate this page with `python -m pyattr.bench.zoo --markdown docs/reference/zoo.md` "
             "(`--only TYPE,...` for some model types, `--json OUT` for the rows); the slow test "
             "`tests/test_zoo.py` runs the same and allows no entry to be wrong, a crash or an unclear refusal. "
             f"This run: transformers {transformers.__version__}, torch {torch.__version__}; {len(rows)} entries "
             f"in {seconds:.0f} s on one CPU thread.", "", *LEGEND, "",
             "| status | entries |", "|---|---:|"]
    lines += [f"| {s} | {n} |" for s, n in c.items()]
    lines += ["", "| mapping | model type | class | status | detail |", "|---|---|---|---|---|"]
    for r in rows:
        detail = r["detail"].replace("|", "\\|")
        lines.append(f"| {r['mapping']} | {r['model_type']} | {r['cls']} | {r['status']} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pyattr.bench.zoo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--markdown", help="write the table as Markdown here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t = time.perf_counter()
    rows = run(args.only.split(",") if args.only else None)
    secs = time.perf_counter() - t
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": counts(rows), "seconds": round(secs, 1), "rows": rows}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, secs))
    print(json.dumps(counts(rows)), f"{len(rows)} entries, {secs:.0f} s")
    for r in rows:
        if r["status"] in BAD:
            print(f"{r['status']}: {r['mapping']} {r['model_type']} {r['cls']}: {r['detail']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
