"""Packing a plan into the device plan the interpreter kernel reads.

Two steps:

* :func:`check_runnable` refuses, at load, what the kernel cannot run (channels the node layout
  cannot carry, switch channels unless allowed, port-channel rules of :mod:`mscclang.runtime.ports`,
  too many ids or operands per op, bad references).
* :func:`pack_blocks` turns one rank's thread blocks into per-block byte regions for one message
  size: every op's operands are resolved to (buffer slot, byte offset, length) pieces with
  :mod:`mscclang.plan.layout`, so the kernel only walks byte ranges. Regions hold no device
  addresses; :func:`pack_blob` adds the header and the address tables once the runtime knows them.

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
from mscclang.plan.layout import Layout, Piece, make_layout, pipeline_iterations, scratch_bytes_needed
from mscclang.plan.models import (
    SWITCH_OPS, BufferKind, BufferRef, ChannelOrdinal, ChannelType, Op, OpName, Plan, ThreadBlock,
)
from mscclang.runtime.ports import (
    PortPacker, PortScript, check_port_plan, is_port_op, pair_slots, port_inbound_slots,
)
from mscclang.runtime.topology import Topology, channel_transports
from mscclang.runtime.structs import (
    BLOCK_ENTRY, BLOCK_HEADER, CHANNEL_DEV, CONSTANTS, DEV_OP, PLAN_HEADER, REMOTE_BUF,
)

MAX_OPERANDS = CONSTANTS["MSCCLANG_MAX_OPERANDS"]
MAX_IDS = CONSTANTS["MSCCLANG_MAX_IDS"]
MAX_FLAGS = CONSTANTS["MSCCLANG_MAX_FLAGS"]
MAX_BARRIERS = CONSTANTS["MSCCLANG_MAX_BARRIERS"]
MAX_BLOCK_BYTES = 200 * 1024  # dynamic shared memory the kernel may ask for (H100/H200: 227 KiB)

DOP_NOP, DOP_BARRIER, DOP_SIGNAL, DOP_WAIT, DOP_DATA = 0, 1, 2, 3, 4
DOP_SEM_ACQUIRE, DOP_SEM_RELEASE, DOP_PIPELINE = 5, 6, 7
SLOT_INPUT, SLOT_OUTPUT, SLOT_SCRATCH, SLOT_REMOTE0 = 0, 1, 2, 3
MODE_PACKET = 1
KIND_CODE = {BufferKind.input: 0, BufferKind.output: 1, BufferKind.scratch: 2}
FLAG_RELAXED = 1
FLAG_READS_PACKETS = 2

PORT_OPS = frozenset({OpName.flush, OpName.pws, OpName.pwsf})

# sync area of one rank (one per context): abort word, flags, inbound counters, expected counters,
# semaphores, barrier counters
SYNC_ABORT_OFF = 0
SYNC_FLAGS_OFF = 64
SYNC_INBOUND_OFF = SYNC_FLAGS_OFF + 4 * MAX_FLAGS


def _where(rank: int, tb: int, i: int, inner: Optional[int] = None) -> str:
    s = f"gpus[{rank}].threadblocks[{tb}].ops[{i}]"
    return s + (f".ops[{inner}]" if inner is not None else "")


# --------------------------------------------------------------------------------------------
# load-time checks


def check_runnable(plan: Plan, allow_switch: bool = False, topology: Optional[Topology] = None) -> None:
    """Refuse plans the executor cannot run, naming rank, thread block and op index, or the
    rank, the channel and the reason: a channel the node layout (``topology``, default one node)
    cannot carry, or a port-channel op the proxy cannot serve."""
    topo = topology or Topology(plan.world_size, plan.world_size)
    for g in plan.gpus:
        channel_transports(plan, g.id, topo)
        check_port_plan(plan, g.id)
        for q in g.peers(ChannelType.port):
            if q == g.id:
                raise PlanError(f"rank {g.id} has a port channel to itself", f"gpus[{g.id}].channels")
        for ch in g.channels:
            if ch.channel_type == ChannelType.switch and not allow_switch:
                raise PlanError(
                    f"rank {g.id} declares switch channels (NVLink multicast); they are refused unless "
                    "MSCCLANG_ENABLE_NVLS=1", f"gpus[{g.id}].channels")
        nmem = len(g.peers(ChannelType.memory))
        if nmem > 65535:
            raise PlanError(f"rank {g.id} has {nmem} memory channels, more than 65535", f"gpus[{g.id}].channels")
        for tb in g.threadblocks:
            for i, op in enumerate(tb.ops):
                inner = op.ops if op.name == OpName.pipeline else None
                for j, o in enumerate(inner or [op]):
                    _check_op(plan, g.id, tb, i if inner is None else i, o, allow_switch,
                              None if inner is None else j)


def _check_op(plan: Plan, rank: int, tb: ThreadBlock, i: int, op: Op, allow_switch: bool,
              inner: Optional[int]) -> None:
    where = _where(rank, tb.id, i, inner)
    if is_port_op(op):
        return   # checked while packing (mscclang.runtime.ports)
    if op.name in SWITCH_OPS or op.channel_type == ChannelType.switch:
        raise PlanError(f"rank {rank} thread block {tb.id} op {i} ({op.name.value}) uses a switch channel "
                        "(NVLink multicast), which this executor does not run"
                        + ("" if allow_switch else " (refused unless MSCCLANG_ENABLE_NVLS=1)"), where)
    nt = plan.num_threads_per_block
    if op.name in (OpName.signal, OpName.rlxsignal, OpName.wait, OpName.rlxwait):
        n = len(op.channel_ids)
        if n > min(MAX_IDS, nt):
            raise PlanError(f"rank {rank} thread block {tb.id} op {i} ({op.name.value}) uses {n} channels; "
                            f"the kernel supports at most {min(MAX_IDS, nt)} per op", where)
        lst = tb.channel_list(ChannelType.memory)
        for c in op.channel_ids:
            if not 0 <= c < len(lst):
                raise PlanError(f"rank {rank} thread block {tb.id} op {i}: channel id {c} is not in the "
                                f"thread block's {len(lst)} memory channels", where + ".channel_ids")
    if op.name in (OpName.sem_acquire, OpName.sem_release):
        nsem = len(plan.gpus[rank].semaphores)
        if len(op.semaphore_ids) > min(MAX_IDS, nt):
            raise PlanError(f"rank {rank} thread block {tb.id} op {i}: too many semaphores in one op", where)
        for s in op.semaphore_ids:
            if not 0 <= s < nsem:
                raise PlanError(f"rank {rank} thread block {tb.id} op {i}: semaphore {s} is not declared "
                                f"(rank has {nsem})", where + ".semaphore_ids")
    if op.name == OpName.barrier and (op.barrier_id or 0) >= MAX_BARRIERS:
        raise PlanError(f"rank {rank} thread block {tb.id} op {i}: barrier id {op.barrier_id} exceeds the "
                        f"kernel's {MAX_BARRIERS} barriers", where + ".barrier_id")
    if len(op.src_buff) + len(op.dst_buff) > MAX_OPERANDS:
        raise PlanError(f"rank {rank} thread block {tb.id} op {i} ({op.name.value}) has "
                        f"{len(op.src_buff) + len(op.dst_buff)} operands; the kernel supports {MAX_OPERANDS}",
                        where)


# --------------------------------------------------------------------------------------------
# channel pairing and sync-area layout


def memory_channel_ordinals(plan: Plan, rank: int) -> list[tuple[int, int]]:
    """(peer, ordinal) of each memory channel of ``rank`` in global index order, as plain pairs:
    :meth:`mscclang.plan.models.Plan.channel_ordinals` of the memory channels. Kept for the
    executor's callers; new code calls ``plan.channel_ordinals(rank, ChannelType.memory)``."""
    return [(c.peer, c.ordinal) for c in plan.channel_ordinals(rank, ChannelType.memory)]


