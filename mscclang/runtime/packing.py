"""Packing one rank's thread blocks into the per-block byte regions of a device plan, for one
message size (:func:`pack_blocks`): every op's operands are resolved to (buffer slot, byte offset,
length) pieces with :mod:`mscclang.plan.layout`, so the kernel only walks byte ranges. Regions
hold no device addresses; :func:`mscclang.runtime.device_plan.pack_blob` adds the header and the
address tables once the runtime knows them.

What no size changes is made once per (plan, rank) and kept in the caller's ``static`` dict: the
packed records of sync ops (memory-channel signals and waits, barriers, semaphores, nops) and the
operand descriptors of data ops, so a new size packs only its data ops' pieces.

Packet rules (docs/semantics.md): a scratch slot holding packets lives at twice its plain offset;
packet writes of ``cpkt``/``ppkt`` cover whole scratch slots, bytes past the source's end being
zero (a piece's ``valid`` says how many bytes come from the source).
"""

from __future__ import annotations

import functools
import struct as _struct
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from mscclang.errors import PlanError
from mscclang.plan.layout import Layout, Piece, make_layout, make_layouts, pipeline_iterations
from mscclang.plan.models import RELAXED_OPS, SEMAPHORE_OPS, SIGNAL_OPS, SYNC_OPS, WAIT_OPS, BufferKind, BufferRef, ChannelType, Op, OpName, PacketType, Plan, ThreadBlock
from mscclang.runtime.device_plan import (
    DOP_BARRIER, DOP_DATA, DOP_NOP, DOP_PIPELINE, DOP_RADD, DOP_RMSNORM, DOP_SEM_ACQUIRE, DOP_SEM_RELEASE,
    DOP_SIGNAL, DOP_WAIT, FLAG_READS_PACKETS, FLAG_RELAXED, FLAG_SEGMENTS, MAX_BLOCK_BYTES, MODE_PACKET, SLOT_INPUT, SLOT_OUTPUT,
    SLOT_REMOTE0, SLOT_RESIDUAL, SLOT_SCRATCH, where_of as _where,
)
from mscclang.runtime.counted import CountTables, count_tables, segment_pieces
from mscclang.runtime.ports import PortPacker, PortScript, is_port_op
from mscclang.runtime.structs import BLOCK_HEADER, DEV_OP


@functools.lru_cache(maxsize=256)
def _u16s(n: int) -> _struct.Struct:
    """``n`` little-endian u16, padded to 8 bytes (one compiled format per count)."""
    return _struct.Struct(f"<{n}H{-2 * n % 8}x")


@functools.lru_cache(maxsize=1024)
def _u64s(n: int) -> _struct.Struct:
    """``n`` little-endian u64."""
    return _struct.Struct(f"<{n}Q")


#: DevOp packed positionally, in the order :meth:`DevRecord.pack` passes its fields (a new
#: message size packs thousands of records; keywords cost more than the packing)
_DEV_OP_ORDER = ("kind", "n_src", "n_dst", "n_ids", "n_pieces", "flags", "bytes", "index", "tbg_member",
                 "tbg_size", "total", "aux0", "aux1", "tbg_unit")
if tuple(f for f, _ in DEV_OP.fields) != _DEV_OP_ORDER:
    raise ImportError("internal: DevOp's fields changed; update DevRecord.pack and _DEV_OP_ORDER")
_DEV_OP_CODEC = _struct.Struct(DEV_OP.format)


