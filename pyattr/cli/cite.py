"""``pyattr cite``: which sources of a prompt a response rests on, or which sentences of a
passage a retrieval model matched to a query (:func:`pyattr.context_attribution`)."""

from __future__ import annotations

import json
from pathlib import Path

from pyattr.cli._common import UsageError, check_model, check_output_path, checkpoint_kind, fail

#: the toy decoder's built-in example: four "documents" and the question word "fish"
DEFAULT_PROMPT = "sun cat red dog fish owl bee tea key moon ring gold fish"
DEFAULT_SOURCES = ["sun cat red", "dog fish owl", "bee tea key", "moon ring gold"]


def _cost(res) -> str:
    from pyattr.methods.context import ABLATION_METHODS

    if res.method in ABLATION_METHODS:
        return f"{res.ablations} forwards"
    return "one forward" if res.method == "attention" else "one forward and backward"


def _per_token(res, as_json: bool) -> int:
    """Each response token's sources, best first (``--per-token``)."""
    toks = res.response_tokens[0] if res.response_tokens else [str(i) for i in res.response_ids[0]]
    n = len(res.sources[0])
    rows = []
    for j, (a, b) in enumerate(res.spans):
        s = res.scores[0, j, :n]
        order = s.argsort(descending=True).tolist()
        rows.append({"token": "".join(t or "" for t in toks[a:b]), "value": float(res.value[0, j]),
                     "sources": [{"text": res.sources[0][i], "score": float(s[i])} for i in order]})
    if as_json:
        print(json.dumps({"method": res.method, "response": res.response[0], "score_unit": res.score_unit,
                          "ablations": res.ablations, "tokens": rows}))
        return 0
    print(f"response: {res.response[0]!r}  (method {res.method}, {_cost(res)}; each token apart)")
    print(f"score: {res.score_unit}")
    for row in rows:
        best = ", ".join(f"{d['text']} {d['score']:+.4g}" for d in row["sources"][:3])
        print(f"  {row['token']!r:>12}  {best}")
    return 0


def run(args) -> int:
    from pyattr.methods.context import METHODS

    try:
        if args.html is not None:
            check_output_path("--html", args.html)
        if args.query is not None and (args.response is not None or args.max_new_tokens is not None):
            raise UsageError("--query scores a sentence-embedding model's match with a query; --response and "
                             "--max-new-tokens explain a causal LM's response; pass one")
        if args.query is not None and args.text is None:
            raise UsageError("--query needs --text (the passage retrieved for it)")
        if args.query is not None and not args.query.strip():
            raise UsageError("--query is empty")
        if args.query is not None and args.per_token:
            raise UsageError("--per-token splits a response into its tokens; --query scores one similarity")
        if args.response is not None and args.max_new_tokens is not None:
            raise UsageError("--response explains given text, --max-new-tokens generates; pass one")
        if args.max_new_tokens is not None and args.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        if args.method is not None and args.method not in METHODS:
            raise UsageError(f"--method: expected one of {list(METHODS)}, got {args.method!r}")
        if args.source and args.split:
            raise UsageError("--source names the sources, --split splits the prompt; pass one")
        if args.text is None and args.query is None and (args.model not in (None, "induction")):
            raise UsageError("--model needs --text (the prompt); only the toy model has a built-in one")
        if args.text is not None and not args.text.strip():
            raise UsageError("--text is empty")
        check_model(args.model)
    except UsageError as e:
        return fail("cite", str(e))

    import pyattr
    from pyattr.hub import ModelLoadError, load_pretrained

    text = args.text if args.text is not None else DEFAULT_PROMPT
    if args.source:
        sources = list(args.source)
    elif args.split:
        sources = args.split
    else:
        sources = DEFAULT_SOURCES if args.text is None else "sentence"
    response = args.response
    if response is None and args.max_new_tokens is None:
        response = "owl" if args.text is None else None
    new = None if response is not None else (args.max_new_tokens or 16)
    embedding = args.query is not None
    if embedding:
        response = new = None
    try:
        kind = checkpoint_kind(args.model) if args.model is not None else None
        # an encoder–decoder checkpoint loads as its own class (MarianMTModel, T5…): the
        # sources are in its source text, the response on its decoder side
        causal = None if (kind is not None and kind[0] == "encoder-decoder") else not embedding
        tok, model = load_pretrained(args.model or ("minilm" if embedding else "induction"), causal=causal)
        kinds = getattr(model.config, "architectures", None) or []
        if embedding and any(k.endswith(("ForCausalLM", "LMHeadModel")) for k in kinds):
            return fail("cite", f"--query scores a sentence-embedding model's similarity; --model is a causal LM "
                                f"({kinds[0]}): drop --query and give --response or --max-new-tokens")
        if args.method == "attention" and hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("eager")  # the attention weights are read from the model's output
        res = pyattr.context_attribution(model, text, sources, response=response, max_new_tokens=new,
                                         tokenizer=tok, method=args.method, query=args.query,
                                         spans="tokens" if args.per_token else None)
    except (ModelLoadError, ValueError, TypeError) as e:
        return fail("cite", str(e))
    if args.html:
        Path(args.html).write_text(res.to_html(), encoding="utf-8")
    if args.per_token:
        return _per_token(res, args.json)
    ranked = res.top(len(res.sources[0]))
    if args.json:
        said = {"query": res.response[0]} if embedding else {"response": res.response[0]}
        print(json.dumps({"method": res.method, **said, "outcome": res.outcome, "value": float(res.value[0]),
                          "score_unit": res.score_unit,
                          "ablations": res.ablations, "sources": [{"text": t, "score": s} for t, s in ranked]}))
        return 0
    if embedding:
        print(f"query: {res.response[0]!r}  (cosine similarity {float(res.value[0]):.4f}; method {res.method}, "
              f"{_cost(res)})")
    else:
        print(f"response: {res.response[0]!r}  (method {res.method}, {_cost(res)})")
    print(f"score: {res.score_unit}")
    for t, s in ranked:
        print(f"{s:+10.4f}  {t}")
    if args.html:
        print(f"HTML written to {args.html}")
    return 0
