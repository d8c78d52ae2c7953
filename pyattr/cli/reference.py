"""The command-line reference page of the documentation (``docs/reference/cli.md``), made
from the parser itself so that it cannot drift from ``--help``:
``python -m pyattr.cli.reference > docs/reference/cli.md`` rewrites it, and the docs test
checks the page equals this output."""

from __future__ import annotations

import os


def markdown() -> str:
    from pyattr.cli import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: one width for the page
    try:
        parser = build_parser()
        parts = ["# Command line", "",
                 "Every command and option, as `--help` prints them (this page is generated from the parser:",
                 "`python -m pyattr.cli.reference > docs/reference/cli.md`). Errors are one line on stderr",
                 "with exit status 2; `--help` answers without importing torch.", "",
                 "## pyattr", "", "```", parser.format_help().rstrip(), "```", ""]
        for name, sub in parser.commands.items():
            parts += [f"## pyattr {name}", "", "```", sub.format_help().rstrip(), "```", ""]
        return "\n".join(parts)
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


if __name__ == "__main__":
    print(markdown(), end="")
