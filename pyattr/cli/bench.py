"""``pyattr bench``: kernel microbenchmarks, or the end-to-end relevance run (``--e2e``)."""

from __future__ import annotations

import json
from pathlib import Path

from pyattr.cli._common import UsageError, check_output_path, fail

DTYPES = ("float16", "bfloat16", "float32", "float64")
#: CPU runs whose module ``pyattr.bench.<name>`` has ``run_all(quick)`` and
#: ``markdown(rows, contention)`` and whose JSON kind is the name
SIMPLE_RUNS = ("faithfulness", "generation", "long_context", "scale", "estimators", "citations", "circuits",
               "frameworks")


def parse_shapes(text: str):
    try:
        shapes = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        shapes = []
    if not shapes or len(shapes) > 2 or any(len(s) != 2 or min(s) <= 0 for s in shapes):
        raise UsageError(f"--shapes: expected ROWSxHIDDEN[,ROWSxHIDDEN] (elementwise, norm), got {text!r}")
    return {"elementwise": shapes[0], "norm": shapes[-1]}


def _check_args(args):
    """Everything checked before torch loads; returns (dtype names, shapes or None)."""
    names = [n.strip() for n in args.dtypes.split(",")]
    bad = [n for n in names if n not in DTYPES]
    if bad:
        raise UsageError(f"--dtypes: expected some of {list(DTYPES)}, got {bad[0]!r}")
    scale_bad = [n for n in names if n not in ("bfloat16", "float32")]
    if args.scale and scale_bad:  # the 1B rows exist in these two (pyattr.bench.scale.DTYPES)
        raise UsageError(f"--dtypes: --scale runs bfloat16 and float32, got {scale_bad[0]!r}")
    if args.repeats is not None and args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.layers is not None and args.layers < 1:
        raise UsageError(f"--layers must be >= 1, got {args.layers}")
    if getattr(args, "seq", None) is not None and args.seq < 1:
        raise UsageError(f"--seq must be >= 1, got {args.seq}")
    if args.targets < 0:
        raise UsageError(f"--targets must be >= 0, got {args.targets}")
    if args.chunk < 1:
        raise UsageError(f"--chunk must be >= 1, got {args.chunk}")
    if sum(map(bool, (args.e2e, args.conservation, args.ig_memory, args.patching, args.dataset,
                      args.faithfulness, args.estimators, args.generation, args.long_context, args.scale,
                      args.citations, args.circuits, args.frameworks))) > 1:
        raise UsageError("--e2e, --conservation, --ig-memory, --patching, --dataset, --faithfulness, "
                         "--estimators, --generation, --long-context, --scale, --citations, --circuits and "
                         "--frameworks are separate runs; pass one")
    if getattr(args, "rounds", None) is not None:
        if not (args.generation or args.long_context or args.scale or args.frameworks):
            raise UsageError("--rounds sets the interleaved rounds of --generation, --long-context, --scale and "
                             "--frameworks; pass one")
        if args.rounds < 1:
            raise UsageError(f"--rounds must be >= 1, got {args.rounds}")
    contexts = getattr(args, "context", None)
    if contexts is not None:
        if not (args.generation or args.scale):
            raise UsageError("--context sets the context lengths of --generation's long-context table and of "
                             "--scale; pass one")
        try:
            args.context = [int(v) for v in contexts.split(",")]
        except ValueError:
            args.context = []
        if not args.context or min(args.context) < 1:
            raise UsageError(f"--context: expected positive token counts separated by commas, got {contexts!r}")
    lxt = getattr(args, "lxt_python", None)
    if lxt is not None:
        import os
        import shutil

        if not (args.long_context or args.scale):
            raise UsageError("--lxt-python adds LXT to --long-context and --scale; pass one")
        if shutil.which(lxt) is None or not os.access(shutil.which(lxt), os.X_OK):
            raise UsageError(f"--lxt-python: expected the path of a Python interpreter, got {lxt!r} (not an "
                             "executable file)")
    allocator = getattr(args, "allocator", None)
    if allocator is not None and not args.scale:
        raise UsageError("--allocator applies to --scale; pass it")
    if allocator == "returned" and lxt is not None:
        raise UsageError("--allocator returned measures pyattr's processes only; run --lxt-python without it")
    if args.png is not None and not args.faithfulness:
        raise UsageError("--png is the perturbation-curve plot of --faithfulness; pass --faithfulness")
    for flag, path in (("--json", args.json), ("--markdown", args.markdown), ("--png", args.png)):
        if path is not None:
            check_output_path(flag, path)
    shapes = parse_shapes(args.shapes) if args.shapes else None
    return names, shapes


def _ops(text):
    from pyattr.bench.micro import OPS

    ops = [o.strip() for o in text.split(",")] if text else list(OPS)
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise UsageError(f"--ops: unknown op(s) {bad}; expected some of {list(OPS)}")
    return ops


def _device(text: str):
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(f"--device: expected cpu or cuda, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: expected cpu or cuda, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible to torch")
    return device


