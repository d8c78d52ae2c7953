"""``python -m pyattr.bench.check FILE.json``: validate a benchmark JSON document."""

import json
import sys

from pyattr.bench.report import validate


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pyattr.bench.check FILE.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        doc = json.load(f)
    validate(doc)
    print(f"{args[0]}: valid {doc['schema']} document, {len(doc['rows'])} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
