"""Command line: parse and dispatch. One module per command (``explain``, ``bench``);
each imports torch, transformers and the rest of pyattr inside the command, so that
``pyattr --help`` and ``pyattr --version`` answer without loading them."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, NoReturn, Optional

from pyattr._version import __version__
from pyattr.cli._common import model_dir


#: Where the documentation is: every ``--help`` ends with it.
DOCS = ("documentation: `pyattr docs` lists the pages shipped with pyattr (a tutorial per task), "
        "`pyattr docs PAGE` prints one\n"
        "every command and option: pyattr docs reference/cli")


class OneLineParser(argparse.ArgumentParser):
    """argparse with the errors every pyattr command gives: one line on stderr
    (``pyattr explain: error: ...``), exit status 2, no usage block. The epilog (examples
    and the documentation link) is printed as written, not re-wrapped."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")

    def format_help(self) -> str:
        epilog, self.epilog = self.epilog, None
        try:
            text = super().format_help()
        finally:
            self.epilog = epilog
        return text + (f"\n{epilog.rstrip()}\n" if epilog else "")


def _epilog(*examples) -> str:
    """``examples:`` (pairs of a command line and what it does) and the documentation link."""
    lines = ["examples:"]
    for cmd, what in examples:
        lines += [f"  {cmd}", f"      {what}"]
    return "\n".join(lines + ["", DOCS])


def _generate_model_flag(parser) -> None:
    parser.add_argument("--model", type=model_dir,
                        help="a causal LM or an encoder–decoder (its source is --text, each generated token "
                             "explained over the source and the decoder's inputs before it): a local Hugging Face "
                             "directory, a Hugging Face Hub id, 'translation' (the shipped toy translation model), or "
                             "'induction' (the default: the shipped toy induction decoder)")


def _command(name: str):
    """The ``run(args)`` of ``pyattr.cli.<name>``, imported when the command runs (so that
    ``--help`` / ``--version`` load no torch)."""

    def call(args) -> int:
        import importlib

        return importlib.import_module(f"pyattr.cli.{name}").run(args)

    return call


