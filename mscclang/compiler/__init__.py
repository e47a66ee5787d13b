"""The compiler: IR, passes (validate, fuse, sync, hazards, replicate, emit), dependency graph."""

from mscclang.compiler.deps import build_graph, check_acyclic
from mscclang.compiler.driver import compile_program, lower
from mscclang.compiler.emit import emit
from mscclang.compiler.fuse import fuse
from mscclang.compiler.hazards import insert_hazard_syncs
from mscclang.compiler.ir import Access, IROp, IRProgram, IRRank, IRSwitch, Ref
from mscclang.compiler.replicate import replicate
from mscclang.compiler.sync import insert_syncs
from mscclang.compiler.validate import MAX_THREADBLOCKS, validate

__all__ = [
    "MAX_THREADBLOCKS", "Access", "IROp", "IRProgram", "IRRank", "IRSwitch", "Ref", "build_graph",
    "check_acyclic", "compile_program", "emit", "fuse", "insert_hazard_syncs", "insert_syncs", "lower",
    "replicate", "validate",
]
