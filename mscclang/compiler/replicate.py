"""Pass 5: replication of ``instances = k`` copies of the program.

Every thread block ``t`` becomes blocks ``t*k + i`` (instance ``i``); every channel ``j`` becomes
channels ``j*k + i`` (each ``connected_to`` entry repeated ``k`` times in a row, so pairing by
ordinal still matches instance ``i`` with instance ``i`` on the peer); semaphores, switch
channels and barrier ids likewise become ``id*k + i`` (barrier member lists map their blocks
too). Buffers get ``k`` times as many chunks. Chunk references move by the policy:

* ``interleaved``: ``(c, s) -> (c*k + i*s, s)`` (MSCCL++'s rule: the reference's expanded range
  ``[c*k, (c+s)*k)`` is cut into ``k`` pieces of ``s`` chunks, one per instance). As in MSCCL++,
  data shared between references must be addressed with identical ranges everywhere.
* ``none``: each *block* of a buffer keeps its instances' copies one after the other: a buffer
  with ``B`` blocks of ``b`` chunks (the collective's per-rank blocks: allgather's output,
  reduce-scatter's input and all-to-all's buffers have one block per rank of ``chunk_factor``
  chunks; every other buffer, and scratch, is one block) maps ``(c, s)`` of instance ``i`` to
  ``(c//b * b*k + i*b + c%b, s)``. A reference must stay inside one block. This keeps each
  rank's block contiguous, so the replicated plan still implements the collective with chunk
  factor ``f*k`` (shifting every reference by ``i * chunk count`` would not: instance 1 of an
  allgather would write rank 0's data into rank 1's block).

The pass runs once: replicating a replicated program is an error (MSCCL++ replicated ``k^2``
times when post-processing ran twice).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from mscclang.compiler.ir import IROp, IRProgram, IRRank, IRSwitch, Ref
from mscclang.errors import CompileError
from mscclang.plan.models import BufferKind


def block_size(ir: IRProgram, rank: int, kind: BufferKind) -> int:
    """Chunks per block of ``kind`` on ``rank`` for the ``none`` policy (see the module docstring)."""
    spec = ir.spec
    f = spec.chunk_factor
    n = ir.ranks[rank].chunks(kind)
    name = spec.name
    if kind == BufferKind.output and name in ("allgather", "alltoall") and n == spec.num_ranks * f:
        return f
    if kind == BufferKind.input and name in ("reducescatter", "alltoall") and n == spec.num_ranks * f:
        return f
    return max(n, 1)


def _mapper(ir: IRProgram, k: int, i: int) -> Callable[[Ref, str], Ref]:
    if ir.replication_policy == "interleaved":
        def interleaved(ref: Ref, where: str) -> Ref:
            return ref.moved(ref.index * k + i * ref.size)
        return interleaved

    def none_policy(ref: Ref, where: str) -> Ref:
        b = block_size(ir, ref.rank, ref.buffer)
        blk, off = divmod(ref.index, b)
        if (ref.index + ref.size - 1) // b != blk:
            raise CompileError(
                f"{where}: with ReplicationPolicy.none a reference must stay inside one block of "
                f"{b} chunks, but {ref.describe()} crosses a block boundary; use ReplicationPolicy.interleaved")
        return ref.moved(blk * b * k + i * b + off)
    return none_policy


def _replicate_op(op: IROp, k: int, i: int, move: Callable[[Ref, str], Ref], where: str) -> IROp:
    body = None
    if op.body is not None:
        body = [_replicate_op(x, k, i, move, f"{where}.{j}") for j, x in enumerate(op.body)]
    return replace(
        op,
        src=[move(x, where) for x in op.src],
        dst=[move(x, where) for x in op.dst],
        channels=[c * k + i for c in op.channels],
        semaphores=[s * k + i for s in op.semaphores],
        barrier_id=None if op.barrier_id is None else op.barrier_id * k + i,
        barrier_tbs=None if op.barrier_tbs is None else [t * k + i for t in op.barrier_tbs],
        body=body,
    )


def _switch_ref_fix(ref: Ref, k: int, i: int) -> Ref:
    if ref.switch is None:
        return ref
    return replace(ref, switch=ref.switch * k + i)


def replicate(ir: IRProgram) -> IRProgram:
    """Pass 5: make ``ir.instances`` copies (see the module docstring); ``instances == 1`` is the
    identity. Raises CompileError on a second replication."""
    if ir.replicated:
        raise CompileError(f"program {ir.name!r} is already replicated; replicating again would make "
                           f"{ir.instances}^2 instances")
    out = ir.copy()
    k = ir.instances
    out.replicated = True
    if k == 1:
        return out
    new_ranks: list[IRRank] = []
    for r in ir.ranks:
        nr = IRRank(r.rank, r.input_chunks * k, r.output_chunks * k, r.scratch_chunks * k,
                    memory=[p for p in r.memory for _ in range(k)],
                    port=[p for p in r.port for _ in range(k)],
                    switch=[IRSwitch(s.buffer, list(s.ranks)) for s in r.switch for _ in range(k)],
                    semaphores=[v for v in r.semaphores for _ in range(k)],
                    tbs=[[] for _ in range(len(r.tbs) * k)])
        for t, ops in enumerate(r.tbs):
            for i in range(k):
                move = _mapper(ir, k, i)
                new_ops = []
                for idx, op in enumerate(ops):
                    where = f"rank {r.rank}, tb {t}, op {idx} ({op.describe()})"
                    new = _replicate_op(op, k, i, move, where)
                    new_ops.append(_fix_switch(new, k, i))
                nr.tbs[t * k + i] = new_ops
        new_ranks.append(nr)
    out.ranks = new_ranks
    return out


def _fix_switch(op: IROp, k: int, i: int) -> IROp:
    body = None if op.body is None else [_fix_switch(x, k, i) for x in op.body]
    return replace(op, src=[_switch_ref_fix(x, k, i) for x in op.src],
                   dst=[_switch_ref_fix(x, k, i) for x in op.dst], body=body)
