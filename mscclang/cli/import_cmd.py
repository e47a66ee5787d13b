"""``mscclang import-mscclpp IN.json [-o OUT.json]``: convert an MSCCL++ 0.9 execution plan into
an mscclang plan (format ``mscclang.plan/1``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from mscclang.errors import PlanError
from mscclang.plan.io import plan_to_json, read_plan_document
from mscclang.plan.mscclpp import from_mscclpp

__all__ = ["add_parser", "run", "write_output"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "import-mscclpp", help="convert an MSCCL++ execution plan into an mscclang plan",
        description="Convert an MSCCL++ 0.9 execution plan (JSON) into an mscclang plan. Unknown "
                    "keys and inconsistent plans are reported with their JSON path.")
    p.add_argument("input", metavar="IN.json", help="MSCCL++ plan file ('-' reads standard input)")
    p.add_argument("-o", "--output", metavar="OUT.json", default=None,
                   help="where to write the plan (default: standard output)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the semantic checks (the plan's fields are still validated)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mscclang.cli.show_cmd import refuse_other_files

    data = read_plan_document(args.input)  # bounded, UTF-8, JSON errors as PlanError
    refuse_other_files(args.input, data)
    plan = from_mscclpp(data, check=not args.no_check)
    write_output(plan_to_json(plan), args.output)
    return 0


def write_output(text: str, path: Optional[str]) -> None:
    """Write ``text`` to the file ``path``, or to standard output when ``path`` is None or empty;
    a file that cannot be written is a PlanError naming it and why."""
    if path:
        try:
            Path(path).write_text(text)
        except OSError as e:
            raise PlanError(f"cannot write {path}: {e.strerror}") from None
    else:
        sys.stdout.write(text)
