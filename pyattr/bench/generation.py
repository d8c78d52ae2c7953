"""``pyattr bench --generation``: explaining every generated token, three ways, on the e2e
Llama (8 layers, hidden 1024, float32, CPU), a 128-token prompt and 16 / 64 / 256
teacher-forced tokens (the same random ids for all three):

(a) ``loop``: the per-step loop of :func:`pyattr.relevance` (one forward and one backward
    per step over its prefix), what a user writes without the batched path;
(b) ``inseq``: inseq's ``input_x_gradient`` (attributed function the logit), which also
    runs one forward and one backward per step;
(c) ``batched``: :func:`pyattr.generation_relevance` (k steps per backward, default k).

Each measurement runs in its own process, so its peak RSS is its own; ``peak_extra_bytes``
is the peak minus the RSS after the model was built. The three run in rounds whose order
rotates (:mod:`pyattr.bench.rounds`); times are medians with their range over the rounds,
and each ratio is taken per round (its range is the spread a second run falls in).
256 steps (``--steps 256`` of a measurement process) are left out of the default run: inseq
alone takes about 11 minutes there, too long to repeat.

With ``contexts`` (``pyattr bench --generation --context 16384``) the table is instead
16 tokens after a long random context, on the long-context table's Llama (4 layers,
hidden 512, sdpa; :mod:`pyattr.bench.long_context`), (a) against (c) only: inseq runs one
forward and one backward per step as (a) does.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List, Optional

import torch

from pyattr.bench.e2e import peak_rss_bytes, rss_bytes

VARIANTS = ("loop", "inseq", "batched")
STEPS = (16, 64)
PROMPT = 128
#: generated tokens explained after a long context (the issue's 16)
LONG_STEPS = 16


def _word_tokenizer(vocab: int):
    """A word-level tokenizer whose words are ``t0 … t{vocab-1}`` (inseq reads text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tk = Tokenizer(models.WordLevel(vocab=words, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t0", bos_token="t1",
                                   eos_token="t2")


def _model(layers: Optional[int], hidden: Optional[int]):
    from pyattr.bench.e2e import build_model

    if hidden is None:
        return build_model("cpu", torch.float32, layers)[0]
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers or 2,
                      num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def measure(variant: str, steps: int, prompt: int = PROMPT, layers: Optional[int] = None,
            hidden: Optional[int] = None, batch_targets: Optional[int] = None, long: bool = False) -> Dict:
    import pyattr

    if long:
        from pyattr.bench.long_context import _model as long_model

        model = long_model("sdpa", hidden or 512, layers or 4)
    else:
        model = _model(layers, hidden)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, prompt), generator=g)
    cont = torch.randint(3, vocab, (1, steps), generator=g)
    # warm-up: one short call of the same path, so that one-time costs (the rule scope's
    # first install, the extension's load, inseq's hooks) are not timed
    if variant in ("batched", "loop"):
        pyattr.generation_relevance(model, ids[:, :4], continuation=cont[:, :2])
    base = rss_bytes()
    t0 = time.perf_counter()
    k = None
    if variant == "batched":
        r = pyattr.generation_relevance(model, ids, continuation=cont, batch_targets=batch_targets)
        k = r.batch_targets
    elif variant == "loop":
        from pyattr.methods.generation import loop_reference

        loop_reference(model, torch.cat([ids, cont], 1), None, prompt)
    elif variant == "inseq":
        import inseq

        tok = _word_tokenizer(vocab)
        im = inseq.load_model(model, "input_x_gradient", tokenizer=tok)
        text = " ".join(f"t{i}" for i in ids[0].tolist())
        full = text + " " + " ".join(f"t{i}" for i in cont[0].tolist())
        im.attribute(" ".join(text.split()[:4]), generated_texts=" ".join(full.split()[:6]), attributed_fn="logit",
                     show_progress=False, skip_special_tokens=False)
        t0 = time.perf_counter()
        im.attribute(text, generated_texts=full, attributed_fn="logit", show_progress=False,
                     skip_special_tokens=False)
    else:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    return {"variant": variant, "steps": steps, "prompt": prompt, "seconds": seconds, "peak_rss_bytes": peak,
            "peak_extra_bytes": max(0, peak - base), "batch_targets": k,
            "model": f"Llama {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, float32"}


