"""The compiler driver: the compiler's passes, in order (validate, fuse, data-sync nops, hazard
nops, replicate, the cycle check, emit; see :func:`lower` and :func:`compile_program`)."""

from __future__ import annotations

from mscclang.compiler.budget import check_ops, check_ranks, report
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


def lower(ir: IRProgram) -> IRProgram:
    """Run passes 1-5 (validate, fuse if ``instr_fusion``, data-sync nops, hazard nops if
    ``auto_sync``, replicate) and the dependency-cycle check; ``ir`` is not modified. A program
    over the budget (:mod:`mscclang.compiler.budget`, and at most ``MAX_THREADBLOCKS`` thread
    blocks per rank once replicated) is refused before the first pass."""
    ops = sum(1 + len(op.body or ()) for r in ir.ranks for tb in r.tbs for op in tb)
    check_ranks(ir.num_ranks, f"program {ir.name!r}")
    check_ops(ops, ir.instances, f"program {ir.name!r}")
    for r in ir.ranks:
        if len(r.tbs) * ir.instances > MAX_THREADBLOCKS:
            raise DSLError(f"rank {r.rank} uses {len(r.tbs)} thread blocks x {ir.instances} instances; at most "
                           f"{MAX_THREADBLOCKS} are allowed")
    passes = [p for p in (validate, fuse if ir.instr_fusion else None, insert_syncs,
                          insert_hazard_syncs if ir.auto_sync else None, replicate) if p is not None]
    total = ops * (2 + len(passes))  # recording, the passes, the cycle check (about as long each)
    out = ir
    for i, run in enumerate(passes):
        report(ops * (1 + i), total)
        out = run(out)
    report(total - ops, total)
    check_acyclic(out)
    report(total, total)
    return out


def compile_program(ir: IRProgram) -> Plan:
    """Compile a recorded program into a plan (deterministic: same program, same plan)."""
    return emit(lower(ir))
