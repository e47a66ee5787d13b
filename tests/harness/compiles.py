"""The compiles a piece of code makes, with the recorded program of each: for tests of what the
compiler estimates from a recording against what it then makes (mscclang.compiler.budget)."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import mscclang.dsl.program as dsl_program
from mscclang.compiler.ir import IRProgram
from mscclang.plan.models import Plan

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass
class Compiled:
    """One compile: the recorded program (as the driver got it) and the plan it made."""

    ir: IRProgram
    plan: Plan


@contextlib.contextmanager
def capture_compiles() -> Iterator[list[Compiled]]:
    """Every compile of a DSL program inside the block, in order (the DSL's compile_program is
    wrapped for the block's duration)."""
    seen: list[Compiled] = []
    real: Callable[[IRProgram], Plan] = dsl_program.compile_program

    def compile_program(ir: IRProgram) -> Plan:
        plan = real(ir)
        seen.append(Compiled(ir.copy(), plan))
        return plan

    dsl_program.compile_program = compile_program
    try:
        yield seen
    finally:
        dsl_program.compile_program = real


def run_script(path: Path, *argv: str) -> None:
    """Run a DSL script as ``python PATH ARGV...`` would (its printed plan is dropped)."""
    saved = sys.argv
    sys.argv = [str(path), *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = saved


def example_program(name: str) -> Callable[..., object]:
    """The ``program`` function of ``examples/NAME.py``."""
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"), run_name="mscclang_example")["program"]
