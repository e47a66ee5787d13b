"""tools/codelines.py: code lines are lines with a token other than a comment or a docstring."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "codelines.py"
_spec = importlib.util.spec_from_file_location("codelines", TOOL)
codelines = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(codelines)

MODULE = '''"""Module docstring,
on two lines."""
# a comment

import os  # trailing comment counts as code


class A:
    """Class docstring."""

    x = """not a docstring:
    two lines"""

    def f(self):
        """Function docstring."""
        "a second string statement is code"
        return (1,
                2)


async def g():
    \'\'\'async docstring\'\'\'
    pass
'''


def test_counts_one_module():
    # import, class, x = (2 lines), def f, second string, return (2 lines), async def, pass
    assert codelines.code_lines(MODULE) == 10
    assert codelines.code_lines("") == 0
    assert codelines.code_lines('"""only a docstring"""\n') == 0
    assert codelines.code_lines("x = 1\n\n\n# c\ny = 2\n") == 2


def _package(tmp_path: Path) -> Path:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Doc."""\nfrom pkg.sub import m\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "m.py").write_text(MODULE)
    (pkg / "notes.txt").write_text("x = 1\n")
    return pkg


def test_per_folder_totals_and_the_cap(tmp_path):
    pkg = _package(tmp_path)
    assert codelines.count_tree(pkg) == {"pkg": 1, "pkg/sub": 10}
    run = lambda *a: subprocess.run([sys.executable, str(TOOL), str(pkg), *a], capture_output=True, text=True)
    ok = run("--max", "11")
    assert ok.returncode == 0 and ok.stdout.split()[-2:] == ["total", "11"]
    assert "pkg/sub" in ok.stdout
    over = run("--max", "8")
    assert over.returncode == 1 and "3 over the cap of 8" in over.stderr
    assert run().returncode == 0
    assert run("--max", "x").returncode == 2


def test_ci_runs_the_gate_before_the_tests():
    lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    gate = next(i for i, ln in enumerate(lines) if "tools/codelines.py mscclang --max" in ln)
    assert gate < len(lines) - 1 and "pytest" in lines[-1]
