"""docs/semantics.md stands alone: it points at nothing outside the repository, and every module
and file it names exists (issue 14, "Self-contained docs")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "semantics.md"


def test_semantics_points_nowhere_outside_the_repository() -> None:
    text = DOC.read_text()
    for bad in ("../", "design.md", "§", "shared/", "http://", "https://", "mscclpp-notes"):
        assert bad not in text, f"docs/semantics.md refers outside the repository: {bad!r}"


def test_every_module_and_file_named_exists() -> None:
    text = DOC.read_text()
    names = set(re.findall(r"`([A-Za-z_][\w./-]*)`", text))
    modules = {n for n in names if n.startswith("mscclang.")}
    paths = {n for n in names if "/" in n and not n.startswith("mscclang.")}
    assert modules and paths
    for m in modules:
        parts = m.split(".")
        # a module, or a name inside one (mscclang.plan.layout, mscclang.compiler.slices)
        found = any((ROOT.joinpath(*parts[:k]).with_suffix(".py")).exists()
                    or (ROOT.joinpath(*parts[:k]) / "__init__.py").exists()
                    for k in range(len(parts), 1, -1))
        assert found, f"docs/semantics.md names {m}, which is not in the repository"
    for p in paths:
        assert (ROOT / p.rstrip("/")).exists(), f"docs/semantics.md names {p}, which is not in the repository"


_OUTSIDE = re.compile(r"design\.md|design §|design sections? \d|§|\.\./shared|plan-format\.md")


def test_package_source_points_nowhere_outside_the_repository() -> None:
    """Docstrings and comments cite docs/ (or README.md), never the design notes."""
    bad = []
    for p in sorted((ROOT / "mscclang").rglob("*.py")):
        rel = p.relative_to(ROOT / "mscclang").as_posix()
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if _OUTSIDE.search(line):
                bad.append(f"mscclang/{rel}:{n}: {line.strip()}")
    assert not bad, "code cites documents outside the repository:\n" + "\n".join(bad)


def test_docs_the_package_names_exist() -> None:
    names = set()
    for p in (ROOT / "mscclang").rglob("*.py"):
        names |= set(re.findall(r"\bdocs/[\w.-]+\.(?:md|json)", p.read_text()))
    assert names
    for n in names:
        assert (ROOT / n).is_file(), f"the package names {n}, which is not in the repository"
