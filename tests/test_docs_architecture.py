"""docs/architecture.md holds its figures through ``tools/architecture_figures.py``: its generated
sections are current (``--check``), it names every module of ``mscclang/``, and every module it
cites (``runtime/entries.py``, ``plan/call.py:make_call``) exists, with the name it cites."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "architecture_figures.py"
_spec = importlib.util.spec_from_file_location("architecture_figures", TOOL)
figures = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("architecture_figures", figures)   # dataclasses look their module up
_spec.loader.exec_module(figures)

DOC = ROOT / "docs" / "architecture.md"
TEXT = DOC.read_text(encoding="utf-8")
#: a module cited in backticks, with an optional ``:name`` (``Class.method``)
_CITE = re.compile(r"`((?:\w+/)*\w+\.py)(?::([\w.]+))?`")


def test_generated_sections_are_current() -> None:
    r = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{r.stdout}{r.stderr}"


def test_every_module_is_named() -> None:
    missing = [m.path for m in figures.modules() if f"`{m.path}`" not in TEXT]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_distributed_is_described_with_its_path() -> None:
    prose = re.sub(r"<!-- figures:([\w-]+) -->.*?<!-- /figures:\1 -->", "", TEXT, flags=re.S)
    assert "mscclang/distributed.py" in prose


def _module_file(path: str) -> Path | None:
    """The file a citation names: under ``mscclang/`` (``runtime/entries.py``), a bare module
    name found once in it (``state.py``), or the repository (``tools/codelines.py``)."""
    for base in (ROOT / "mscclang", ROOT):
        if (base / path).is_file():
            return base / path
    if "/" not in path:
        found = [p for p in (ROOT / "mscclang").rglob(path) if "__pycache__" not in p.parts]
        if found:
            return found[0]
    return None


def _defines(tree: ast.Module, dotted: str) -> bool:
    """Whether ``tree`` defines ``dotted`` (a top-level name, or ``Class.attr``)."""
    body: list[ast.stmt] = tree.body
    for part in dotted.split("."):
        hit = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                hit = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    hit = node
        if hit is None:
            return False
        body = hit.body if isinstance(hit, ast.ClassDef) else []
    return True


def test_cited_modules_and_names_exist() -> None:
    wrong = []
    for m in _CITE.finditer(TEXT):
        path, name = m.group(1), m.group(2)
        f = _module_file(path)
        if f is None:
            wrong.append(path)
        elif name and not _defines(ast.parse(f.read_text(encoding="utf-8")), name):
            wrong.append(f"{path}:{name}")
    assert not wrong, f"docs/architecture.md cites what does not exist: {wrong}"


def test_check_reports_a_stale_doc(tmp_path: Path) -> None:
    stale = tmp_path / "architecture.md"
    stale.write_text(TEXT.replace("| total |", "| total (stale) |", 1), encoding="utf-8")
    diff = figures.stale_diff(stale)
    assert "-| total (stale) |" in diff and "+| total |" in diff


def test_a_missing_section_is_refused() -> None:
    with pytest.raises(ValueError, match="missing"):
        figures.render("no markers here", {"modules": "x"})


def test_import_order_refuses_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "mscclang" / "runtime"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from mscclang.runtime import b\n")
    (pkg / "b.py").write_text("from mscclang.runtime.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mscclang.runtime import a\n")
    mods = [m for m in figures.modules(tmp_path / "mscclang")]
    with pytest.raises(ValueError, match="import cycle"):
        figures.import_order(mods)
    order = figures.import_order([m for m in mods if m.name != "mscclang.runtime.b"])
    assert [(m.name, deps) for m, deps in order] == [("mscclang.runtime.a", []), ("mscclang.runtime.c", [])]


def test_every_class_over_400_code_lines_has_its_reason() -> None:
    """The prose list under "Classes over 400 code lines" names exactly the classes the code has
    over 400 code lines (the generated table's figures), so that a class that grows past it, or
    shrinks below it, changes the reasons too; and no prose says a class over 400 is below it."""
    big = {name for _, name, n in figures.class_sizes(figures.modules()) if n > 400}
    head = "Classes over 400 code lines, and why each is one class:"
    assert head in TEXT
    section = TEXT.split(head, 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^- `(\w+)`", section, flags=re.M))
    assert listed == big, f"listed {sorted(listed)}, over 400 code lines: {sorted(big)}"
    for name in big:
        assert not re.search(rf"`{name}`[^.]*below 400", section), f"the prose calls {name} below 400"
