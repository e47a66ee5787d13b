"""The compiler driver: the compiler's passes, in order (validate, fuse, data-sync nops, hazard
nops, replicate, the cycle check, emit; see :func:`lower` and :func:`compile_program`)."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

from mscclang.compiler import meter
from mscclang.compiler.budget import PlanEstimate, check_ops, check_plan, check_ranks, estimate_plan
from mscclang.compiler.deps import check_acyclic
from mscclang.compiler.emit import emit
from mscclang.compiler.fuse import fuse
from mscclang.compiler.hazards import insert_hazard_syncs
from mscclang.compiler.ir import IRProgram
from mscclang.compiler.replicate import replicate
from mscclang.compiler.sync import insert_syncs
from mscclang.compiler.validate import MAX_THREADBLOCKS, validate
from mscclang.errors import DSLError
from mscclang.plan.models import Plan

_PASSES = (("validate", validate), ("fuse", fuse), ("syncs", insert_syncs), ("hazards", insert_hazard_syncs),
           ("replicate", replicate))


def _check(ir: IRProgram) -> PlanEstimate:
    """Refuse a program over the budget (:mod:`mscclang.compiler.budget`; at most
    ``MAX_THREADBLOCKS`` thread blocks per rank once replicated); return its estimate."""
    check_ranks(ir.num_ranks, f"program {ir.name!r}")
    check_ops(sum(1 + len(op.body or ()) for r in ir.ranks for tb in r.tbs for op in tb), ir.instances,
              f"program {ir.name!r}")
    for r in ir.ranks:
        if len(r.tbs) * ir.instances > MAX_THREADBLOCKS:
            raise DSLError(f"rank {r.rank} uses {len(r.tbs)} thread blocks x {ir.instances} instances; at most "
                           f"{MAX_THREADBLOCKS} are allowed")
    estimate = estimate_plan(ir)
    check_plan(estimate, f"program {ir.name!r}")
    return estimate


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector in the block (restored after). Recording a program
    and compiling it make millions of small objects and no reference cycles: the collector would
    scan the growing program again and again (a third of the time at 128 and 300 ranks) and find
    nothing to free. The passes run with it paused; ``mscclang compile`` records with it paused
    too."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _lower(ir: IRProgram, estimate: PlanEstimate) -> IRProgram:
    out = ir
    for name, run in _PASSES:
        if (name == "fuse" and not ir.instr_fusion) or (name == "hazards" and not ir.auto_sync):
            continue
        with meter.step(name, 1e6 * estimate.steps[name]):
            out = run(out)
    with meter.step("cycle check", 1e6 * estimate.steps["cycles"]):
        check_acyclic(out)
    return out


def lower(ir: IRProgram) -> IRProgram:
    """Run passes 1-5 (validate, fuse if ``instr_fusion``, data-sync nops, hazard nops if
    ``auto_sync``, replicate) and the dependency-cycle check; ``ir`` is not modified. A program
    over the budget (see :func:`_check`) is refused before the first pass."""
    estimate = _check(ir)
    with collector_paused():
        return _lower(ir, estimate)


def compile_program(ir: IRProgram) -> Plan:
    """Compile a recorded program into a plan (deterministic: same program, same plan). Refused
    before the first pass as :func:`lower` says; the progress (:mod:`mscclang.compiler.meter`)
    counts the recording as done, then the passes and emitting the plan, and leaves writing it
    out (the tail) to the caller."""
    estimate = _check(ir)
    steps = estimate.steps
    meter.start(1e6 * sum(steps.values()), 1e6 * steps["record"], [sum(len(tb) for tb in r.tbs) for r in ir.ranks],
                1e6 * steps["write"])
    with collector_paused():
        out = _lower(ir, estimate)
        with meter.step("emit", 1e6 * steps["emit"]):
            plan = emit(out)
    meter.advance("serialising the plan", 0.0)
    return plan