def inbound_slots(plan: Plan, rank: int) -> dict[tuple[int, int], int]:
    """Slot of each memory-channel inbound counter of ``rank``, keyed by (peer, ordinal)
    (:func:`mscclang.runtime.ports.pair_slots`)."""
    return pair_slots(plan, rank, ChannelType.memory)


@dataclass(frozen=True)
class SyncLayout:
    """Byte offsets inside one rank's sync area."""

    n_inbound: int
    n_channels: int
    n_semaphores: int
    n_port_inbound: int = 0
    n_port: int = 0

    @property
    def inbound(self) -> int:
        return SYNC_INBOUND_OFF

    @property
    def expected(self) -> int:
        return self.inbound + 8 * self.n_inbound

    @property
    def semaphores(self) -> int:
        return self.expected + 8 * self.n_channels

    @property
    def barriers(self) -> int:
        return self.semaphores + 8 * self.n_semaphores

    @property
    def port_inbound(self) -> int:
        """u64 counters the peers' proxies write (one per peer port channel to this rank)."""
        return self.barriers + 8 * MAX_BARRIERS

    @property
    def port_counters(self) -> int:
        """{expected, sent} u64 pairs, one per port channel of this rank."""
        return self.port_inbound + 8 * self.n_port_inbound

    @property
    def size(self) -> int:
        return (self.port_counters + 16 * self.n_port + 255) // 256 * 256


