"""``python -m pyattr.bench.check FILE.json``: validate a benchmark JSON document."""

import json
import sys

from pyattr.bench.report import validate


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args in (["-h"], ["--help"]):
        print("usage: python -m pyattr.bench.check FILE.json\n\nValidate a benchmark JSON document written by "
              "`pyattr bench --json` (schema pyattr-bench/1 or /2).")
        return 0
    if len(args) != 1:
        print("usage: python -m pyattr.bench.check FILE.json", file=sys.stderr)
        return 2
    try:
        with open(args[0], encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict):
            raise ValueError("benchmark JSON: the top level must be an object")
        validate(doc)
    except json.JSONDecodeError as e:
        print(f"{args[0]}: invalid: not a JSON document ({e})", file=sys.stderr)
        return 1
    except (OSError, UnicodeDecodeError, ValueError) as e:
        print(f"{args[0]}: invalid: {e}", file=sys.stderr)
        return 1
    busy = (doc.get("contention") or {}).get("oversubscribed")
    note = " (measured on an oversubscribed CPU: timings unreliable)" if busy else ""
    print(f"{args[0]}: valid {doc['schema']} document, {len(doc['rows'])} rows{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
