"""``Communicator.trace()``: the per-op GPU timeline of the collectives called inside a block.

Inside ``with comm.trace() as tr:``, every collective the communicator runs on a plan is launched
through the interpreter's traced kernel (:meth:`mscclang.runtime.executor.Executor.execute_traced`)
and waited for; calls that fall back to torch.distributed are listed in ``tr.skipped``. Outside
the block nothing is traced and the untraced kernels run, so tracing costs nothing when off.
Leaving the block is collective when the communicator has a store: the ranks exchange their first
timer value, so every rank's events share one time base (:meth:`CallTrace.save` then writes a
trace that merges with the other ranks' files by concatenating their ``traceEvents``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from mscclang.errors import MscclangError, RuntimeUnavailable


@dataclass
class TracedCall:
    """One traced collective: its collective and plan, the input bytes, and this rank's trace
    (:class:`~mscclang.runtime.trace.RankTrace`)."""

    collective: str
    plan: str
    nbytes: int
    trace: Any


@dataclass
class CallTrace:
    """What :meth:`Communicator.trace` recorded on this rank: ``calls`` in order, ``skipped``
    (the collectives that ran on the torch.distributed fallback, untraced) and ``base_ns``, the
    time base of :attr:`events` (the earliest first record of any rank once the block is left;
    this rank's own before)."""

    rank: int
    calls: list[TracedCall] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    base_ns: Optional[int] = None

    @property
    def problems(self) -> list[str]:
        """Where a traced launch departed from its plan's op order (empty: none did)."""
        return [f"call {k} ({c.collective}): {p}" for k, c in enumerate(self.calls) for p in c.trace.problems]

    @property
    def events(self) -> list[dict]:
        """This rank's Chrome trace events of every call (``ph: X``, ``pid`` the rank, ``tid`` the
        thread block; ``args.call`` the call's position), in microseconds from :attr:`base_ns`."""
        ran = [c for c in self.calls if c.trace.events]
        if not ran:
            return []
        base = self.base_ns if self.base_ns is not None else min(c.trace.t0_ns for c in ran)
        out = []
        for k, c in enumerate(self.calls):
            shift = (c.trace.t0_ns - base) / 1e3
            for e in c.trace.events:
                out.append(dict(e, ts=e["ts"] + shift, args=dict(e["args"], call=k, collective=c.collective,
                                                                  plan=c.plan)))
        return out

    def chrome(self) -> dict:
        """The Chrome trace-event JSON of :attr:`events` (Perfetto and chrome://tracing load it)."""
        from mscclang.runtime.trace import chrome_trace

        return chrome_trace(self.events)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write :meth:`chrome` to ``path`` (MscclangError naming the path when it cannot)."""
        try:
            with open(path, "w") as f:
                json.dump(self.chrome(), f)
        except OSError as e:
            raise MscclangError(f"rank {self.rank}: cannot write the trace to {path}: {e.strerror or e}") from e


class Tracing:
    """The context manager :meth:`Communicator.trace` returns: it switches the communicator's
    launches to traced ones on entry and back on exit, then puts the ranks on one time base over
    ``store`` (every rank must leave its block: collective), with ``key`` naming this block
    among the communicator's."""

    def __init__(self, runs: Any, store: Any, key: str) -> None:
        self._runs = runs   # the communicator's Launch
        self._store = store
        self._key = key
        self.result = CallTrace(runs.rank)

    def __enter__(self) -> CallTrace:
        if self._runs.tracer is not None:
            raise MscclangError(f"rank {self._runs.rank}: comm.trace() blocks do not nest")
        self._runs.tracer = self.result
        return self.result

    def __exit__(self, *exc: Any) -> None:
        self._runs.tracer = None
        if exc[0] is not None:
            return
        ran = [c.trace.t0_ns for c in self.result.calls if c.trace.events]
        mine = min(ran) if ran else 0
        if self._store is None or self._runs.planner.world_size == 1:
            self.result.base_ns = mine or None
            return
        self._store.set(f"{self._key}/{self._runs.rank}", str(mine))
        firsts = [int(self._store.get(f"{self._key}/{r}")) for r in range(self._runs.planner.world_size)]
        ran_any = [t for t in firsts if t]
        self.result.base_ns = min(ran_any) if ran_any else None


def check_traceable(backend: Any, rank: int) -> None:
    """RuntimeUnavailable unless ``backend`` can run traced launches (the GPU runtime's)."""
    if backend is None or not backend.launch.traces:
        raise RuntimeUnavailable(f"rank {rank}: comm.trace() needs the GPU runtime (traced kernels); on a "
                                 "CPU, `mscclang predict PLAN --trace FILE` writes the predicted timeline")