def sync_layout(plan: Plan, rank: int) -> SyncLayout:
    """The sync-area layout of ``rank`` (the runtime reads it from :func:`rank_tables`, computed
    once per loaded plan)."""
    return rank_tables(plan, rank).sync


@dataclass(frozen=True)
class RankTables:
    """The size-free channel tables of one rank of a plan: its memory and port channels' (peer,
    ordinal) in global index order (:meth:`~mscclang.plan.models.Plan.channel_ordinals`), the
    slot of each inbound counter keyed by (peer, ordinal) (:func:`inbound_slots`,
    :func:`~mscclang.runtime.ports.port_inbound_slots`), and its sync-area layout. No message size
    changes them, so the runtime computes them once per loaded plan and rank
    (``LoadedPlan.table``) instead of at every device plan."""

    memory: tuple[ChannelOrdinal, ...]
    port: tuple[ChannelOrdinal, ...]
    memory_slots: dict[tuple[int, int], int]
    port_slots: dict[tuple[int, int], int]
    sync: SyncLayout


def rank_tables(plan: Plan, rank: int) -> RankTables:
    """:class:`RankTables` of ``rank`` (computed from the plan; cache it per plan)."""
    g = plan.gpus[rank]
    ms = inbound_slots(plan, rank)
    ps = port_inbound_slots(plan, rank)
    sync = SyncLayout(len(ms), len(g.peers(ChannelType.memory)), len(g.semaphores), len(ps),
                      len(g.peers(ChannelType.port)))
    return RankTables(tuple(plan.channel_ordinals(rank, ChannelType.memory)),
                      tuple(plan.channel_ordinals(rank, ChannelType.port)), ms, ps, sync)


def peers_of(plan: Plan, rank: int) -> list[int]:
    """Ranks this rank talks to (channels or remote buffers, either direction), sorted."""
    s: set[int] = set()
    g = plan.gpus[rank]
    s.update(g.peers(ChannelType.memory))
    s.update(rb.rank for rb in g.remote_buffers)
    for h in plan.gpus:
        if h.id != rank and (rank in h.peers(ChannelType.memory) or any(rb.rank == rank for rb in h.remote_buffers)):
            s.add(h.id)
    s.discard(rank)
    return sorted(s)


def mapped_peers(plan: Plan, rank: int, topo: Optional[Topology] = None) -> list[int]:
    """The peers whose memory this rank maps (CUDA IPC): :func:`peers_of` on this rank's node.
    Peers on other nodes are reached only through port channels and the engine."""
    topo = topo or Topology(plan.world_size, plan.world_size)
    return [q for q in peers_of(plan, rank) if topo.same_node(rank, q)]


def is_zero_copy(plan: Plan) -> bool:
    """True when some rank reads or writes a peer's input/output directly."""
    return any(rb.type != BufferKind.scratch for g in plan.gpus for rb in g.remote_buffers)


