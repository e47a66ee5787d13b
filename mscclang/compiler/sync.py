"""Pass 3: block syncs for ``data_sync``.

Signal, wait, flush and semaphore ops run on one thread per channel (or semaphore), while data ops
run on every thread of the block. A ``nop`` (``__syncthreads``) before such an op makes the whole
block's earlier writes precede it (so a release signal publishes them); one after it makes the
block's later accesses follow it (so data read after an acquiring wait is current). This pass
inserts a ``nop`` before each sync op whose ``data_sync`` has ``before`` and after each one with
``after``, then merges runs: ``nop nop -> nop``, ``nop barrier -> barrier``,
``barrier nop -> barrier`` (a barrier synchronises the block on both sides).
"""

from __future__ import annotations

from dataclasses import replace

from mscclang.compiler.ir import SYNC_AFTER, SYNC_BEFORE, IROp, IRProgram
from mscclang.compiler.meter import each_rank
from mscclang.plan.models import SYNC_OPS, OpName


def merge_syncs(ops: list[IROp]) -> list[IROp]:
    """Collapse adjacent nops, and nops next to barriers."""
    out: list[IROp] = []
    for op in ops:
        if out:
            prev = out[-1]
            if op.name == OpName.nop and prev.name in (OpName.nop, OpName.barrier):
                continue
            if op.name == OpName.barrier and prev.name == OpName.nop:
                out[-1] = op
                continue
        out.append(op)
    return out


def sync_ops(ops: list[IROp]) -> list[IROp]:
    """Insert the data-sync nops of one op list (pipeline bodies recursively)."""
    out: list[IROp] = []
    for op in ops:
        if op.body is not None:
            op = replace(op, body=sync_ops(op.body))
        if op.name in SYNC_OPS and op.data_sync & SYNC_BEFORE:
            out.append(IROp(OpName.nop, origin=f"sync before {op.describe()}", source=op.source))
        out.append(op)
        if op.name in SYNC_OPS and op.data_sync & SYNC_AFTER:
            out.append(IROp(OpName.nop, origin=f"sync after {op.describe()}", source=op.source))
    return merge_syncs(out)


def insert_syncs(ir: IRProgram) -> IRProgram:
    """Pass 3: insert ``nop`` around sync ops per their ``data_sync`` (see the module docstring)."""
    out = ir.copy()
    for r in each_rank(out.ranks):
        r.tbs = [sync_ops(ops) for ops in r.tbs]
    return out
