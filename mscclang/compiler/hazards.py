"""Pass 4: hazard syncs inside a thread block.

Threads of a block split each data op differently (by op size, thread-block group, pipeline
slice), so an op that reads or writes bytes an earlier op of the same block wrote (or writes bytes
it read) must wait for every thread to finish that earlier op: the pass inserts a ``nop`` right
before it. It walks each block keeping the byte ranges (chunk granularity, see
:class:`mscclang.compiler.ir.Access`) touched since the last ``nop``/``barrier``; local buffers,
peers' buffers (through remote references) and multicast ranges (as this rank's own buffer) are
all tracked.

The packet rule (:func:`mscclang.compiler.ir.conflicts`): LL packets carry a flag in the same
vector store as their data, and a packet reader spins on the flag. So *packet write -> packet read*
of the same slot needs no ``nop`` — the reader waits for the data itself. Everything else does:
*packet read -> packet write* (a thread could overwrite a packet, with the same flag, before
another thread of the block read it), *packet write -> packet write* (readers could see either),
and any plain access to bytes also used as packets.

In-place collectives: the input and the output are the same memory, so ranges are compared
after :func:`mscclang.compiler.ir.alias_range` maps them into one buffer's chunks (an in-place
allreduce's ``input[c]`` is ``output[c]``; an in-place allgather's ``input[c]`` is rank ``r``'s
``output[r*f + c]``; an in-place reduce-scatter's ``output[c]`` is ``input[r*f + c]``), on this
rank and on peers alike.

A pipeline body is checked on its own (fresh ranges at the start of the body; iterations touch
different slices); the pipeline op as a whole counts as touching everything its body touches.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from mscclang.compiler.ir import Access, IROp, IRProgram, accesses, conflicts
from mscclang.plan.collectives import CollectiveSpec
from mscclang.plan.models import OpName


def hazard_ops(ops: list[IROp], spec: Optional[CollectiveSpec] = None) -> list[IROp]:
    """Insert hazard nops into one op list (pipeline bodies recursively); ``spec`` (the
    program's collective) makes in-place input/output aliases count as the same bytes."""
    out: list[IROp] = []
    seen: list[Access] = []
    for op in ops:
        if op.body is not None:
            op = replace(op, body=hazard_ops(op.body, spec))
        if op.name in (OpName.nop, OpName.barrier):
            seen = []
            out.append(op)
            continue
        acc = accesses(op, spec=spec)
        if any(conflicts(p, a) for a in acc for p in seen):
            out.append(IROp(OpName.nop, origin=f"hazard before {op.describe()}"))
            seen = []
        seen.extend(acc)
        out.append(op)
    return out


def insert_hazard_syncs(ir: IRProgram) -> IRProgram:
    """Pass 4: insert ``nop`` where ops of one block touch overlapping bytes (see the module
    docstring)."""
    out = ir.copy()
    for r in out.ranks:
        r.tbs = [hazard_ops(ops, ir.spec) for ops in r.tbs]
    return out