def _rule_flags(p) -> None:
    """The rule switches and the backend choice, shared by explain and generate."""
    p.add_argument("--attention", choices=["frozen", "attnlrp", "off"], default="frozen", help="attention rule")
    p.add_argument("--no-norm-rule", action="store_true", help="switch off the LN-rule")
    p.add_argument("--no-activation-rule", action="store_true", help="switch off the Identity-rule")
    p.add_argument("--no-gate-rule", action="store_true", help="switch off the Half-rule on gates")
    p.add_argument("--no-routing-rule", action="store_true",
                   help="mixture-of-experts models: let gradient flow through the routing weights")
    p.add_argument(
        "--backend",
        default=None,
        choices=["auto", "torch", "cpp", "cuda", "triton"],
        help="force a backend (default: PYATTR_BACKEND, else auto)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="pyattr", description="Relevance attribution with fused LRP-rule kernels.",
        epilog=_epilog(
            ("pyattr explain", "token relevance of the bundled MiniLM for a built-in sentence pair's similarity"),
            ("pyattr explain --model induction --text 'sun cat red tree sun'",
             "the next-token logit of the bundled toy decoder, token by token"),
            ("pyattr explain --model gpt2 --text 'The capital of France is' --html gpt2.html",
             "a Hugging Face Hub model (downloaded once), with an HTML heatmap"),
            ("pyattr generate --png gen.png", "every generated token of the toy decoder over its context"),
            ("pyattr patch --model induction --clean 'sun cat red tree sun' --corrupt 'sun dog red tree sun'",
             "which layers and heads carry the toy decoder's prediction"),
        ))
    p.add_argument("--version", action="version", version=f"pyattr {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{explain,generate,cite,patch,run,bench,docs}")
    e = sub.add_parser(
        "explain",
        help="token relevance heatmap",
        description=(
            "Explain a model output token by token. With no arguments: the bundled all-MiniLM-L6-v2 "
            "and the cosine similarity of a built-in sentence pair."
        ),
        epilog=_epilog(
            ("pyattr explain --text 'A man plays guitar.' --pair 'Someone makes music.'",
             "the bundled MiniLM: the two sentences' cosine similarity"),
            ("pyattr explain --model induction --text 'sun cat red tree sun' --target cat",
             "the bundled toy decoder: the logit of 'cat' after the text"),
            ("pyattr explain --model gpt2 --text 'The capital of France is' --html out.html",
             "a Hugging Face Hub id, or a local directory: --model ./my-model"),
            ("pyattr explain --model squares --image square.png --png map.png",
             "an image classifier: patch relevance drawn over the image"),
        ),
    )
    e.add_argument("--text", help="sentence to explain (first of the pair, or the causal-LM prompt)")
    e.add_argument("--pair", help="second sentence: explain the cosine similarity of the two mean-pooled embeddings (the bundled model, or --model DIR)")
    e.add_argument("--model", type=model_dir,
                   help="a local Hugging Face model directory (save_pretrained, tokenizer included), a Hugging Face "
                        "Hub id (gpt2, org/name; downloaded once), or a bundled model: 'minilm', 'induction' (the "
                        "toy induction decoder), 'squares' (the toy image classifier): a causal LM explains the next-token "
                        "logit of --text; with --pair, a sentence encoder explains the cosine of the two "
                        "sentences; with --image, an image classifier explains a class logit")
    e.add_argument("--target", help="target token for --model (default: the top-1 prediction); with --image a class label or index")
    e.add_argument("--image", metavar="FILE",
                   help="image for --model (an image classifier: ViT, CLIP, or 'squares'): patch relevance of a "
                        "class logit")
    e.add_argument("--png", metavar="PATH",
                   help="with --image: where to write the relevance map over the image (default: <image stem>_relevance.png)")
    e.add_argument("--html", metavar="PATH", help="also write a self-contained HTML heatmap")
    e.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the heatmap")
    e.add_argument(
        "--generic",
        action="store_true",
        help="--model of an architecture without a rule map: mount rules by module class",
    )
    _rule_flags(e)
    e.set_defaults(func=_command("explain"))

    g = sub.add_parser(
        "generate",
        help="relevance of every generated token over the prompt and the tokens before it",
        description=(
            "Generate a continuation (greedy) or take one (--continuation), and explain every generated "
            "token's logit over its context with one forward and batched backwards. With no arguments: the "
            "shipped toy induction decoder and a built-in prompt."
        ),
        epilog=_epilog(
            ("pyattr generate --text 'dog owl fish bee dog' --max-new-tokens 4 --html gen.html",
             "the bundled toy decoder: generate 4 tokens and explain each"),
            ("pyattr generate --model gpt2 --text 'The capital of France is' --continuation ' Paris.' --png gen.png",
             "a given continuation, teacher-forced, as a generated x context heatmap"),
        ),
    )
    g.add_argument("--text", help="the prompt")
    _generate_model_flag(g)
    g.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (default 8)")
    g.add_argument("--continuation", help="explain this continuation instead of generating (teacher-forced)")
    g.add_argument("--target", choices=["logit", "logprob", "prob"], default="logit",
                   help="what each step explains: the token's logit (default), log-probability or probability")
    g.add_argument("--batch-targets", type=int, default=None,
                   help="steps per batched backward (default: measured: doubled from 8 while the time per step "
                        "falls and the measured memory per step lets the batching add at most 2 GiB)")
    g.add_argument("--top", type=int, default=3, help="sources listed per generated token (default 3)")
    g.add_argument("--html", metavar="PATH", help="write an interactive HTML page")
    g.add_argument("--png", metavar="PATH", help="write the generated x context heatmap as PNG")
    g.add_argument("--json", action="store_true", help="print machine-readable JSON instead")
    _rule_flags(g)
    g.set_defaults(func=_command("generate"))

    c = sub.add_parser(
        "cite",
        help="which sources of the prompt (documents, sentences, lines) a response rests on",
        description=(
            "Score each source of the prompt for a response, given (--response) or generated (--max-new-tokens), "
            "or, with --query, each sentence of a passage for a sentence-embedding model's cosine similarity to "
            "the query: pyattr.context_attribution, by default a fold-over ablation surrogate. With no arguments: "
            "the shipped toy induction decoder, four built-in documents and its answer."
        ),
        epilog=_epilog(
            ("pyattr cite", "the bundled toy decoder: which document holds the answer"),
            ("pyattr cite --model gpt2 --text 'Paris is in France. Rome is in Italy. Rome is in' "
             "--source 'Paris is in France.' --source 'Rome is in Italy.' --response Italy",
             "a Hugging Face Hub model, two sources and the question kept"),
            ("pyattr cite --text 'The lake is cold. A man plays the guitar.' --query 'someone making music'",
             "the bundled MiniLM: which sentence of the passage matches the query"),
            ("pyattr cite --model translation --text 'sun cat red fox' --split word --response 'FOX RED CAT SUN' "
             "--method attnlrp --per-token", "an encoder–decoder (the bundled translation toy): the source word "
             "each translated word rests on"),
        ),
    )
    c.add_argument("--text", help="the prompt: context and question (with --query: the passage)")
    c.add_argument("--model", type=model_dir,
                   help="a causal LM or an encoder–decoder (its sources in the source text, the response on the "
                        "decoder side): a local Hugging Face directory, a Hugging Face Hub id, 'translation' (the "
                        "shipped toy translation model), or 'induction' (the default: the shipped toy induction "
                        "decoder); with --query a sentence-embedding model (default 'minilm', the bundled "
                        "all-MiniLM-L6-v2)")
    c.add_argument("--query", help="score the passage's sentences for a sentence-embedding model's cosine "
                                   "similarity to this query, instead of a response")
    c.add_argument("--source", action="append", metavar="TEXT",
                   help="a source: a span of the prompt text (repeat, in order)")
    c.add_argument("--split", choices=["sentence", "line", "paragraph", "word"],
                   help="split the prompt into sources (default with --text: sentence)")
    c.add_argument("--response", help="the response to explain (teacher-forced)")
    c.add_argument("--max-new-tokens", type=int, default=None, help="generate this many tokens instead (default 16)")
    c.add_argument("--method", help="foldover (default), contextcite, loo, attnlrp, relevance, gradient, attention")
    c.add_argument("--per-token", action="store_true",
                   help="score the sources for each response token apart (its own log-probability) instead of "
                        "the whole response")
    c.add_argument("--html", metavar="PATH", help="write the sources as an HTML heatmap")
    c.add_argument("--json", action="store_true", help="print machine-readable JSON instead")
    c.set_defaults(func=_command("cite"))

    pa = sub.add_parser(
        "patch",
        help="which layers, heads and neurons matter: RelP, AtP and activation patching",
        description=(
            "Effect of patching each node (residual stream, attention output, heads, MLP output, "
            "neurons) from the corrupt text into the clean one: estimated by RelP (rule-modified "
            "gradient) or AtP (plain gradient), or measured by activation patching. With no "
            "arguments: the bundled all-MiniLM-L6-v2 and a built-in sentence pair, metric the cosine "
            "similarity with a partner sentence."
        ),
        epilog=_epilog(
            ("pyattr patch --method all --png patch.png",
             "the bundled MiniLM: RelP, AtP and activation patching side by side"),
            ("pyattr patch --model induction --clean 'sun cat red tree sun' --corrupt 'sun dog red tree sun' "
             "--html patch.html", "the bundled toy decoder's next-token logit"),
            ("pyattr patch --edges --html edges.html --png edges.png",
             "the toy decoder's edges and circuits, drawn as a graph"),
        ),
    )
    pa.add_argument("--clean", help="the clean text")
    pa.add_argument("--corrupt", help="the corrupt text (same number of tokens)")
    pa.add_argument("--pair", help="partner sentence of the cosine metric (sentence-embedding model; default: "
                                   "the built-in partner sentence)")
    pa.add_argument("--model", type=model_dir,
                    help="a causal LM: a local Hugging Face directory, a Hugging Face Hub id, or 'induction' (the "
                         "shipped toy induction decoder); metric: the next-token logit")
    pa.add_argument("--target", help="target token for --model (default: the clean run's top-1 prediction)")
    pa.add_argument("--edges", action="store_true",
                    help="score every edge of a causal LM's graph instead (heads' q/k/v inputs, MLPs, logits; "
                         "default model: the toy decoder and a built-in pair), and run circuits of the strongest "
                         "edges exactly (MIB's CPR and CMD); --method relp, atp, ig, blockwise or exact")
    pa.add_argument("--nodes", default="residual,attention,heads,mlp",
                    help="comma-separated: residual,attention,heads,mlp,neurons (default: all but neurons)")
    pa.add_argument("--method", choices=["relp", "atp", "atp*", "ig", "blockwise", "exact", "all"], default="relp",
                    help="relp, atp, atp* (AtP with the QK fix), ig (EAP-IG, 16 steps), blockwise (exact patching "
                         "computed block by block from the clean run: sees composition), exact (activation "
                         "patching), or all: relp, atp "
                         "and exact with correlations (default relp); with --edges one of relp, atp, ig, blockwise (exact edge "
                         "patching block by block), exact")
    pa.add_argument("--sample", type=int, default=200, help="exact: neurons patched, a random sample (default 200)")
    pa.add_argument("--generic", action="store_true",
                    help="--model of an architecture without a rule map: its roles (blocks, heads, MLP) found "
                         "structurally, each role it cannot find refused with the reason")
    pa.add_argument("--top", type=int, default=10, help="nodes (with --edges: edges) listed in the terminal (default 10)")
    pa.add_argument("--png", metavar="PATH", help="write layer x position heatmaps (and scatter plots) as PNG; with "
                                                  "--edges the circuit graph and the edge grid")
    pa.add_argument("--html", metavar="PATH", help="write a self-contained HTML page of the heatmaps; with --edges "
                                                   "the circuit graph, the edge grid and the faithfulness curve")
    pa.add_argument("--json", metavar="PATH", help="write every effect as JSON (NaN: a neuron not patched, as null)")
    pa.set_defaults(func=_command("patch"))

    r = sub.add_parser(
        "run",
        help="relevance over a dataset of prompts into Parquet shards (resumable, torchrun-aware)",
        description=(
            "Token relevance of every prompt of a .jsonl / .csv / .parquet file for a causal LM's "
            "next-token logit, stored as Parquet shards plus _manifest.json in --out (read it with "
            "pandas.read_parquet(OUT)). Rerunning the same command resumes. Under torchrun each rank "
            "takes every N-th prompt."
        ),
        epilog=_epilog(
            ("pyattr run --model induction --data prompts.jsonl --out results",
             "every prompt's token relevance into results/ (rerun to resume)"),
            ("torchrun --nproc-per-node 2 -m pyattr run --model ./my-model --data prompts.csv --out results "
             "--device cuda", "two processes, one GPU each"),
        ),
    )
    r.add_argument("--model", required=True, type=model_dir,
                   help="a causal LM: a local Hugging Face directory (with its tokenizer), a Hugging Face Hub id, "
                        "or 'induction'")
    r.add_argument("--data", required=True, help="prompts: .jsonl (one object per line), .csv or .parquet")
    r.add_argument("--out", required=True, help="results directory (created; an existing run is resumed)")
    r.add_argument("--text-field", default="text", help="the field holding each prompt (default: text)")
    r.add_argument("--target", default="top1", help="a field holding each prompt's target token, or top1 (default)")
    r.add_argument("--rules", default="all",
                   help="all (default), attnlrp, none, or a comma list of normalization,activation,"
                        "multiplicative_gate,attention,routing")
    r.add_argument("--generate", type=int, default=None, metavar="N",
                   help="generate N tokens per prompt (greedy) and store each one's relevance over its context "
                        "(the relevance matrix per row)")
    r.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="model dtype")
    r.add_argument("--max-tokens-per-batch", type=int, default=4096, help="rows x padded length per pass (default 4096)")
    r.add_argument("--shard-size", type=int, default=256, help="rows per Parquet shard (default 256)")
    where = r.add_mutually_exclusive_group()
    where.add_argument("--device", choices=["cpu", "cuda"], help="cpu (default) or cuda")
    where.add_argument("--device-map", metavar="MAP",
                       help="place the model with accelerate instead: auto, balanced, balanced_low_0, sequential, "
                            "or a JSON file mapping module names to devices (0, \"cuda:1\", \"cpu\", \"disk\")")
    r.add_argument("--max-memory", metavar="SPEC", help="with --device-map: per-device limits, e.g. 0=70GiB,cpu=120GiB")
    r.add_argument("--offload-folder", metavar="DIR", help="with --device-map: where modules mapped to disk are kept (needed when the checkpoint "
                        "is not in safetensors format)")
    r.add_argument("--generic", action="store_true",
                   help="structural rule installation for an architecture without a rule map")
    r.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each block in the backward instead of keeping its activations (less memory)")
    r.set_defaults(func=_command("run"))

    b = sub.add_parser(
        "bench",
        help="kernel microbenchmarks and the end-to-end relevance benchmark",
        description=(
            "Kernel microbenchmarks (native autograd, the unfused rules, and every pyattr backend, "
            "the torch reference included), or the end-to-end relevance run with --e2e. The output "
            "says when the CPU was oversubscribed (timings unreliable)."
        ),
        epilog=_epilog(
            ("pyattr bench --quick", "every kernel on small shapes (under a minute on 2 CPU cores)"),
            ("pyattr bench --e2e --markdown e2e.md", "the end-to-end relevance run on a random Llama"),
        ),
    )
    b.add_argument("--quick", action="store_true", help="small shapes and few repeats (under a minute on 2 CPU cores)")
    b.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    b.add_argument("--ops", help="comma-separated: identity,half,gated,layer_norm,rms_norm,attention (default: all)")
    b.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes (default: float32,bfloat16)")
    b.add_argument("--shapes", help="ROWSxHIDDEN for elementwise ops[,ROWSxHIDDEN for norms] (attention has its own: seq 2048, head dims 64 and 128)")
    b.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement")
    b.add_argument("--json", metavar="PATH", help="write the results as JSON")
    b.add_argument("--markdown", metavar="PATH", help="write the results as a markdown table")
    b.add_argument("--e2e", action="store_true", help="end-to-end relevance run on a random Llama instead")
    b.add_argument("--layers", type=int, default=None, help="e2e: override the number of layers")
    b.add_argument("--seq", type=int, default=None, help="e2e: override the input length (default 512 on CPU, 4096 on CUDA)")
    b.add_argument("--compile", action="store_true",
                   help="e2e: also time relevance on torch.compile(model) (inductor; the compile is timed apart)")
    b.add_argument("--targets", type=int, default=8, metavar="K",
                   help="e2e: also time K targets in one relevance call against K calls (0: skip; default 8)")
    b.add_argument("--conservation", action="store_true",
                   help="layer-wise conservation error of pyattr vs the unfused rules, per dtype, instead")
    b.add_argument("--ig-memory", action="store_true",
                   help="peak memory of integrated_gradients at n_steps 16, 64, 256, instead")
    b.add_argument("--chunk", type=int, default=16, help="--ig-memory: internal_batch_size (default 16)")
    b.add_argument("--patching", action="store_true",
                   help="correlation of RelP / AtP with activation patching on MiniLM and a random Llama, instead")
    b.add_argument("--faithfulness", action="store_true",
                   help="ABPC (perturbation curves) and time of relevance, AttnLRP, LN-rule, gradient x input, IG "
                        "and random on MiniLM and the toy induction decoder, instead")
    b.add_argument("--generation", action="store_true",
                   help="explaining 16 / 64 generated tokens on the e2e Llama: the per-step loop, inseq "
                        "input_x_gradient and generation_relevance (time with its range over interleaved rounds, "
                        "ratios per round, peak RSS), instead")
    b.add_argument("--context", metavar="N[,N]",
                   help="--generation: instead, 16 tokens explained after contexts of these lengths (e.g. 16384) "
                        "on the long-context Llama, the per-step loop against generation_relevance; --scale: the "
                        "token counts (default 1024,4096)")
    b.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="--generation, --long-context, --scale: exactly N interleaved rounds (default: 3, up to 6 while "
                        "a ratio's range is wider than 10%% of its median)")
    b.add_argument("--long-context", action="store_true",
                   help="one relevance map after a 4k / 8k / 16k-token context under every rule set (default, "
                        "AttnLRP, LN-rule only, none) against a plain forward + backward: time with its range over "
                        "interleaved rounds, peak memory, memory per 1k tokens, instead")
    b.add_argument("--scale", action="store_true",
                   help="one relevance map on a Llama-3.2-1B-shaped model (random weights, drawn once into the "
                        "cache) in bfloat16 and float32 (--dtypes) after 1k and 4k tokens (--context) under every "
                        "rule set against a plain forward + backward: time with its range over interleaved rounds, "
                        "the call's peak memory, instead")
    b.add_argument("--allocator", choices=("glibc", "returned"), default=None,
                   help="--scale: 'returned' unmaps every freed block of 64 KiB or more in pyattr's processes, so the "
                        "peak memory is the tensors' and not glibc's heap fragmentation (default: glibc as it starts)")
    b.add_argument("--lxt-python", metavar="PYTHON",
                   help="--long-context, --scale: also time LXT's AttnLRP, run by this Python (a development "
                        "environment with lxt and the transformers 4 it supports; LXT is not a pyattr dependency)")
    b.add_argument("--estimators", action="store_true",
                   help="patching estimators (AtP, AtP*, RelP, EAP-IG) against exact patching and the known circuit "
                        "of the toy induction decoder, and their time on a 144-head model, instead")
    b.add_argument("--citations", action="store_true",
                   help="context attribution (fold-over surrogate, ContextCite-style Lasso, leave-one-out, relevance, "
                        "attention): LDS, drop@k, top-1 hit and time on both toy decoders' context task, instead")
    b.add_argument("--circuits", action="store_true",
                   help="edge attribution (AtP, RelP, EAP-IG) against exact edge patching on both toy decoders' key "
                        "and value pairs: Pearson, top-2, MIB's CPR and CMD, time, instead")
    b.add_argument("--frameworks", action="store_true",
                   help="the rules under TransformerLens' and nnsight's own backward against their plain backward "
                        "and against the rules written as TransformerLens hooks: time with its range over interleaved "
                        "rounds, peak memory, instead")
    b.add_argument("--png", metavar="PATH", help="--faithfulness: write the mean perturbation curves as PNG")
    b.add_argument("--dataset", action="store_true",
                   help="pyattr run over a file of prompts on a random ~1B Llama (bfloat16 on CUDA, 64 prompts; "
                        "float32 on the CPU, 8 prompts; --quick: 44M, float32): "
                        "prompts/s, tokens/s, peak RSS, with and without checkpointing, 1 vs 2 torchrun processes")
    b.set_defaults(func=_command("bench"))
    _docs_parser(sub)
    p.commands = {"explain": e, "generate": g, "cite": c, "patch": pa, "run": r, "bench": b,
                  "docs": sub.choices["docs"]}
    return p


