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

from typing import Any, Callable, Optional, Sequence

from mscclang.dsl import (
    BaseBuffer,
    Chunk,
    Collective,
    CollectiveProgram,
    MemoryChannel,
    Rank,
    SyncType,
    ThreadBlockGroup,
)
from mscclang.errors import DSLError
from mscclang.plan.models import MAX_MESSAGE_SIZE

__all__ = [
    "Channels", "announce_ready", "await_ready", "check_common", "data_handshake", "get_from_peers", "input_of", "library_program",
    "make_program", "mesh", "output_of", "peers", "plan_name", "put_to_peers", "read_reduce",
    "ready_handshake", "reduce_packets_from_peers", "send_packets_to_peers", "sender_slot",
    "signal_all", "stage_peer_chunks", "unpack_packets_from_peers", "wait_all",
]

#: skip this module's frames when recording an op's source line (mscclang.compiler.source)
__mscclang_helper__ = True

#: channels keyed ``(src, dst)`` (see :func:`mesh`)
Channels = dict[tuple[int, int], MemoryChannel]
#: a peer rank -> the chunk used for that peer
PerPeer = Callable[[int], Chunk]


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
                 double_scratch: bool = False) -> CollectiveProgram:
    """A :class:`CollectiveProgram` with the library's settings (fusion and auto sync on)."""
    return CollectiveProgram(
        name, collective, ranks, instances=instances, protocol=protocol, instr_fusion=True,
        auto_sync=True, num_threads_per_block=num_threads_per_block,
        use_double_scratch_buffer=double_scratch, min_message_size=min_message_size,
        max_message_size=max_message_size)


def library_program(algorithm: str, collective: Callable[..., Collective], ranks: int, instances: int,
                    inplace: bool, protocol: str, num_threads_per_block: int, name: Optional[str],
                    min_message_size: int, max_message_size: int, double_scratch: bool = False,
                    **collective_kw: Any) -> CollectiveProgram:
    """The program of one library builder: checks ``ranks`` and ``instances``, then a
    :func:`make_program` named by :func:`plan_name` for ``collective(ranks, 1, inplace=inplace,
    **collective_kw)`` (one chunk per rank)."""
    check_common(algorithm, ranks, instances)
    return make_program(plan_name(algorithm, ranks, instances, name),
                        collective(ranks, 1, inplace=inplace, **collective_kw), ranks, instances,
                        protocol, num_threads_per_block, min_message_size, max_message_size,
                        double_scratch=double_scratch)


def mesh(num_ranks: int, pairs: Optional[Sequence[tuple[int, int]]] = None) -> Channels:
    """One memory channel ``src -> dst`` for every ordered pair (or the given ``(src, dst)``
    pairs), keyed ``(src, dst)``. Created in a fixed order, so calling ``mesh`` twice gives two
    channel sets whose ends pair up set by set (the j-th channel A->B meets the j-th B->A)."""
    if pairs is None:
        pairs = [(s, d) for s in range(num_ranks) for d in range(num_ranks) if s != d]
    return {(s, d): MemoryChannel(d, s) for s, d in pairs}


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
    """The relaxed "ready" handshake of design section 5: tell ``to`` that this launch has
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
    """``dst = src OP remote_0 OP remote_1 ...`` reading each peer's chunk through the channel to
    it. Recorded as a chain (``dst = src OP r0``, then ``dst = dst OP r1`` ...) that is correct on
    its own and that the compiler fuses into one ``rre``."""
    cur = src
    for p, chunk in remote:
        chans[(rank, p)].reduce(cur, [chunk], tb=tb, local_dst_chunk=dst)
        cur = dst


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
    shared by a thread block group (default: blocks ``0 .. len(ps) - 1``) as one ``repkt``."""
    if group is None:
        group = ThreadBlockGroup(list(range(len(ps))))
    Rank(rank).reduce(own, [scratch[q] for q in ps], tb_group=group, dst_chunk=dst, packet=True)
