"""The benchmark's case families: cases whose buffers, sizes, columns and checks are their own
rather than a plain collective's (the fused allreduce + RMSNorm, all-to-all-v, MoE dispatch and
combine).

A :class:`Family` is one record of what the worker needs from such a module; :func:`family_of`
answers, for a case name, the family serving it (None for the plain collectives, which the worker
runs itself). The worker calls nothing of these modules but through this record, so a new family
is one module and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from mscclang.bench import alltoallv, fused, moe
from mscclang.bench.cells import Cell

if TYPE_CHECKING:
    from mscclang.bench.worker import BenchWorker

__all__ = ["Family", "FAMILIES", "family_of"]


@dataclass(frozen=True)
class Family:
    """One family of cases: its case names, its columns (``impls``, in table order), its byte
    sizes ``sizes(cfg, esz, world)``, a cell ``make_cell(worker, case, impl, nbytes)``, fresh
    inputs ``fill(worker, cell) -> seed``, the check ``compare(worker, cell, seed) -> (ok, why)``,
    the collective whose bus-bandwidth factor its records use (``bus``), and, when its timing is
    its own, the modes it is timed in and ``measure(worker, cell, mode, iters) -> sorted times``
    (None: the worker's graph and eager modes)."""

    cases: tuple[str, ...]
    impls: tuple[str, ...]
    sizes: Callable[[Any, int, int], list[int]]
    make_cell: Callable[["BenchWorker", str, str, int], Cell]
    fill: Callable[["BenchWorker", Any], int]
    compare: Callable[["BenchWorker", Any, int], tuple[bool, str]]
    bus: str
    modes: Optional[tuple[str, ...]] = None
    measure: Optional[Callable[["BenchWorker", Any, str, int], list[float]]] = None


FAMILIES: tuple[Family, ...] = (
    Family(cases=(fused.FUSED,), impls=fused.FUSED_IMPLS, sizes=lambda cfg, esz, n: fused.fused_sizes(cfg, esz),
           make_cell=lambda w, case, impl, nbytes: fused.make_cell(w, impl, nbytes),
           fill=fused.fill, compare=fused.compare, bus=fused.FUSED),
    Family(cases=tuple(alltoallv.CASES), impls=alltoallv.IMPLS, sizes=alltoallv.sizes, make_cell=alltoallv.make_cell,
           fill=alltoallv.fill, compare=alltoallv.compare, bus="alltoallv"),
    Family(cases=tuple(moe.CASES), impls=moe.IMPLS, sizes=moe.sizes, make_cell=moe.make_cell, fill=moe.fill,
           compare=moe.compare, bus="alltoallv", modes=moe.MODES, measure=moe.measure),
)


def family_of(case: str) -> Optional[Family]:
    """The family serving ``case``, or None for a plain collective."""
    for f in FAMILIES:
        if case in f.cases:
            return f
    return None
