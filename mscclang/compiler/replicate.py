"""Pass 5: replication of ``instances = k`` copies of the program.

Every thread block ``t`` becomes blocks ``t*k + i`` (instance ``i``); every channel ``j`` becomes
channels ``j*k + i`` (each ``connected_to`` entry repeated ``k`` times in a row, so pairing by
ordinal still matches instance ``i`` with instance ``i`` on the peer); semaphores, switch
channels and barrier ids likewise become ``id*k + i`` (barrier member lists map their blocks
too). Buffers get ``k`` times as many chunks. Chunk references move by the policy:

* ``interleaved``: ``(c, s) -> (c*k + i*s, s)`` (MSCCL++'s rule: the reference's expanded range
  ``[c*k, (c+s)*k)`` is cut into ``k`` pieces of ``s`` chunks, one per instance). As in MSCCL++,
  data shared between references must be addressed with identical ranges everywhere: the old
  chunk ``c + j`` at position ``j`` of a reference ``(c, s)`` lands in new chunk
  ``c*k + i*s + j``, but addressed alone as ``(c + j, 1)`` in new chunk ``(c + j)*k + i``, so the
  two ops would hand each instance different data (a plan that is silently wrong or racy: the
  instances' thread blocks are not synchronised with each other). :func:`check_interleaved_ranges`
  (run by the validation pass when ``instances > 1``) rejects such programs with a
  :class:`~mscclang.errors.DSLError` naming both ops whenever one of the two writes the shared
  bytes (an error, not a warning: the plan it would produce has an unordered cross-block
  dependency); read-only sharing, and LL packets written and read as packets, stay allowed.
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

from mscclang.compiler.ir import IROp, IRProgram, IRRank, IRSwitch, Ref, alias_range, op_where, operand_roles
from mscclang.compiler.meter import each_rank
from mscclang.errors import CompileError, DSLError
from mscclang.plan.models import BufferKind


def block_size(ir: IRProgram, rank: int, kind: BufferKind) -> int:
    """Chunks per block of ``kind`` on ``rank`` for the ``none`` policy (see the module docstring)."""
    spec = ir.spec
    f = spec.chunk_factor
    n = ir.ranks[rank].chunks(kind)
    bi, bo = spec.row.blocks(spec.num_ranks)
    if (bo if kind == BufferKind.output else bi) > 1 and n == spec.num_ranks * f:
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


def _ref_ranges(ir: IRProgram, rank: int, ref: Ref, packet: bool) -> list[tuple[tuple[int, BufferKind], int, int]]:
    """((owner rank, buffer), start, end) of the bytes ``ref`` names, in plain chunk units (LL
    packet ranges doubled, as in :class:`mscclang.compiler.ir.Access`; interleaving commutes with
    that doubling). A multicast reference names every member's buffer; in-place input/output
    aliases are expressed in one buffer (:func:`mscclang.compiler.ir.alias_range`)."""
    if ref.switch is not None:
        sw = ir.ranks[rank].switch
        if not 0 <= ref.switch < len(sw):
            return []
        owners = [(m, sw[ref.switch].buffer) for m in sw[ref.switch].ranks]
    else:
        owners = [(ref.rank, ref.buffer)]
    scale = 2 if packet and ref.buffer == BufferKind.scratch else 1
    out = []
    for owner, buf in owners:
        kind, a, b = alias_range(ir.spec, owner, buf, scale * ref.index, scale * ref.end)
        out.append(((owner, kind), a, b))
    return out


def _roles_conflict(x: tuple[bool, bool], y: tuple[bool, bool]) -> bool:
    """Whether uses ``(write, packet)`` of the same bytes by different instances' blocks need an
    order: not when both read, nor between an LL packet write and a packet read (flags order
    those whichever block writes)."""
    (wx, px), (wy, py) = x, y
    if not wx and not wy:
        return False
    if px and py and wx != wy:
        return False
    return True


def check_interleaved_ranges(ir: IRProgram) -> None:
    """Raise :class:`DSLError` when, with ``instances > 1`` and the interleaved policy, two ops
    address overlapping chunks of one buffer with different ranges and one of them writes them
    (see the module docstring).

    Interleaving moves every reference by the same rule, so the data itself still flows right;
    what changes is *which instance* handles each piece: with ``k`` instances, old chunk ``c + j``
    at position ``j`` of a reference ``(c, s)`` is handled by instance ``(j*k + m) // s`` for its
    piece ``m``, but by instance ``m`` when addressed alone. When both ops only read the bytes
    (e.g. the one-shot LL allreduce packing its whole input at once and reducing it chunk by
    chunk), nothing depends on that. When one of them writes, the other depends on a write made by
    another instance's thread block, and nothing orders the two (nops, barriers, semaphores and
    channels are all per instance): the plan is racy, and its outputs wrong on a GPU. The one
    exception is an LL packet write read as packets, whose flags order it across blocks.

    Both ops are named (rank, thread block, op index, DSL call) with the ranges they use. Buffers
    are compared by the bytes they hold: a peer's buffer reached remotely is that peer's buffer,
    a multicast range covers every member's buffer, and an in-place collective's input is the
    matching part of its output."""
    if ir.instances <= 1 or ir.replication_policy != "interleaved":
        return
    # per (owner, buffer): per distinct range: per role (write, packet): the first op using it
    uses: dict[tuple[int, BufferKind], dict[tuple[int, int], dict[tuple[bool, bool], str]]] = {}
    for r in ir.ranks:
        for t, ops in enumerate(r.tbs):
            for i, op in enumerate(ops):
                inner = [(str(i), op)] if op.body is None else [(f"{i}.{j}", x) for j, x in enumerate(op.body)]
                for idx, x in inner:
                    for ref, write, packet in operand_roles(x):
                        for key, a, b in _ref_ranges(ir, r.rank, ref, packet):
                            verb = "writes" if write else "reads"
                            uses.setdefault(key, {}).setdefault((a, b), {}).setdefault(
                                (write, packet),
                                f"{op_where(r.rank, t, idx, x)} {verb} "
                                f"{'packets in ' if packet else ''}{ref.describe()}")
    for (owner, kind), ranges in sorted(uses.items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
        order = sorted(ranges)
        for ai, ra in enumerate(order):
            for rb in order[ai + 1:]:
                if rb[0] >= ra[1]:
                    break
                for role_a, where_a in sorted(ranges[ra].items()):
                    for role_b, where_b in sorted(ranges[rb].items()):
                        if not _roles_conflict(role_a, role_b):
                            continue
                        unit = "plain chunk units" if not (role_a[1] or role_b[1]) else "plain chunk units, packets doubled"
                        raise DSLError(
                            f"instances={ir.instances} with ReplicationPolicy.interleaved: rank {owner}'s "
                            f"{kind.name} buffer is addressed with different overlapping ranges, "
                            f"[{ra[0]}:{ra[1]}] and [{rb[0]}:{rb[1]}] ({unit}): {where_a}; {where_b}. "
                            f"Interleaving maps each reference on its own, so the instance that handles a "
                            f"piece of the shared chunks differs between the two ops, and one instance's "
                            f"thread block would depend on another's write with nothing ordering them (a racy, "
                            f"wrong plan). Address shared data with identical chunk ranges everywhere (e.g. "
                            f"one op per chunk), or use ReplicationPolicy.none")


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
    for r in each_rank(ir.ranks):
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
                    where = op_where(r.rank, t, str(idx), op)
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
