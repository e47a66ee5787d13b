"""The program being recorded.

MSCCL++ programs call ``Rank(0)``, ``MemoryChannel(1, 0)`` ... without naming their program, so
the DSL needs a *current* program. It is set by ``CollectiveProgram.__enter__`` and cleared by
``__exit__``; nothing else is kept at module or class level, so no state outlives a program.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from mscclang.errors import DSLError

if TYPE_CHECKING:
    from mscclang.dsl.program import CollectiveProgram

_current: Optional["CollectiveProgram"] = None


def get_program() -> "CollectiveProgram":
    """The program of the innermost active ``with CollectiveProgram(...)`` block."""
    if _current is None:
        raise DSLError("no active program: DSL calls must happen inside 'with CollectiveProgram(...)'")
    return _current


def set_program(prog: Optional["CollectiveProgram"]) -> Optional["CollectiveProgram"]:
    """Make ``prog`` current; return the previously current program."""
    global _current
    prev = _current
    _current = prog
    return prev
