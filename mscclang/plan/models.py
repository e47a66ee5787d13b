"""Pydantic models of the execution plan, formats ``mscclang.plan/1``, ``/2`` and ``/3``.

``mscclang.plan/2`` is ``/1`` plus the epilogue ops (``radd``, ``rmsnorm``) and their buffers
(``r`` residual, ``w`` weight). ``mscclang.plan/3`` is ``/1`` plus segmented buffers
(:class:`SegmentedBuffer`: row counts read at run time from the call's count matrix). A plan
says the lowest format that holds it (:func:`plan_format`).

The plan is the contract between the front half (DSL, compiler) and the back half (simulator,
GPU runtime). It carries everything an MSCCL++ 0.9 execution plan carries (same key names, same op
names) plus a few fields of our own (``format``, ``num_ranks``, ``root``, ``reduce_op``,
``packet_type``, barrier member lists). See ``docs/plan.schema.json`` (the format) and
``docs/semantics.md`` (what a plan means).

Conventions kept from MSCCL++:

* ``gpus[r].id == r`` and ``threadblocks[t].id == t``.
* Channel ids in an op index the thread block's local channel list of the op's channel type
  (``threadblocks[t].channels[k]`` with ``channel_type`` equal to the op's); that list holds
  per-rank global channel indexes (position among the rank's channel descriptors of that type).
* A remote buffer reference's ``buffer_id`` indexes the thread block's ``remote_buffer_refs``
  list for the op's access channel type, which holds indexes into ``gpus[r].remote_buffers``.
* Switch references' ``switch_channel_id`` index the thread block's switch channel list.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Iterator, Literal, Optional, Sequence

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, StrictBool, model_validator

from mscclang.errors import PlanError

PLAN_FORMAT = "mscclang.plan/1"
#: the format of plans with epilogue ops (:data:`EPILOGUE_OPS`)
PLAN_FORMAT_2 = "mscclang.plan/2"
#: the format of plans with segmented buffers (:class:`SegmentedBuffer`)
PLAN_FORMAT_3 = "mscclang.plan/3"
#: every format the loader accepts
PLAN_FORMATS = (PLAN_FORMAT, PLAN_FORMAT_2, PLAN_FORMAT_3)
#: largest message size a plan can name (an unsigned 64-bit byte count)
MAX_MESSAGE_SIZE = 2**64 - 1
#: largest chunk count, chunk index, id or rank a plan can name (a signed 32-bit value)
MAX_COUNT = 2**31 - 1
#: largest ``buffer_alignment`` (a power of two from 1 to this)
MAX_BUFFER_ALIGNMENT = 2**20
#: longest plan ``name`` / ``collective`` string
MAX_NAME_LENGTH = 1024


def _power_of_two(value: int) -> int:
    if value & (value - 1):
        raise ValueError(f"buffer_alignment must be a power of two, got {value}")
    return value


# JSON integers only: "1", true and 16.0 are not integers (strict mode), and every value is bounded.
Count = Annotated[int, Strict(), Field(ge=0, le=MAX_COUNT)]
Positive = Annotated[int, Strict(), Field(ge=1, le=MAX_COUNT)]
ByteCount = Annotated[int, Strict(), Field(ge=0, le=MAX_MESSAGE_SIZE)]
Text = Annotated[str, Strict(), Field(max_length=MAX_NAME_LENGTH)]  # pydantic refuses lone surrogates
Alignment = Annotated[int, Strict(), Field(
    ge=1, le=MAX_BUFFER_ALIGNMENT, description="a power of two from 1 to 1048576 (1 MiB)",
    json_schema_extra={"enum": [1 << k for k in range(MAX_BUFFER_ALIGNMENT.bit_length())]}),
    AfterValidator(_power_of_two)]


class OpName(str, Enum):
    """Every op of the plan format (MSCCL++'s names, plus ``glre``)."""

    nop = "nop"
    barrier = "barrier"
    signal = "signal"
    rlxsignal = "rlxsignal"
    wait = "wait"
    rlxwait = "rlxwait"
    flush = "flush"
    put = "put"
    pws = "pws"
    pwsf = "pwsf"
    get = "get"
    copy = "copy"
    cpkt = "cpkt"
    upkt = "upkt"
    ppkt = "ppkt"
    rppkt = "rppkt"
    re = "re"
    res = "res"
    rre = "rre"
    rres = "rres"
    repkt = "repkt"
    respkt = "respkt"
    recpkt = "recpkt"
    recspkt = "recspkt"
    glre = "glre"
    glres = "glres"
    gstore = "gstore"
    gstorepkt = "gstorepkt"
    sem_acquire = "sem_acquire"
    sem_release = "sem_release"
    pipeline = "pipeline"
    # plan/2: the epilogue (docs/semantics.md, "Epilogue ops")
    radd = "radd"
    rmsnorm = "rmsnorm"


class ChannelType(str, Enum):
    memory = "memory"
    port = "port"
    switch = "switch"
    none = "none"


class BufferKind(str, Enum):
    """Buffer kinds as the plan spells them."""

    input = "i"
    output = "o"
    scratch = "s"
    #: plan/2: the residual (activation dtype, the input's chunking)
    residual = "r"
    #: plan/2: the norm weight (one row, read whole by every rmsnorm; never in a buffer ref)
    weight = "w"


class ReduceOp(str, Enum):
    sum = "sum"
    min = "min"
    max = "max"


class PacketType(str, Enum):
    """An LL packet format, named by its packet size in bytes: ``LL16`` (the default: two 4-byte
    data words, each with its flag) or ``LL8`` (one data word and its flag). Half of a packet is
    payload, and packet offsets must be aligned to it (:attr:`align`)."""

    LL8 = "LL8"
    LL16 = "LL16"

    @property
    def code(self) -> str:
        """The runtime's spelling in kernel names and specialisations: ``"ll8"``, ``"ll16"``."""
        return self.value.lower()

    @property
    def size(self) -> int:
        """The bytes of one packet, the number in its name: LL16 16, LL8 8."""
        return int(self.value[2:])

    @property
    def align(self) -> int:
        """The payload bytes of one packet, the alignment its packet offsets need: LL16 8, LL8 4."""
        return self.size // 2

    @classmethod
    def of(cls, p: object) -> "PacketType":
        """The packet type named by ``p``: a PacketType, or its name in any case (``"ll8"``);
        ``None`` is the default, LL16. ValueError for anything else."""
        return cls.LL16 if p is None else cls(str(getattr(p, "value", p)).upper())


SIGNAL_OPS = frozenset({OpName.signal, OpName.rlxsignal})
WAIT_OPS = frozenset({OpName.wait, OpName.rlxwait})
#: the relaxed signal and wait
RELAXED_OPS = frozenset({OpName.rlxsignal, OpName.rlxwait})
#: put-with-signal: data ops that signal the peer after writing
PUT_SIGNAL_OPS = frozenset({OpName.pws, OpName.pwsf})
SEMAPHORE_OPS = frozenset({OpName.sem_acquire, OpName.sem_release})
#: the ops that move no data and order other ops (signal, wait, flush, semaphores)
SYNC_OPS = SIGNAL_OPS | WAIT_OPS | SEMAPHORE_OPS | {OpName.flush}
#: the reduce-op names a plan or a call may name (:class:`ReduceOp`'s values)
REDUCE_OP_NAMES: tuple[str, ...] = tuple(o.value for o in ReduceOp)
#: the packet types a plan may name (:class:`PacketType`'s values)
PACKET_TYPES: tuple[str, ...] = tuple(p.value for p in PacketType)
REDUCE_OPS = frozenset(
    {OpName.re, OpName.res, OpName.rre, OpName.rres, OpName.repkt, OpName.respkt,
     OpName.recpkt, OpName.recspkt, OpName.glre, OpName.glres}
)
#: ops that move source i into destination i when they have as many of each (one source: into
#: every destination); every other op with several sources reduces them
PAIRWISE_OPS = frozenset({OpName.put, OpName.pws, OpName.pwsf, OpName.get, OpName.copy,
                          OpName.cpkt, OpName.upkt, OpName.ppkt, OpName.rppkt})
PACKET_OPS = frozenset(
    {OpName.cpkt, OpName.upkt, OpName.ppkt, OpName.rppkt, OpName.repkt, OpName.respkt,
     OpName.recpkt, OpName.recspkt, OpName.gstorepkt}
)
#: packet ops -> the first destination operand they write as LL packets (the ones before it, a
#: packet reduction's local result, are plain writes)
PACKET_DST_FROM: dict[OpName, int] = {OpName.ppkt: 0, OpName.cpkt: 0, OpName.rppkt: 0, OpName.gstorepkt: 0,
                                      OpName.respkt: 1, OpName.recpkt: 1, OpName.recspkt: 1}
#: packet ops -> the first source operand they read as LL packets, waiting for their flags (the
#: ones before it, a packet reduction's local source, are plain reads); ``gstorepkt`` reads packets
#: from a scratch source only, so it is not listed
PACKET_SRC_FROM: dict[OpName, int] = {OpName.upkt: 0, OpName.rppkt: 0, OpName.repkt: 1, OpName.respkt: 1,
                                      OpName.recpkt: 1, OpName.recspkt: 1}
#: reductions whose first source is local (plain) and may take a place in the order other than
#: the first (``Op.src0_position``): every reduction but the switch ones, whose sources are a group
POSITIONED_REDUCE_OPS = REDUCE_OPS - {OpName.glre, OpName.glres}
SWITCH_OPS = frozenset({OpName.glre, OpName.glres, OpName.gstore, OpName.gstorepkt})
#: ops only a ``mscclang.plan/2`` plan may hold
EPILOGUE_OPS = frozenset({OpName.radd, OpName.rmsnorm})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, use_enum_values=False)


