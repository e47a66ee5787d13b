"""The README's DSL example is examples/oneshot_allreduce.py, and it compiles and verifies."""

from __future__ import annotations

import re
from pathlib import Path

from mscclang.cli.compile_cmd import compile_file
from mscclang.sim import verify

ROOT = Path(__file__).resolve().parent.parent


def _readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_dsl_example_is_the_example_file():
    example = (ROOT / "examples" / "oneshot_allreduce.py").read_text()
    assert example in _readme_python_blocks()


def test_readme_dsl_example_compiles_and_verifies():
    plan = compile_file(str(ROOT / "examples" / "oneshot_allreduce.py"))
    assert plan.collective == "allreduce" and len(plan.gpus) == 4
    report = verify(plan, schedules=3)
    assert report.ok, str(report)
