"""How much a compile may do, checked before the work: a program's ranks
(``MSCCLANG_COMPILE_MAX_RANKS``) and the ops it records times its instances
(``MSCCLANG_COMPILE_MAX_OPS``: the compiler's time and memory grow linearly with them, about
:data:`SECONDS_PER_OP` and :data:`BYTES_PER_OP` each). The DSL checks the ranks when a program
is created and the ops as they are recorded, the driver again before lowering, so an oversized
program is refused at once with an estimate and the setting that raises the limit.

:func:`reporting` installs a progress callback for the compiles of one block of code (the CLI's
progress bar); the DSL and the driver call :func:`report` with the ops done so far."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable, Iterator, Optional

from mscclang.config import Settings, settings
from mscclang.errors import LimitError
from mscclang.units import format_bytes

__all__ = ["check_ranks", "check_ops", "reporting", "report", "SECONDS_PER_OP", "BYTES_PER_OP"]

#: compile time per recorded op and instance (measured: 128-rank all-pairs allreduce, 130,000 ops)
SECONDS_PER_OP = 1e-4
#: peak memory per recorded op and instance (same measurement)
BYTES_PER_OP = 3300

#: ``callback(ops_done, ops_total or None)``, set by :func:`reporting`
_REPORTER: ContextVar[Optional[Callable[[int, Optional[int]], None]]] = ContextVar("mscclang_compile_progress",
                                                                                    default=None)


def check_ranks(ranks: int, what: str = "the program") -> None:
    """Raise :class:`LimitError` when ``ranks`` exceeds ``MSCCLANG_COMPILE_MAX_RANKS``."""
    limit = settings.compile_max_ranks
    if ranks > limit:
        raise LimitError(f"{what} has {ranks} ranks, more than the compiler takes (at most {limit}; "
                         f"set {Settings.compile_max_ranks.name} to raise it)")


def check_ops(ops: int, instances: int, what: str = "the program", so_far: bool = False) -> None:
    """Raise :class:`LimitError` when ``ops`` recorded ops times ``instances`` exceed
    ``MSCCLANG_COMPILE_MAX_OPS``; the message gives the estimated time and memory (``so_far``:
    the program is still recording, so these are lower bounds)."""
    limit = settings.compile_max_ops
    total = ops * instances
    if total <= limit:
        return
    times = f" x {instances} instances" if instances > 1 else ""
    more = "at least " if so_far else ""
    raise LimitError(f"{what} {'records more than' if so_far else 'records'} {ops:,} ops{times}, {more}"
                     f"{total:,} ops to compile (about {_duration(total * SECONDS_PER_OP)} and "
                     f"{format_bytes(total * BYTES_PER_OP)}), over the limit of {limit:,} ops (set "
                     f"{Settings.compile_max_ops.name} to raise it)")


def _duration(s: float) -> str:
    return f"{s / 60:.3g} min" if s >= 120 else f"{s:.3g} s"


@contextlib.contextmanager
def reporting(callback: Callable[[int, Optional[int]], None]) -> Iterator[None]:
    """Call ``callback(ops_done, ops_total)`` from the compiles inside the block."""
    token = _REPORTER.set(callback)
    try:
        yield
    finally:
        _REPORTER.reset(token)


def report(done: int, total: Optional[int] = None) -> None:
    """Tell the installed progress callback (if any) how far the compile is."""
    cb = _REPORTER.get()
    if cb is not None:
        cb(done, total)