def run(args) -> int:
    try:
        names, shapes = _check_args(args)
        device = _device(args.device)
        ops = _ops(args.ops)
    except UsageError as e:
        return fail("bench", str(e))

    import torch

    import pyattr.apps.contention as contention
    import pyattr.bench.e2e as e2e
    import pyattr.bench.micro as micro
    import pyattr.bench.report as report

    dtypes = [getattr(torch, n) for n in names]
    simple = next((k for k in SIMPLE_RUNS if getattr(args, k)), None)
    if simple is not None:
        import importlib

        if device.type != "cpu":
            return fail("bench", f"--{simple.replace('_', '-')} runs on the CPU only (--device cpu)")
        module = importlib.import_module(f"pyattr.bench.{simple}")
        monitor = contention.start()
        try:
            extra = {"lxt_python": args.lxt_python} if getattr(args, "lxt_python", None) else {}
            if getattr(args, "context", None):
                extra["contexts"] = args.context
            if getattr(args, "rounds", None):
                extra["rounds"] = args.rounds
            if simple == "scale":
                extra["dtypes"] = names
                extra["allocator"] = getattr(args, "allocator", None) or "glibc"
            rows = module.run_all(quick=args.quick, **extra)
        except e2e.E2EError as e:  # a measurement process failed
            return fail("bench", str(e), status=1)
        cond = monitor.stop()
        kind = "generation-long" if simple == "generation" and extra.get("contexts") else simple.replace("_", "-")
        doc = report.document(kind, device, rows, contention=cond)
        report.validate(doc)
        table = module.markdown(rows, cond)
        if args.png:
            module.plot(rows, args.png)
    elif args.patching:
        import pyattr.bench.patching as patching

        if device.type != "cpu":
            return fail("bench", "--patching runs on the CPU only (--device cpu)")
        monitor = contention.start()
        rows = patching.run_all(quick=args.quick)
        cond = monitor.stop()
        why = patching.breakdown(limit=6 if args.quick else 0)
        doc = report.document("patching", device, rows, contention=cond, breakdown=why)
        report.validate(doc)
        table = patching.markdown(rows, cond) + "\n" + patching.breakdown_markdown(why)
    elif args.conservation:
        import pyattr.bench.conservation as conservation

        monitor = contention.start()
        rows = conservation.measure(device.type, dtypes, args.layers or 8)
        reduced = [d for d in dtypes if d != torch.float32]
        prompts = conservation.measure_prompts(device.type, reduced, n=10 if args.quick else 100,
                                               layers=args.layers or 8) if reduced else []
        cond = monitor.stop()
        summ = conservation.summary(rows)
        doc = report.document("conservation", device, rows, contention=cond, summary=summ, prompts=prompts)
        report.validate(doc)
        table = conservation.markdown(rows, summ)  # errors, not timings: no CPU conditions
        if prompts:
            table += "\n" + conservation.prompts_markdown(prompts)
    elif args.dataset:
        import os

        import pyattr.bench.dataset as dataset

        monitor = contention.start()
        try:
            rows, model = dataset.run_all(device.type, args.quick, torch.get_num_threads())
        except RuntimeError as e:
            return fail("bench", str(e), status=1)
        cond = monitor.stop()
        doc = report.document("dataset", device, rows, contention=cond, model=model, cpus=os.cpu_count())
        report.validate(doc)
        table = dataset.markdown(rows, model, cond)
    elif args.ig_memory:
        import pyattr.bench.ig_memory as ig_memory

        monitor = contention.start()
        try:
            rows = ig_memory.run_all(device.type, dtypes[0], args.chunk)
        except e2e.E2EError as e:
            return fail("bench", str(e), status=1)
        cond = monitor.stop()
        doc = report.document("ig-memory", device, rows, contention=cond)
        report.validate(doc)
        table = ig_memory.markdown(rows, cond)
    elif args.e2e:
        monitor = contention.start()
        try:
            rows = e2e.run_all(device.type, dtypes, args.repeats or 3, args.layers, k=args.targets, seq=args.seq,
                               compiled=args.compile)
        except e2e.E2EError as e:
            return fail("bench", str(e), status=1)
        cond = monitor.stop()
        doc = report.document("e2e", device, rows, contention=cond, ratios=e2e.ratios(rows))
        report.validate(doc)
        table = e2e.markdown(rows, doc["ratios"], cond)
    else:
        shapes = dict(shapes or (micro.QUICK_SHAPES if args.quick else micro.DEFAULT_SHAPES))
        shapes["attention"] = micro.QUICK_ATTENTION_SHAPES if args.quick else micro.ATTENTION_SHAPES
        repeats = args.repeats or (5 if args.quick else 15)
        allocator = micro.keep_freed_memory() if device.type == "cpu" else None
        monitor = contention.start()
        copy_bw, rows = micro.run_suite(
            device, ops, dtypes, shapes, warmup=2 if args.quick else 3, repeats=repeats,
            activations=("silu", "gelu_tanh") if args.quick else micro.ACTIVATIONS,
        )
        cond = monitor.stop()
        doc = report.document("micro", device, micro.rows_as_dicts(rows), contention=cond, copy_bandwidth_gbps=copy_bw,
                              allocator=allocator)
        report.validate(doc)
        title = f"pyattr microbenchmarks on {device.type} ({doc['machine']['processor']}, torch {torch.__version__})"
        table = report.markdown(doc["rows"], copy_bw, title, cond, allocator)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(table)
    print(table)
    return 0
