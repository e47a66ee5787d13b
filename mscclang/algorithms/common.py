"""Helpers shared by the library's DSL programs.

They only call the public DSL (``mscclang.dsl``), so every program stays an ordinary MSCCL++-style
program, and each helper records its ops in the order a hand-written loop would. Nothing here
keeps state between programs.

Ops recorded through these helpers name the calling algorithm's line as their ``src`` (this
module is marked ``__mscclang_helper__``, see :mod:`mscclang.compiler.source`).

Conventions: ``chans`` is a channel set from :func:`mesh`, keyed ``(src, dst)``; ``rank`` is the
rank whose ops are recorded; ``to`` / ``frm`` / ``ps`` are peer ranks; ``dst`` / ``src`` given
as callables map a peer rank to the chunk used for that peer.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

from mscclang.dsl import (
    BaseBuffer,
    Chunk,
    Collective,
    CollectiveProgram,
    MemoryChannel,
    PortChannel,
    Rank,
    SyncType,
    ThreadBlockGroup,
)
from mscclang.dsl import read_reduce as read_reduce_op
from mscclang.errors import DSLError
from mscclang.plan.models import MAX_MESSAGE_SIZE, ChannelType, Op, OpName, Plan

__all__ = [
    "MAX_PORT_REQUESTS", "PortChannels", "check_port_requests", "local_peers", "node_layout", "port_mesh",
    "port_requests", "remote_peers",
    "Channels", "announce_ready", "await_ready", "check_common", "data_handshake", "get_from_peers", "input_of", "library_program",
    "make_program", "mesh", "mesh_program", "output_of", "peers", "plan_name", "put_to_peers", "read_reduce",
    "ready_handshake", "reduce_packets_from_peers", "send_packets_to_peers", "sender_slot",
    "signal_all", "stage_peer_chunks", "unpack_packets_from_peers", "wait_all",
]

#: skip this module's frames when recording an op's source line (mscclang.compiler.source)
__mscclang_helper__ = True

#: channels keyed ``(src, dst)`` (see :func:`mesh`)
Channels = dict[tuple[int, int], MemoryChannel]
#: port channels keyed ``(src, dst)`` (see :func:`port_mesh`)
PortChannels = dict[tuple[int, int], PortChannel]
#: a peer rank -> the chunk used for that peer
PerPeer = Callable[[int], Chunk]

#: most port requests (one per put destination, per signal and per flush of a channel) a rank
#: of a library plan may post per launch: every request becomes host-enqueued work per launch
#: (a copy-engine copy, a stream write or wait) in the GPU runtime
MAX_PORT_REQUESTS = 200


# -- ranks, names and programs ------------------------------------------------------------------

def peers(rank: int, num_ranks: int) -> list[int]:
    """Every rank but ``rank``, in increasing order."""
    return [p for p in range(num_ranks) if p != rank]


def sender_slot(sender: int, receiver: int) -> int:
    """Position of ``sender`` among ``receiver``'s peers (a per-sender scratch slot index)."""
    return sender if sender < receiver else sender - 1


def input_of(rank: int) -> BaseBuffer:
    """Rank ``rank``'s input buffer."""
    return Rank(rank).get_input_buffer()


def output_of(rank: int, inplace: bool = False) -> BaseBuffer:
    """Where rank ``rank``'s results go: its output buffer, or its input buffer when ``inplace``
    (in-place programs write into the input, which is the output, so the compiler sees the
    alias)."""
    r = Rank(rank)
    return r.get_input_buffer() if inplace else r.get_output_buffer()


def plan_name(algorithm: str, ranks: int, instances: int, name: Optional[str]) -> str:
    """The plan's name: ``name`` when given, else ``<algorithm>.r<ranks>.i<instances>``."""
    return name if name else f"{algorithm}.r{ranks}.i{instances}"


def check_common(algorithm: str, ranks: int, instances: int) -> None:
    """Reject rank and instance counts the library does not build."""
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 2:
        raise DSLError(f"{algorithm}: ranks must be an int >= 2, got {ranks!r}")
    if not isinstance(instances, int) or isinstance(instances, bool) or instances < 1:
        raise DSLError(f"{algorithm}: instances must be a positive int, got {instances!r}")