# --------------------------------------------------------------------------------------------
# ops -> device records


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


_STEP_BYTES, _STEP_DATA, _STEP_PIPE, _STEP_PORT = 0, 1, 2, 3


#: ops whose device records are the same at every message size (memory-channel sync and
#: semaphores; port-channel ops are not: the proxy's script is built with them)
_SIZE_FREE_OPS = frozenset({OpName.nop, OpName.barrier, OpName.signal, OpName.rlxsignal, OpName.wait,
                            OpName.rlxwait, OpName.sem_acquire, OpName.sem_release})


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


class _Packer:
    def __init__(self, plan: Plan, rank: int, layout: Layout, static: Optional[dict] = None) -> None:
        self.plan = plan
        self.static = static if static is not None else {}   # (tb, op) -> packed records of sync ops
        self.rank = rank
        self.gpu = plan.gpus[rank]
        self.layout = layout
        self.port = PortPacker(plan, rank)
        self.unit = max(plan.buffer_alignment, 8)
        self.packet_align = 8
        self.uses_packets = False

    # operands ---------------------------------------------------------------------------------
    def operand(self, ref: BufferRef, op: Op, tb: ThreadBlock, where: str, packet: bool) -> tuple[int, BufferKind]:
        mode = (MODE_PACKET << 8) if packet else 0
        if ref.type is not None:
            slot = {BufferKind.input: SLOT_INPUT, BufferKind.output: SLOT_OUTPUT,
                    BufferKind.scratch: SLOT_SCRATCH}[ref.type]
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
            if slot > 255:
                raise PlanError(f"rank {self.rank} has more than {255 - SLOT_REMOTE0} remote buffers", where)
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
                extend: bool = False) -> "_DataOp":
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
        return _DataOp(index, where, tb.id, tuple(descs), tuple(kinds), tuple(refs), tuple(packets), len(srcs),
                       extend or any(dst_packet), any(src_packet), tbg)

    def data_record(self, d: "_DataOp") -> DevRecord:
        """The data record of ``d`` at this packer's message size."""
        if d.whole_slots:
            raw = self.pack_pieces(d.kinds, d.refs, d.where)
        else:
            raw = [(p.length, p.length, p.offsets) for p in self.pieces(d.kinds, d.refs, d.where)]
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
        return DevRecord(DOP_DATA, d.index, list(d.descs), d.n_src, pieces=raw,
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
        if n in (OpName.signal, OpName.rlxsignal, OpName.wait, OpName.rlxwait):
            lst = tb.channel_list(ChannelType.memory)
            kind = DOP_SIGNAL if n in (OpName.signal, OpName.rlxsignal) else DOP_WAIT
            relaxed = FLAG_RELAXED if n in (OpName.rlxsignal, OpName.rlxwait) else 0
            return [DevRecord(kind, index, ids=[lst[c] for c in op.channel_ids], flags=relaxed)]
        if n in (OpName.sem_acquire, OpName.sem_release):
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
            return [self.data_op(op, tb, index, where, S, [False] * len(S), D, [False] * len(D))]
        if n in (OpName.repkt, OpName.respkt, OpName.recpkt, OpName.recspkt):
            if not S or not D:
                raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} ({n.value}) needs sources "
                                "and a destination", where)
            src_pk = [False] + [True] * (len(S) - 1)
            dst_pk = [False] + [True] * (len(D) - 1)
            return [self.data_op(op, tb, index, where, S, src_pk, D, dst_pk)]
        raise PlanError(f"rank {self.rank} thread block {tb.id} op {index}: op {n.value!r} is not supported "
                        "by the GPU executor", where)

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
                static: Optional[dict] = None) -> PackedRank:
    """Pack ``rank``'s thread blocks for one message size (sizes in bytes). ``static``: a dict kept
    per (plan, rank) by the caller, where the records that do not depend on the size are kept
    between sizes (packing a new size then packs its data ops only)."""
    layout = make_layout(plan, rank, input_bytes, output_bytes)
    pk = _Packer(plan, rank, layout, static)
    blocks = [pk.block(tb) for tb in plan.gpus[rank].threadblocks]
    sb = scratch_bytes_needed(plan, layout)
    if pk.uses_packets and not (plan.protocol == "LL"):
        pass  # scratch_bytes_needed already doubles for plans with packet ops
    return PackedRank(rank, input_bytes, output_bytes, layout, blocks, sb, pk.packet_align, pk.uses_packets,
                      pk.port.script())


