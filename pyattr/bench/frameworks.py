"""``pyattr bench --frameworks``: the rules under a framework's own backward against that
framework's plain backward, on a 4-layer, hidden-512 Llama (8 heads, float32, CPU, 512 and
2048 tokens; ``--quick``: 2 layers, hidden 128, 128 tokens; parameters frozen: the gradient of
the activations only, as relevance needs), one target logit at the last position, the
gradient read at the first block's input (gradient × activation):

- ``bridge_plain``: a TransformerLens ``TransformerBridge`` forward and ``backward()``, no
  rules (the floor a TransformerLens user pays for a gradient);
- ``bridge_rules``: the same under ``use_relevance_rules(bridge)`` (the default rules);
- ``bridge_same``: the LN-, Identity- and AH-rule alone under the scope, and
  ``bridge_hooks``: the same rules written with TransformerLens' own hooks, as a
  TransformerLens user writes them without pyattr (``hook_scale`` and ``hook_pattern``
  detached, the Identity-rule as a forward hook on each activation; the Half-rule has no
  hook point in a gated MLP the bridge delegates to Hugging Face);
- ``nnsight_plain`` / ``nnsight_rules``: an nnsight ``trace`` reading ``.grad`` at the
  embeddings, without and with the scope.

Each measurement runs in its own process, in rounds whose order rotates
(:mod:`pyattr.bench.rounds`); times are medians with their range, ratios per round. The
frameworks are test dependencies of pyattr, not requirements: a run without them says so.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import torch

from pyattr.bench.e2e import peak_rss_bytes, rss_bytes

VARIANTS = ("bridge_plain", "bridge_rules", "bridge_same", "bridge_hooks", "nnsight_plain", "nnsight_rules")
PAIRS = (("bridge_rules", "bridge_plain"), ("bridge_same", "bridge_plain"), ("bridge_same", "bridge_hooks"),
         ("bridge_hooks", "bridge_plain"), ("nnsight_rules", "nnsight_plain"))
NAMES = {"bridge_plain": "TransformerBridge, plain backward",
         "bridge_rules": "TransformerBridge, pyattr's default rules",
         "bridge_same": "TransformerBridge, pyattr: LN-, Identity-, AH-rule",
         "bridge_hooks": "TransformerBridge, LN-, Identity-, AH-rule as TransformerLens hooks",
         "nnsight_plain": "nnsight trace, plain .grad", "nnsight_rules": "nnsight trace, pyattr's rules"}
#: activation modules the hand-written Identity-rule hooks (what Hugging Face decoders use)
ACTS = ("SiLUActivation", "SiLU", "NewGELUActivation", "GELUActivation", "GELU", "GELUTanh", "PytorchGELUTanh",
        "FastGELUActivation")


def rules_as_tl_hooks(bridge) -> list:
    """The LN-, Identity- and AH-rule written as a TransformerLens user writes them, with
    no pyattr: every ``hook_scale`` and ``hook_pattern`` detached, each activation's output
    as ``x · (act(x)/x)`` with the ratio detached. Returns the activation hooks' handles
    (``bridge.reset_hooks()`` removes the TL ones)."""
    for name, hp in bridge.hook_dict.items():
        if name.endswith(("hook_scale", "hook_pattern")):
            hp.add_hook(lambda t, hook: t.detach())
    return [mod.register_forward_hook(lambda m, i, o: i[0] * (o / i[0]).detach())
            for mod in bridge.original_model.modules() if type(mod).__name__ in ACTS]


def _model(hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():  # the gradient of the activations only, as relevance needs
        p.requires_grad_(False)
    return model


def _bridge_step(bridge, ids, target, variant):
    import pyattr

    kept = {}

    def keep(t, hook):
        t.requires_grad_(True)  # frozen parameters: the user's hook asks for the gradient here
        kept["x"] = t

    bridge.hook_dict["blocks.0.hook_resid_pre"].add_hook(keep)
    handles = rules_as_tl_hooks(bridge) if variant == "bridge_hooks" else []
    try:
        if variant in ("bridge_rules", "bridge_same"):
            rules = None if variant == "bridge_rules" else \
                pyattr.RelevanceRules(normalization=True, attention=True, activation=True)
            with pyattr.use_relevance_rules(bridge, rules):
                bridge(ids)[0, -1, target].backward()
        else:
            bridge(ids)[0, -1, target].backward()
        return (kept["x"] * kept["x"].grad).sum(-1)  # a leaf: its .grad is kept
    finally:
        bridge.reset_hooks()
        for h in handles:
            h.remove()


def _nnsight_step(lm, ids, target, variant):
    import contextlib

    import pyattr

    scope = pyattr.use_relevance_rules(lm) if variant == "nnsight_rules" else contextlib.nullcontext()
    with scope:
        with lm.trace(ids):
            emb = lm.model.embed_tokens.output.requires_grad_(True).save()
            with lm.output.logits[0, -1, target].backward():
                grad = emb.grad.save()
    return (emb * grad).sum(-1)


def measure(variant: str, seq: int, hidden: int = 512, layers: int = 4) -> Dict:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    import warnings

    model = _model(hidden, layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (1, seq), generator=g)
    target = int(torch.randint(3, 32000, (1,), generator=g))
    if variant.startswith("bridge"):
        from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner = build_bridge_from_module(model, type(model).__name__, hf_config=model.config)
        step = _bridge_step
    else:
        from nnsight import NNsight

        runner, step = NNsight(model), _nnsight_step
    # a warm-up on a short input, every variant alike: one-time costs are not timed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(runner, ids[:, :16], target, variant)
        model.zero_grad(set_to_none=True)
        base = rss_bytes()
        t0 = time.perf_counter()
        step(runner, ids, target, variant)
        seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    return {"variant": variant, "seq": seq, "seconds": seconds, "peak_rss_bytes": peak,
            "peak_extra_bytes": max(0, peak - base),
            "model": f"Llama {layers} layers, hidden {hidden}, {hidden // 64} heads, float32",
            "threads": torch.get_num_threads()}


def run_all(quick: bool = False, rounds: int = None) -> List[Dict]:
    """Every variant in interleaved rounds (``rounds``: exactly that many; default 3, more
    while a ratio's range is wide)."""
    from pyattr.bench.rounds import MAX_ROUNDS, ROUNDS, interleaved_grid

    missing = [name for name in ("transformer_lens", "nnsight") if _absent(name)]
    if missing:
        from pyattr.bench.e2e import E2EError

        raise E2EError(f"--frameworks measures TransformerLens and nnsight; {', '.join(missing)} not installed "
                       "(the dev extra has both)")
    seqs = (128,) if quick else (512, 2048)
    extra = ["--hidden", "128", "--layers", "2"] if quick else []
    return interleaved_grid("pyattr.bench.frameworks", "--seq", seqs, VARIANTS, extra, "frameworks, tokens:",
                            pairs=PAIRS, rounds=rounds or (2 if quick else ROUNDS),
                            max_rounds=rounds or (2 if quick else MAX_ROUNDS))


def _absent(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def markdown(rows: List[Dict], contention=None) -> str:
    from pyattr.bench.report import with_conditions
    from pyattr.bench.rounds import ratio_text, versions_line

    lines = [f"The rules under a framework's own backward: {rows[0]['model']}, CPU; time median (range) over "
             f"{min(r['rounds'] for r in rows)} rounds, ratios per round", "",
             "| tokens | framework and rules | time (s) | / its plain backward | / the rules as TL hooks | "
             "peak over model (MB) |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        plain = r.get("over_bridge_plain") or r.get("over_nnsight_plain")
        hooks = r.get("over_bridge_hooks") if r["variant"] == "bridge_same" else None
        lines.append(f"| {r['seq']} | {NAMES[r['variant']]} | {r['seconds']:.2f} ({r['seconds_min']:.2f}–{r['seconds_max']:.2f}) | "
                     f"{ratio_text(plain) or '1'} | {ratio_text(hooks) or ''} | "
                     f"{r['peak_extra_bytes'] / 2**20:.0f} |")
    return with_conditions(lines + ["", versions_line()], contention)


def _main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args(argv)
    print(json.dumps(measure(a.variant, a.seq, a.hidden, a.layers)))


if __name__ == "__main__":
    _main()