def make_program(name: str, collective: Collective, ranks: int, instances: int, protocol: str,
                 num_threads_per_block: int, min_message_size: int = 0,
                 max_message_size: int = MAX_MESSAGE_SIZE,
                 double_scratch: bool = False, chunk_unit: Optional[str] = None,
                 replicated_residual: Optional[bool] = None,
                 batch_invariant: Optional[bool] = None) -> CollectiveProgram:
    """A :class:`CollectiveProgram` with the library's settings: fusion and auto sync on, and the
    promises that plan generation proves: every rank gets the same bits (``consistent``) and,
    for a collective that reduces, every reduced element is the canonical sum (``batch_invariant``:
    the ranks' sources in rank order, left to right, in one reduction op; docs/semantics.md,
    "Batch invariance"). ``batch_invariant=False`` disclaims it (a program with partial sums);
    a collective that reduces nothing promises nothing (None)."""
    if batch_invariant is None and collective.spec.is_reduction:
        batch_invariant = True
    return CollectiveProgram(
        name, collective, ranks, instances=instances, protocol=protocol, instr_fusion=True,
        auto_sync=True, num_threads_per_block=num_threads_per_block,
        use_double_scratch_buffer=double_scratch, min_message_size=min_message_size,
        max_message_size=max_message_size, consistent=True, batch_invariant=batch_invariant,
        chunk_unit=chunk_unit, replicated_residual=replicated_residual)


def library_program(algorithm: str, collective: Callable[..., Collective], ranks: int, instances: int,
                    inplace: bool, protocol: str, num_threads_per_block: int, name: Optional[str],
                    min_message_size: int, max_message_size: int, double_scratch: bool = False,
                    chunk_unit: Optional[str] = None, replicated_residual: Optional[bool] = None,
                    batch_invariant: Optional[bool] = None, **collective_kw: Any) -> CollectiveProgram:
    """The program of one library builder: checks ``ranks`` and ``instances``, then a
    :func:`make_program` named by :func:`plan_name` for ``collective(ranks, 1, inplace=inplace,
    **collective_kw)`` (one chunk per rank)."""
    check_common(algorithm, ranks, instances)
    return make_program(plan_name(algorithm, ranks, instances, name),
                        collective(ranks, 1, inplace=inplace, **collective_kw), ranks, instances,
                        protocol, num_threads_per_block, min_message_size, max_message_size,
                        double_scratch=double_scratch, chunk_unit=chunk_unit,
                        replicated_residual=replicated_residual, batch_invariant=batch_invariant)


def mesh(num_ranks: int, pairs: Optional[Sequence[tuple[int, int]]] = None) -> Channels:
    """One memory channel ``src -> dst`` for every ordered pair (or the given ``(src, dst)``
    pairs), keyed ``(src, dst)``. Created in a fixed order, so calling ``mesh`` twice gives two
    channel sets whose ends pair up set by set (the j-th channel A->B meets the j-th B->A)."""
    if pairs is None:
        pairs = [(s, d) for s in range(num_ranks) for d in range(num_ranks) if s != d]
    return {(s, d): MemoryChannel(d, s) for s, d in pairs}


@contextmanager
def mesh_program(*args: Any, channels: Callable[[int], Channels] = mesh,
                 **kw: Any) -> Iterator[tuple[CollectiveProgram, Channels]]:
    """The prologue of a library builder: :func:`library_program` (same arguments), entered,
    yielding it with ``channels(ranks)`` made in it (by default :func:`mesh`, a memory channel
    for every ordered pair of ranks). The block records the ops; ``prog.to_plan()`` after it
    gives the plan."""
    prog = library_program(*args, **kw)
    with prog:
        yield prog, channels(prog.num_ranks)


def port_mesh(pairs: Sequence[tuple[int, int]]) -> PortChannels:
    """One port channel ``src -> dst`` for every given ordered pair, keyed ``(src, dst)``, made
    in the order given (so the j-th channel A->B meets the j-th B->A, as for :func:`mesh`)."""
    return {(s, d): PortChannel(d, s) for s, d in pairs}


# -- node layouts (hierarchical programs) -------------------------------------------------------

def node_layout(algorithm: str, ranks: int, gpus_per_node: object) -> tuple[int, int]:
    """``(nodes, gpus_per_node)`` of ``ranks`` ranks numbered node by node, ``gpus_per_node``
    consecutive ranks per node (the launcher's layout, see :mod:`mscclang.runtime.topology`);
    a hierarchical program needs at least two nodes."""
    if not isinstance(gpus_per_node, int) or isinstance(gpus_per_node, bool) or gpus_per_node < 1:
        raise DSLError(f"{algorithm}: gpus_per_node must be a positive int (the node layout is a "
                       f"parameter of the program), got {gpus_per_node!r}")
    if ranks % gpus_per_node:
        raise DSLError(f"{algorithm}: {ranks} ranks do not split into nodes of {gpus_per_node} GPUs")
    nodes = ranks // gpus_per_node
    if nodes < 2:
        raise DSLError(f"{algorithm}: {ranks} ranks with {gpus_per_node} GPUs per node is one node; "
                       "a hierarchical program needs at least two")
    return nodes, gpus_per_node


