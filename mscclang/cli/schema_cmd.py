"""``mscclang schema [-o FILE] [--check]``: write the JSON schema of the plan format
(:func:`mscclang.plan.schema.schema_text`) to ``docs/plan.schema.json`` of the source tree, to
``FILE`` (``-``: standard output), or with ``--check`` write nothing and exit 1 when the file
differs from the models' schema (or cannot be read)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mscclang.errors import MscclangError


def add_parser(sub: "argparse._SubParsersAction") -> None:
    from mscclang.plan.schema import DEFAULT_PATH

    p = sub.add_parser("schema", help="write (or --check) docs/plan.schema.json", description=__doc__)
    p.add_argument("-o", "--output", default=str(DEFAULT_PATH),
                   help=f"file to write ('-' for standard output; default {DEFAULT_PATH})")
    p.add_argument("--check", action="store_true",
                   help="do not write: exit 1 if the file differs from the models' schema")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mscclang.plan.schema import schema_text

    text = schema_text()
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.output)
    if args.check:
        try:
            current = json.loads(out.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise MscclangError(f"{out}: cannot read the schema: {getattr(e, 'strerror', None) or e}") from None
        if current != json.loads(text):
            raise MscclangError(f"{out} is out of date: run `mscclang schema`")
        print(f"{out} matches the plan models")
        return 0
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as e:
        raise MscclangError(f"cannot write {out}: {e.strerror or e}") from None
    print(f"wrote {out}")
    return 0
