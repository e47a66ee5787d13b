"""``mscclang generate-plans [--check] [--out DIR] [--only ALGORITHM ...]``: regenerate the shipped
plans (``plans/*.json`` and ``plans/index.json``) from the library's DSL programs
(:mod:`mscclang.algorithms.generate`), writing only the files that changed; a plan that gives
ranks different bits fails it (every library plan promises the same bits); with ``--check``
write nothing and exit 1 when any plan or the index differs from a fresh generation (CI)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("generate-plans", help="regenerate plans/ and plans/index.json from the library",
                       description=__doc__)
    p.add_argument("--check", action="store_true",
                   help="write nothing; fail (exit 1) if any plan or the index differs from a fresh generation")
    p.add_argument("-o", "--out", "--output", type=Path, default=None, help="plans directory (default: the checkout's plans/)")
    p.add_argument("--only", action="append", metavar="ALGORITHM",
                   help="only this algorithm (repeatable); the index then lists only these, and "
                        "plans of other algorithms count as stale")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mscclang.algorithms.generate import (broken_invariance_promises, check_files, generate_files,
                                              inconsistent_plans, write_files)
    from mscclang.algorithms.index import default_plans_dir

    out_dir = args.out if args.out is not None else default_plans_dir()
    files = generate_files(args.only)  # a MscclangError is reported by mscclang.cli.main
    proofs = ((inconsistent_plans, "give ranks different bits, though every library plan promises the same "
                                   "bits on every rank (docs/semantics.md, \"Rank consistency\")"),
              (broken_invariance_promises, "promise batch invariance and break it (docs/semantics.md, "
                                           "\"Batch invariance\")"))
    for prove, what in proofs:
        broken = prove(files)
        if broken:
            print(f"mscclang generate-plans: {len(broken)} library plan(s) {what}; nothing written:", file=sys.stderr)
            for line in broken:
                print(f"  {line}", file=sys.stderr)
            return 1
    if args.check:
        problems = check_files(out_dir, files)
        if problems:
            print(f"mscclang generate-plans --check: {len(problems)} difference(s) in {out_dir}; "
                  "run `mscclang generate-plans` and commit the result:", file=sys.stderr)
            for p in problems:
                print(f"  {p}", file=sys.stderr)
            return 1
        print(f"generate-plans --check: {len(files) - 1} plans and the index in {out_dir} are up to date")
        return 0
    changed = write_files(out_dir, files)
    print(f"generate-plans: {len(files) - 1} plans and the index in {out_dir}; "
          f"{len(changed)} file(s) written or deleted")
    return 0