def group_scratch_bytes(plan: Plan, input_bytes: int, output_bytes: int) -> int:
    """Scratch bytes of the rank that needs the most at one message size. Every rank allocates
    this much: making or growing a plan's context is collective (a store barrier, and every peer
    maps the new scratch), so the decision must be the same on every rank, which a rank's own
    need is not when the plan gives ranks different scratch (a receiver's, not a sender's)."""
    return max(scratch_bytes_needed(plan, make_layout(plan, q, input_bytes, output_bytes))
               for q in range(len(plan.gpus)))


@dataclass(frozen=True)
class Addresses:
    """Device addresses the runtime fills into the header and tables."""

    sync_base: int
    scratch_base: int
    scratch_half: int
    error_record: int
    peer_abort: Sequence[int]
    remote: Sequence[tuple[int, int]]          # (base, kind code) per gpus[rank].remote_buffers entry
    channels: Sequence[tuple[int, int, int]]   # (inbound, remote inbound, expected) per memory channel, then
    # per port channel (inbound, the device plan's port block, {expected, sent})


def pack_blob(plan: Plan, packed: PackedRank, addr: Addresses, sync: SyncLayout) -> bytes:
    """The whole device plan of one rank: header, tables, block regions."""
    nb = len(packed.blocks)
    # the block table sits right after the header: the kernel reads its entry without waiting for
    # the header (interpreter.cuh)
    off = PLAN_HEADER.size
    block_tab = off
    off += BLOCK_ENTRY.size * nb
    off = (off + 15) // 16 * 16
    peer_off = off
    off += 8 * len(addr.peer_abort)
    off = (off + 15) // 16 * 16
    remote_off = off
    off += REMOTE_BUF.size * len(addr.remote)
    chan_off = off
    off += CHANNEL_DEV.size * len(addr.channels)
    off = (off + 15) // 16 * 16
    entries = []
    regions = []
    for b in packed.blocks:
        entries.append((off, len(b.region)))
        regions.append(b.region)
        off += len(b.region)
    if off >= 2**32:
        raise PlanError(f"rank {packed.rank}: device plan of {off} bytes exceeds 4 GiB")
    sb = addr.sync_base
    head = PLAN_HEADER.pack(
        magic=CONSTANTS["MSCCLANG_PLAN_MAGIC"], version=CONSTANTS["MSCCLANG_PLAN_VERSION"], n_blocks=nb,
        rank=packed.rank, sync_base=sb, scratch_base=addr.scratch_base, scratch_half=addr.scratch_half,
        flags=sb + SYNC_FLAGS_OFF, abort_word=sb + SYNC_ABORT_OFF, error_record=addr.error_record,
        semaphores=sb + sync.semaphores, barriers=sb + sync.barriers, n_peers=len(addr.peer_abort),
        n_remote=len(addr.remote), n_channels=len(addr.channels), n_semaphores=sync.n_semaphores,
        peer_abort_table=peer_off, remote_table=remote_off, channel_table=chan_off, block_table=block_tab)
    out = bytearray(head)
    for o, n in entries:
        out += BLOCK_ENTRY.pack(offset=o, bytes=n)
    out += b"\0" * (peer_off - len(out))
    for p in addr.peer_abort:
        out += int(p).to_bytes(8, "little")
    out += b"\0" * (remote_off - len(out))
    for base, kind in addr.remote:
        out += REMOTE_BUF.pack(base=base, kind=kind)
    for a, b, c in addr.channels:
        out += CHANNEL_DEV.pack(inbound=a, remote_inbound=b, expected=c)
    out += b"\0" * (entries[0][0] - len(out) if entries else (-len(out) % 16))
    for r in regions:
        out += r
    return bytes(out)
