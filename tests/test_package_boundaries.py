"""What ships and what does not: the package's rooms import only downwards (the layer table below),
the package imports no test code, only the command line parses arguments, and test modules share
code through tests/harness and tests/conftest.py only."""

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


# The package's rooms (a subpackage, or a top-level module), lowest floor first. A room may import
# only rooms on lower floors: rooms on one floor never import each other.
LAYERS = [("errors", "units"), ("config",), ("plan",), ("compiler", "sim", "runtime", "viz"), ("dsl",),
          ("algorithms",), ("comm",), ("distributed", "reference"), ("__init__", "bench"), ("cli",),
          ("__main__",)]
FLOOR = {room: floor for floor, rooms in enumerate(LAYERS) for room in rooms}


def _room(module: str) -> str:
    """The room of a dotted module name under ``mscclang`` (``mscclang`` alone is ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(package: Path = PACKAGE) -> list[str]:
    """Every import of the package that does not run down the layer table, as ``file:line a -> b``.
    Every import counts: module level, inside functions, and under ``if TYPE_CHECKING:``."""
    found = []
    for f in sorted(package.rglob("*.py")):
        rel = f.relative_to(package)
        here = rel.stem if len(rel.parts) == 1 else rel.parts[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                found.append(f"{rel}:{node.lineno} a relative import")
                continue
            elif isinstance(node, ast.ImportFrom):
                targets = [node.module] if node.module != "mscclang" else [
                    f"mscclang.{a.name}" if (package / a.name).exists() or (package / f"{a.name}.py").exists()
                    else "mscclang" for a in node.names]
            else:
                continue
            for there in {_room(t) for t in targets if t.split(".")[0] == "mscclang"} - {here}:
                if FLOOR[there] >= FLOOR[here]:
                    found.append(f"{rel}:{node.lineno} {here} -> {there}")
    return found


def test_every_room_of_the_package_is_on_a_floor():
    rooms = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert rooms == set(FLOOR)


def test_imports_run_down_the_layers_only():
    assert upward_imports() == []


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


def _backslash_continuations(path: Path) -> list[int]:
    """Lines of ``path`` that end in a backslash outside strings (a line continuation)."""
    import io
    import tokenize

    text = path.read_text()
    lines = text.splitlines()
    inside = set()   # lines a token runs past the end of (a multi-line string's own backslashes)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        inside.update(range(tok.start[0], tok.end[0]))
    return [i for i, ln in enumerate(lines, 1) if ln.rstrip().endswith("\\") and i not in inside
            and not ln.lstrip().startswith("#")]


def test_the_package_and_tools_continue_lines_in_parentheses_never_with_a_backslash():
    found = [(str(f.relative_to(ROOT)), n) for top in (PACKAGE, ROOT / "tools")
             for f in sorted(top.rglob("*.py")) for n in _backslash_continuations(f)]
    assert found == []
