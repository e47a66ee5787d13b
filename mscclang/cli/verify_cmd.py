"""``mscclang verify PLAN.json [--schedules N] [--sizes 1K 4M ...] [--dtype fp16 ...]``: prove a
plan in the CPU simulator. Exits 0 with a one-screen report when the plan is correct, 1 with the
diagnosis (deadlock cycle, races, wrong outputs) otherwise. ``-`` reads the plan from standard
input. Sizes and dtypes follow :mod:`mscclang.cli.args`; ``--schedules`` is capped at
:data:`~mscclang.cli.args.MAX_SCHEDULES` (1000) and ``--launches`` at
:data:`~mscclang.cli.args.MAX_LAUNCHES` (16). A progress bar with an ETA is drawn on stderr when
it is a terminal (or with ``--progress``)."""

from __future__ import annotations

import argparse
import json
import sys

from mscclang.cli.args import (MAX_LAUNCHES, MAX_SCHEDULES, SIM_DTYPES, SIZES_FORMS, add_progress_flag,
                               dtype_arg, flatten_sizes, int_range_arg, sizes_arg)
from mscclang.errors import PlanError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify", help="prove a plan in the CPU simulator (deadlocks, races, outputs)",
        description="Run a plan in the CPU simulator under several schedules, sizes and dtypes; "
                    "report deadlocks, races and wrong outputs. Exit 0 when correct, 1 otherwise.")
    p.add_argument("plan", help="plan JSON file ('-' reads standard input)")
    p.add_argument("--schedules", type=int_range_arg(1, MAX_SCHEDULES), default=10,
                   help=f"runs per size, 1..{MAX_SCHEDULES} (default 10)")
    p.add_argument("--sizes", nargs="+", type=sizes_arg(), default=None, metavar="SIZES",
                   help="message sizes (input bytes; allgather: output bytes): " + SIZES_FORMS)
    p.add_argument("--dtype", nargs="+", type=dtype_arg(SIM_DTYPES), default=None,
                   help="dtypes: " + ", ".join(SIM_DTYPES) + " or an alias (fp16, bf16, fp32, i32, ...)")
    p.add_argument("--reduce-op", nargs="+", default=None, choices=("sum", "min", "max"))
    p.add_argument("--packet-type", nargs="+", default=None, choices=("LL8", "LL16"))
    p.add_argument("--launches", type=int_range_arg(1, MAX_LAUNCHES), default=2,
                   help=f"consecutive launches, 1..{MAX_LAUNCHES} (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-symbolic", action="store_true", help="skip the symbolic postcondition")
    add_progress_flag(p)
    p.set_defaults(func=run)


def read_stdin_plan() -> dict:
    """The plan JSON on standard input (``mscclang verify -``), parsed."""
    text = sys.stdin.read()
    if not text.strip():
        raise PlanError("no plan on standard input ('-' reads the plan JSON from stdin)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"standard input is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def run(args: argparse.Namespace) -> int:
    from mscclang.cli.progress import Progress
    from mscclang.sim.runner import as_plan
    from mscclang.sim.verify import DEFAULT_DTYPES, verify

    plan = as_plan(read_stdin_plan() if args.plan == "-" else args.plan)
    sizes = flatten_sizes(args.sizes)
    kw = {}
    if args.packet_type:
        kw["packet_types"] = args.packet_type
    with Progress(None, f"verify {plan.name}", unit="run", enabled=args.progress) as bar:
        def step(done: int, total: int) -> None:
            bar.set_total(total)
            bar.update(done - bar.n)

        rep = verify(plan, sizes=sizes, dtypes=args.dtype or DEFAULT_DTYPES,
                     schedules=args.schedules, seed=args.seed, launches=args.launches,
                     reduce_ops=args.reduce_op, symbolic=not args.no_symbolic, progress=step, **kw)
    print(str(rep), file=sys.stdout if rep.ok else sys.stderr)
    return 0 if rep.ok else 1
