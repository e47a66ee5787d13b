"""The device plan the interpreter kernel reads: its format's constants, the load-time checks,
the sync-area layout and channel tables of a rank, and the whole blob.

* :func:`check_runnable` refuses, at load, what the kernel cannot run (channels the node layout
  cannot carry, switch channels unless allowed, port-channel rules of :mod:`mscclang.runtime.ports`,
  too many ids or operands per op, bad references).
* :func:`rank_tables` and :class:`SyncLayout`: a rank's channel pairing slots and sync area, which
  no message size changes.
* :mod:`mscclang.runtime.packing` turns one rank's thread blocks into per-block byte regions for
  one message size; :func:`pack_blob` adds the header and the address tables once the runtime
  knows them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from mscclang.config import CUDA_MAX_CONNECTIONS, Settings
from mscclang.errors import PlanError
from mscclang.plan.check import validate_plan
from mscclang.plan.models import SEMAPHORE_OPS, SIGNAL_OPS, SWITCH_OPS, WAIT_OPS, BufferKind, ChannelOrdinal, ChannelType, Op, OpName, Plan, ThreadBlock
from mscclang.runtime.ports import check_port_plan, is_port_op, pair_slots, port_inbound_slots
from mscclang.runtime.topology import Topology, channel_transports
from mscclang.runtime.structs import BLOCK_ENTRY, CHANNEL_DEV, CONSTANTS, PLAN_HEADER, REMOTE_BUF

if TYPE_CHECKING:
    from mscclang.runtime.packing import PackedRank

MAX_OPERANDS = CONSTANTS["MSCCLANG_MAX_OPERANDS"]
MAX_IDS = CONSTANTS["MSCCLANG_MAX_IDS"]
MAX_FLAGS = CONSTANTS["MSCCLANG_MAX_FLAGS"]
MAX_BARRIERS = CONSTANTS["MSCCLANG_MAX_BARRIERS"]
MAX_BLOCK_BYTES = 200 * 1024  # dynamic shared memory the kernel may ask for (H100/H200: 227 KiB)

DOP_NOP, DOP_BARRIER, DOP_SIGNAL, DOP_WAIT, DOP_DATA = 0, 1, 2, 3, 4
DOP_SEM_ACQUIRE, DOP_SEM_RELEASE, DOP_PIPELINE = 5, 6, 7
DOP_RADD, DOP_RMSNORM = CONSTANTS["DOP_RADD"], CONSTANTS["DOP_RMSNORM"]
SLOT_INPUT, SLOT_OUTPUT, SLOT_SCRATCH, SLOT_REMOTE0 = 0, 1, 2, 3
SLOT_RESIDUAL = CONSTANTS["OPND_SLOT_RESIDUAL"]   # the call's residual (epilogue kernels; never remote)
MODE_PACKET = 1
KIND_CODE = {BufferKind.input: 0, BufferKind.output: 1, BufferKind.scratch: 2}
FLAG_RELAXED = CONSTANTS["FLAG_RELAXED"]
FLAG_READS_PACKETS = CONSTANTS["FLAG_READS_PACKETS"]
FLAG_SEGMENTS = CONSTANTS["FLAG_SEGMENTS"]   # a data op over segments (mscclang.runtime.counted)

_PAIRWISE_OPS = frozenset({OpName.put, OpName.get, OpName.copy, OpName.cpkt, OpName.ppkt, OpName.upkt})

# sync area of one rank (one per context): abort word, flags, inbound counters, expected counters,
# semaphores, barrier counters
SYNC_ABORT_OFF = 0
SYNC_FLAGS_OFF = 64
SYNC_INBOUND_OFF = SYNC_FLAGS_OFF + 4 * MAX_FLAGS


def where_of(rank: int, tb: int, i: int, inner: Optional[int] = None) -> str:
    """The JSON path of op ``i`` (and inner op ``inner`` of a pipeline) of a thread block."""
    s = f"gpus[{rank}].threadblocks[{tb}].ops[{i}]"
    return s + (f".ops[{inner}]" if inner is not None else "")


# --------------------------------------------------------------------------------------------
# load-time checks


CUDA_DEFAULT_CONNECTIONS = 8


def process_work_queues(env: Optional[Mapping[str, str]] = None) -> int:
    """The hardware work queues CUDA gives this process: ``CUDA_DEVICE_MAX_CONNECTIONS`` (CUDA's
    variable, read by CUDA when the process first uses the GPU; a value that is not a positive
    integer counts as CUDA's default, 8), at most 32. mscclang's own worker processes set 32."""
    text = str(Settings(env).cuda_device_max_connections or "").strip()
    n = int(text) if text.isdigit() and int(text) > 0 else CUDA_DEFAULT_CONNECTIONS
    return min(n, CUDA_MAX_CONNECTIONS)


def port_streams(plan: Plan, rank: int, topology: Topology) -> int:
    """Side streams the port proxy runs for ``rank`` at every launch: one per port channel of the
    rank (its copies, or its engine sends to another node) and one per port channel of a rank on
    another node that points at it (the engine's receives). The proxy creates exactly these."""
    own = len(plan.gpus[rank].peers(ChannelType.port))
    incoming = sum(1 for g in plan.gpus if not topology.same_node(g.id, rank)
                   for q in g.peers(ChannelType.port) if q == rank)
    return own + incoming


def check_port_streams(plan: Plan, rank: int, topology: Topology, work_queues: int) -> None:
    """Refuse a plan whose port channels need more side streams on ``rank`` than the process's
    hardware work queues (``CUDA_DEVICE_MAX_CONNECTIONS``, CUDA's default 8) hold beside the
    launching stream. Streams beyond that share a queue, where a side stream's wait for a trigger
    blocks the copies queued behind it, and a kernel waiting for those copies never gets its
    trigger: a hang that no spin bound ends (the stream wait has no timeout). Seen on an H200
    with eight ranks and 12 port channels per rank."""
    n = port_streams(plan, rank, topology)
    queues = min(work_queues, CUDA_MAX_CONNECTIONS)
    if n > queues - 1:
        raise PlanError(
            f"rank {rank} needs {n} side streams for its port channels (one per channel) but "
            f"CUDA_DEVICE_MAX_CONNECTIONS={work_queues} gives this process {queues} hardware work queue(s), "
            f"{queues - 1} beside the launching stream; streams sharing a queue can deadlock. Set "
            f"CUDA_DEVICE_MAX_CONNECTIONS={CUDA_MAX_CONNECTIONS} in the environment before the process first "
            "uses CUDA, or use a plan with fewer port channels", f"gpus[{rank}].channels")


def check_runnable(plan: Plan, allow_switch: bool = False, topology: Optional[Topology] = None,
                   work_queues: Optional[int] = None) -> None:
    """Refuse plans the executor cannot run, naming rank, thread block and op index, or the
    rank, the channel and the reason: a channel the node layout (``topology``, default one node)
    cannot carry, a port-channel op the proxy cannot serve, or (given the process's hardware
    ``work_queues``) more port side streams than those queues hold (:func:`check_port_streams`);
    first every rule of the plan format (:func:`mscclang.plan.check.validate_plan`, which
    ``load_plan`` and ``verify`` apply too: what one refuses the other does)."""
    validate_plan(plan)
    topo = topology or Topology(plan.world_size, plan.world_size)
    for g in plan.gpus:
        channel_transports(plan, g.id, topo)
        check_port_plan(plan, g.id)
        if work_queues is not None:
            check_port_streams(plan, g.id, topo, work_queues)
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
    where = where_of(rank, tb.id, i, inner)
    if is_port_op(op):
        return   # checked while packing (mscclang.runtime.ports); over segments, moves_whole_slots
    if op.name in SWITCH_OPS or op.channel_type == ChannelType.switch:
        raise PlanError(f"rank {rank} thread block {tb.id} op {i} ({op.name.value}) uses a switch channel "
                        "(NVLink multicast), which this executor does not run"
                        + ("" if allow_switch else " (refused unless MSCCLANG_ENABLE_NVLS=1)"), where)
    nt = plan.num_threads_per_block
    if op.name in SIGNAL_OPS | WAIT_OPS:
        n = len(op.channel_ids)
        if n > min(MAX_IDS, nt):
            raise PlanError(f"rank {rank} thread block {tb.id} op {i} ({op.name.value}) uses {n} channels; "
                            f"the kernel supports at most {min(MAX_IDS, nt)} per op", where)
        lst = tb.channel_list(ChannelType.memory)
        for c in op.channel_ids:
            if not 0 <= c < len(lst):
                raise PlanError(f"rank {rank} thread block {tb.id} op {i}: channel id {c} is not in the "
                                f"thread block's {len(lst)} memory channels", where + ".channel_ids")
    if op.name in SEMAPHORE_OPS:
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
    # ops that move pairs (one source, one destination) pack one record per pair
    n_opnd = 2 if op.name in _PAIRWISE_OPS else len(op.src_buff) + len(op.dst_buff)
    if n_opnd > MAX_OPERANDS:
        raise PlanError(f"rank {rank} thread block {tb.id} op {i} ({op.name.value}) has "
                        f"{n_opnd} operands; the kernel supports {MAX_OPERANDS}", where)


# --------------------------------------------------------------------------------------------
# channel pairing and sync-area layout


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
