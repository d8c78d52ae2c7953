"""``pyattr run``: relevance over a dataset of prompts into Parquet shards (torchrun-aware)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from pyattr.cli._common import UsageError, fail

_RULE_FIELDS = ("normalization", "activation", "multiplicative_gate", "attention")


def parse_rules(text: str):
    """``all`` (default), ``attnlrp`` (all, AttnLRP attention), ``none``, or a comma list of
    normalization, activation, multiplicative_gate, attention (the AH-rule)."""
    from pyattr.integration.config import RelevanceRules

    if text == "all":
        return RelevanceRules.all()
    if text == "attnlrp":
        return RelevanceRules.all("attnlrp")
    if text == "none":
        return RelevanceRules()
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in _RULE_FIELDS]
    if bad or not names:
        raise UsageError(f"--rules: expected all, attnlrp, none or a comma list of {', '.join(_RULE_FIELDS)}; got {text!r}")
    return RelevanceRules(**{n: True for n in names})


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
    except UsageError as e:
        return fail("run", str(e))

    import torch

    from pyattr.dataset_run import RunError, run as run_dataset
    from pyattr.explain import ExplainError, _load

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            return fail("run", "--device cuda: no CUDA device is visible to torch")
        tok, model = _load(Path(args.model), causal=True)
        dtype = getattr(torch, args.dtype)
        device = torch.device(args.device)
        if device.type == "cuda" and world > 1:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        model = model.to(device=device, dtype=dtype)
        summary = run_dataset(
            model, args.data, out, tokenizer=tok, text_field=args.text_field,
            target=None if args.target == "top1" else args.target, rules=rules,
            max_tokens_per_batch=args.max_tokens_per_batch, shard_size=args.shard_size,
            command=" ".join(shlex.quote(a) for a in ["pyattr", *sys.argv[1:]]),
        )
    except (ExplainError, RunError) as e:
        return fail("run", str(e))
    except KeyboardInterrupt:
        print("pyattr run: interrupted; the shards written so far are kept, rerun the same command to resume",
              file=sys.stderr)
        return 130
    finally:
        if world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    rank = int(os.environ.get("RANK", "0"))
    print(f"rank {rank}: {summary.stored} prompts stored ({summary.failed} with an error), "
          f"{summary.skipped} already stored, {len(summary.shards)} shards, {summary.seconds:.1f} s -> {out}")
    return 0
