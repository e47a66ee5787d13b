"""What ships and what does not: the package imports no test code, only the command line parses
arguments, and test modules share code through tests/harness and tests/conftest.py only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mscclang"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_the_package_imports_no_test_code():
    bad = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        hits = sorted(n for n in _imports(f) if n.split(".")[0] in ("tests", "tools")
                      or n.startswith("mscclang.testing"))
        if hits:
            bad[str(f.relative_to(ROOT))] = hits
        assert "tests.harness" not in f.read_text(), f"{f}: names test code (a pool target string?)"
    assert bad == {}
    assert not (PACKAGE / "testing").exists()


def test_only_the_command_line_has_argparse_or_a_main_block():
    found = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE)
        if rel.parts[0] == "cli" or rel == Path("__main__.py"):
            continue
        text = f.read_text()
        if "argparse" in _imports(f) or 'if __name__ == "__main__"' in text:
            found.append(str(rel))
    assert found == []


def test_no_test_module_imports_another():
    found = []
    for f in sorted((ROOT / "tests").rglob("test_*.py")):
        hits = [n for n in _imports(f) if n.split(".")[-1].startswith("test_") or n.startswith("tests.test_")
                or n.split(".")[0].startswith(("test_", "_plan"))]
        if hits:
            found.append((f.name, hits))
    assert found == []
