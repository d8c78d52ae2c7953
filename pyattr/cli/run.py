"""``pyattr run``: relevance over a dataset of prompts into Parquet shards (torchrun-aware)."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

from pyattr.cli._common import UsageError, check_model, checkpoint_kind, fail

_RULE_FIELDS = ("normalization", "activation", "multiplicative_gate", "attention", "routing")


def parse_rules(text: str):
    """``all`` (default), ``attnlrp`` (all, AttnLRP attention), ``ln`` (the LN-rule alone),
    ``none`` — the shorthands the Python methods' ``rules=`` takes — or a comma list of
    normalization, activation, multiplicative_gate, attention (the AH-rule), routing
    (frozen mixture-of-experts routing)."""
    from pyattr.config import RelevanceRules
    from pyattr.config import RULE_SHORTHANDS, rules_from

    if text.strip().lower() in RULE_SHORTHANDS:
        return rules_from(text)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in _RULE_FIELDS]
    if bad or not names:
        raise UsageError(f"--rules: expected all, attnlrp, ln, none or a comma list of {', '.join(_RULE_FIELDS)}; got {text!r}")
    return RelevanceRules(**{n: True for n in names})


_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def parse_placement(device_map, max_memory, offload_folder):
    """accelerate's loading arguments from ``--device-map``, ``--max-memory`` and
    ``--offload-folder`` (None without ``--device-map``)."""
    if device_map is None:
        if max_memory is not None or offload_folder is not None:
            raise UsageError("--max-memory and --offload-folder need --device-map")
        return None
    if device_map in _MAPS:
        dm = device_map
    else:
        path = Path(device_map)
        if not path.is_file():
            raise UsageError(
                f"--device-map: expected {', '.join(_MAPS)} or a JSON file mapping module names to "
                f"devices (0, \"cpu\", \"disk\"); {device_map!r} is neither"
            )
        try:
            dm = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"--device-map: cannot read {device_map!r} as JSON: {e}") from None
        if not isinstance(dm, dict) or not dm or not all(isinstance(k, str) and _device_ok(v) for k, v in dm.items()):
            bad = next((v for v in dm.values() if not _device_ok(v)), None) if isinstance(dm, dict) else None
            raise UsageError(f"--device-map: {device_map!r} must hold a JSON object of module name -> device "
                             "(an integer GPU index, \"cpu\", \"disk\" or \"cuda:N\")"
                             + (f"; {bad!r} is not one" if bad is not None else ""))
    place = {"device_map": dm}
    if max_memory is not None:
        limits = {}
        for part in max_memory.split(","):
            key, sep, size = part.partition("=")
            key, size = key.strip(), size.strip()
            dev = int(key) if key.isdigit() else key
            if not sep or not key or not size or not _device_ok(dev):
                raise UsageError(f"--max-memory: expected DEVICE=SIZE[,DEVICE=SIZE...] (e.g. 0=70GiB,cpu=120GiB), got {max_memory!r}")
            if dev in limits:
                raise UsageError(f"--max-memory: device {key!r} is given twice")
            limits[dev] = int(size) if size.isdigit() else size
        place["max_memory"] = limits
    if offload_folder is not None:
        if not offload_folder.strip():
            raise UsageError("--offload-folder needs a directory")
        if Path(offload_folder).exists() and not Path(offload_folder).is_dir():
            raise UsageError(f"--offload-folder: {offload_folder!r} exists and is not a directory")
        place["offload_folder"] = offload_folder
    return place


_DEVICE = re.compile(r"(cuda|xpu|npu|mps|mlu|hpu)(:\d+)?")


def _device_ok(v) -> bool:
    """What accelerate places modules on: a GPU index, "cpu", "disk" or a named device
    ("cuda:1"); never "meta", which holds no weights."""
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return v >= 0
    return isinstance(v, str) and (v in ("cpu", "disk") or bool(_DEVICE.fullmatch(v)))


def gpu_indices(placement) -> list:
    """The GPUs a placement names (map values and --max-memory keys)."""
    dm = placement["device_map"]
    named = list(dm.values()) if isinstance(dm, dict) else []
    named += list(placement.get("max_memory", {}))
    return [d for d in named if isinstance(d, int) or (isinstance(d, str) and d.startswith("cuda"))]


def run(args) -> int:
    try:
        if args.max_tokens_per_batch < 1:
            raise UsageError(f"--max-tokens-per-batch must be >= 1, got {args.max_tokens_per_batch}")
        if args.shard_size < 1:
            raise UsageError(f"--shard-size must be >= 1, got {args.shard_size}")
        if not Path(args.data).is_file():
            raise UsageError(f"--data: {args.data!r} is not a file")
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out: {args.out!r} exists and is not a directory")
        rules = parse_rules(args.rules)
        placement = parse_placement(args.device_map, args.max_memory, args.offload_folder)
        if placement is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UsageError(
                "--device-map places one model over every visible device, and under torchrun each "
                "rank would do so over the same devices: run one process with --device-map, or "
                "give each rank its own device with --device cuda"
            )
        check_model(args.model)
        kind = checkpoint_kind(args.model)
        if kind is not None and kind[0] == "encoder-decoder":  # read from config.json, before any weights load
            raise UsageError(f"--model {args.model} is an encoder–decoder ({kind[1]}): pyattr run explains causal "
                             "LMs' prompts; explain it from Python with pyattr.relevance(model, source, "
                             "decoder_input_ids=...) or pyattr.generation_relevance")
    except UsageError as e:
        return fail("run", str(e))

    args.device = args.device or "cpu"
    import torch

    from pyattr.apps.run import RunError, run as run_dataset
    from pyattr.apps.explain import ExplainError, _load

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            return fail("run", "--device cuda: no CUDA device is visible to torch")
        if placement is not None and gpu_indices(placement) and not torch.cuda.is_available():
            return fail("run", f"--device-map / --max-memory name GPU {gpu_indices(placement)[0]!r}, "
                               "but no CUDA device is visible to torch")
        dtype = getattr(torch, args.dtype)
        tok, model = _load(args.model, causal=True, dtype=dtype, placement=placement)
        if args.gradient_checkpointing:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ExplainError(f"--gradient-checkpointing: {type(model).__name__} does not support it")
            kw = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # its name since transformers 5
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        if placement is None:
            device = torch.device(args.device)
            if device.type == "cuda" and world > 1:
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            model = model.to(device=device)
        summary = run_dataset(
            model, args.data, out, tokenizer=tok, text_field=args.text_field,
            target=None if args.target == "top1" else args.target, rules=rules,
            max_tokens_per_batch=args.max_tokens_per_batch, shard_size=args.shard_size,
            command=" ".join(shlex.quote(a) for a in ["pyattr", *sys.argv[1:]]), generic=args.generic,
            generate=args.generate,
        )
    except (ExplainError, RunError) as e:
        return fail("run", str(e).replace("Pass generic=True", "Pass --generic"))
    except KeyboardInterrupt:
        print("pyattr run: interrupted; the shards written so far are kept, rerun the same command to resume",
              file=sys.stderr)
        return 130
    finally:
        if world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    who = f"rank {int(os.environ.get('RANK', '0'))}: " if world > 1 else ""  # one line per process under torchrun
    shards = len(summary.shards)
    print(f"{who}{summary.stored} prompts stored ({summary.failed} with an error), {summary.skipped} already "
          f"stored, {shards} shard{'' if shards == 1 else 's'}, {summary.seconds:.1f} s -> {out}")
    return 0
