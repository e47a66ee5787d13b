"""``mscclang export-mscclpp PLAN.json [-o OUT.json]``: convert an mscclang plan (format
``mscclang.plan/1``) into an MSCCL++ 0.9 execution plan, the counterpart of ``import-mscclpp``."""

from __future__ import annotations

import argparse
import json

from mscclang.cli.args import add_output_option
from mscclang.cli.import_cmd import write_output
from mscclang.errors import PlanError
from mscclang.plan.io import plan_from_document, read_plan_document
from mscclang.plan.mscclpp import is_mscclpp_plan, to_mscclpp

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export-mscclpp", help="convert an mscclang plan into an MSCCL++ execution plan",
        description="Convert an mscclang plan into an MSCCL++ 0.9 execution plan (JSON), exactly: "
                    "importing the result gives the plan back but for what MSCCL++ has no field for "
                    "(the 'consistent' promise, the ops' program lines) and a reduction's local source "
                    "at place 1, written first (the same sum: x1 + x0 == x0 + x1). What MSCCL++ cannot "
                    "express (a broadcast, an epilogue op, a local source at place 2 or later, a lone "
                    "glre, an LL8 packet type) is refused with its JSON path.")
    p.add_argument("input", metavar="PLAN.json", help="mscclang plan file ('-' reads standard input)")
    add_output_option(p, dest="output", metavar="OUT.json", default=None,
                      help="where to write the MSCCL++ plan (default: standard output)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    data = read_plan_document(args.input)  # bounded, UTF-8, JSON errors as PlanError
    if is_mscclpp_plan(data):
        raise PlanError("this is already an MSCCL++ plan (it has 'gpus' and no 'format'); export-mscclpp "
                        "takes an mscclang plan")
    plan = plan_from_document(data)  # fields and cross-references checked, JSON paths in errors
    write_output(json.dumps(to_mscclpp(plan), indent=2) + "\n", args.output)
    return 0