class _TorchaoEnumNotice(logging.Filter):
    """The notices torchao's import prints (transformers imports torchao while loading any
    model once it is installed): another library's housekeeping at the top of every
    command's output. Dropped, and only they:

    * torch 2.14 warns, on every import of torchao 0.18, that registering Enum classes as
      pytree constants is deprecated;
    * torchao's ``__init__`` warns that it skips its C++ extensions (a torch older than it
      wants, or ``TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1``) or that one failed to load (a
      torch newer than its build): pyattr's own kernels do not use them."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if "is an Enum subclass and is now natively supported" in msg:
            return False
        return not (record.name == "torchao" and msg.startswith(("Skipping import of cpp extensions",
                                                                  "Failed to load")))


# the loggers those notices come from
_NOTICE_LOGS = (logging.getLogger("torch.utils._pytree"), logging.getLogger("torchao"))


def _docs_parser(sub) -> None:
    d = sub.add_parser(
        "docs", help="print a documentation page (shipped with pyattr; no network)",
        description="The documentation pages shipped with pyattr: with no PAGE the list, with a PAGE its text "
                    "(Markdown).",
        epilog=_epilog(("pyattr docs", "the pages and their titles"),
                       ("pyattr docs getting-started", "install, the kernels, the two commands"),
                       ("pyattr docs causal-lm", "a page by its last part (tutorials/causal-lm)")))
    d.add_argument("page", nargs="?", help="a page, as `pyattr docs` lists it")
    d.add_argument("--path", action="store_true", help="print the folder of the pages instead")
    d.set_defaults(func=_command("docs"))


def main(argv: Optional[List[str]] = None) -> int:
    for log in _NOTICE_LOGS:
        if not any(isinstance(f, _TorchaoEnumNotice) for f in log.filters):
            log.addFilter(_TorchaoEnumNotice())
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the command whose arguments they are, as its other errors do
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
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


__all__ = ["main", "build_parser", "OneLineParser", "DOCS"]
