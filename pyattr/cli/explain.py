"""``pyattr explain``: token relevance of a model output, as a heatmap or JSON."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from pyattr.cli._common import (UsageError, _article, bundled_name, check_model, check_output_path, checkpoint_kind,
                                fail, is_toy)


def rules_from_args(args):
    """The RelevanceRules the flags ask for; every field given, whatever the defaults."""
    from pyattr.config import RelevanceRules

    attention = {"frozen": "frozen", "attnlrp": "attnlrp", "off": False}[args.attention]
    return RelevanceRules(
        normalization=not args.no_norm_rule,
        activation=not args.no_activation_rule,
        multiplicative_gate=not args.no_gate_rule,
        attention=attention,
        routing=not args.no_routing_rule,
    )


def default_text(model) -> str:
    """The prompt explained when ``--text`` is not given: the toy decoder's own kind of
    text for the toy decoder (its vocabulary has no English), else a sentence."""
    if is_toy(model):
        from pyattr.apps.generate import DEFAULT_PROMPT

        return DEFAULT_PROMPT
    from pyattr.apps.explain import DEFAULT_TEXT

    return DEFAULT_TEXT


def run(args) -> int:
    # checks that need no model come first: a bad output path fails in milliseconds
    try:
        if args.html is not None:
            check_output_path("--html", args.html)
        if args.pair is not None and args.target is not None:
            raise UsageError("--target is a next-token logit of a causal LM; with --pair the target is the "
                             "pair's cosine similarity (drop one of them)")
        if args.model is None and args.target is not None:
            raise UsageError("--target needs --model (a causal LM directory)")
        if args.target is not None and args.image is None and bundled_name(args.model) == "minilm":
            raise UsageError("--target is a next-token logit of a causal LM; the bundled MiniLM is a sentence "
                             "encoder, explained on a pair's cosine similarity (drop --target)")
        if args.image is not None and args.model is None:
            raise UsageError("--image needs --model DIR (an image classifier directory)")
        if args.image is not None and (args.text is not None or args.pair is not None):
            raise UsageError("--image explains an image; drop --text / --pair")
        if args.png is not None and args.image is None:
            raise UsageError("--png is the relevance map of --image; give --image FILE")
        if args.png is not None:
            check_output_path("--png", args.png)
        check_model(args.model)
        kind = checkpoint_kind(args.model) if args.model is not None else None
        # read from config.json: no weights are loaded to find out
        if kind is not None and kind[0] == "image classifier" and args.image is None:
            raise UsageError(f"--model {args.model} is an image classifier ({kind[1]}): explain an image with --image "
                             "FILE (--text and --pair are for language models)")
        if kind is not None and kind[0] == "encoder-decoder":
            raise UsageError(f"--model {args.model} is an encoder–decoder ({kind[1]}): pyattr explain reads one stack; "
                             f"pyattr generate --model {args.model} --text SOURCE explains its translation over the "
                             "source and the target prefix, pyattr cite which source words it rests on")
        if kind is not None and kind[0] != "image classifier" and args.image is not None:
            raise UsageError(f"--image needs an image classifier; --model {args.model} is {_article(kind[0])} "
                             f"({kind[1]})")
    except UsageError as e:
        return fail("explain", str(e))

    from pyattr.backends import backend as use_backend
    from pyattr.apps.explain import DEFAULT_PAIR, ExplainError, explain_causal, explain_pair
    from pyattr.integration.errors import RelevanceRuleConflictError, RelevanceRuleUnsupportedError

    # --backend wins; without it PYATTR_BACKEND (or auto) applies, as in the Python API
    scope = use_backend(args.backend) if args.backend else contextlib.nullcontext()
    try:
        with scope:
            if args.image is not None:
                from pyattr.apps.image import explain_image

                expl = explain_image(args.model, Path(args.image), args.target, rules_from_args(args),
                                     png=Path(args.png) if args.png else None, generic=args.generic)
            elif args.model is not None and (args.pair is not None or bundled_name(args.model) == "minilm"):
                # any encoder (or decoder); the bundled sentence encoder explains a pair, the
                # built-in one where none is given
                expl = explain_pair(args.text if args.text is not None else DEFAULT_PAIR[0],
                                    args.pair if args.pair is not None else DEFAULT_PAIR[1],
                                    model_dir=args.model, rules=rules_from_args(args), generic=args.generic)
            elif args.model is not None:
                expl = explain_causal(
                    args.model,
                    args.text if args.text is not None else default_text(args.model),
                    args.target,
                    rules_from_args(args),
                    generic=args.generic,
                )
            else:
                a = args.text if args.text is not None else DEFAULT_PAIR[0]
                b = args.pair if args.pair is not None else DEFAULT_PAIR[1]
                expl = explain_pair(a, b, rules=rules_from_args(args))
    except ExplainError as e:
        return fail("explain", str(e))
    except (ValueError, RelevanceRuleUnsupportedError, RelevanceRuleConflictError) as e:  # incl. a role discovery lacks
        return fail("explain", str(e).replace("Pass generic=True", "Pass --generic").replace("generic=True",
                                                                                             "--generic"))
    if args.html:
        from pyattr.apps.render import to_html

        try:
            Path(args.html).write_text(to_html(expl), encoding="utf-8")
        except OSError as e:
            return fail("explain", f"cannot write {args.html!r}: {e.strerror}")
    if args.json:
        print(json.dumps(expl.to_json(), indent=2))
    else:
        from pyattr.apps.render import print_terminal

        print_terminal(expl)
        if args.html:
            print(f"heatmap written to {args.html}")
    return 0
