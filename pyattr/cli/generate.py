"""``pyattr generate``: relevance of every generated token over its context."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from pyattr.cli._common import UsageError, _article, check_model, check_output_path, checkpoint_kind, fail, is_toy
from pyattr.cli.explain import rules_from_args


def run(args) -> int:
    try:
        for flag, path in (("--html", args.html), ("--png", args.png)):
            if path is not None:
                check_output_path(flag, path)
        if args.max_new_tokens is not None and args.continuation is not None:
            raise UsageError("--max-new-tokens generates, --continuation explains given text; pass one")
        if args.max_new_tokens is not None and args.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        if args.top < 1:
            raise UsageError(f"--top must be >= 1, got {args.top}")
        if args.model is not None and not args.model.strip():
            raise UsageError("--model is empty")
        if args.batch_targets is not None and args.batch_targets < 1:
            raise UsageError(f"--batch-targets must be >= 1, got {args.batch_targets}")
        if args.text is not None and not args.text.strip():
            raise UsageError("--text is empty")
        kind = checkpoint_kind(args.model) if args.model is not None else None
        if kind is not None and kind[0] not in ("causal LM", "encoder-decoder"):
            # read from config.json: no weights are loaded to find out
            instead = (f"pyattr explain --model {args.model} --image FILE explains an image"
                       if kind[0] == "image classifier" else
                       f"pyattr explain --model {args.model} explains a pair's cosine similarity"
                       if kind[0] == "sentence encoder" else "pyattr explain --model DIR --text TEXT --pair TEXT "
                       "explains an encoder's pair similarity")
            raise UsageError(f"--model {args.model} is {_article(kind[0])} ({kind[1]}), not a causal language "
                             f"model: pyattr generate explains the text a causal LM generates; {instead}")
        if args.text is None and args.model is not None and not is_toy(args.model):
            raise UsageError("--model needs --text (the prompt); only the toy model has a built-in one")
        check_model(args.model)
    except UsageError as e:
        return fail("generate", str(e))

    from pyattr.apps.explain import ExplainError
    from pyattr.apps.generate import DEFAULT_PROMPT, print_terminal, run_generate, save_png, to_html
    from pyattr.backends import backend as use_backend
    from pyattr.toy import INDUCTION_DIR

    scope = use_backend(args.backend) if args.backend else contextlib.nullcontext()
    model_dir = args.model if args.model else INDUCTION_DIR
    new = args.max_new_tokens if args.continuation is not None or args.max_new_tokens is not None else 8
    try:
        with scope:
            rep = run_generate(model_dir, args.text or DEFAULT_PROMPT, new, args.continuation, args.target,
                               rules_from_args(args), args.batch_targets)
    except (ExplainError, ValueError, TypeError) as e:
        return fail("generate", str(e))
    if args.html:
        Path(args.html).write_text(to_html(rep), encoding="utf-8")
    if args.png:
        save_png(rep, args.png)
    if args.json:
        print(json.dumps(rep.to_json()))
    else:
        print_terminal(rep, top=args.top)
        for flag, path in (("HTML", args.html), ("PNG", args.png)):
            if path:
                print(f"{flag} written to {path}")
    return 0
