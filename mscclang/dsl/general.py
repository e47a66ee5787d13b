"""``JSON()``: the current program's plan as JSON."""

from __future__ import annotations

from mscclang.dsl._context import get_program

__all__ = ["JSON"]


def JSON() -> str:  # noqa: N802 (MSCCL++'s name)
    """The plan of the program of the enclosing ``with CollectiveProgram(...)`` block, as JSON text
    in format ``mscclang.plan/1`` (identical on every call)."""
    return get_program().to_json()