@dataclass
class DevRecord:
    """One device op before packing."""

    kind: int
    index: int
    operands: list[int] = field(default_factory=list)   # u16 descriptors
    n_src: int = 0
    ids: list[int] = field(default_factory=list)
    pieces: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)  # (len, valid, offs)
    flags: int = 0
    tbg: tuple[int, int] = (0, 1)
    tbg_unit: int = 8
    total: int = 0
    aux0: int = 0
    aux1: int = 0

    def pack(self) -> bytes:
        nops = len(self.operands)
        nid = len(self.ids)
        # u16 operand descriptors and ids, each list padded to 8 bytes; pieces as u64 words
        opnd = _u16s(nops).pack(*self.operands)
        ids = _u16s(nid).pack(*self.ids)
        words: list[int] = []
        for ln, valid, offs in self.pieces:
            if len(offs) != nops:
                raise PlanError("internal: piece operand count mismatch")
            words += (ln, valid, *offs)
        pcs = _u64s(len(words)).pack(*words)
        size = DEV_OP.size + len(opnd) + len(ids) + len(pcs)
        head = _DEV_OP_CODEC.pack(self.kind, self.n_src, nops - self.n_src, len(self.ids), len(self.pieces),
                                  self.flags, size, self.index, self.tbg[0], self.tbg[1], self.total, self.aux0,
                                  self.aux1, self.tbg_unit)
        return head + opnd + ids + pcs


@dataclass
class BlockPlan:
    """The packed region of one thread block and what the runtime must know about it."""

    region: bytes
    n_records: int


@dataclass
class PackedRank:
    """Everything size-dependent of one rank: block regions and requirements."""

    rank: int
    input_bytes: int
    output_bytes: int
    layout: Layout
    blocks: list[BlockPlan]
    scratch_bytes: int
    packet_align: int   # largest packet size (4 or 8 bytes of payload) all packet offsets allow
    uses_packets: bool
    port: Optional[PortScript] = None   # the proxy's work (port channels only)
    #: rmsnorm records: (JSON path, [(residual byte offset, length)], the dst ref's byte span in the
    #: output's own grid), checked per call (whole rows, and the output rows where they belong)
    norms: list[tuple[str, list[tuple[int, int]], tuple[int, int]]] = field(default_factory=list)

    @property
    def smem(self) -> int:
        """Dynamic shared memory of a launch: the largest block region (at least 16 bytes)."""
        return max((len(b.region) for b in self.blocks), default=16)


_STEP_BYTES, _STEP_DATA, _STEP_PIPE, _STEP_PORT = 0, 1, 2, 3


#: ops whose device records are the same at every message size (memory-channel sync and
#: semaphores; port-channel ops are not: the proxy's script is built with them)
_SIZE_FREE_OPS = (SYNC_OPS - {OpName.flush}) | {OpName.nop, OpName.barrier}


@dataclass(frozen=True)
class _DataOp:
    """The size-free part of one data record: where it comes from, its operands' u16
    descriptors, kinds and references, which operands are packets, whether its destination
    slots are written whole (packet writes), and its thread-block group."""

    index: int
    where: str
    tb: int
    descs: tuple[int, ...]
    kinds: tuple[BufferKind, ...]
    refs: tuple[BufferRef, ...]
    packets: tuple[bool, ...]
    n_src: int
    whole_slots: bool
    reads_packets: bool
    tbg: tuple[int, int]
    kind: int = DOP_DATA   # DOP_RADD / DOP_RMSNORM: the epilogue ops
    #: an op over segments: its size-free pieces (mscclang.runtime.counted.segment_pieces)
    segs: Optional[tuple[tuple[int, int, tuple[int, ...]], ...]] = None


def _grid_kind(kind: BufferKind, norm: bool) -> BufferKind:
    """The buffer whose chunk grid places a chunk of ``kind``: the residual's is the input's; an
    rmsnorm's rows are placed by the residual (row k of it goes to row k of the output, in the
    output's dtype: the kernel computes that address from the row)."""
    if kind == BufferKind.residual or (norm and kind == BufferKind.output):
        return BufferKind.input
    return kind


