"""``mscclang verify PLAN.json [--schedules N] [--sizes 1K,4M ...] [--dtype fp16,bf16 ...] [--strict] [--all]``:
prove a plan in the CPU simulator.

The report goes to standard output whether the plan passes or fails, and a one-line verdict
(``mscclang verify: NAME: FAILED (3 problems)``) to standard error. Exit status: 1 when an error
is found (deadlock cycle, race, wrong output); otherwise 0, with the report's status: ``OK``; ``OK`` with warnings (``multimem-relaxed``) or
vacuous (the plan moves no bytes); ``NO POSTCONDITION`` (a ``test``/``custom`` plan: deadlocks and
races checked). ``--strict`` makes every status but a clean, non-vacuous ``OK`` exit 1. An
MSCCL++ plan is imported first (a note on standard error says so); ``-`` reads the plan from
standard input. Sizes and dtypes follow :mod:`mscclang.cli.args` (list options take comma
lists and may be repeated); ``--schedules`` is capped at
:data:`~mscclang.cli.args.MAX_SCHEDULES` (1000) and ``--launches`` at
:data:`~mscclang.cli.args.MAX_LAUNCHES` (16). A progress bar with an ETA is drawn on stderr when
it is a terminal (or with ``--progress``). The first eight problems are printed, causes first
(deadlocks, unbalanced channels and semaphores before the races they imply); ``--all`` prints
every problem in full. A reduction's report says in a note whether every reduced element is the
canonical expression (``batch invariant (...): yes`` or ``no: ...``); a plan that promises it
(``"batch_invariant": true``) and breaks it fails (``batch-variant``, docs/verify.md). A size is :data:`~mscclang.cli.args.MESSAGE_SIZE`, refused unless whole
elements of every dtype on every rank (:func:`mscclang.sim.runner.message_to_bytes`). A Python DSL program (``.py``) is refused with the command that compiles
it: verify checks plans, and a program's own arguments (ranks, instances) are for
``mscclang compile`` to take."""

from __future__ import annotations

import argparse
import sys

from mscclang.cli.args import (MAX_LAUNCHES, MAX_SCHEDULES, MESSAGE_SIZE, SIM_DTYPES, MergeLists, add_progress_flag,
                               add_sizes_option, choice_list_arg, dtype_list_arg, int_range_arg)
from mscclang.errors import MscclangError
from mscclang.plan.models import PACKET_TYPES, REDUCE_OP_NAMES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify", help="prove a plan in the CPU simulator (deadlocks, races, outputs)",
        description="Run a plan in the CPU simulator under several schedules, sizes and dtypes; "
                    "report deadlocks, races and wrong outputs. Exit 0 when correct, 1 otherwise.")
    p.add_argument("plan", help="plan JSON file (mscclang or MSCCL++ format; '-' reads standard input)")
    p.add_argument("--schedules", type=int_range_arg(1, MAX_SCHEDULES), default=10,
                   help=f"runs per size, 1..{MAX_SCHEDULES} (default 10)")
    add_sizes_option(p, MESSAGE_SIZE, "a small, an odd and a larger one in the plan's range")
    p.add_argument("--dtype", action=MergeLists, type=dtype_list_arg(SIM_DTYPES), default=None,
                   help="comma list of dtypes, repeatable: " + ", ".join(SIM_DTYPES) +
                        " or an alias (fp16, bf16, fp32, i32, ...)")
    p.add_argument("--reduce-op", action=MergeLists, type=choice_list_arg(REDUCE_OP_NAMES), default=None,
                   help="comma list of sum, min, max")
    p.add_argument("--packet-type", action=MergeLists, type=choice_list_arg(PACKET_TYPES), default=None,
                   help="comma list of LL8, LL16")
    p.add_argument("--launches", type=int_range_arg(1, MAX_LAUNCHES), default=None,
                   help=f"consecutive launches, 1..{MAX_LAUNCHES} (default: 3 for double-scratch plans, else 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-symbolic", action="store_true", help="skip the symbolic postcondition")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 unless the plan is proven OK: also on warnings (multimem-relaxed), "
                        "on NO POSTCONDITION (test/custom plans) and on a vacuous OK")
    p.add_argument("--senders", default=None, metavar="S0,S1,...",
                   help="sendrecv only: the rank each rank receives from, e.g. 3,0,1,2 "
                        "(default: taken from the plan's data flow)")
    p.add_argument("--all", action="store_true", dest="show_all",
                   help="print every problem in full (default: the first 8, causes first)")
    add_progress_flag(p)
    p.set_defaults(func=run)


def parse_senders(text: str) -> list[int]:
    """``"3,0,1,2"`` -> ``[3, 0, 1, 2]``."""
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise MscclangError(f"--senders {text!r}: expected comma-separated ranks, e.g. 3,0,1,2") from None


def run(args: argparse.Namespace) -> int:
    from mscclang.cli.progress import Progress
    from mscclang.cli.show_cmd import read_plan_any
    from mscclang.sim.verify import verify

    if args.plan.endswith(".py"):
        raise MscclangError(f"{args.plan} is a DSL program (Python), not a plan: compile it first, "
                            f"`mscclang compile {args.plan} -o plan.json`, then `mscclang verify plan.json`")
    plan, was_mscclpp = read_plan_any(args.plan)
    if was_mscclpp:
        print(f"note: {args.plan} is an MSCCL++ plan; verifying it as imported "
              "(`mscclang import-mscclpp` writes the converted plan)", file=sys.stderr)
    sizes = args.sizes
    kw: dict = {}
    if args.packet_type:
        kw["packet_types"] = args.packet_type
    if args.senders is not None:
        kw["senders"] = parse_senders(args.senders)
    if args.launches is not None:
        kw["launches"] = args.launches
    with Progress(None, f"verify {plan.name}", unit="run", enabled=args.progress) as bar:
        def step(done: int, total: int) -> None:
            bar.set_total(total)
            bar.update(done - bar.n)

        rep = verify(plan, sizes=sizes, dtypes=args.dtype or None, schedules=args.schedules,
                     seed=args.seed, reduce_ops=args.reduce_op, symbolic=not args.no_symbolic,
                     progress=step, **kw)
    code = rep.exit_code(strict=args.strict)
    print(rep.render(show_all=args.show_all))
    strict = (f"; --strict: {rep.status}{' (vacuous)' if rep.vacuous else ''}"
              f"{f' with {len(rep.warnings)} warning(s)' if rep.warnings else ''} is not a proof"
              if code and not rep.failed else "")
    print(f"mscclang verify: {plan.name}: {rep.headline()}{strict}", file=sys.stderr)
    return code