class BufferRef(_Strict):
    """A chunk range of one buffer.

    Exactly one of ``type`` (a local buffer of this rank), ``buffer_id`` (a remote buffer, through
    the thread block's ``remote_buffer_refs`` of the op's channel type) or ``switch_channel_id``
    (the multicast view of a switch channel) is set. ``index``/``size`` are in chunks.
    """

    type: Optional[BufferKind] = None
    buffer_id: Optional[Count] = None
    switch_channel_id: Optional[Count] = None
    index: Count
    size: Count

    @model_validator(mode="after")
    def _one_kind(self) -> "BufferRef":
        n = sum(x is not None for x in (self.type, self.buffer_id, self.switch_channel_id))
        if n != 1:
            raise ValueError(
                "a buffer reference needs exactly one of 'type', 'buffer_id', 'switch_channel_id'"
            )
        return self

    @property
    def is_local(self) -> bool:
        return self.type is not None

    @property
    def is_remote(self) -> bool:
        return self.buffer_id is not None

    @property
    def is_switch(self) -> bool:
        return self.switch_channel_id is not None


class TbgInfo(_Strict):
    """Position of this thread block inside a thread-block group that shares one op."""

    tb_id: Count
    tbg_size: Positive

    @model_validator(mode="after")
    def _in_range(self) -> "TbgInfo":
        if self.tb_id >= self.tbg_size:
            raise ValueError(f"tb_id {self.tb_id} must be below tbg_size {self.tbg_size}")
        return self


