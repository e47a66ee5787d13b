"""How far a compile is, for a progress bar (the CLI's ``compile --progress``).

:func:`reporting` installs a callback for the compiles of one block of code. While the DSL
records a program it reports the ops recorded so far (:func:`report`: ``callback(ops, None,
"recording")``). Then the driver :func:`start` s the compile with the work it expects, in
microseconds (:func:`mscclang.compiler.budget.estimate_plan`; the recording counts as done), and
reports each pass's share as the pass goes: a pass runs as one :func:`step`, and the passes that loop over ranks count each
rank's part as they finish it (:func:`each_rank`), so the count moves through every pass at the
pace of its own work. The last part of the expected work (the ``tail``: writing out the plan)
is the caller's, which reports it with :func:`advance`. The callback gets
``(done, total, note)``: microseconds of expected work done and in all, and what is running.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, TypeVar

__all__ = ["Callback", "reporting", "report", "start", "step", "each_rank", "advance"]

#: ``callback(done, total, note)`` (see the module docstring)
Callback = Callable[[int, Optional[int], str], None]
T = TypeVar("T")


@dataclass
class _Meter:
    """The progress of the compiles of one :func:`reporting` block."""

    callback: Callback
    total: float = 0.0
    done: float = 0.0
    tail: float = 0.0
    rank_ops: Sequence[int] = ()
    per_op: float = 0.0  # work per recorded op of the running step, counted by each_rank
    note: str = ""

    def add(self, work: float, note: Optional[str] = None) -> None:
        self.note = self.note if note is None else note
        self.done = min(self.total, self.done + max(0.0, work))
        self.callback(int(self.done), int(self.total), self.note)


_METER: ContextVar[Optional[_Meter]] = ContextVar("mscclang_compile_meter", default=None)


@contextlib.contextmanager
def reporting(callback: Callback) -> Iterator[None]:
    """Report the progress of the compiles inside the block to ``callback``."""
    token = _METER.set(_Meter(callback))
    try:
        yield
    finally:
        _METER.reset(token)


def report(done: int, total: Optional[int] = None) -> None:
    """The DSL has recorded ``done`` ops (of ``total``, when it knows)."""
    meter = _METER.get()
    if meter is not None:
        meter.callback(done, total, "recording")


def start(work: float, done: float, rank_ops: Sequence[int], tail: float) -> None:
    """A compile of ``work`` microseconds in all begins, ``done`` of them already (recording the
    program); ``tail`` of them are writing the plan out, which the caller reports with
    :func:`advance`; ``rank_ops``: each rank's recorded ops."""
    meter = _METER.get()
    if meter is not None:
        meter.total, meter.done, meter.tail, meter.rank_ops, meter.per_op = work, done, tail, rank_ops, 0.0


@contextlib.contextmanager
def step(note: str, work: float) -> Iterator[None]:
    """A step of ``work`` microseconds: :func:`each_rank` counts it rank by rank (each rank's
    share is its share of the recorded ops), its end the rest."""
    meter = _METER.get()
    if meter is None:
        yield
        return
    end, meter.per_op = meter.done + work, work / max(1, sum(meter.rank_ops))
    meter.add(0.0, note)
    yield
    meter.per_op = 0.0
    meter.add(end - meter.done)


def each_rank(ranks: Sequence[T]) -> Iterator[T]:
    """The ranks a pass loops over; each one finished counts its part of the running step."""
    meter = _METER.get()
    for i, r in enumerate(ranks):
        yield r
        if meter is not None and meter.per_op and i < len(meter.rank_ops):
            meter.add(meter.per_op * meter.rank_ops[i])


def advance(note: str, fraction: float) -> None:
    """``fraction`` of the tail is done; ``note``: what runs now."""
    meter = _METER.get()
    if meter is not None and meter.total:
        meter.add(meter.total - (1 - fraction) * meter.tail - meter.done, note)