class _Packer:
    def __init__(self, plan: Plan, rank: int, layout: Layout, static: Optional[dict] = None) -> None:
        self.plan = plan
        self.static = static if static is not None else {}   # (tb, op) -> packed records of sync ops
        self.rank = rank
        self.gpu = plan.gpus[rank]
        self.layout = layout
        self.port = PortPacker(plan, rank)
        self.unit = max(plan.buffer_alignment, 8)
        self.packet_align = max(p.align for p in PacketType)
        self.uses_packets = False
        self.norms: list[tuple[str, list[tuple[int, int]], tuple[int, int]]] = []
        self._tables: Optional[CountTables] = None

    @property
    def tables(self) -> CountTables:
        """The plan's segment table and count checks (made when a segment op is first packed)."""
        if self._tables is None:
            self._tables = count_tables(self.plan)
        return self._tables

    # operands ---------------------------------------------------------------------------------
    def operand(self, ref: BufferRef, op: Op, tb: ThreadBlock, where: str, packet: bool) -> tuple[int, BufferKind]:
        mode = (MODE_PACKET << 8) if packet else 0
        if ref.type is not None:
            slot = {BufferKind.input: SLOT_INPUT, BufferKind.output: SLOT_OUTPUT, BufferKind.scratch: SLOT_SCRATCH,
                    BufferKind.residual: SLOT_RESIDUAL}.get(ref.type)
            if slot is None:
                raise PlanError(f"rank {self.rank} thread block {tb.id}: buffer kind {ref.type.value!r} cannot be "
                                "an operand", where)
            kind = ref.type
        elif ref.buffer_id is not None:
            ct = op.channel_type if op.channel_type != ChannelType.none else ChannelType.memory
            lst = tb.remote_buffer_list(ct)
            if ref.buffer_id >= len(lst):
                raise PlanError(f"rank {self.rank} thread block {tb.id}: buffer_id {ref.buffer_id} is not in "
                                f"the thread block's {len(lst)} remote buffers of type {ct.value}", where)
            k = lst[ref.buffer_id]
            if not 0 <= k < len(self.gpu.remote_buffers):
                raise PlanError(f"rank {self.rank} thread block {tb.id}: remote buffer {k} is not declared",
                                where)
            kind = self.gpu.remote_buffers[k].type
            slot = SLOT_REMOTE0 + k
            if slot >= SLOT_RESIDUAL:
                raise PlanError(f"rank {self.rank} has more than {SLOT_RESIDUAL - SLOT_REMOTE0} remote buffers", where)
        else:
            raise PlanError(f"rank {self.rank} thread block {tb.id}: switch references are not supported", where)
        if packet and kind != BufferKind.scratch:
            raise PlanError(f"rank {self.rank} thread block {tb.id}: a packet operand must be in scratch, "
                            f"got buffer kind {kind.value!r}", where)
        return slot | mode, kind

    # pieces -----------------------------------------------------------------------------------
    def pieces(self, kinds: Sequence[BufferKind], refs: Sequence[BufferRef], where: str) -> list[Piece]:
        sizes = {r.size for r in refs}
        if len(sizes) != 1:
            raise PlanError(f"rank {self.rank}: operands of one op must span the same number of chunks, "
                            f"got {sorted(sizes)}", where)
        return self.layout.pieces([(k, r.index) for k, r in zip(kinds, refs)], refs[0].size)

    def pack_pieces(self, kinds: Sequence[BufferKind], refs: Sequence[BufferRef],
                    where: str) -> list[tuple[int, int, tuple[int, ...]]]:
        """Pieces of an op that writes packets into scratch: every destination slot is written
        whole (``length`` = slot bytes); ``valid`` bytes come from the user buffers' clipped
        chunks, the rest of a plain source reads as zero and is never written plainly."""
        sizes = {r.size for r in refs}
        if len(sizes) != 1:
            raise PlanError(f"rank {self.rank}: operands of one op must span the same number of chunks, "
                            f"got {sorted(sizes)}", where)
        lay = self.layout
        out: list[tuple[int, int, tuple[int, ...]]] = []
        ln = lay.chunk_bytes
        if ln <= 0:
            return out
        for t in range(refs[0].size):
            offs = []
            valid = ln
            for k, r in zip(kinds, refs):
                o, l_ = lay.span(k, r.index + t)
                offs.append(o)
                if k != BufferKind.scratch:
                    valid = min(valid, l_)
            if out:
                pl, pv, po = out[-1]
                if pv == pl and all(a + pl == b for a, b in zip(po, offs)):
                    out[-1] = (pl + ln, pv + valid, po)
                    continue
            out.append((ln, valid, tuple(offs)))
        return out

    # records ----------------------------------------------------------------------------------
    def data_op(self, op: Op, tb: ThreadBlock, index: int, where: str, srcs: Sequence[BufferRef],
                src_packet: Sequence[bool], dsts: Sequence[BufferRef], dst_packet: Sequence[bool],
                extend: bool = False, kind: int = DOP_DATA) -> "_DataOp":
        """The size-free part of one data record (operand descriptors and kinds)."""
        descs: list[int] = []
        kinds: list[BufferKind] = []
        packets = list(src_packet) + list(dst_packet)
        refs = list(srcs) + list(dsts)
        for r, pk in zip(refs, packets):
            d, k = self.operand(r, op, tb, where, pk)
            descs.append(d)
            kinds.append(k)
        tbg = (op.tbg_info.tb_id, op.tbg_info.tbg_size) if op.tbg_info is not None else (0, 1)
        segs = segment_pieces(self.plan, self.tables, self.rank, tb, op, refs) if self.plan.has_segments() else None
        return _DataOp(index, where, tb.id, tuple(descs), tuple(kinds), tuple(refs), tuple(packets), len(srcs),
                       extend or any(dst_packet), any(src_packet), tbg, kind, None if segs is None else tuple(segs))

    def data_record(self, d: "_DataOp") -> DevRecord:
        """The data record of ``d`` at this packer's message size."""
        if d.segs is not None:   # lengths and offsets from the count matrix, at run time
            self.uses_packets = self.uses_packets or any(d.packets)
            return DevRecord(d.kind, d.index, list(d.descs), d.n_src, pieces=list(d.segs),
                             flags=FLAG_SEGMENTS | (FLAG_READS_PACKETS if d.reads_packets else 0), tbg=d.tbg,
                             tbg_unit=self.unit)
        if d.whole_slots:
            raw = self.pack_pieces([_grid_kind(k, False) for k in d.kinds], d.refs, d.where)
        else:
            grid = [_grid_kind(k, d.kind == DOP_RMSNORM) for k in d.kinds]
            raw = [(p.length, p.length, p.offsets) for p in self.pieces(grid, d.refs, d.where)]
        if d.kind == DOP_RMSNORM:
            dst = d.refs[1]
            self.norms.append((d.where, [(offs[0], ln) for ln, _, offs in raw],
                               self.layout.ref_span(BufferKind.output, dst.index, dst.size)))
        if len(raw) > 65535:
            raise PlanError(f"rank {self.rank} thread block {d.tb} op {d.index}: {len(raw)} pieces, more than "
                            "the kernel's 65535", d.where)
        if any(d.packets):
            self.uses_packets = True
            for _, _, offs in raw:
                for o, pk in zip(offs, d.packets):
                    if pk:
                        while self.packet_align > 1 and o % self.packet_align:
                            self.packet_align //= 2
        return DevRecord(d.kind, d.index, list(d.descs), d.n_src, pieces=raw,
                         flags=FLAG_READS_PACKETS if d.reads_packets else 0,
                         total=sum(p[0] for p in raw), tbg=d.tbg, tbg_unit=self.unit)

    def _port_rec(self, kind: int, index: int, ids: list[int], flags: int, aux0: int, aux1: int) -> DevRecord:
        return DevRecord(kind, index, ids=ids, flags=flags, aux0=aux0, aux1=aux1)

    def port_records(self, op: Op, tb: ThreadBlock, index: int, where: str) -> list[DevRecord]:
        """Device records of a port-channel op (and its part of the proxy's script)."""
        n = op.name
        pp = self.port
        if n == OpName.wait:
            return [DevRecord(DOP_WAIT, index, ids=pp.wait_ids(op, tb, index, where))]
        if n == OpName.flush:
            return pp.flush(op, tb, index, where, self._port_rec)
        if n == OpName.signal:
            return pp.trigger(op, tb, index, where, True, False, [], self._port_rec)
        if n in (OpName.put, OpName.pws, OpName.pwsf):
            S, D = op.src_buff, op.dst_buff
            if len(S) != len(D) or not S:
                raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} ({n.value}) needs as many "
                                "sources as destinations", where)
            pairs = []
            for s, d in zip(S, D):
                if s.type is None or d.buffer_id is None:
                    raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} ({n.value}): a port put "
                                    "copies from a local buffer into a remote buffer", where)
                ds, dk = self.operand(d, op, tb, where, False)
                pcs = self.pieces([s.type, dk], [s, d], where)
                pairs.append((s.type, (ds & 0xFF) - SLOT_REMOTE0, [(p.length, (p.offsets[0], p.offsets[1])) for p in pcs]))
            return pp.puts(op, tb, index, where, n != OpName.put, n == OpName.pwsf, pairs, self._port_rec)
        raise PlanError(f"rank {self.rank} thread block {tb.id} op {index}: op {n.value!r} cannot run on a port "
                        "channel (put, pws, pwsf, signal, wait, flush)", where)

    def records(self, op: Op, tb: ThreadBlock, index: int, where: str) -> list[DevRecord]:
        n = op.name
        if is_port_op(op):
            return self.port_records(op, tb, index, where)
        if n == OpName.nop:
            return [DevRecord(DOP_NOP, index)]
        if n == OpName.barrier:
            return [DevRecord(DOP_BARRIER, index, aux0=op.barrier_id or 0, aux1=op.num_threadblocks or 1)]
        if n in SIGNAL_OPS | WAIT_OPS:
            lst = tb.channel_list(ChannelType.memory)
            kind = DOP_SIGNAL if n in SIGNAL_OPS else DOP_WAIT
            relaxed = FLAG_RELAXED if n in RELAXED_OPS else 0
            return [DevRecord(kind, index, ids=[lst[c] for c in op.channel_ids], flags=relaxed)]
        if n in SEMAPHORE_OPS:
            kind = DOP_SEM_ACQUIRE if n == OpName.sem_acquire else DOP_SEM_RELEASE
            return [DevRecord(kind, index, ids=list(op.semaphore_ids))]
        return [self.data_record(d) for d in self.data_ops(op, tb, index, where)]

    def data_ops(self, op: Op, tb: ThreadBlock, index: int, where: str) -> list["_DataOp"]:
        """The size-free parts of a data op's records (one per source/destination pair, or one)."""
        n = op.name
        S, D = op.src_buff, op.dst_buff
        if n in (OpName.put, OpName.get, OpName.copy):
            if len(S) != len(D) or not S:
                raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} ({n.value}) needs as many "
                                "sources as destinations", where)
            return [self.data_op(op, tb, index, where, [s], [False], [d], [False]) for s, d in zip(S, D)]
        if n in (OpName.cpkt, OpName.ppkt):
            if len(S) != len(D) or not S:
                raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} ({n.value}) needs as many "
                                "sources as destinations", where)
            return [self.data_op(op, tb, index, where, [s], [False], [d], [True], extend=True)
                    for s, d in zip(S, D)]
        if n == OpName.upkt:
            if len(S) != len(D) or not S:
                raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} (upkt) needs as many "
                                "sources as destinations", where)
            return [self.data_op(op, tb, index, where, [s], [True], [d], [False]) for s, d in zip(S, D)]
        if n == OpName.rppkt:
            if len(S) != 1 or not D:
                raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} (rppkt) needs one source "
                                "and at least one destination", where)
            return [self.data_op(op, tb, index, where, S, [True], D, [True] * len(D))]
        if n in (OpName.re, OpName.res, OpName.rre, OpName.rres):
            if not S or not D:
                raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} ({n.value}) needs sources "
                                "and a destination", where)
            order = op.reduction_order()   # the kernel reduces its sources in the order packed
            return [self.data_op(op, tb, index, where, [S[i] for i in order], [False] * len(S), D, [False] * len(D))]
        if n in (OpName.repkt, OpName.respkt, OpName.recpkt, OpName.recspkt):
            if not S or not D:
                raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} ({n.value}) needs sources "
                                "and a destination", where)
            order = op.reduction_order()   # src_buff[0] is the plain one, the others packets
            dst_pk = [False] + [True] * (len(D) - 1)
            return [self.data_op(op, tb, index, where, [S[i] for i in order], [i > 0 for i in order], D, dst_pk)]
        if n in (OpName.radd, OpName.rmsnorm):
            return [self.epilogue_op(op, tb, index, where)]
        raise PlanError(f"rank {self.rank} thread block {tb.id} op {index}: op {n.value!r} is not supported "
                        "by the GPU executor", where)

    def epilogue_op(self, op: Op, tb: ThreadBlock, index: int, where: str) -> "_DataOp":
        """radd: a sum of (src, residual) into the residual; rmsnorm: residual rows to output rows
        (both local, one reference each; the plan checks hold it, this refuses what the kernel
        cannot address)."""
        S, D = op.src_buff, op.dst_buff
        norm = op.name == OpName.rmsnorm
        want = (BufferKind.residual, BufferKind.output) if norm else (None, BufferKind.residual)
        if (len(S) != 1 or len(D) != 1 or S[0].type is None or D[0].type != want[1]
                or (want[0] is not None and S[0].type != want[0])):
            raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} ({op.name.value}): the GPU runtime "
                            "runs it on one local source and one local destination "
                            + ("(residual -> output)" if norm else "(input/output/scratch -> residual)"), where)
        if norm and (op.tbg_info is not None and op.tbg_info.tbg_size > 1):
            raise PlanError(f"rank {self.rank} thread block {tb.id} op {index}: rmsnorm takes no thread-block "
                            "group", where)
        if norm:
            return self.data_op(op, tb, index, where, S, [False], D, [False], kind=DOP_RMSNORM)
        return self.data_op(op, tb, index, where, [S[0], D[0]], [False, False], D, [False], kind=DOP_RADD)

    def steps(self, tb: ThreadBlock) -> list[tuple[int, int, Any]]:
        """The block's ops as (what, op index, payload), made once per (plan, rank) and kept in
        ``static``: ``_STEP_BYTES`` (signals, waits, barriers, semaphores: their packed records and
        how many, which no size changes), ``_STEP_DATA`` (data ops: their size-free :class:`_DataOp`),
        ``_STEP_PIPE`` and ``_STEP_PORT`` (the op, packed anew at every size)."""
        got = self.static.get(tb.id)
        if got is not None:
            return got
        out: list[tuple[int, int, Any]] = []
        for i, op in enumerate(tb.ops):
            if op.name == OpName.pipeline:
                out.append((_STEP_PIPE, i, op))
            elif is_port_op(op):
                out.append((_STEP_PORT, i, op))
            elif op.name in _SIZE_FREE_OPS:
                got = [r.pack() for r in self.records(op, tb, i, _where(self.rank, tb.id, i))]
                out.append((_STEP_BYTES, i, (b"".join(got), len(got))))
            else:
                out.append((_STEP_DATA, i, self.data_ops(op, tb, i, _where(self.rank, tb.id, i))))
        self.static[tb.id] = out
        return out

    def block(self, tb: ThreadBlock) -> BlockPlan:
        recs: list[bytes] = []
        n_recs = 0
        for what, i, payload in self.steps(tb):
            if what == _STEP_BYTES:
                recs.append(payload[0])
                n_recs += payload[1]
            elif what == _STEP_DATA:
                for d in payload:
                    recs.append(self.data_record(d).pack())
                n_recs += len(payload)
            elif what == _STEP_PORT:
                got = [r.pack() for r in self.port_records(payload, tb, i, _where(self.rank, tb.id, i))]
                recs += got
                n_recs += len(got)
            else:
                op = payload
                where = _where(self.rank, tb.id, i)
                inner: list[DevRecord] = []
                self.port.begin_pipeline()
                for j, o in enumerate(op.ops or []):
                    inner += self.records(o, tb, i, _where(self.rank, tb.id, i, j))
                ic = op.iter_context
                assert ic is not None
                totals = [r.total for r in inner if r.kind == DOP_DATA] + self.port.pipe_totals()
                if any(r.kind == DOP_DATA and (r.operands and any(d >> 8 for d in r.operands)) for r in inner):
                    if ic.unit_size % 8:
                        raise PlanError(f"rank {self.rank} thread block {tb.id} op {i}: a pipeline with packet "
                                        f"ops needs unit_size divisible by 8, got {ic.unit_size}",
                                        where + ".iter_context.unit_size")
                iters = pipeline_iterations(totals, ic.unit_size)
                if iters >= 2**32:
                    raise PlanError(f"rank {self.rank} thread block {tb.id} op {i}: {iters} pipeline iterations",
                                    where)
                self.port.end_pipeline(iters, ic.unit_size)
                recs.append(DevRecord(DOP_PIPELINE, i, total=ic.unit_size, aux0=len(inner), aux1=iters).pack())
                recs += [r.pack() for r in inner]
                n_recs += 1 + len(inner)
        finals = [r.pack() for r in self.port.finals(tb, self._port_rec)]
        recs += finals
        n_recs += len(finals)
        body = b"".join(recs)
        head = BLOCK_HEADER.pack(n_ops=n_recs, bytes=BLOCK_HEADER.size + len(body), n_finals=len(finals))
        region = head + body
        region += b"\0" * (-len(region) % 16)
        if len(region) > MAX_BLOCK_BYTES:
            raise PlanError(f"rank {self.rank} thread block {tb.id}: its device plan takes {len(region)} bytes "
                            f"at this size, more than the {MAX_BLOCK_BYTES} bytes of shared memory the kernel "
                            "uses", f"gpus[{self.rank}].threadblocks[{tb.id}]")
        return BlockPlan(region, n_recs)