class IterContext(_Strict):
    """Pipeline loop: inner ops run over ``unit_size``-byte slices of ``num_chunks`` chunks."""

    unit_size: Annotated[int, Strict(), Field(ge=1, le=MAX_MESSAGE_SIZE)]
    num_chunks: Positive


class Op(_Strict):
    """One operation of a thread block."""

    name: OpName
    src_buff: list[BufferRef] = Field(default_factory=list)
    dst_buff: list[BufferRef] = Field(default_factory=list)
    channel_ids: list[Count] = Field(default_factory=list)
    channel_type: ChannelType = ChannelType.none
    tbg_info: Optional[TbgInfo] = None
    reduce_op: Optional[ReduceOp] = None
    barrier_id: Optional[Count] = None
    num_threadblocks: Optional[Positive] = None
    # ours: the ids of the thread blocks meeting at a barrier (MSCCL++ only carries the count)
    barrier_tbs: Optional[list[Count]] = None
    semaphore_ids: list[Count] = Field(default_factory=list)
    iter_context: Optional[IterContext] = None
    ops: Optional[list["Op"]] = None
    # ours: debug info, the DSL source line that made the op ("program.py:42"; base name of the
    # program file and line of the DSL call). Optional; ignored by execution; not exported to
    # MSCCL++ plans.
    src: Optional[str] = Field(default=None, max_length=1024)
    # plan/2, rmsnorm only: the output is FP8 (scaled, saturated; docs/semantics.md)
    quant: Optional[StrictBool] = None
    # ours, reductions with a local first source (re, res, rre, rres and the packet reductions):
    # where src_buff[0] enters the reduction order (reduction_order); absent means first
    src0_position: Optional[Count] = None

    def reduction_order(self) -> list[int]:
        """The indexes of ``src_buff`` in the order a reduction combines them: ``src_buff[1..k]``,
        then ``src_buff[0]``, then the rest, with k = ``src0_position`` (0 when absent: the listed
        order). The one home of the rule; the simulator, the runtime's packing and ``show`` read it."""
        k = self.src0_position or 0
        rest = list(range(1, len(self.src_buff)))
        return rest[:k] + [0] + rest[k:] if self.src_buff else []

    @model_validator(mode="after")
    def _shape(self) -> "Op":
        if self.src0_position is not None and self.name not in POSITIONED_REDUCE_OPS:
            raise ValueError(f"only reductions with a local first source take 'src0_position', not "
                             f"{self.name.value}")
        if self.src0_position is not None and self.src0_position >= max(len(self.src_buff), 1):
            raise ValueError(f"src0_position {self.src0_position} must be below the number of sources "
                             f"({len(self.src_buff)})")
        if self.quant is not None and self.name != OpName.rmsnorm:
            raise ValueError(f"only rmsnorm takes 'quant', not {self.name.value}")
        if self.name == OpName.pipeline:
            if self.iter_context is None or self.ops is None:
                raise ValueError("a pipeline op needs 'iter_context' and 'ops'")
            for inner in self.ops:
                if inner.name == OpName.pipeline:
                    raise ValueError("pipelines cannot be nested")
        elif self.ops is not None or self.iter_context is not None:
            raise ValueError(f"only pipeline ops carry 'ops'/'iter_context', not {self.name.value}")
        if self.name == OpName.barrier and (self.barrier_id is None or self.num_threadblocks is None):
            raise ValueError("a barrier op needs 'barrier_id' and 'num_threadblocks'")
        if self.name in SEMAPHORE_OPS and not self.semaphore_ids:
            raise ValueError(f"{self.name.value} needs 'semaphore_ids'")
        return self


