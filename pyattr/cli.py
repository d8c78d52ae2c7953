"""Command line: ``pyattr explain`` (relevance heatmaps)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List, Optional


def _rules(args):
    from pyattr.integration.config import RelevanceRules

    attention = {"frozen": "frozen", "attnlrp": "attnlrp", "off": False}[args.attention]
    return RelevanceRules(
        normalization=not args.no_norm_rule,
        activation=not args.no_activation_rule,
        multiplicative_gate=not args.no_gate_rule,
        attention=attention,
    )


def _explain(args) -> int:
    import contextlib

    from pyattr import backend as use_backend
    from pyattr.explain import DEFAULT_PAIR, DEFAULT_TEXT, ExplainError, explain_causal, explain_pair
    from pyattr.integration.errors import RelevanceRuleConflictError, RelevanceRuleUnsupportedError

    if args.html is not None and not args.html.strip():
        print("pyattr explain: error: --html needs a file path", file=sys.stderr)
        return 2
    # --backend wins; without it PYATTR_BACKEND (or auto) applies, as in the Python API
    scope = use_backend(args.backend) if args.backend else contextlib.nullcontext()
    try:
        with scope:
            if args.model is not None:
                if args.pair is not None:
                    raise ExplainError("--pair works with the sentence-embedding model only (drop --model)")
                expl = explain_causal(
                    Path(args.model),
                    args.text if args.text is not None else DEFAULT_TEXT,
                    args.target,
                    _rules(args),
                    generic=args.generic,
                )
            else:
                if args.target is not None:
                    raise ExplainError("--target needs --model (a causal LM directory)")
                a = args.text if args.text is not None else DEFAULT_PAIR[0]
                b = args.pair if args.pair is not None else DEFAULT_PAIR[1]
                expl = explain_pair(a, b, rules=_rules(args))
    except ExplainError as e:
        print(f"pyattr explain: error: {e}", file=sys.stderr)
        return 2
    except (RelevanceRuleUnsupportedError, RelevanceRuleConflictError) as e:
        msg = " ".join(str(e).split()).replace("Pass generic=True", "Pass --generic")
        print(f"pyattr explain: error: {msg}", file=sys.stderr)
        return 2
    if args.html:
        from pyattr.render import to_html

        try:
            Path(args.html).write_text(to_html(expl), encoding="utf-8")
        except OSError as e:
            print(f"pyattr explain: error: cannot write {args.html!r}: {e.strerror}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(expl.to_json(), indent=2))
    else:
        from pyattr.render import print_terminal

        print_terminal(expl)
        if args.html:
            print(f"heatmap written to {args.html}")
    return 0


def _parse_shapes(text: str):
    try:
        shapes = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        shapes = []
    if not shapes or len(shapes) > 2 or any(len(s) != 2 or min(s) <= 0 for s in shapes):
        raise ValueError(f"--shapes: expected ROWSxHIDDEN[,ROWSxHIDDEN] (elementwise, norm), got {text!r}")
    return {"elementwise": shapes[0], "norm": shapes[-1]}


def _bench(args) -> int:
    import torch

    from pyattr.bench import e2e, micro, report

    try:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device: expected cpu or cuda, got {args.device!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible to torch")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device: expected cpu or cuda, got {args.device!r}")
        dtypes = []
        allowed = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
        for name in args.dtypes.split(","):
            if name.strip() not in allowed:
                raise ValueError(f"--dtypes: expected some of {list(allowed)}, got {name!r}")
            dtypes.append(allowed[name.strip()])
        if args.repeats is not None and args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        if args.layers is not None and args.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {args.layers}")
        for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
            if path is None:
                continue
            if not path.strip():
                raise ValueError(f"{flag} needs a file path")
            parent = Path(path).resolve().parent
            if not parent.is_dir() or not os.access(parent, os.W_OK) or Path(path).is_dir():
                raise ValueError(f"{flag}: cannot write {path!r}")
        ops = [o.strip() for o in args.ops.split(",")] if args.ops else list(micro.OPS)
        bad = [o for o in ops if o not in micro.OPS]
        if bad:
            raise ValueError(f"--ops: unknown op(s) {bad}; expected some of {list(micro.OPS)}")
        shapes = _parse_shapes(args.shapes) if args.shapes else (micro.QUICK_SHAPES if args.quick else micro.DEFAULT_SHAPES)
    except ValueError as e:
        print(f"pyattr bench: error: {e}", file=sys.stderr)
        return 2
    if args.e2e:
        try:
            rows = e2e.run_all(device.type, dtypes, args.repeats or 3, args.layers)
        except e2e.E2EError as e:
            print(f"pyattr bench: error: {e}", file=sys.stderr)
            return 1
        doc = report.document("e2e", device, rows, ratios=e2e.ratios(rows))
        table = e2e.markdown(rows, doc["ratios"])
    else:
        repeats = args.repeats or (5 if args.quick else 15)
        copy_bw, rows = micro.run_suite(
            device, ops, dtypes, shapes, warmup=2 if args.quick else 3, repeats=repeats,
            activations=("silu", "gelu_tanh") if args.quick else micro.ACTIVATIONS,
        )
        doc = report.document("micro", device, micro.rows_as_dicts(rows), copy_bandwidth_gbps=copy_bw)
        report.validate(doc)
        title = f"pyattr microbenchmarks on {device.type} ({doc['machine']['processor']}, torch {torch.__version__})"
        table = report.markdown(doc["rows"], copy_bw, title)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(table)
    print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pyattr", description="Relevance attribution with fused LRP-rule kernels.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser(
        "explain",
        help="token relevance heatmap",
        description=(
            "Explain a model output token by token. With no arguments: the bundled all-MiniLM-L6-v2 "
            "and the cosine similarity of a built-in sentence pair."
        ),
    )
    e.add_argument("--text", help="sentence to explain (first of the pair, or the causal-LM prompt)")
    e.add_argument("--pair", help="second sentence (sentence-embedding model)")
    e.add_argument("--model", help="local Hugging Face causal-LM directory; explains the next-token logit")
    e.add_argument("--target", help="target token for --model (default: the top-1 prediction)")
    e.add_argument("--html", metavar="PATH", help="also write a self-contained HTML heatmap")
    e.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the heatmap")
    e.add_argument("--attention", choices=["frozen", "attnlrp", "off"], default="frozen", help="attention rule")
    e.add_argument(
        "--generic",
        action="store_true",
        help="--model of an architecture without a rule map: mount rules by module class",
    )
    e.add_argument("--no-norm-rule", action="store_true", help="switch off the LN-rule")
    e.add_argument("--no-activation-rule", action="store_true", help="switch off the Identity-rule")
    e.add_argument("--no-gate-rule", action="store_true", help="switch off the Half-rule on gates")
    e.add_argument(
        "--backend",
        default=None,
        choices=["auto", "torch", "cpp", "cuda", "triton"],
        help="force a backend (default: PYATTR_BACKEND, else auto)",
    )
    e.set_defaults(func=_explain)

    b = sub.add_parser("bench", help="kernel microbenchmarks and the end-to-end relevance benchmark")
    b.add_argument("--quick", action="store_true", help="small shapes and few repeats (under a minute on 2 CPU cores)")
    b.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    b.add_argument("--ops", help="comma-separated: identity,half,gated,layer_norm,rms_norm (default: all)")
    b.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes (default: float32,bfloat16)")
    b.add_argument("--shapes", help="ROWSxHIDDEN for elementwise ops[,ROWSxHIDDEN for norms]")
    b.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement")
    b.add_argument("--json", metavar="PATH", help="write the results as JSON")
    b.add_argument("--markdown", metavar="PATH", help="write the results as a markdown table")
    b.add_argument("--e2e", action="store_true", help="end-to-end relevance run on a random Llama instead")
    b.add_argument("--layers", type=int, default=None, help="e2e: override the number of layers")
    b.set_defaults(func=_bench)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # e.g. `pyattr explain --json | head`
        sys.stderr.close()
        return 0
    except Exception as e:
        from pyattr.backends import BackendUnavailableError

        if isinstance(e, BackendUnavailableError) or (
            isinstance(e, ValueError) and "PYATTR_BACKEND" in str(e)
        ):
            print(f"pyattr {args.command}: error: {e}", file=sys.stderr)
            return 2
        if os.environ.get("PYATTR_DEBUG") == "1":
            raise
        msg = " ".join(str(e).split())[:400]
        print(
            f"pyattr {args.command}: error: {type(e).__name__}: {msg} (PYATTR_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
