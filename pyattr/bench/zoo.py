"""The zoo: ``generic=True`` over every model class in transformers' own mappings.

For each (mapping, model type) of transformers' causal-LM, masked-LM, sequence-
classification and image-classification mappings, a tiny random model is built in float64
(seed 0, eval mode; 2-D weights scaled ×3 so that nonlinearities leave their linear regime,
biases zeroed so that LRP conservation is exact when every nonlinearity has its rule) and
``pyattr.relevance(model, x, generic=True)`` is classified:

- ``right``: Σ relevance = target (relative 1e-6), and a padded row equals the row alone;
- ``refused``: pyattr raised (ValueError, TypeError, NotImplementedError or
  RelevanceRuleUnsupportedError) from its own code, naming what it cannot do;
- ``wrong``: a number came back that fails a check, with no error;
- ``crash``: any other exception during pyattr's call;
- ``declared``: a mapped architecture whose loss its rule map documents (coverage names
  it: a classification head's ``torch.tanh``, Gemma 2's logit soft-capping);
- ``transformers``: the model itself is not pad-invariant, or gives a non-finite output;
- ``not buildable``: the tiny config or model cannot be made or run here (extra
  libraries, encoder–decoder, a config that needs more than sizes, float64 kernels).

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
STATUSES = ("right", "declared", "refused", "wrong", "crash", "transformers", "not buildable")
SIZES = dict(hidden_size=32, d_model=32, n_embd=32, embed_dim=32, dim=32, num_hidden_layers=2, n_layer=2,
             num_layers=2, n_layers=2, num_attention_heads=4, n_head=4, n_heads=4, num_heads=4,
             num_key_value_heads=2, intermediate_size=64, ffn_dim=64, n_inner=64, hidden_dim=64, d_ff=64,
             vocab_size=128, max_position_embeddings=128, n_positions=128, head_dim=8, image_size=32, patch_size=8)
SEQ, TIMEOUT_S = 7, 30


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


def _shrink(cfg, depth: int = 0) -> None:
    for k, v in SIZES.items():
        if isinstance(getattr(cfg, k, None), int) and not isinstance(getattr(cfg, k), bool):
            setattr(cfg, k, v)
    lt = getattr(cfg, "layer_types", None)
    if isinstance(lt, (list, tuple)) and lt:
        n = next((getattr(cfg, k) for k in ("num_hidden_layers", "num_layers", "n_layer") if hasattr(cfg, k)), 2)
        cfg.layer_types = list(lt)[:n]
    for k in ("text_config", "vision_config"):
        sub = getattr(cfg, k, None)
        if sub is not None and depth < 2 and hasattr(sub, "to_dict"):
            _shrink(sub, depth + 1)


def build(mapping: str, model_type: str, cls_name: str):
    """The tiny float64 model (see the module docstring)."""
    import transformers as T
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]()
    if getattr(cfg, "is_encoder_decoder", False):
        raise NotImplementedError("encoder-decoder")
    _shrink(cfg)
    if mapping == "sequence_classification" or mapping == "image_classification":
        cfg.num_labels = 3
    if getattr(cfg, "pad_token_id", None) is None and hasattr(cfg, "vocab_size"):
        cfg.pad_token_id = 0
    torch.manual_seed(0)
    model = getattr(T, cls_name)(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "bias" in n.rsplit(".", 1)[-1]:
                p.zero_()
            elif p.dim() >= 2:
                p.mul_(3.0)
    return model


def _inputs(model, mapping: str, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    if mapping == "image_classification" or getattr(model, "main_input_name", "input_ids") == "pixel_values":
        cfg = getattr(model.config, "vision_config", None) or model.config
        size = getattr(cfg, "image_size", 32)
        size = (size, size) if isinstance(size, int) else tuple(size)
        return torch.randn(1, getattr(cfg, "num_channels", 3), *size, generator=g, dtype=torch.float64)
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None) or model.config.vocab_size
    return torch.randint(5, vocab - 5, (1, SEQ), generator=g)


def _from_pyattr(e: BaseException) -> bool:
    tb = traceback.extract_tb(e.__traceback__)
    return bool(tb) and "/pyattr/" in tb[-1].filename.replace("\\", "/")


def classify(mapping: str, model_type: str, cls_name: str) -> Dict[str, str]:
    """One entry's status and a one-line detail."""
    import pyattr
    import pyattr.architectures as A

    row = dict(mapping=mapping, model_type=model_type, cls=cls_name)
    try:
        model = build(mapping, model_type, cls_name)
        x = _inputs(model, mapping)
    except Exception as e:  # noqa: BLE001 - anything that stops the build
        return {**row, "status": "not buildable", "detail": f"{type(e).__name__}: {_short(e)}"}
    pixels = x.is_floating_point()
    try:
        with torch.no_grad():
            out = model(x)
        y = out[0] if isinstance(out, (tuple, dict)) or hasattr(out, "to_tuple") else out
        if not torch.isfinite(y).all():
            return {**row, "status": "transformers", "detail": "non-finite output in float64"}
    except Exception as e:  # noqa: BLE001
        # a tiny config the model does not run with here (float64 grouped matmuls, sizes)
        return {**row, "status": "not buildable", "detail": f"plain forward fails: {type(e).__name__}: {_short(e)}"}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r = pyattr.relevance(model, x, generic=True)
            pad = None if pixels else _padded(pyattr, model, x, r)
    except (ValueError, TypeError, NotImplementedError, pyattr.RelevanceRuleUnsupportedError) as e:
        if _from_pyattr(e):
            return {**row, "status": "refused", "detail": f"{type(e).__name__}: {_short(e)}"}
        return {**row, "status": "crash", "detail": f"{type(e).__name__} in {_where(e)}: {_short(e)}"}
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "crash", "detail": f"{type(e).__name__} in {_where(e)}: {_short(e)}"}
    warned = [str(w.message)[:80] for w in caught if issubclass(w.category, pyattr.PartialRelevanceWarning)]
    t, d = float(r.target.abs().max()), float(r.conservation_delta.abs().max())
    if not d <= 1e-6 * max(t, 1e-12):
        if A.model_type(model) in A.ARCHITECTURES and any("not conserved" in why for why in r.coverage.reasons.values()):
            return {**row, "status": "declared", "detail": f"conservation |delta| {d:.3g} for |target| {t:.3g}; "
                    + next(f"{p}: {w}" for p, w in r.coverage.reasons.items() if "not conserved" in w)[:160]}
        return {**row, "status": "wrong", "detail": f"conservation |delta| {d:.3g} for |target| {t:.3g}"
                + (f"; warned: {warned[0]}" if warned else "")}
    if pad is not None:
        return {**row, **pad}
    return {**row, "status": "right", "detail": f"|delta|/|target| {d / max(t, 1e-300):.1e}"}


