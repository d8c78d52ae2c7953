"""``pyattr patch``: RelP / AtP / activation patching of one clean and corrupt pair; with
``--edges``, every edge of the graph and the circuits of the strongest."""

from __future__ import annotations

import json
from pathlib import Path

from pyattr.cli._common import UsageError, check_model, check_output_path, checkpoint_kind, fail

NODE_TYPES = ("residual", "attention", "heads", "mlp", "neurons")
NODES_DEFAULT = "residual,attention,heads,mlp"


def _nodes(text: str):
    nodes = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in nodes if n not in NODE_TYPES]
    if bad or not nodes:
        raise UsageError(f"--nodes: unknown node type(s) {bad or [text]}; expected some of {list(NODE_TYPES)}")
    return list(dict.fromkeys(nodes))


def _write(args, png, html, doc, report, drawing: str) -> int:
    """Write ``--png`` (``png(path)``), ``--html`` (``html()``) and ``--json`` (``doc()``), then
    print the report and where each file went."""
    try:
        if args.png:
            png(args.png)
        if args.html:
            Path(args.html).write_text(html(), encoding="utf-8")
        if args.json:
            Path(args.json).write_text(json.dumps(doc(), indent=1))
    except OSError as e:
        return fail("patch", f"cannot write the output: {e.strerror or e}")
    except ImportError:
        return fail("patch", "--png needs matplotlib (pip install matplotlib)")
    report()
    for flag, path in ((drawing, args.png), ("page", args.html), ("JSON", args.json)):
        if path:
            print(f"{flag} written to {path}")
    return 0


def _run_edges(args) -> int:
    from pyattr.apps.explain import ExplainError
    from pyattr.apps.patch_edges import EDGE_CLI_METHODS, print_edges, run_edges

    try:
        if args.method not in EDGE_CLI_METHODS:
            raise UsageError(f"--edges: --method must be one of {list(EDGE_CLI_METHODS)}, got {args.method!r}")
        for flag, value in (("--pair", args.pair), ("--generic", args.generic or None)):
            if value is not None:
                raise UsageError(f"--edges scores a causal LM's edges; {flag} does not apply")
        if args.nodes != NODES_DEFAULT:
            raise UsageError("--edges scores every edge of the graph; --nodes does not apply")
    except UsageError as e:
        return fail("patch", str(e))
    try:
        rep = run_edges(args.clean, args.corrupt, args.model, args.target, args.method)
    except (ExplainError, ValueError) as e:
        return fail("patch", str(e))
    return _write(args, lambda path: rep.result.plot().savefig(path, dpi=110), rep.html, rep.to_json,
                  lambda: print_edges(rep, top=args.top), "graph")


def run(args) -> int:
    try:
        for flag, path in (("--html", args.html), ("--png", args.png), ("--json", args.json)):
            if path is not None:
                check_output_path(flag, path)
        if args.model is not None and args.pair is not None:
            raise UsageError("--pair works with the sentence-embedding model only (drop --model)")
        if args.model is None and args.target is not None and not args.edges:
            raise UsageError("--target needs --model (a causal LM directory)")
        if (args.clean is None) != (args.corrupt is None):
            raise UsageError("--clean and --corrupt go together (without both, the built-in pair is used)")
        if args.top < 1:
            raise UsageError(f"--top must be >= 1, got {args.top}")
        if args.sample < 1:
            raise UsageError(f"--sample must be >= 1, got {args.sample}")
        if not args.edges:
            nodes = _nodes(args.nodes)
        check_model(args.model)
        kind = checkpoint_kind(args.model) if args.model is not None else None
        if kind is not None and kind[0] == "encoder-decoder":  # read from config.json, before any weights load
            raise UsageError(f"--model {args.model} is an encoder–decoder ({kind[1]}): pyattr patch runs causal LMs; "
                             "patch it from Python with pyattr.patching.attribution_patching(model, clean, corrupt, "
                             "metric, decoder_input_ids=...)")
    except UsageError as e:
        return fail("patch", str(e))
    if args.edges:
        return _run_edges(args)

    from pyattr.apps.explain import ExplainError
    from pyattr.integration.errors import RelevanceRuleUnsupportedError
    from pyattr.apps.patch_report import METHODS, print_terminal, run_patch, to_html, to_png

    methods = METHODS if args.method == "all" else (args.method,)
    try:
        rep = run_patch(args.clean, args.corrupt, args.pair, args.model,
                        args.target, nodes, methods, args.sample, generic=args.generic)
    except ExplainError as e:
        return fail("patch", str(e))
    except (ValueError, RelevanceRuleUnsupportedError) as e:  # an unmapped model, or a role it lacks
        return fail("patch", str(e).replace("generic=True", "--generic"))
    return _write(args, lambda path: Path(path).write_bytes(to_png(rep)), lambda: to_html(rep), rep.to_json,
                  lambda: print_terminal(rep, top=args.top), "heatmaps")
