#!/usr/bin/env python3
"""The generated sections of docs/architecture.md: what the doc states as figures is computed
here from the code, never written by hand.

    python3 tools/architecture_figures.py --write   # regenerate the sections in place
    python3 tools/architecture_figures.py --check   # exit 1 with a diff when the doc is stale

A section lies between ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->``; its text is
replaced whole. The sections:

* ``modules``: every module of ``mscclang/``, its layer (its folder; ``top`` for the package's
  own modules) and its code lines (``tools/codelines.py``'s count);
* ``runtime-order``: the runtime's modules in import order (each imports only runtime modules
  listed before it), derived from their module-level imports (not those under
  ``if TYPE_CHECKING:`` nor inside functions); ties are broken by name;
* ``classes``: every class over :data:`CLASS_LINES` code lines, with its size;
* ``collectives``: the rows of ``mscclang.plan.collectives.TABLE``.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mscclang"
DOC = ROOT / "docs" / "architecture.md"
#: a class is listed in ``classes`` when it holds more code lines than this
CLASS_LINES = 300


def _load_codelines() -> Callable[[str], int]:
    """tools/codelines.py's ``code_lines`` (the one counting rule)."""
    spec = importlib.util.spec_from_file_location("codelines", ROOT / "tools" / "codelines.py")
    if spec is None or spec.loader is None:
        raise SystemExit("architecture_figures: tools/codelines.py not found")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.code_lines


code_lines = _load_codelines()


@dataclass(frozen=True)
class Module:
    """One module of the package: its path under the repository (``mscclang/runtime/cuda.py``),
    its dotted name, its layer and its parsed source."""

    path: str
    name: str
    layer: str
    source: str
    tree: ast.Module


