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

A pipeline body is checked on its own (fresh ranges at the start of the body); the pipeline op
as a whole counts as touching everything its body touches. Iterations follow each other with no
``nop`` of their own, so the body is then checked across iterations (:func:`pipeline_body`):
an access of iteration ``j`` and one of iteration ``j' > j`` are unordered when no ``nop`` (or
``barrier``) of the body lies after the first one's op or before the second one's op, i.e. the
first lies in the body's *tail* (after its last ``nop``) and the second in its *head* (before
its first ``nop``); with no ``nop`` at all, every op is in both, and pairs further apart than one
iteration are unordered as well. Such a pair needs a ``nop`` when its chunk ranges conflict and
the two are not pipelined the same way (:mod:`mscclang.compiler.slices`: same range, same stream
chunk lengths, hence disjoint byte slices in different iterations; e.g. a slot written late in
an iteration as ``s[1:2]`` and read early in the next as part of ``s[0:2]`` overlaps whenever a
chunk is not a multiple of the unit). The pass puts the ``nop`` right before the first such head
op and repeats until no pair is left: one ``nop`` per iteration at most per hazard, and none for
bodies whose ops reuse ranges the same way (the usual pipelined copy/reduce/put chains).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from mscclang.compiler.ir import AccessIndex, IROp, IRProgram, accesses
from mscclang.compiler.meter import each_rank
from mscclang.compiler.slices import ChunkClasses, chunk_classes, cross_iteration_conflict, stream_accesses
from mscclang.plan.collectives import CollectiveSpec
from mscclang.plan.models import OpName

_SYNCS = (OpName.nop, OpName.barrier)


def pipeline_body(body: list[IROp], spec: Optional[CollectiveSpec] = None,
                  classes: Optional[dict[int, ChunkClasses]] = None) -> list[IROp]:
    """Hazard nops of a pipeline body: within one iteration (as :func:`hazard_ops`), then across
    consecutive iterations (see the module docstring). ``classes`` (each rank's chunk length
    classes, :func:`mscclang.compiler.slices.chunk_classes`) lets accesses through user buffers
    count as pipelined the same way; without it only scratch-only streams do."""
    body = hazard_ops(body, spec, classes)
    cls = classes or {}
    while True:
        syncs = [k for k, op in enumerate(body) if op.name in _SYNCS]
        first = syncs[0] if syncs else len(body)
        last = syncs[-1] if syncs else -1
        tail = [a for op in body[last + 1:] for a in stream_accesses(op, cls, spec)]
        if not tail:
            return body
        for k in range(first):
            head = stream_accesses(body[k], cls, spec)
            if any(cross_iteration_conflict(p, a) for a in head for p in tail):
                nop = IROp(OpName.nop, origin=f"hazard across pipeline iterations before {body[k].describe()}",
                           source=body[k].source)
                body = body[:k] + [nop] + body[k:]
                break
        else:
            return body


def hazard_ops(ops: list[IROp], spec: Optional[CollectiveSpec] = None,
               classes: Optional[dict[int, ChunkClasses]] = None) -> list[IROp]:
    """Insert hazard nops into one op list (pipeline bodies through :func:`pipeline_body`);
    ``spec`` (the program's collective) makes in-place input/output aliases count as the same
    bytes; ``classes`` as for :func:`pipeline_body`."""
    out: list[IROp] = []
    seen = AccessIndex()  # the accesses since the last sync
    for op in ops:
        if op.body is not None:
            op = replace(op, body=pipeline_body(op.body, spec, classes))
        if op.name in _SYNCS:
            seen = AccessIndex()
            out.append(op)
            continue
        acc = accesses(op, spec=spec)
        if any(next(seen.conflicting(a), None) is not None for a in acc):
            out.append(IROp(OpName.nop, origin=f"hazard before {op.describe()}", source=op.source))
            seen = AccessIndex()
        seen.add(acc)
        out.append(op)
    return out


def insert_hazard_syncs(ir: IRProgram) -> IRProgram:
    """Pass 4: insert ``nop`` where ops of one block touch overlapping bytes (see the module
    docstring)."""
    out = ir.copy()
    classes = {r.rank: chunk_classes(ir, i) for i, r in enumerate(ir.ranks)}
    for r in each_rank(out.ranks):
        r.tbs = [hazard_ops(ops, ir.spec, classes) for ops in r.tbs]
    return out
