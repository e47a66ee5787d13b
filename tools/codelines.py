#!/usr/bin/env python3
"""Count the code lines of a Python package: lines that hold a Python token other than a comment
or a docstring (a string statement that is the first statement of a module, class or function).
Blank lines, comments and docstrings do not count; a line of a multi-line token (a string that is
not a docstring, a bracketed expression) counts once.

    python3 tools/codelines.py mscclang [--max N]

prints each folder's total (its own files, not its subfolders) and the total; with ``--max N``
the exit status is 1 when the total exceeds N, and the last line says by how much.
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
         tokenize.ENCODING, tokenize.ENDMARKER}


def _docstring_starts(tree: ast.AST) -> set[tuple[int, int]]:
    """(line, column) where each docstring's string token starts."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                out.add((first.value.lineno, first.value.col_offset))
    return out


def code_lines(source: str) -> int:
    """The number of code lines of one module's text (see the module docstring). A text that is
    not valid Python raises SyntaxError."""
    docstrings = _docstring_starts(ast.parse(source))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in _SKIP:
            continue
        if tok.type == tokenize.STRING and (tok.start[0], tok.start[1]) in docstrings:
            continue
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines)


def count_tree(root: Path) -> dict[str, int]:
    """Code lines per folder (relative to ``root``'s parent, ``/``-separated) of every ``*.py``
    file under ``root``."""
    per: dict[str, int] = defaultdict(int)
    base = root.parent
    for p in sorted(root.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        try:
            n = code_lines(p.read_text(encoding="utf-8"))
        except (SyntaxError, tokenize.TokenError) as e:
            raise SystemExit(f"codelines: {p}: not valid Python ({e})") from None
        per[p.parent.relative_to(base).as_posix()] += n
    return dict(per)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="codelines.py", description="Count the code lines of a Python package.")
    ap.add_argument("package", help="the package folder (e.g. mscclang)")
    ap.add_argument("--max", type=int, default=None, metavar="N", help="exit 1 when the total exceeds N")
    args = ap.parse_args(argv)
    root = Path(args.package)
    if not root.is_dir():
        print(f"codelines: {root} is not a folder", file=sys.stderr)
        return 2
    per = count_tree(root.resolve())
    width = max([len(k) for k in per] + [5])
    for folder in sorted(per):
        print(f"{folder:<{width}}  {per[folder]:>7}")
    total = sum(per.values())
    print(f"{'total':<{width}}  {total:>7}")
    if args.max is not None and total > args.max:
        print(f"codelines: {total} code lines, {total - args.max} over the cap of {args.max}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
