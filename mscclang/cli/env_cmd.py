"""``mscclang env``: every ``MSCCLANG_*`` setting with its value in this environment, its kind,
its default and what it does (:func:`mscclang.config.settings_text`). ``--markdown`` prints the
reference table of ``docs/settings.md`` instead (:func:`mscclang.config.settings_markdown`),
independent of the environment. A variable set to a value its setting refuses (a plans folder
that holds no plan, a tuning table that cannot be read: what the code that reads it refuses) is
shown with the reason, and the exit status is then 1."""

from __future__ import annotations

import argparse

from mscclang.config import describe, settings_markdown, settings_text


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "env", help="print every MSCCLANG_* setting and its value",
        description="Print every MSCCLANG_* environment variable mscclang reads: its value here "
                    "(or its default), its kind and what it does. Exit status 1 when a variable "
                    "holds a value its setting refuses (a plans folder with no plan, a tuning "
                    "table that cannot be read).")
    p.add_argument("--markdown", action="store_true",
                   help="print the reference table (docs/settings.md) instead of the values in effect")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        print(settings_markdown(), end="")
        return 0
    print(settings_text(), end="")
    return 1 if any(r.problem for r in describe()) else 0
