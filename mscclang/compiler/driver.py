"""The compiler driver: the compiler's passes, in order (validate, fuse, data-sync nops, hazard
nops, replicate, the cycle check, emit; see :func:`lower` and :func:`compile_program`)."""

from __future__ import annotations

from mscclang.compiler.deps import check_acyclic
from mscclang.compiler.emit import emit
from mscclang.compiler.fuse import fuse
from mscclang.compiler.hazards import insert_hazard_syncs
from mscclang.compiler.ir import IRProgram
from mscclang.compiler.replicate import replicate
from mscclang.compiler.sync import insert_syncs
from mscclang.compiler.validate import validate
from mscclang.plan.models import Plan


def lower(ir: IRProgram) -> IRProgram:
    """Run passes 1-5 (validate, fuse if ``instr_fusion``, data-sync nops, hazard nops if
    ``auto_sync``, replicate) and the dependency-cycle check; ``ir`` is not modified."""
    out = validate(ir)
    if out.instr_fusion:
        out = fuse(out)
    out = insert_syncs(out)
    if out.auto_sync:
        out = insert_hazard_syncs(out)
    out = replicate(out)
    check_acyclic(out)
    return out


def compile_program(ir: IRProgram) -> Plan:
    """Compile a recorded program into a plan (deterministic: same program, same plan)."""
    return emit(lower(ir))
