"""The runtime's per-plan records: what a loaded plan, its contexts, device plans, specialised
kernels and launch entries are. Plain data, shared by the runtime's modules (kernels, contexts,
staging, capture, entries, abort, launcher) and owned by none of them, so that each of those
imports this module and never another of its siblings' state. ``docs/architecture.md`` draws how
they fit together."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mscclang.errors import PlanError, RuntimeUnavailable
from mscclang.plan.collectives import collective
from mscclang.plan.models import PACKET_TYPES, REDUCE_OPS, PacketType, Plan
from mscclang.runtime.device_plan import RankTables, SyncLayout, rank_tables


def packet_code(p: Any) -> str:
    """The runtime's code (:attr:`PacketType.code`) of a packet type name or enum, LL16's for ``None``."""
    try:
        return PacketType.of(p).code
    except ValueError:
        raise RuntimeUnavailable(f"unknown packet type {p!r}; use {' or '.join(map(repr, PACKET_TYPES))}") from None



def runtime_granule(plan: Plan) -> int:
    """The runtime's granule for a collective API call of ``plan``: collectives whose buffers hold
    several blocks (allgather, reduce-scatter, all-to-all) have block starts inside the buffer,
    which the runtime needs aligned (packet offsets), so their blocks are padded to the plan's
    ``buffer_alignment`` (at least 16 bytes); single-block calls take any element count. The CPU
    engine can apply the same rule (``SimWorld(granule=runtime_granule)``)."""
    if collective(plan.collective).multi_block:
        return max(16, plan.buffer_alignment)
    return 1


def plan_reduce_op(plan: Plan) -> str:
    """The plan's reduce op: ``plan.reduce_op``, else the ops' (they must agree), else sum."""
    if plan.reduce_op is not None:
        return plan.reduce_op.value
    seen: set[str] = set()
    for g in plan.gpus:
        for tb in g.threadblocks:
            for op in tb.ops:
                for o in (op.ops or [op]):
                    if o.name in REDUCE_OPS and o.reduce_op is not None:
                        seen.add(o.reduce_op.value)
    if len(seen) > 1:
        raise PlanError(f"the plan's reductions disagree on the reduce op ({sorted(seen)}); set plan.reduce_op "
                        "or pass reduce_op= at launch")
    return seen.pop() if seen else "sum"


@dataclass
class DevPlan:
    """One device plan (a rank's plan packed for one message size and buffer set) in device memory."""

    blob: int
    nbytes: int
    n_blocks: int
    smem: int
    packet_align: int
    uses_packets: bool
    packed: Any = None       # PackedRank (the specialised kernel's source comes from it)
    addr: Any = None         # Addresses (the specialised kernel's parameters)
    port_area: int = 0       # device port area (port channels: triggers, done words, signal slots)
    port_launch: Any = None  # a counted plan's proxy work (PortLaunch; fixed-size plans keep it per entry)


@dataclass
class Spec:
    """A loaded specialised kernel of one (plan, sizes, dtype, packet type, reduce op)."""

    func: Any
    fh: int
    n_blocks: int
    nthreads: int
    steps: int
    origin: str          # 'prebuilt', 'cache', 'nvrtc' or 'loaded'
    name: str
    layout: Any          # spec_source.ArgsLayout


@dataclass
class SpecLaunch:
    """What one launch of a specialised kernel needs: the function and its parameter struct (the
    first five u64 words are written per launch)."""

    spec: Spec
    args: Any
    param_addr: int
    keep: Any


@dataclass
class Context:
    """Scratch + sync area of one loaded plan on this rank, with peers' mappings, and the device
    plans built on it (keyed by :class:`DevPlanKey`)."""

    sync: SyncLayout
    sync_base: int
    scratch_base: int
    scratch_bytes: int
    peer_sync: dict[int, int]
    peer_scratch: dict[int, int]
    plans: dict["DevPlanKey", DevPlan] = field(default_factory=dict)


@dataclass(frozen=True)
class DevPlanKey:
    """A device plan's identity on its context: the sizes and the buffers its addresses name
    (symmetric allocation indices or registrations' ``Region.index``; None: the caller's)."""

    in_bytes: int
    out_bytes: int
    in_buf: Any = None
    out_buf: Any = None
    #: a row-chunked plan's input row bytes (0: the plan's chunks are not rows)
    row: int = 0


@dataclass(frozen=True)
class EntryKey:
    """A launch entry's identity: the call's sizes, dtype, packet type and reduce op, and how its
    buffers map (``mode``: 'any' for plans that run on any tensors, 'sym' for symmetric or
    registered buffers, 'staged' for the plan's staging; ``in_buf``/``out_buf`` name them)."""

    in_bytes: int
    out_bytes: int
    dtype: Any
    packet: str
    op: str
    mode: str = "any"
    in_buf: Any = None
    out_buf: Any = None
    #: a row-chunked plan's input row bytes (0: the plan's chunks are not rows)
    row: int = 0

    def buffers(self) -> tuple:
        """The buffer names this entry depends on (released with them)."""
        return (self.in_buf, self.out_buf) if self.mode != "any" else ()

    def how(self) -> str:
        """How the call's buffers map, as the ranks compare it."""
        if self.mode == "any":
            return "any"
        return "staged" if self.mode == "staged" else f"zero-copy {self.in_buf} {self.out_buf}"


@dataclass(frozen=True, slots=True)
class SpecKey:
    """A specialised kernel's identity in :attr:`LoadedPlan.spec`: the call's sizes, dtype,
    packet type and reduce op, and a row-chunked plan's input row bytes (0: not rows)."""

    in_bytes: int
    out_bytes: int
    dtype: str
    packet: str
    op: str
    row: int = 0


@dataclass
class Pending:
    """A launch entry running the interpreter while its specialised kernel ``key`` is wanted:
    ``calls`` left before it is built (the 'hot' policy), or the background build in flight
    (``build``); ``sym_in``/``sym_out``: the buffers its device plan names (a rebuild needs them)."""

    calls: int
    key: SpecKey
    sym_in: Any = None
    sym_out: Any = None
    build: Any = None


@dataclass(frozen=True)
class LaunchEntry:
    """Everything one launch needs, resolved once: the interpreter function and its handle, the
    device plan and launch shape, the specialised launch (None: the interpreter runs), the
    pending specialisation (None: nothing wanted), the context it runs on, and the port-channel
    launch (None: no port work on this rank)."""

    func: Any
    blob: int
    n_blocks: int
    nthreads: int
    smem: int
    handle: int
    spec: Optional[SpecLaunch] = None
    pending: Optional[Pending] = None
    ctx: Optional[Context] = None
    port: Any = None


@dataclass(frozen=True)
class Operands:
    """How a resolved call's buffers map onto the entry: ``mode`` 'direct' (the caller's
    tensors), 'sym' (symmetric or registered buffers at ``in_delta``/``out_delta`` from their
    bases) or 'staged' (``stage_in``/``stage_out``: the plan's staging allocations)."""

    mode: str = "direct"
    in_delta: int = 0
    out_delta: int = 0
    stage_in: Any = None
    stage_out: Any = None


@dataclass(frozen=True)
class Bound:
    """A call resolved once for repeated launches on the same tensors (the collective API's memo
    holds it): the loaded plan, entry key and entry, how the buffers map, the checked
    :class:`~mscclang.plan.call.Call` (addresses, sizes, reduce op, accumulation), its
    description and packet type, the entries' ``epoch`` it is valid for (any entry dropped or
    replaced since invalidates it), a fused call's ``EpiArgs`` bytes, and the copies enqueued
    ``before`` and ``after`` the kernel (functions of the stream: the collective API's staging)."""

    lp: Any
    key: EntryKey
    entry: LaunchEntry
    operands: Operands
    call: Any
    desc: str
    packet: str
    epoch: int
    epi: Optional[bytes] = None
    before: tuple = ()
    after: tuple = ()
    #: its key in the entries' recently-used order, ``(id(lp), key)``, made once
    #: (:meth:`mscclang.runtime.entries.Entries.touch` knows the latest by identity)
    recent: tuple = ()


@dataclass(frozen=True, slots=True)
class CachedAddresses:
    """A device plan's :class:`~mscclang.runtime.device_plan.Addresses` as cached on its loaded
    plan, with what they were made from: the context, the buffers (the objects, so a reused id
    never matches) and the buffers' peer ``bases`` then."""

    ctx: Any
    sym_in: Any
    sym_out: Any
    bases: tuple
    addr: Any


@dataclass
class LoadedPlan:
    """A plan accepted by this executor (load-time checks passed), with what the runtime built
    for it: the live context, outgrown (retired) ones that prepared calls and captured graphs
    still use, the plan's staging, launch entries and specialised kernels by key."""

    plan: Plan
    zero_copy: bool
    default_packet: str
    default_op: str
    nthreads: int
    n_blocks: int
    ctx: Optional[Context] = None
    retired: list = field(default_factory=list)
    fast: dict = field(default_factory=dict)     # EntryKey -> LaunchEntry
    spec: dict = field(default_factory=dict)     # SpecKey -> Spec or the reason not
    has_port: bool = False   # port channels on some rank: the interpreter runs it, with the proxy
    packets: bool = False    # this rank's blocks use LL packets (their offsets must suit the packet type)
    engine_keys: list = field(default_factory=list)   # engine.Key of each port channel between nodes
    serial: int = -1         # engine communicators' namespace (assigned collectively at first context)
    group_scratch: dict = field(default_factory=dict)   # (in, out bytes) -> scratch
    static: dict = field(default_factory=dict)   # this rank's device records that no size changes
    tables: dict = field(default_factory=dict)   # rank -> RankTables (size-free, made on first use)
    addresses: dict = field(default_factory=dict)   # (id(ctx), id(in), id(out)) -> CachedAddresses
    epi: Any = None   # EpiPlan (mscclang.runtime.epilogue): the plan runs on the epilogue kernels

    def table(self, rank: int) -> RankTables:
        """The channel tables of ``rank`` in this plan (computed once)."""
        t = self.tables.get(rank)
        if t is None:
            t = self.tables[rank] = rank_tables(self.plan, rank)
        return t


def describe_call(plan: Plan, in_bytes: int, out_bytes: int, dt: str, pkt: str, op: str) -> str:
    """What a call is, as the ranks compare it: collective, sizes, dtype, plan, packet and op."""
    size = f"{in_bytes} B" if in_bytes == out_bytes else f"{in_bytes} B in, {out_bytes} B out"
    extra = f" {pkt.upper()}" if plan.protocol == "LL" else ""
    red = f" {op}" if collective(plan.collective).reduces else ""
    return f"{plan.collective} of {size} {dt} on plan {plan.name}{extra}{red}"