def modules(package: Path = PACKAGE) -> list[Module]:
    """Every ``*.py`` module under ``package``, sorted by path."""
    out = []
    for p in sorted(package.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        rel = p.relative_to(package.parent)
        parts = rel.with_suffix("").parts
        layer = parts[1] if len(parts) > 2 else "top"
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        src = p.read_text(encoding="utf-8")
        out.append(Module(rel.as_posix(), name, layer, src, ast.parse(src)))
    return out


def _module_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """The import statements run when the module is imported: at module level, inside
    top-level ``try``/``if`` blocks, but not under ``if TYPE_CHECKING:``."""
    found: list[ast.stmt] = []

    def visit(body: Sequence[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if "TYPE_CHECKING" not in test:
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                    visit(block)

    visit(tree.body)
    return found


def imported_names(tree: ast.Module, known: set[str]) -> set[str]:
    """The modules of ``known`` (dotted names) that ``tree`` imports when it is imported."""
    out: set[str] = set()
    for node in _module_level_imports(tree):
        if isinstance(node, ast.Import):
            cands = [a.name for a in node.names]
        else:
            base = node.module or ""
            cands = [base] + [f"{base}.{a.name}" for a in node.names]
        out.update(c for c in cands if c in known)
    return out


def import_order(mods: Sequence[Module]) -> list[tuple[Module, list[str]]]:
    """``mods`` in import order (each after every module of ``mods`` it imports; ties by name),
    each with the short names of the modules of ``mods`` it imports. ValueError naming the
    modules of an import cycle."""
    by = {m.name: m for m in mods}
    deps = {m.name: imported_names(m.tree, set(by)) - {m.name} for m in mods}
    done: list[str] = []
    left = dict(deps)
    while left:
        ready = sorted(n for n, d in left.items() if d <= set(done))
        if not ready:
            raise ValueError(f"import cycle among {', '.join(sorted(left))}")
        done.append(ready[0])
        del left[ready[0]]
    return [(by[n], sorted(d.rsplit(".", 1)[-1] for d in deps[n])) for n in done]


def class_sizes(mods: Sequence[Module], over: int = CLASS_LINES) -> list[tuple[str, str, int]]:
    """(module path, class name, code lines) of every class over ``over`` code lines, largest
    first."""
    out = []
    for m in mods:
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ClassDef):
                seg = ast.get_source_segment(m.source, node, padded=True) or ""
                n = code_lines(textwrap.dedent(seg))
                if n > over:
                    out.append((m.path, node.name, n))
    return sorted(out, key=lambda r: (-r[2], r[0], r[1]))


def _section_modules(mods: Sequence[Module]) -> str:
    rows = ["| module | layer | code lines |", "| --- | --- | ---: |"]
    rows += [f"| `{m.path}` | {m.layer} | {code_lines(m.source)} |" for m in mods]
    per: dict[str, int] = {}
    for m in mods:
        per[m.layer] = per.get(m.layer, 0) + code_lines(m.source)
    rows.append("")
    rows.append("| layer | modules | code lines |")
    rows.append("| --- | ---: | ---: |")
    rows += [f"| {layer} | {sum(1 for m in mods if m.layer == layer)} | {n} |" for layer, n in sorted(per.items())]
    rows.append(f"| total | {len(mods)} | {sum(per.values())} |")
    return "\n".join(rows)


def _section_runtime_order(mods: Sequence[Module]) -> str:
    rt = [m for m in mods if m.layer == "runtime" and not m.path.endswith("__init__.py")]
    rows = ["| # | module | imports (runtime modules) |", "| ---: | --- | --- |"]
    for i, (m, deps) in enumerate(import_order(rt), 1):
        rows.append(f"| {i} | `{m.path}` | {', '.join(f'`{d}`' for d in deps) or '-'} |")
    return "\n".join(rows)


def _section_classes(mods: Sequence[Module]) -> str:
    rows = [f"Classes over {CLASS_LINES} code lines:", "", "| class | module | code lines |", "| --- | --- | ---: |"]
    rows += [f"| `{c}` | `{p}` | {n} |" for p, c, n in class_sizes(mods)]
    return "\n".join(rows)


def _section_collectives() -> str:
    sys.path.insert(0, str(ROOT))
    try:
        from mscclang.plan.collectives import TABLE
    finally:
        sys.path.pop(0)
    rows = ["| plan name | `Communicator` method | reduces | input blocks | output blocks | in place | torch.distributed |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in TABLE.values():
        rows.append(f"| `{c.name}` | {f'`{c.api}`' if c.api else '-'} | {'yes' if c.reduces else 'no'} | "
                    f"{c.in_blocks} | {c.out_blocks} | {c.inplace} | {f'`{c.torch}`' if c.torch else '-'} |")
    return "\n".join(rows)


def sections(package: Path = PACKAGE) -> dict[str, str]:
    """Each generated section's text, by name."""
    mods = modules(package)
    return {"modules": _section_modules(mods), "runtime-order": _section_runtime_order(mods),
            "classes": _section_classes(mods), "collectives": _section_collectives()}


_MARK = re.compile(r"(<!-- figures:([\w-]+) -->\n)(.*?)(<!-- /figures:\2 -->)", re.S)


def render(doc: str, secs: dict[str, str]) -> str:
    """``doc`` with every section between its markers replaced; ValueError naming a section
    the doc lacks or one it has that is not generated."""
    seen = set(m.group(2) for m in _MARK.finditer(doc))
    if seen != set(secs):
        raise ValueError(f"docs/architecture.md: sections missing {sorted(set(secs) - seen)}, "
                         f"unknown {sorted(seen - set(secs))}")
    return _MARK.sub(lambda m: f"{m.group(1)}{secs[m.group(2)]}\n{m.group(4)}", doc)


def stale_diff(doc_path: Path = DOC, package: Path = PACKAGE) -> str:
    """The unified diff from the doc to its regenerated text ('' when current)."""
    old = doc_path.read_text(encoding="utf-8")
    new = render(old, sections(package))
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        str(doc_path), f"{doc_path} (regenerated)"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="architecture_figures.py", description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true", help="regenerate the sections of docs/architecture.md")
    g.add_argument("--check", action="store_true", help="exit 1 with a diff when docs/architecture.md is stale")
    args = ap.parse_args(argv)
    if args.write:
        old = DOC.read_text(encoding="utf-8")
        new = render(old, sections())
        if new != old:
            DOC.write_text(new, encoding="utf-8")
        return 0
    diff = stale_diff()
    if diff:
        sys.stdout.write(diff)
        print("docs/architecture.md is stale: run python3 tools/architecture_figures.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