def pack_blocks(plan: Plan, rank: int, input_bytes: int, output_bytes: int,
                static: Optional[dict] = None, row_bytes: int = 0, layout: Optional[Layout] = None) -> PackedRank:
    """Pack ``rank``'s thread blocks for one message size (sizes in bytes). ``static``: a dict kept
    per (plan, rank) by the caller, where the records that do not depend on the size are kept
    between sizes (packing a new size then packs its data ops only). ``row_bytes``: the input
    row of a row-chunked fused plan (:func:`mscclang.plan.layout.make_layout`). ``layout``: the
    rank's layout when given (a call of a plan with segments:
    :func:`mscclang.runtime.counted.counted_layout_of`)."""
    if layout is None and plan.has_segments():
        raise PlanError(f"plan {plan.name!r} has segmented buffers: its sizes come from a call's counts, not a "
                        "message size; run it with Executor.execute_counted", f"gpus[{rank}].segments")
    layout = layout or make_layout(plan, rank, input_bytes, output_bytes, row_bytes)
    pk = _Packer(plan, rank, layout, static)
    blocks = [pk.block(tb) for tb in plan.gpus[rank].threadblocks]
    sb = layout.scratch_alloc_bytes
    return PackedRank(rank, input_bytes, output_bytes, layout, blocks, sb, pk.packet_align, pk.uses_packets,
                      pk.port.script(), pk.norms)


def group_scratch_bytes(plan: Plan, input_bytes: int, output_bytes: int, row_bytes: int = 0) -> int:
    """Scratch bytes of the rank that needs the most at one message size. Every rank allocates
    this much: making or growing a plan's context is collective (a store barrier, and every peer
    maps the new scratch), so the decision must be the same on every rank, which a rank's own
    need is not when the plan gives ranks different scratch (a receiver's, not a sender's)."""
    return max(lay.scratch_alloc_bytes for lay in make_layouts(plan, input_bytes, output_bytes, row_bytes))