def run_long(contexts, quick: bool = False, rounds: int = None, steps: int = LONG_STEPS) -> List[Dict]:
    """(a) and (c) explaining ``steps`` tokens after each of ``contexts`` tokens (the
    long-context Llama; ``quick``: hidden 128, 2 layers), in interleaved rounds."""
    from pyattr.bench.rounds import ROUNDS, interleaved_grid

    extra = ["--steps", str(steps), "--long"] + (["--layers", "2", "--hidden", "128"] if quick else [])
    rows = interleaved_grid("pyattr.bench.generation", "--prompt", contexts, ("loop", "batched"), extra,
                            "generation after a long context, tokens:", pairs=[("batched", "loop")],
                            rounds=rounds or (2 if quick else ROUNDS), max_rounds=rounds or (2 if quick else ROUNDS))
    for r in rows:
        r["time_over_loop"] = 1.0 if r["variant"] == "loop" else r["over_loop"]["median"]
    return rows


def run_all(quick: bool = False, rounds: int = None, contexts=None) -> List[Dict]:
    from pyattr.bench.rounds import MAX_ROUNDS, ROUNDS, interleaved_grid

    if contexts:
        return run_long(contexts, quick, rounds)
    steps = (4, 8) if quick else STEPS
    extra = ["--layers", "2", "--hidden", "128", "--prompt", "16"] if quick else []
    pairs = [("batched", "loop"), ("batched", "inseq"), ("loop", "inseq"), ("inseq", "loop")]
    rows = interleaved_grid("pyattr.bench.generation", "--steps", steps, VARIANTS, extra, "generation, steps:",
                            pairs=pairs, rounds=rounds or (2 if quick else ROUNDS),
                            max_rounds=rounds or (2 if quick else MAX_ROUNDS - 2))  # a round takes about 5 minutes
    for r in rows:
        r["time_over_loop"] = 1.0 if r["variant"] == "loop" else r["over_loop"]["median"]
        r["time_over_inseq"] = 1.0 if r["variant"] == "inseq" else r["over_inseq"]["median"]
    return rows


def markdown(rows: List[Dict], contention=None) -> str:
    from pyattr.bench.report import with_conditions
    from pyattr.bench.rounds import ratio_text, versions_line

    lines = [f"Explaining every generated token: {rows[0]['model']}, {rows[0]['prompt']}-token prompt, CPU; time "
             f"median (range) over {min(r['rounds'] for r in rows)} interleaved rounds, ratios per round", "",
             "| generated | method | time (s) | / loop (a) | / inseq (b) | peak RSS (MB) | peak over model (MB) | k |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    names = {"loop": "(a) loop of pyattr.relevance", "inseq": "(b) inseq input_x_gradient",
             "batched": "(c) generation_relevance"}
    if "over_inseq" not in next(r for r in rows if r["variant"] == "batched"):
        return _markdown_long(rows, names, contention)
    for r in rows:
        lines.append(f"| {r['steps']} | {names[r['variant']]} | {r['seconds']:.2f} ({r['seconds_min']:.2f}–"
                     f"{r['seconds_max']:.2f}) | {ratio_text(r.get('over_loop')) or '1'} | "
                     f"{ratio_text(r.get('over_inseq')) or '1'} | {r['peak_rss_bytes'] / 2**20:.0f} | "
                     f"{r['peak_extra_bytes'] / 2**20:.0f} | {r['batch_targets'] or ''} |")
    return with_conditions(lines + ["", versions_line("inseq")], contention)


def _markdown_long(rows: List[Dict], names: Dict[str, str], contention=None) -> str:
    from pyattr.bench.report import with_conditions
    from pyattr.bench.rounds import ratio_text, versions_line

    lines = [f"Explaining {rows[0]['steps']} generated tokens after a long context: {rows[0]['model']}, CPU; time "
             f"median (range) over {min(r['rounds'] for r in rows)} interleaved rounds, ratio per round; k: the "
             "largest chunk generation_relevance ran", "",
             "| context | method | time (s) | / loop (a) | peak RSS (MB) | peak over model (MB) | k |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['prompt']} | {names[r['variant']]} | {r['seconds']:.1f} ({r['seconds_min']:.1f}–"
                     f"{r['seconds_max']:.1f}) | {ratio_text(r.get('over_loop')) or '1'} | "
                     f"{r['peak_rss_bytes'] / 2**20:.0f} | {r['peak_extra_bytes'] / 2**20:.0f} | "
                     f"{r['batch_targets'] or ''} |")
    return with_conditions(lines + ["", versions_line()], contention)


def _main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--prompt", type=int, default=PROMPT)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--long", action="store_true", help="the long-context table's Llama")
    a = p.parse_args(argv)
    print(json.dumps(measure(a.variant, a.steps, a.prompt, a.layers, a.hidden, long=a.long)))


if __name__ == "__main__":
    _main()
