"""Helpers shared by the library's DSL programs.

They only call the public DSL (``mscclang.dsl``), so every program stays an ordinary MSCCL++-style
program. Nothing here keeps state between programs.
"""

from __future__ import annotations

from typing import Optional, Sequence

from mscclang.dsl import Chunk, Collective, CollectiveProgram, MemoryChannel, SyncType
from mscclang.errors import DSLError
from mscclang.plan.models import MAX_MESSAGE_SIZE

__all__ = [
    "check_common", "handshake", "make_program", "mesh", "peers", "plan_name", "read_reduce",
    "sender_slot", "signal_all", "wait_all",
]


def peers(rank: int, num_ranks: int) -> list[int]:
    """Every rank but ``rank``, in increasing order."""
    return [p for p in range(num_ranks) if p != rank]


def sender_slot(sender: int, receiver: int) -> int:
    """Position of ``sender`` among ``receiver``'s peers (a per-sender scratch slot index)."""
    return sender if sender < receiver else sender - 1


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


def mesh(num_ranks: int, pairs: Optional[Sequence[tuple[int, int]]] = None) -> dict[tuple[int, int], MemoryChannel]:
    """One memory channel ``src -> dst`` for every ordered pair (or the given ``(src, dst)``
    pairs), keyed ``(src, dst)``. Created in a fixed order, so calling ``mesh`` twice gives two
    channel sets whose ends pair up set by set (the j-th channel A->B meets the j-th B->A)."""
    if pairs is None:
        pairs = [(s, d) for s in range(num_ranks) for d in range(num_ranks) if s != d]
    return {(s, d): MemoryChannel(d, s) for s, d in pairs}


def signal_all(chans: dict[tuple[int, int], MemoryChannel], rank: int, to: Sequence[int], tb: int,
               relaxed: bool = False, data_sync: SyncType = SyncType.both) -> None:
    """Signal every peer in ``to`` from ``rank``'s block ``tb`` (fused into one op)."""
    for p in to:
        chans[(rank, p)].signal(tb, data_sync=data_sync, relaxed=relaxed)


def wait_all(chans: dict[tuple[int, int], MemoryChannel], rank: int, frm: Sequence[int], tb: int,
             relaxed: bool = False, data_sync: SyncType = SyncType.both) -> None:
    """Wait for one signal of every peer in ``frm`` on ``rank``'s block ``tb`` (fused)."""
    for p in frm:
        chans[(rank, p)].wait(tb, data_sync=data_sync, relaxed=relaxed)


def handshake(chans: dict[tuple[int, int], MemoryChannel], rank: int, to: Sequence[int],
              frm: Sequence[int], tb: int) -> None:
    """The relaxed "ready" handshake of design section 5: tell ``to`` that this launch has
    started (so they may write our buffers), then wait until every rank in ``frm`` said the same.
    It orders execution only; it publishes no data."""
    signal_all(chans, rank, to, tb, relaxed=True, data_sync=SyncType.none)
    wait_all(chans, rank, frm, tb, relaxed=True, data_sync=SyncType.after)


def read_reduce(chans: dict[tuple[int, int], MemoryChannel], rank: int, src: Chunk,
                remote: Sequence[tuple[int, Chunk]], dst: Chunk, tb: int) -> None:
    """``dst = src OP remote_0 OP remote_1 ...`` reading each peer's chunk through the channel to
    it. Recorded as a chain (``dst = src OP r0``, then ``dst = dst OP r1`` ...) that is correct on
    its own and that the compiler fuses into one ``rre``."""
    cur = src
    for p, chunk in remote:
        chans[(rank, p)].reduce(cur, [chunk], tb=tb, local_dst_chunk=dst)
        cur = dst
