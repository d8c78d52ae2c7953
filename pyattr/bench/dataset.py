"""The dataset run measured: ``pyattr run`` over a file of prompts on a random Llama.

Configurations, each run as its own ``pyattr run`` command (a fresh process, so that its
peak resident set size is its own):

* ``1 process``                 the plain command;
* ``1 process, checkpointing``  with ``--gradient-checkpointing`` (blocks recomputed in
  the backward);
* ``2 processes``               ``torchrun --nproc-per-node 2 -m pyattr run`` (gloo on the
  CPU), each rank with half the threads.

Reported per configuration: prompts/s and tokens/s over the relevance run (the slowest
rank's time from its first batch to its last shard; model loading excluded), and the
peak RSS of the largest process (``wait4``'s ``ru_maxrss``: the launcher or its largest
worker). The model is built with random weights in the run's dtype, saved with the
bundled MiniLM tokenizer; prompts are random whole words of that vocabulary, one token
each, with lengths drawn uniformly from the size's range.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

SIZES = {
    # the issue's ~1B model: for a GPU (on the 2-core CPU one prompt takes minutes in bfloat16)
    "full": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                 num_key_value_heads=16, prompts=64, lo=128, hi=1024, dtype="bfloat16"),
    # the same ~1B model on a CPU: float32, because a CPU without native bfloat16 (AVX2)
    # runs the bfloat16 matmul backward 60-300x slower than float32; few, short prompts
    "cpu": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                num_key_value_heads=16, prompts=8, lo=128, hi=256, dtype="float32"),
    # a small model for a quick look (minutes on 2 cores)
    "quick": dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                  num_key_value_heads=8, prompts=32, lo=64, hi=256, dtype="float32"),
}
CONFIGS = ("1 process", "1 process, checkpointing", "2 processes")
_RANK_LINE = re.compile(r"(?:rank (\d+): )?(\d+) prompts stored .* ([0-9.]+) s -> ")  # no rank: one process


def prepare(workdir: Path, size: Dict, seed: int = 0):
    """(model directory, prompts file, parameter count) for ``size`` under ``workdir``."""
    import random

    from transformers import LlamaConfig, LlamaForCausalLM

    from pyattr.apps.explain import bundled_model_dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bundled_model_dir()), local_files_only=True)
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=max(2048, size["hi"] + 8),
                      **{k: size[k] for k in keys})
    torch.manual_seed(seed)
    dtype = getattr(torch, size["dtype"])
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: no float32 copy of a 1B model
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model_dir = workdir / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    del model
    # whole lowercase words: one token each, so a prompt of n words is n + 1 tokens: [CLS] and
    # the words (a run drops the [SEP] the tokenizer appends: it explains the prompt's next token)
    words = [w for w in tok.get_vocab() if w.isalpha() and w.islower() and len(w) > 2]
    rng = random.Random(seed)
    data = workdir / "prompts.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for i in range(size["prompts"]):
            n = rng.randint(size["lo"], size["hi"]) - 1
            f.write(json.dumps({"id": f"p{i}", "text": " ".join(rng.choice(words) for _ in range(n))}) + "\n")
    return model_dir, data, params


def _spawn(cmd: List[str], env: Dict[str, str]):
    """Run ``cmd``; (exit status, stdout + stderr, peak RSS in bytes of it or its largest
    reaped descendant)."""
    with tempfile.TemporaryFile() as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        return p.returncode, log.read().decode(errors="replace"), usage.ru_maxrss * 1024


def run_config(config: str, model_dir: Path, data: Path, out: Path, size: Dict, device: str, threads: int) -> Dict:
    args = ["run", "--model", str(model_dir), "--data", str(data), "--out", str(out),
            "--dtype", size["dtype"], "--device", device, "--max-tokens-per-batch", str(max(4096, size["hi"]))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    if config == "2 processes":
        env["OMP_NUM_THREADS"] = str(max(1, threads // 2))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "pyattr", *args]
    else:
        cmd = [sys.executable, "-m", "pyattr", *args]
        if config.endswith("checkpointing"):
            cmd.append("--gradient-checkpointing")
    t0 = time.perf_counter()
    code, log, rss = _spawn(cmd, env)
    wall = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"{config}: `{' '.join(cmd)}` exited with {code}:\n{log[-2000:]}")
    ranks = {int(m.group(1) or 0): (int(m.group(2)), float(m.group(3))) for m in _RANK_LINE.finditer(log)}
    import pandas as pd

    df = pd.read_parquet(out)
    if df["error"].notna().any():
        raise RuntimeError(f"{config}: {int(df['error'].notna().sum())} prompts failed: {df['error'].dropna().iloc[0]}")
    tokens = int(df["tokens"].map(len).sum())
    seconds = max(s for _, s in ranks.values())
    return {
        "config": config,
        "device": device,
        "dtype": size["dtype"],
        "processes": len(ranks),
        "prompts": len(df),
        "tokens": tokens,
        "seconds": seconds,
        "wall_seconds": wall,
        "prompts_per_s": len(df) / seconds,
        "tokens_per_s": tokens / seconds,
        "peak_rss_bytes": rss,
    }


def run_all(device: str, quick: bool, threads: int, progress=None) -> tuple:
    """(rows, model description) for every configuration."""
    size = SIZES["quick" if quick else "full" if device == "cuda" else "cpu"]
    work = Path(tempfile.mkdtemp(prefix="pyattr-dataset-bench-"))
    try:
        model_dir, data, params = prepare(work, size)
        rows = []
        # one GPU per rank: two ranks need two GPUs
        configs = [c for c in CONFIGS if not (c == "2 processes" and device == "cuda" and torch.cuda.device_count() < 2)]
        for i, config in enumerate(configs):
            if progress:
                progress(f"dataset run: {config}")
            rows.append(run_config(config, model_dir, data, work / f"out-{i}", size, device, threads))
        model = {k: size[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "dtype")}
        model.update(parameters=params, prompts=size["prompts"], prompt_tokens=[size["lo"], size["hi"]])
        return rows, model
    finally:
        shutil.rmtree(work, ignore_errors=True)


def markdown(rows: List[Dict], model: Dict, contention=None) -> str:
    from pyattr.bench.report import conditions

    lines = [conditions(contention).rstrip("\n"), ""] if contention is not None else []
    lines.append(f"Random Llama, {model['parameters'] / 1e6:.0f}M parameters ({model['num_hidden_layers']} layers, "
                 f"hidden {model['hidden_size']}, intermediate {model['intermediate_size']}), {model['dtype']}, "
                 f"{model['prompts']} prompts of {model['prompt_tokens'][0]}-{model['prompt_tokens'][1]} tokens.")
    lines += ["", "| configuration | processes | prompts/s | tokens/s | seconds | peak RSS (GB) |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['processes']} | {r['prompts_per_s']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['seconds']:.1f} | {r['peak_rss_bytes'] / 1e9:.2f} |")
    return "\n".join(lines) + "\n"