def local_peers(rank: int, gpus_per_node: int) -> list[int]:
    """The other ranks of ``rank``'s node, in increasing order."""
    base = rank - rank % gpus_per_node
    return [q for q in range(base, base + gpus_per_node) if q != rank]


def remote_peers(rank: int, gpus_per_node: int, nodes: int) -> list[int]:
    """The ranks with ``rank``'s local index on every other node, in increasing order."""
    local, node = rank % gpus_per_node, rank // gpus_per_node
    return [m * gpus_per_node + local for m in range(nodes) if m != node]


# -- port request budget ------------------------------------------------------------------------

def _op_requests(op: Op) -> int:
    if op.channel_type != ChannelType.port:
        return 0
    if op.name in (OpName.put, OpName.pws, OpName.pwsf, OpName.ppkt, OpName.rppkt):
        n = len(op.dst_buff)
        return n + (len(set(op.channel_ids)) if op.name == OpName.pwsf else 0)
    if op.name in (OpName.signal, OpName.flush):
        return len(op.channel_ids)
    return 0


def port_requests(plan: Plan) -> int:
    """The most port requests one rank of ``plan`` posts per launch: one per destination of a
    ``put``/``pws``/``pwsf`` (a put with its signal is one request, as in MSCCL++'s trigger),
    one per channel of a ``signal``, of a ``flush`` and of a ``pwsf``'s flush. Ops inside a
    pipeline count once (their number of iterations depends on the message size)."""
    return max((sum(_op_requests(op) for op in g.all_ops()) for g in plan.gpus), default=0)


def check_port_requests(algorithm: str, plan: Plan, limit: int = MAX_PORT_REQUESTS) -> Plan:
    """``plan`` when no rank posts more than ``limit`` port requests per launch, else a
    :class:`DSLError` (fewer instances or pipeline steps keep the host-enqueued work moderate)."""
    n = port_requests(plan)
    if n > limit:
        raise DSLError(f"{algorithm}: a rank posts {n} port requests per launch, more than the "
                       f"{limit} a copy-engine runtime enqueues cheaply; use fewer instances or steps")
    return plan


# -- synchronisation ----------------------------------------------------------------------------

def signal_all(chans: Channels, rank: int, to: Sequence[int], tb: int,
               relaxed: bool = False, data_sync: SyncType = SyncType.both) -> None:
    """Signal every peer in ``to`` from ``rank``'s block ``tb`` (fused into one op)."""
    for p in to:
        chans[(rank, p)].signal(tb, data_sync=data_sync, relaxed=relaxed)


def wait_all(chans: Channels, rank: int, frm: Sequence[int], tb: int,
             relaxed: bool = False, data_sync: SyncType = SyncType.both) -> None:
    """Wait for one signal of every peer in ``frm`` on ``rank``'s block ``tb`` (fused)."""
    for p in frm:
        chans[(rank, p)].wait(tb, data_sync=data_sync, relaxed=relaxed)


def announce_ready(chans: Channels, rank: int, to: Sequence[int], tb: int) -> None:
    """Tell every rank in ``to`` that this launch has started, so it may write our buffers (a
    relaxed signal: it orders execution only and publishes no data)."""
    signal_all(chans, rank, to, tb, relaxed=True, data_sync=SyncType.none)


def await_ready(chans: Channels, rank: int, frm: Sequence[int], tb: int) -> None:
    """Wait for the :func:`announce_ready` word of every rank in ``frm`` (then a block sync)."""
    wait_all(chans, rank, frm, tb, relaxed=True, data_sync=SyncType.after)


def ready_handshake(chans: Channels, rank: int, to: Sequence[int], frm: Sequence[int], tb: int) -> None:
    """The relaxed "ready" handshake (docs/dsl.md, "Quickstart: a zero-copy allgather and its
    ready handshake"): tell ``to`` that this launch has
    started (so they may write our buffers), then wait until every rank in ``frm`` said the same.
    It orders execution only; it publishes no data."""
    announce_ready(chans, rank, to, tb)
    await_ready(chans, rank, frm, tb)


