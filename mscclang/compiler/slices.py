"""Which accesses of a pipeline body touch the same byte slices in every iteration.

A ``pipeline`` runs its body once per iteration; iteration ``j`` runs every inner op over bytes
``[j * unit, (j + 1) * unit)`` of that op's *stream*: the concatenation of its pieces, chunk by
chunk, each chunk as long as the shortest clipped length among the op's user-buffer operands
(``chunk_bytes`` when every operand is scratch), see :func:`mscclang.plan.layout.iteration_slice`
and ``Layout.pieces``. Packet writes into scratch also write zero-payload packets over the rest
of a short chunk's slot, in the iteration that holds the chunk's last data byte.

So two accesses of one thread block, in different iterations, touch disjoint bytes when they are
*pipelined the same way*: the same buffer range (same key, same first and last chunk, same plain
or packet view) whose streams have the same chunk lengths, at every message size, before each
byte they share. That holds when, for every chunk but the last (and the last too for packet
views, whose slot padding depends on it), the two ops' operand groups hold user-buffer chunks of
the same *length class*. Chunk ``k`` of a user buffer whose grid repeats the collective's
reference block (every buffer of the standard collectives) has class ``k mod block_chunks``;
any other user-buffer chunk is its own class; scratch operands do not clip. Accesses that are not
pipelined the same way may overlap across iterations at some message size (a range that starts
at another chunk, a plain and a packet view of one slot, a stream clipped differently before the
shared bytes), so the compiler treats them as overlapping whenever their chunk ranges do.

Replication keeps the property: the interleaved and ``none`` policies move every reference of a
group by the same rule, and equal classes stay equal under it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mscclang.compiler.ir import Access, IROp, IRProgram, Ref, accesses, conflicts, operand_roles
from mscclang.plan.collectives import CollectiveSpec
from mscclang.plan.models import BufferKind, OpName

#: ops whose operands pair up ``src[i]`` with ``dst[i]`` (one source may feed every destination)
PAIRWISE = frozenset({OpName.put, OpName.pws, OpName.pwsf, OpName.get, OpName.copy, OpName.cpkt,
                      OpName.upkt, OpName.ppkt, OpName.rppkt})
#: ops whose first source feeds every destination
BROADCAST = frozenset({OpName.gstore, OpName.gstorepkt})

LengthClass = tuple


@dataclass(frozen=True)
class ChunkClasses:
    """Length classes of one rank's user-buffer chunks (see the module docstring):
    ``block_chunks`` chunks per reference block, and the user buffers whose grid repeats it."""

    block_chunks: int
    periodic: frozenset

    def of(self, kind: BufferKind, index: int) -> LengthClass:
        """The class of chunk ``index`` of buffer ``kind``: chunks of one class have the same
        clipped length at every message size."""
        if kind in self.periodic and self.block_chunks > 0:
            return ("block", index % self.block_chunks)
        return (kind.value, index)


def chunk_classes(ir: IRProgram, rank: int) -> ChunkClasses:
    """The length classes of ``rank``'s buffers, mirroring :func:`mscclang.plan.layout.make_layout`
    (the reference block from rank 0's chunk counts, as the layout takes it)."""
    n = ir.num_ranks
    r0 = ir.ranks[0]
    cin0, cout0 = r0.input_chunks, r0.output_chunks
    me = ir.ranks[rank]
    cin, cout = me.input_chunks, me.output_chunks
    row = ir.spec.row
    bi, bo = row.blocks(n)
    periodic: set[BufferKind] = set()
    if bi > 1 or bo > 1:   # whole blocks of bc chunks: allgather, reducescatter, alltoall
        bc = cin0 // bi if cin0 % bi == 0 else 0
        if bc and cin == bi * bc:
            periodic.add(BufferKind.input)
        if bc and cout == bo * bc:
            periodic.add(BufferKind.output)
    else:
        # the block is the input (or the output when there is no input); the other buffer of a
        # standard collective has the same size, so it repeats the block only when its chunk
        # count is the block's; test/custom collectives may size it freely, and the fused
        # collective's FP8 output has other bytes
        bc = cin0 if cin0 > 0 else cout0
        block_kind = BufferKind.input if cin0 > 0 else BufferKind.output
        if me.chunks(block_kind) == bc:
            periodic.add(block_kind)
        other = BufferKind.output if block_kind == BufferKind.input else BufferKind.input
        if row.sized and not row.fused and me.chunks(other) == bc:
            periodic.add(other)
    return ChunkClasses(bc, frozenset(periodic))


@dataclass(frozen=True)
class StreamAccess:
    """An :class:`~mscclang.compiler.ir.Access` with the length classes of its op's stream:
    ``lengths[t]`` is the set of classes of the group's user-buffer chunks at chunk ``t``
    (empty: every operand is scratch, the chunk is ``chunk_bytes`` long)."""

    access: Access
    lengths: tuple


def _groups(op: IROp) -> list[list[int]]:
    """Operand indexes (sources first, then destinations) of each group the op moves chunk by
    chunk, as the simulator and the executor pair them."""
    ns, nd = len(op.src), len(op.dst)
    if op.name in PAIRWISE and ns == nd:
        return [[i, ns + i] for i in range(ns)]
    if op.name in BROADCAST:
        return [[0] + [ns + i for i in range(nd)]] if ns else [[ns + i for i in range(nd)]]
    return [list(range(ns + nd))]


def stream_accesses(op: IROp, classes: dict[int, ChunkClasses],
                    spec: Optional[CollectiveSpec] = None) -> list[StreamAccess]:
    """The accesses of one (non-pipeline) op with the length classes of their streams;
    ``classes`` maps each rank to its :class:`ChunkClasses`."""
    if op.name == OpName.pipeline:
        return []
    roles = operand_roles(op)
    accs = accesses(op, spec=spec)   # one per role, in the same order
    out: list[StreamAccess] = []
    for group in _groups(op):
        idx = [i for i in group if i < len(roles)]
        user: list[Ref] = [roles[i][0] for i in idx if roles[i][0].buffer != BufferKind.scratch]
        size = max((roles[i][0].size for i in idx), default=0)
        lengths = tuple(
            frozenset(classes[ref.rank].of(ref.buffer, ref.index + t) if ref.rank in classes
                      else (ref.buffer.value, ref.index + t) for ref in user)
            for t in range(size))
        for i in idx:
            out.append(StreamAccess(accs[i], lengths[:roles[i][0].size]))
    return out


def same_slices(a: StreamAccess, b: StreamAccess) -> bool:
    """Whether ``a`` and ``b`` are pipelined the same way: in two different iterations they
    touch disjoint bytes (see the module docstring)."""
    x, y = a.access, b.access
    if (x.key, x.start, x.end, x.packet) != (y.key, y.start, y.end, y.packet):
        return False
    n = len(a.lengths)
    if len(b.lengths) != n:
        return False
    upto = n if x.packet else n - 1
    return a.lengths[:upto] == b.lengths[:upto]


def cross_iteration_conflict(earlier: StreamAccess, later: StreamAccess) -> bool:
    """Whether ``later``, in a later iteration of the same pipeline, must wait for ``earlier``
    on every thread: their chunk ranges conflict (:func:`mscclang.compiler.ir.conflicts`) and
    they are not pipelined the same way."""
    return conflicts(earlier.access, later.access) and not same_slices(earlier, later)