def _padded(pyattr, model, x, r) -> Optional[Dict[str, str]]:
    """A row padded (left for decoders, right for encoders) against the row alone: None
    when equal, else the status (``transformers`` when the model itself is not pad-invariant)."""
    causal = bool(getattr(model.config, "is_decoder", False)) or "CausalLM" in type(model).__name__
    pad = torch.full((1, 2), int(getattr(model.config, "pad_token_id", 0) or 0), dtype=x.dtype)
    ids = torch.cat([pad, x], 1) if causal else torch.cat([x, pad], 1)
    mask = torch.ones_like(ids)
    if causal:
        mask[:, :2] = 0
    else:
        mask[:, -2:] = 0
    real = slice(2, None) if causal else slice(0, x.shape[1])
    try:
        rp = pyattr.relevance(model, {"input_ids": ids, "attention_mask": mask}, target=r.target_ids, generic=True)
    except (ValueError, TypeError, NotImplementedError, pyattr.RelevanceRuleUnsupportedError) as e:
        if _from_pyattr(e):
            return {"status": "refused", "detail": f"padded: {type(e).__name__}: {_short(e)}"}
        raise
    a, b = r.token_relevance[0].double(), rp.token_relevance[0, real].double()
    if torch.allclose(a, b, rtol=1e-5, atol=1e-7 * float(a.abs().max() + 1e-30)):
        return None
    # pyattr's padded row differs: is the model itself pad-invariant (positions counted
    # along the mask where its forward takes them)?
    import inspect

    kw = {"input_ids": ids, "attention_mask": mask}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kw["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone, padded = model(x)[0], model(**kw)[0]
    if alone.dim() == 3:
        padded = padded[:, real]
    if alone.shape != padded.shape or not torch.allclose(alone, padded, rtol=1e-6, atol=1e-9):
        return {"status": "transformers", "detail": "the model's own output is not pad-invariant (or not finite) "
                                                    "with attention_mask and position_ids"}
    return {"status": "wrong", "detail": f"padded row differs from the row alone by {float((a - b).abs().max()):.3g} "
                                         f"(max |relevance| {float(a.abs().max()):.3g})"}


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:240]


def _where(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    return f"{tb[-1].filename.rsplit('/', 2)[-2]}/{tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else "?"


class _Timeout(Exception):
    pass


def run(only: Optional[List[str]] = None, timeout_s: int = TIMEOUT_S) -> List[Dict[str, str]]:
    """Every entry classified (an entry over ``timeout_s`` seconds: ``not buildable``)."""
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []

    def alarm(signum, frame):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, alarm)
    try:
        for mapping, mt, cls in entries(only):
            t = time.perf_counter()
            signal.alarm(timeout_s)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    row = classify(mapping, mt, cls)
            except _Timeout:
                row = dict(mapping=mapping, model_type=mt, cls=cls, status="not buildable",
                           detail=f"over {timeout_s} s")
            finally:
                signal.alarm(0)
            row["seconds"] = round(time.perf_counter() - t, 2)
            rows.append(row)
    finally:
        signal.signal(signal.SIGALRM, old)
    return rows


def counts(rows) -> Dict[str, int]:
    return {s: sum(r["status"] == s for r in rows) for s in STATUSES}


def markdown(rows, seconds: float) -> str:
    import transformers

    c = counts(rows)
    lines = ["# The zoo: `generic=True` over transformers' mappings", "",
             "Generated by `python -m pyattr.bench.zoo --markdown docs/reference/zoo.md` (see "
             "`pyattr/bench/zoo.py` for what each status means). transformers "
             f"{transformers.__version__}, torch {torch.__version__}; {len(rows)} entries in {seconds:.0f} s.", "",
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
        if r["status"] in ("wrong", "crash"):
            print(f"{r['status']}: {r['mapping']} {r['model_type']} {r['cls']}: {r['detail']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