class ThreadBlockChannels(_Strict):
    channel_type: ChannelType
    channel_ids: list[Count] = Field(default_factory=list)


class RemoteBufferRefs(_Strict):
    access_channel_type: ChannelType
    remote_buffer_ids: list[Count] = Field(default_factory=list)


class ThreadBlock(_Strict):
    id: Count
    ops: list[Op] = Field(default_factory=list)
    channels: list[ThreadBlockChannels] = Field(default_factory=list)
    remote_buffer_refs: list[RemoteBufferRefs] = Field(default_factory=list)

    def all_ops(self) -> Iterator[Op]:
        """Every op of the block in order, each pipeline's inner ops right after it."""
        for op in self.ops:
            yield op
            yield from op.ops or ()

    def channel_list(self, channel_type: ChannelType) -> list[int]:
        """Global channel indexes this block uses for ``channel_type`` (TB-local order)."""
        return next((c.channel_ids for c in self.channels if c.channel_type == channel_type), [])

    def remote_buffer_list(self, channel_type: ChannelType) -> list[int]:
        """Indexes into the rank's ``remote_buffers`` for access through ``channel_type``."""
        return next((r.remote_buffer_ids for r in self.remote_buffer_refs if r.access_channel_type == channel_type), [])


class RankGroup(_Strict):
    size: Positive
    ranks: list[Count]


