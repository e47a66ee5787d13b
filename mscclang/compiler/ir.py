"""The compiler's intermediate representation.

The DSL records a program into an :class:`IRProgram`: per rank, its buffers' chunk counts, its
channels (in creation order), its semaphores and its thread blocks, each an ordered list of
:class:`IROp` records. Compiler passes are pure functions ``IRProgram -> IRProgram`` (they copy
their input); :mod:`mscclang.compiler.emit` turns the final IR into a
:class:`mscclang.plan.models.Plan`.

Channel ids inside the IR are *rank-global* per channel type (the position among the rank's
channels of that type, i.e. creation order); the emitter maps them to thread-block-local indexes.
Buffer references are :class:`Ref` records that still name the owning rank, so remote buffer
numbering also happens in the emitter.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional, Sequence

from mscclang.plan.collectives import CollectiveSpec
from mscclang.plan.models import PUT_SIGNAL_OPS, SIGNAL_OPS, WAIT_OPS, BufferKind, ChannelType, OpName, ReduceOp

# Data-sync bits (same values as mscclang.dsl.types.SyncType; kept as ints here so that the
# compiler does not import the DSL).
SYNC_BEFORE = 1
SYNC_AFTER = 2


def signal_side(op: IROp) -> Optional[str]:
    """Which end of a channel's signal/wait pairing ``op`` is, by the plan's op table:
    ``"signal"`` (a signal, or a put-with-signal on a port channel), ``"wait"``, or None (any
    other op, and every op off the memory and port channels)."""
    if op.channel_type not in (ChannelType.memory, ChannelType.port):
        return None
    if op.name in SIGNAL_OPS or (op.channel_type == ChannelType.port and op.name in PUT_SIGNAL_OPS):
        return "signal"
    return "wait" if op.name in WAIT_OPS else None


@dataclass(frozen=True)
class Ref:
    """A chunk range used by an op.

    ``rank`` owns the bytes. A local reference has ``rank`` equal to the op's rank; a remote one
    (``remote=True``) names a peer's buffer; a switch reference (``switch`` set to the rank-global
    switch channel id) names the multicast view of ``buffer`` over the channel's group.
    """

    rank: int
    buffer: BufferKind
    index: int
    size: int
    remote: bool = False
    switch: Optional[int] = None

    @property
    def end(self) -> int:
        return self.index + self.size

    def moved(self, index: int) -> "Ref":
        """The same reference starting at chunk ``index``."""
        return Ref(self.rank, self.buffer, index, self.size, self.remote, self.switch)

    def describe(self) -> str:
        where = f"switch channel {self.switch} " if self.switch is not None else (
            f"remote rank {self.rank} " if self.remote else "")
        return f"{where}{self.buffer.name}[{self.index}:{self.end}]"


@dataclass
class IROp:
    """One recorded operation of a thread block (see the plan's :class:`~mscclang.plan.models.Op`).

    ``channels`` hold rank-global channel ids of ``channel_type``; ``data_sync`` is the DSL's
    SyncType value for sync ops (consumed by the sync pass); ``body`` holds a pipeline's inner ops;
    ``origin`` describes the DSL call that recorded the op (for error messages); ``source`` is
    where the user's program made that call (``"program.py:42"``, see
    :mod:`mscclang.compiler.source`), kept by every pass (a fused op keeps its first
    constituent's, an inserted ``nop`` that of the op it was inserted for) and emitted as the
    plan op's ``src``.
    """

    name: OpName
    src: list[Ref] = field(default_factory=list)
    dst: list[Ref] = field(default_factory=list)
    channel_type: ChannelType = ChannelType.none
    channels: list[int] = field(default_factory=list)
    tbg: Optional[tuple[int, int]] = None
    reduce_op: Optional[ReduceOp] = None
    barrier_id: Optional[int] = None
    barrier_tbs: Optional[list[int]] = None
    semaphores: list[int] = field(default_factory=list)
    data_sync: int = 0
    iter_context: Optional[tuple[int, int]] = None
    body: Optional[list["IROp"]] = None
    origin: str = ""
    source: Optional[str] = None
    #: rmsnorm only: the output is FP8 (the plan op's ``quant``)
    quant: bool = False
    #: reductions: where ``src[0]`` enters the reduction order (the plan op's ``src0_position``)
    src_position: int = 0

    def describe(self) -> str:
        return self.origin or self.name.value

    def copy(self) -> "IROp":
        """An independent copy (lists and the body copied, refs shared: they are frozen). Every
        pass copies every op, so this copies the fields directly rather than through
        :func:`dataclasses.replace` (which costs several times as much)."""
        new = object.__new__(IROp)
        d = new.__dict__
        d.update(self.__dict__)
        d["src"], d["dst"], d["channels"] = list(self.src), list(self.dst), list(self.channels)
        d["semaphores"] = list(self.semaphores)
        if self.barrier_tbs is not None:
            d["barrier_tbs"] = list(self.barrier_tbs)
        if self.body is not None:
            d["body"] = [op.copy() for op in self.body]
        return new


def op_where(rank: int, tb: int, idx: str, op: IROp) -> str:
    """``rank R, tb T, op I (the DSL call, program.py:42)`` for error messages (``idx`` is the op's
    index in the recorded block, ``"i.j"`` inside a pipeline)."""
    at = f", {op.source}" if op.source else ""
    return f"rank {rank}, tb {tb}, op {idx} ({op.describe()}{at})"


@dataclass
class IRSwitch:
    """A switch channel of one rank: the multicast view of ``buffer`` over ``ranks``."""

    buffer: BufferKind
    ranks: list[int]


@dataclass
class IRRank:
    """Everything one rank of the program holds."""

    rank: int
    input_chunks: int
    output_chunks: int
    scratch_chunks: int = 0
    memory: list[int] = field(default_factory=list)
    port: list[int] = field(default_factory=list)
    switch: list[IRSwitch] = field(default_factory=list)
    semaphores: list[int] = field(default_factory=list)
    tbs: list[list[IROp]] = field(default_factory=list)
    #: plan/3: the count-matrix entry of each segment of a segmented buffer (its chunks are its
    #: segments; see :mod:`mscclang.plan.segments`)
    segments: dict[BufferKind, list[tuple[int, int]]] = field(default_factory=dict)

    def chunks(self, kind: BufferKind) -> int:
        return {BufferKind.input: self.input_chunks, BufferKind.output: self.output_chunks,
                BufferKind.scratch: self.scratch_chunks, BufferKind.residual: self.input_chunks,
                BufferKind.weight: 0}[kind]

    def peers(self, channel_type: ChannelType) -> list[int]:
        if channel_type == ChannelType.memory:
            return self.memory
        if channel_type == ChannelType.port:
            return self.port
        return []

    def ensure_tb(self, tb: int) -> list[IROp]:
        while len(self.tbs) <= tb:
            self.tbs.append([])
        return self.tbs[tb]


@dataclass
class IRProgram:
    """A whole program: settings plus one :class:`IRRank` per rank."""

    name: str
    spec: CollectiveSpec
    ranks: list[IRRank]
    protocol: str = "Simple"
    instances: int = 1
    replication_policy: str = "interleaved"
    instr_fusion: bool = True
    auto_sync: bool = True
    reuse_resources: bool = False
    num_threads_per_block: int = 1024
    use_double_scratch_buffer: bool = False
    buffer_alignment: int = 16
    min_message_size: int = 0
    max_message_size: int = 2**64 - 1
    #: signal/wait imbalances are errors, not warnings (``CollectiveProgram(strict=True)``)
    strict: bool = False
    #: set by the replication pass; replicating twice is an error
    replicated: bool = False
    #: the plan's ``consistent`` promise (True: every rank gets the same bits; None: unsaid)
    consistent: Optional[bool] = None
    #: the plan's ``batch_invariant`` promise (True: every reduced element is the canonical
    #: expression at every size; False: disclaimed; None: unsaid)
    batch_invariant: Optional[bool] = None
    #: the plan's ``chunk_unit`` ("row": fused plans whose chunks are whole rows)
    chunk_unit: Optional[str] = None
    #: the plan's ``replicated_residual`` (fused plans whose ranks take each other's residual rows)
    replicated_residual: Optional[bool] = None

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def copy(self) -> "IRProgram":
        """An independent copy: every list and op is new (refs, which are frozen, and the
        collective spec are shared)."""
        ranks = [replace(r, memory=list(r.memory), port=list(r.port),
                         switch=[IRSwitch(s.buffer, list(s.ranks)) for s in r.switch],
                         semaphores=list(r.semaphores), tbs=[[op.copy() for op in ops] for ops in r.tbs],
                         segments={k: list(v) for k, v in r.segments.items()})
                 for r in self.ranks]
        return replace(self, ranks=ranks)


# ------------------------------------------------------------------------------------------------
# Data accesses (used by fusion legality, hazard syncs and validation)


@dataclass(frozen=True)
class Access:
    """One op's access to a byte range.

    ``key`` names the buffer: ``("L", kind)`` for this rank's buffer, ``("R", rank, kind)`` for a
    peer's. ``start``/``end`` are in units of one plain chunk; a scratch range holding LL packets
    is doubled (packet chunk ``c`` occupies plain units ``[2c, 2c + 2)``), so plain and packet
    views of scratch compare by bytes.
    """

    key: tuple
    start: int
    end: int
    write: bool
    packet: bool

    def overlaps(self, other: "Access") -> bool:
        return self.key == other.key and self.start < other.end and other.start < self.end


def alias_range(spec: Optional[CollectiveSpec], owner: int, buffer: BufferKind, start: int,
                end: int) -> tuple[BufferKind, int, int]:
    """The canonical (buffer, start, end) of chunks ``[start, end)`` of ``owner``'s ``buffer``.

    For in-place collectives the input and the output are the same memory
    (:meth:`CollectiveSpec.input_in_output` / :meth:`~CollectiveSpec.output_in_input` give the
    chunk offset): the input range is expressed in output chunks (or, for an in-place
    reduce-scatter, the output range in input chunks), so overlapping input and output ranges
    compare as the same bytes. Scratch, and every buffer of an out-of-place collective, is
    returned unchanged."""
    if spec is None or buffer == BufferKind.scratch:
        return buffer, start, end
    off = spec.input_in_output(owner)
    if off is not None and buffer == BufferKind.input:
        return BufferKind.output, start + off, end + off
    off = spec.output_in_input(owner)
    if off is not None and buffer == BufferKind.output:
        return BufferKind.input, start + off, end + off
    return buffer, start, end


def _acc(ref: Ref, write: bool, packet: bool, spec: Optional[CollectiveSpec]) -> Access:
    packet = packet and ref.buffer == BufferKind.scratch
    start, end = (2 * ref.index, 2 * ref.end) if packet else (ref.index, ref.end)
    buffer, start, end = alias_range(spec, ref.rank, ref.buffer, start, end)
    if ref.switch is not None:
        # the multicast view covers this rank's own buffer of the switch's kind at the same range
        return Access(("L", buffer), start, end, write, packet)
    if ref.remote:
        return Access(("R", ref.rank, buffer), start, end, write, packet)
    return Access(("L", buffer), start, end, write, packet)


def operand_roles(op: IROp) -> list[tuple[Ref, bool, bool]]:
    """``(ref, write, packet)`` for every operand of ``op`` (pipeline bodies included), in the
    order sources then destinations; ``packet``: the operand holds LL packets (see
    :func:`accesses`)."""
    n = op.name
    out: list[tuple[Ref, bool, bool]] = []
    if n == OpName.pipeline:
        for inner in op.body or []:
            out.extend(operand_roles(inner))
        return out
    if n in (OpName.copy, OpName.put, OpName.pws, OpName.pwsf, OpName.get, OpName.gstore,
             OpName.re, OpName.rre, OpName.res, OpName.rres, OpName.glre, OpName.glres):
        out += [(s, False, False) for s in op.src] + [(d, True, False) for d in op.dst]
    elif n in (OpName.cpkt, OpName.ppkt):
        out += [(s, False, False) for s in op.src] + [(d, True, True) for d in op.dst]
    elif n in (OpName.rppkt, OpName.gstorepkt):
        out += [(s, False, True) for s in op.src] + [(d, True, True) for d in op.dst]
    elif n == OpName.upkt:
        out += [(s, False, True) for s in op.src] + [(d, True, False) for d in op.dst]
    elif n in (OpName.repkt, OpName.respkt, OpName.recpkt, OpName.recspkt):
        out += [(s, False, i > 0) for i, s in enumerate(op.src)]
        out += [(d, True, i > 0) for i, d in enumerate(op.dst)]
    elif n == OpName.radd:  # r[dst] = src + r[dst]: the residual is read, then written
        out += [(s, False, False) for s in op.src] + [(d, False, False) for d in op.dst]
        out += [(d, True, False) for d in op.dst]
    elif n == OpName.rmsnorm:
        out += [(s, False, False) for s in op.src] + [(d, True, False) for d in op.dst]
    return out


def accesses(op: IROp, spec: Optional[CollectiveSpec] = None) -> list[Access]:
    """The byte ranges ``op`` reads and writes (see :class:`Access`).

    Packet-format operands: ``cpkt``/``ppkt``/``rppkt``/``gstorepkt`` destinations, the packet
    copies and sends of ``respkt``/``recpkt``/``recspkt``; ``upkt``/``rppkt``/``gstorepkt`` sources
    and the sources after the first of ``repkt``/``respkt``/``recpkt``/``recspkt``.

    With ``spec`` (the program's collective), ranges of in-place input/output buffers are
    expressed in one buffer's chunks (see :func:`alias_range`), so aliases of the same bytes
    overlap; without it, input and output are compared as distinct buffers.
    """
    return [_acc(ref, write, packet, spec) for ref, write, packet in operand_roles(op)]


def conflicts(earlier: Access, later: Access) -> bool:
    """Whether ``later`` must not start before ``earlier`` finished on every thread of the block.

    Two accesses to overlapping bytes conflict unless both read, or unless the earlier one writes
    LL packets and the later one reads them as packets: a packet reader spins on each packet's flag
    until the writer's single vector store (data and flag together) has landed, so that order is
    kept by the packets themselves. Every other combination involving packets still conflicts: a
    packet read followed by a packet write of the same slot (the writer may replace the packet
    before a slower thread read it, with the same flag), two packet writes of one slot, and any
    mix of plain and packet views of the same scratch bytes.
    """
    if not earlier.overlaps(later):
        return False
    if not earlier.write and not later.write:
        return False
    if earlier.write and earlier.packet and not later.write and later.packet:
        return False
    return True


@dataclass
class _Sorted:
    """Accesses of one buffer key and mode, sorted by start (``starts`` alongside)."""

    starts: list[int] = field(default_factory=list)
    accesses: list[Access] = field(default_factory=list)
    longest: int = 0


class AccessIndex:
    """Accesses grouped by buffer key and mode, each group sorted by start: the earlier accesses a
    later one conflicts with (same key; a write, or any access when the later one writes;
    overlapping) are found by bisection, so a lookup costs the candidates near its range, not
    every access so far (a pass that keeps adding accesses stays linear)."""

    def __init__(self, accs: Sequence[Access] = ()) -> None:
        self._groups: dict[tuple, _Sorted] = {}
        self.add(accs)

    def add(self, accs: Sequence[Access]) -> None:
        for x in accs:
            g = self._groups.setdefault((x.key, x.write), _Sorted())
            i = bisect_right(g.starts, x.start)
            g.starts.insert(i, x.start)
            g.accesses.insert(i, x)
            g.longest = max(g.longest, x.end - x.start)

    def conflicting(self, later: Access) -> Iterator[Access]:
        """The accesses of the index that ``later`` conflicts with (see :func:`conflicts`)."""
        for mode in (True, False) if later.write else (True,):
            g = self._groups.get((later.key, mode))
            if g is None:
                continue
            lo, hi = bisect_right(g.starts, later.start - g.longest), bisect_left(g.starts, later.end)
            for x in g.accesses[lo:hi]:
                if conflicts(x, later):
                    yield x
