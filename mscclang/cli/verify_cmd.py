"""``mscclang verify PLAN.json [--schedules N] [--sizes 1K 4M ...] [--dtype fp16 ...]``: prove a
plan in the CPU simulator. Exits 0 with a one-screen report when the plan is correct, 1 with the
diagnosis (deadlock cycle, races, wrong outputs) otherwise."""

from __future__ import annotations

import argparse
import re
import sys

from mscclang.errors import MscclangError

_SIZE = re.compile(r"^\s*(\d+)\s*([kKmMgG]?)(i?[bB])?\s*$")


def parse_size(text: str) -> int:
    """``"4096"``, ``"1K"``, ``"4M"``, ``"1G"`` (powers of 1024; a trailing B/iB is allowed)."""
    m = _SIZE.match(text)
    if not m:
        raise MscclangError(f"not a size: {text!r} (use e.g. 4096, 1K, 4M)")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(m.group(1)) * mult


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify", help="prove a plan in the CPU simulator (deadlocks, races, outputs)",
        description="Run a plan in the CPU simulator under several schedules, sizes and dtypes; "
                    "report deadlocks, races and wrong outputs. Exit 0 when correct, 1 otherwise.")
    p.add_argument("plan", help="plan JSON file")
    p.add_argument("--schedules", type=int, default=10, help="runs per size (default 10)")
    p.add_argument("--sizes", nargs="+", default=None,
                   help="message sizes (input bytes; allgather: output bytes), e.g. 1K 4M")
    p.add_argument("--dtype", nargs="+", default=None,
                   help="dtypes (fp16, bf16, fp32, int32, uint8, fp8_e4m3, fp8_e5m2)")
    p.add_argument("--reduce-op", nargs="+", default=None, choices=("sum", "min", "max"))
    p.add_argument("--packet-type", nargs="+", default=None, choices=("LL8", "LL16"))
    p.add_argument("--launches", type=int, default=None,
                   help="consecutive launches (default: 3 for double-scratch plans, else 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-symbolic", action="store_true", help="skip the symbolic postcondition")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mscclang.sim.runner import as_plan
    from mscclang.sim.verify import DEFAULT_DTYPES, verify

    plan = as_plan(args.plan)
    sizes = [parse_size(s) for s in args.sizes] if args.sizes else None
    kw = {}
    if args.packet_type:
        kw["packet_types"] = args.packet_type
    rep = verify(plan, sizes=sizes, dtypes=args.dtype or DEFAULT_DTYPES,
                 schedules=args.schedules, seed=args.seed, launches=args.launches,
                 reduce_ops=args.reduce_op, symbolic=not args.no_symbolic, **kw)
    print(str(rep), file=sys.stdout if rep.ok else sys.stderr)
    return 0 if rep.ok else 1