@dataclass(frozen=True)
class ChannelOrdinal:
    """One memory or port channel of a rank, as the pairing rule sees it: ``peer`` is the rank at
    its other end and ``ordinal`` its position among this rank's channels of the same type to
    ``peer`` (0 for the first)."""

    peer: int
    ordinal: int


@dataclass(frozen=True)
class PairedEnd:
    """The other end of a channel: channel ``index`` (global index among the channels of the same
    type) of rank ``rank``."""

    rank: int
    index: int


def plan_format(has_epilogue: bool, has_segments: bool = False) -> str:
    """The format a plan must say: ``mscclang.plan/2`` when it holds an epilogue op,
    ``mscclang.plan/3`` when it has segmented buffers, else ``mscclang.plan/1`` (the one place
    the rule is written; no plan has both)."""
    return PLAN_FORMAT_2 if has_epilogue else PLAN_FORMAT_3 if has_segments else PLAN_FORMAT


def channel_ordinals(peers: Sequence[int]) -> list[ChannelOrdinal]:
    """The :class:`ChannelOrdinal` of each channel of one type of one rank, given the peer rank of
    each of those channels in global channel index order (``Gpu.peers``, or the compiler's
    ``IRRank.peers``). Channels to different peers are numbered separately."""
    seen: dict[int, int] = {}
    out: list[ChannelOrdinal] = []
    for p in peers:
        o = seen.get(p, 0)
        seen[p] = o + 1
        out.append(ChannelOrdinal(p, o))
    return out


def paired_indices(peers_by_rank: Sequence[Sequence[int]]) -> list[list[Optional[int]]]:
    """:func:`paired_index` of every channel of one type of every rank, in time linear in the
    channels: ``result[a][j]`` is the global index, on rank ``peers_by_rank[a][j]``, of the
    channel paired with rank ``a``'s channel ``j`` (None when unpaired). The same rule: the j-th
    channel from A to B pairs with B's j-th channel to A."""
    ordinals = [channel_ordinals(peers) for peers in peers_by_rank]
    ends = {(a, c.peer, c.ordinal): j for a, row in enumerate(ordinals) for j, c in enumerate(row)}
    return [[ends.get((c.peer, a, c.ordinal)) for c in row] for a, row in enumerate(ordinals)]


def paired_index(rank: int, peers: Sequence[int], index: int, peer_peers: Sequence[int]) -> Optional[int]:
    """The channel pairing rule, the one place it is written: on rank A the j-th channel (of one
    type: memory and port channels are numbered separately) to peer B is bound to the j-th
    channel of the same type to A on rank B.

    ``peers`` is the peer of each of ``rank``'s channels of the type (global index order),
    ``index`` one of those channels, and ``peer_peers`` the same list of the rank at its other
    end (``peers[index]``). Returns the global index of the paired channel on that rank, or
    ``None`` when it has fewer channels to ``rank`` than the ordinal needs (an unpaired channel).
    Raises ``IndexError`` when ``index`` is not one of ``peers``'s positions."""
    if not 0 <= index < len(peers):
        raise IndexError(f"channel {index} does not exist (the rank has {len(peers)})")
    ordinal = channel_ordinals(peers[:index + 1])[index].ordinal
    back = [j for j, p in enumerate(peer_peers) if p == rank]
    return back[ordinal] if ordinal < len(back) else None


