"""``LoopIterationContext``: a pipelined loop."""

from __future__ import annotations

from typing import Optional

from mscclang.compiler.source import source_line
from mscclang.dsl._context import get_program
from mscclang.errors import DSLError

__all__ = ["LoopIterationContext"]


class LoopIterationContext:
    """``with LoopIterationContext(unit, num_chunks):`` — the ops recorded inside become, per
    (rank, thread block), one ``pipeline`` op that runs them over ``unit``-byte slices of their
    chunk ranges (``num_chunks`` chunks), iteration after iteration. Pipelines do not nest."""

    def __init__(self, unit: int, num_chunks: int) -> None:
        if not isinstance(unit, int) or isinstance(unit, bool) or unit < 1:
            raise DSLError(f"LoopIterationContext(unit={unit!r}, num_chunks={num_chunks!r}): unit must be a positive int (bytes)")
        if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1:
            raise DSLError(f"LoopIterationContext(unit={unit!r}, num_chunks={num_chunks!r}): num_chunks must be a positive int")
        self.unit = unit
        self.num_chunks = num_chunks
        #: the program line of the ``with LoopIterationContext(...)`` (the pipeline op's ``src``)
        self.source: Optional[str] = source_line()

    def __enter__(self) -> "LoopIterationContext":
        get_program().set_loop_context(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        get_program().set_loop_context(None)