def data_handshake(chans: Channels, rank: int, to: Sequence[int], frm: Sequence[int], tb: int) -> None:
    """Publish this block's writes to ``to`` (block sync, then a data signal to each) and wait
    for the data signal of every rank in ``frm`` (then a block sync), so that what ``frm`` wrote
    may be read. With ``to == frm`` it is also the closing round that keeps a rank's buffers
    alive until no peer touches them any more."""
    signal_all(chans, rank, to, tb, data_sync=SyncType.before)
    wait_all(chans, rank, frm, tb, data_sync=SyncType.after)


# -- data movement ------------------------------------------------------------------------------

def put_to_peers(chans: Channels, rank: int, ps: Sequence[int], dst: PerPeer, src: PerPeer, tb: int) -> None:
    """Block ``tb`` writes ``src(p)`` into peer ``p``'s ``dst(p)``, for every ``p`` in ``ps``
    (fused into one multi-destination ``put`` when the sources agree)."""
    for p in ps:
        chans[(rank, p)].put(dst(p), src(p), tb=tb)


def get_from_peers(chans: Channels, rank: int, ps: Sequence[int], dst: PerPeer, src: PerPeer, tb: int) -> None:
    """Block ``tb`` reads peer ``p``'s ``src(p)`` into the local ``dst(p)``, for every ``p`` in
    ``ps`` (fused into one multi-source ``get``)."""
    for p in ps:
        chans[(rank, p)].get(dst(p), src(p), tb=tb)


def stage_peer_chunks(rank: int, ps: Sequence[int], scratch: BaseBuffer, inp: BaseBuffer, tb: int = 0) -> None:
    """Copy chunk ``p`` of ``rank``'s input into slot ``p`` of its own ``scratch`` for every
    peer ``p``, chunk by chunk (with ``instances > 1`` every reference must be one chunk range),
    so that the peers can read their chunks from there."""
    me = Rank(rank)
    for p in ps:
        me.copy(scratch[p], inp[p], tb=tb)


def read_reduce(chans: Channels, rank: int, src: Chunk, remote: Sequence[tuple[int, Chunk]], dst: Chunk,
                tb: int) -> None:
    """``dst`` = the sum of ``src`` (``rank``'s chunk) and every peer ``p``'s ``chunk`` of
    ``remote`` (``(p, chunk)`` pairs), read through the channel to ``p``: one ``rre`` adding the
    ranks' chunks in rank order, ``src`` at ``rank``'s place (the canonical order, which a chain
    of single-peer reductions cannot give: a chain starts with its local source)."""
    remote = sorted(remote, key=lambda pc: pc[0])
    read_reduce_op([chans[(rank, p)] for p, _ in remote], src, [c for _, c in remote], tb=tb, local_dst_chunk=dst,
                   src_position=sum(1 for p, _ in remote if p < rank))


# -- LL packets (one scratch slot per sender) ---------------------------------------------------

def send_packets_to_peers(chans: Channels, rank: int, ps: Sequence[int], scratch: Sequence[BaseBuffer],
                          src: PerPeer, slot_base: int = 0) -> None:
    """Block ``j`` packs ``src(p)`` for the ``j``-th peer ``p`` of ``ps`` as LL packets into
    slot ``slot_base + rank`` of ``p``'s scratch (``scratch`` lists every rank's buffer)."""
    for j, p in enumerate(ps):
        chans[(rank, p)].put_packets(scratch[p][slot_base + rank], src(p), tb=j)


def unpack_packets_from_peers(rank: int, ps: Sequence[int], scratch: BaseBuffer, dst: PerPeer,
                              slot_base: int = 0) -> None:
    """Block ``j`` unpacks the packets of the ``j``-th peer ``p`` of ``ps`` (slot
    ``slot_base + p`` of ``rank``'s ``scratch``) into ``dst(p)``."""
    me = Rank(rank)
    for j, p in enumerate(ps):
        me.unpack_packets(dst(p), scratch[slot_base + p], tb=j)


def reduce_packets_from_peers(rank: int, ps: Sequence[int], scratch: BaseBuffer, own: Chunk, dst: Chunk,
                              group: Optional[ThreadBlockGroup] = None) -> None:
    """``dst = own OP packets of every peer p of ps`` (slot ``p`` of ``rank``'s ``scratch``),
    shared by a thread block group (default: blocks ``0 .. len(ps) - 1``) as one ``repkt``; the
    ranks' contributions combine in rank order (``own`` at this rank's place)."""
    if group is None:
        group = ThreadBlockGroup(list(range(len(ps))))
    Rank(rank).reduce(own, [scratch[q] for q in ps], tb_group=group, dst_chunk=dst, packet=True,
                      src_position=sum(1 for q in ps if q < rank))