class ChannelDesc(_Strict):
    """A channel descriptor of one rank.

    memory/port: one channel per ``connected_to`` entry. switch: ``buffer_type`` and one switch
    channel per rank group.
    """

    channel_type: ChannelType
    connected_to: list[Count] = Field(default_factory=list)
    buffer_type: Optional[BufferKind] = None
    rank_groups: list[RankGroup] = Field(default_factory=list)

    @model_validator(mode="after")
    def _shape(self) -> "ChannelDesc":
        if self.channel_type == ChannelType.switch:
            if self.buffer_type is None:
                raise ValueError("a switch channel needs 'buffer_type'")
        elif self.channel_type == ChannelType.none:
            raise ValueError("channel_type 'none' is not a channel")
        return self


class RemoteBuffer(_Strict):
    rank: Count
    type: BufferKind
    access_channel_types: list[ChannelType] = Field(default_factory=list)


class SemaphoreDesc(_Strict):
    init_value: Count = 0


class SegmentedBuffer(_Strict):
    """plan/3: one buffer of a rank cut into segments whose row counts are read at run time from
    the call's count matrix (docs/semantics.md, "Data-dependent counts"). ``counts[k]`` is the
    entry ``[i, j]`` whose value is segment ``k``'s row count. The input and the output are
    packed (segment ``k`` starts where segment ``k - 1`` ends); scratch is slots (segment ``k``
    starts at ``k`` times the call's capacity rows). A buffer reference's ``index``/``size`` into
    a segmented buffer count segments, and the rank's chunk count of the buffer is the number of
    segments."""

    type: BufferKind
    counts: list[Annotated[list[Count], Field(min_length=2, max_length=2)]] = Field(min_length=1)

    @model_validator(mode="after")
    def _kind(self) -> "SegmentedBuffer":
        if self.type not in (BufferKind.input, BufferKind.output, BufferKind.scratch):
            raise ValueError(f"only the input, output and scratch can be segmented, not {self.type.value!r}")
        return self

    def entries(self) -> list[tuple[int, int]]:
        """The count-matrix entry of each segment, as (i, j) pairs."""
        return [(i, j) for i, j in self.counts]


class Gpu(_Strict):
    id: Count
    input_chunks: Count
    output_chunks: Count
    scratch_chunks: Count
    threadblocks: list[ThreadBlock] = Field(default_factory=list)
    channels: list[ChannelDesc] = Field(default_factory=list)
    remote_buffers: list[RemoteBuffer] = Field(default_factory=list)
    semaphores: list[SemaphoreDesc] = Field(default_factory=list)
    # plan/3: the rank's segmented buffers (at most one entry per buffer kind)
    segments: Optional[list[SegmentedBuffer]] = None

    def all_ops(self) -> Iterator[Op]:
        """Every op of the rank's thread blocks (:meth:`ThreadBlock.all_ops`)."""
        return (op for tb in self.threadblocks for op in tb.all_ops())

    def chunks(self, kind: BufferKind) -> int:
        """The rank's chunk count of buffer ``kind`` (the residual has the input's; the weight
        none, it is read whole)."""
        return {BufferKind.input: self.input_chunks, BufferKind.output: self.output_chunks,
                BufferKind.scratch: self.scratch_chunks, BufferKind.residual: self.input_chunks,
                BufferKind.weight: 0}[kind]

    def segmented(self, kind: BufferKind) -> Optional[SegmentedBuffer]:
        """The segments of buffer ``kind`` (None: the buffer is cut into chunks)."""
        return next((s for s in self.segments or () if s.type == kind), None)

    def peers(self, channel_type: ChannelType) -> list[int]:
        """Peer rank of each channel of ``channel_type`` (global channel index order)."""
        return [p for c in self.channels if c.channel_type == channel_type for p in c.connected_to]

    def switch_groups(self) -> list[tuple[BufferKind, list[int]]]:
        """(buffer kind, ranks) of each switch channel, in global switch channel order."""
        return [(c.buffer_type, list(g.ranks)) for c in self.channels  # type: ignore[misc]
                if c.channel_type == ChannelType.switch for g in c.rank_groups]


class Plan(_Strict):
    """A whole execution plan: one entry of ``gpus`` per rank."""

    format: Literal["mscclang.plan/1", "mscclang.plan/2", "mscclang.plan/3"] = PLAN_FORMAT
    name: Text
    collective: Text
    protocol: Literal["Simple", "LL"] = "Simple"
    inplace: StrictBool = False
    reuse_resources: StrictBool = False
    num_threads_per_block: Annotated[int, Strict(), Field(ge=32, le=1024)] = 1024
    use_double_scratch_buffer: StrictBool = False
    buffer_alignment: Alignment = 16
    min_message_size: ByteCount = 0
    max_message_size: ByteCount = MAX_MESSAGE_SIZE
    # ours
    num_ranks: Optional[Positive] = None
    root: Optional[Count] = None
    chunk_factor: Optional[Positive] = None
    reduce_op: Optional[ReduceOp] = None
    packet_type: Optional[PacketType] = None
    # ours: every rank's copy of a reduced output holds the same bits (docs/semantics.md, "Rank
    # consistency"): true promises it (verify fails an inconsistent reduction), false disclaims
    # it (verify notes it), absent says nothing (verify warns)
    consistent: Optional[StrictBool] = None
    # ours: every reduced output element is exactly the canonical expression (docs/semantics.md,
    # "Batch invariance": the ranks' sources in rank order, left to right, rounded as the dtype
    # says), at every size the plan serves; true promises it (verify fails a plan that breaks
    # it), false disclaims it (the hierarchical plans), absent: verify reports whether it holds
    batch_invariant: Optional[StrictBool] = None
    # ours (plan/2): "row" cuts the chunks of the input, residual and output at whole rows of the
    # epilogue's hidden size instead of buffer_alignment units (plan.layout)
    chunk_unit: Optional[Literal["row"]] = None
    # ours (plan/2): true when a rank's residual may come from another rank (a two-shot's rows
    # normalised by their owner), so the call's residual must be the same on every rank; absent,
    # every rank adds its own residual
    replicated_residual: Optional[StrictBool] = None
    gpus: list[Gpu]

    @model_validator(mode="after")
    def _ids(self) -> "Plan":
        if self.num_ranks is None:
            self.num_ranks = len(self.gpus)
        elif self.num_ranks != len(self.gpus):
            raise ValueError(f"num_ranks is {self.num_ranks} but there are {len(self.gpus)} gpus")
        for r, g in enumerate(self.gpus):
            if g.id != r:
                raise ValueError(f"gpus[{r}].id is {g.id}, must equal its position {r}")
            for t, tb in enumerate(g.threadblocks):
                if tb.id != t:
                    raise ValueError(
                        f"gpus[{r}].threadblocks[{t}].id is {tb.id}, must equal its position {t}"
                    )
        if self.min_message_size > self.max_message_size:
            raise ValueError("min_message_size exceeds max_message_size")
        n = len(self.gpus)
        for r, g in enumerate(self.gpus):
            seen: set[BufferKind] = set()
            for k, sb in enumerate(g.segments or ()):
                if sb.type in seen:
                    raise ValueError(f"gpus[{r}].segments[{k}]: buffer {sb.type.value!r} is segmented twice")
                seen.add(sb.type)
                chunks = g.chunks(sb.type)
                if chunks != len(sb.counts):
                    raise ValueError(f"gpus[{r}].segments[{k}]: {len(sb.counts)} segments, but the rank's "
                                     f"{sb.type.name}_chunks is {chunks} (a segmented buffer has one chunk per segment)")
                for m, (i, j) in enumerate(sb.counts):
                    if i >= n or j >= n:
                        raise ValueError(f"gpus[{r}].segments[{k}].counts[{m}]: entry [{i}, {j}] is outside "
                                         f"the {n} x {n} count matrix")
        return self

    def all_ops(self) -> Iterator[Op]:
        """Every op of every rank (:meth:`ThreadBlock.all_ops`)."""
        return (op for g in self.gpus for op in g.all_ops())

    def has_segments(self) -> bool:
        """Whether some rank has a segmented buffer (a plan/3 plan, run with a count matrix)."""
        return any(g.segments for g in self.gpus)

    @property
    def world_size(self) -> int:
        return len(self.gpus)

    def max_threadblocks(self) -> int:
        return max((len(g.threadblocks) for g in self.gpus), default=0)

    def channel_ordinals(self, rank: int, channel_type: ChannelType) -> list[ChannelOrdinal]:
        """(peer, ordinal) of each of ``rank``'s channels of ``channel_type``, in global channel
        index order (:func:`channel_ordinals`); the channel with ordinal j to peer B is paired
        with B's channel of ordinal j to ``rank`` (:func:`paired_index`)."""
        return channel_ordinals(self._gpu(rank).peers(channel_type))

    def paired_end(self, rank: int, channel_type: ChannelType, index: int) -> PairedEnd:
        """The other end of ``rank``'s memory or port channel ``index`` (global index among the
        rank's channels of ``channel_type``), by the pairing rule of :func:`paired_index`.
        Raises :class:`~mscclang.errors.PlanError` naming the rank and channel when the channel
        does not exist, leads to a rank outside the plan, or has no partner on the peer."""
        peers = self._gpu(rank).peers(channel_type)
        ct = channel_type.value
        if not 0 <= index < len(peers):
            raise PlanError(f"rank {rank}: {ct} channel {index} does not exist", f"gpus[{rank}].channels")
        peer = peers[index]
        if not 0 <= peer < len(self.gpus):
            raise PlanError(f"rank {rank}: {ct} channel {index} leads to rank {peer}, which is not in the plan",
                            f"gpus[{rank}].channels")
        peer_peers = self.gpus[peer].peers(channel_type)
        j = paired_index(rank, peers, index, peer_peers)
        if j is None:
            ordinal = channel_ordinals(peers)[index].ordinal
            n = sum(1 for p in peer_peers if p == rank)
            raise PlanError(f"rank {rank}: {ct} channel {index} is its channel {ordinal} to rank {peer}, but rank "
                            f"{peer} has only {n} {ct} channel(s) to rank {rank}", f"gpus[{peer}].channels")
        return PairedEnd(peer, j)

    def _gpu(self, rank: int) -> Gpu:
        if not 0 <= rank < len(self.gpus):
            raise PlanError(f"rank {rank} is not in the plan (it has {len(self.gpus)} ranks)")
        return self.gpus[rank]

    def has_epilogue_ops(self) -> bool:
        """Whether some op (or pipeline inner op) is an epilogue op (:data:`EPILOGUE_OPS`): the
        plan/2 fused collective's residual exists. Stops at the first one."""
        return any(op.name in EPILOGUE_OPS for op in self.all_ops())

    def epilogue_ops(self) -> list[tuple[str, "Op"]]:
        """Every epilogue op (:data:`EPILOGUE_OPS`) with its JSON path, pipeline inner ops
        after their pipeline."""
        out: list[tuple[str, Op]] = []
        for r, g in enumerate(self.gpus):
            for t, tb in enumerate(g.threadblocks):
                for i, op in enumerate(tb.ops):
                    path = f"gpus[{r}].threadblocks[{t}].ops[{i}]"
                    for j, inner in enumerate([op] + list(op.ops or [])):
                        if inner.name in EPILOGUE_OPS:
                            out.append((path if j == 0 else f"{path}.ops[{j - 1}]", inner))
        return out

    def uses_port_channels(self) -> bool:
        """Whether some rank has a port channel (proxy / copy-engine transfers)."""
        return any(g.peers(ChannelType.port) for g in self.gpus)
