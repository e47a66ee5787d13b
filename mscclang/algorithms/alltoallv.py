"""All-to-all-v programs of the library (``AllToAllV(ranks)``: rank ``r``'s input segment ``p``
holds the ``counts[r][p]`` rows for rank ``p``; its output segment ``p`` must receive the
``counts[p][r]`` rows rank ``p`` sent). The counts are read at run time (docs/dsl.md,
"Data-dependent counts"), so one plan serves every count matrix.

Every program starts each block with the relaxed "ready" handshake with its peer: a segment of
zero rows sends no packet and no data, so nothing else would order a sender's next launch after
the receiver's reads of this one (fixed-size plans get that order from their packets).
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import (check_port_requests, data_handshake, input_of, mesh_program, output_of, peers,
                                        port_mesh, ready_handshake)
from mscclang.dsl import AllToAllV, Buffer, Rank, SyncType
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_alltoallv_ll", "build_alltoallv_port", "build_alltoallv_simple", "build_alltoallv_zero_copy"]


def build_alltoallv_ll(ranks: int, instances: int = 1, num_threads_per_block: int = 512,
                       inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                       max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """LL all-to-all-v: block ``j`` handles the ``j``-th peer ``p``: after the ready handshake with
    ``p`` it packs the rows for ``p`` as LL packets into slot ``r`` of ``p``'s scratch (one slot
    per sender, each the call's capacity rows), then unpacks the rows ``p`` sent into output
    segment ``p``; block 0 also copies the rank's own rows. Double scratch, as every LL plan
    that shares a scratch (the handshake alone would order a launch's writes after the peer's
    reads of the previous one)."""
    n = ranks
    with mesh_program("alltoallv_ll", AllToAllV, ranks, instances, inplace, "LL", num_threads_per_block,
                      name, min_message_size, max_message_size, double_scratch=True) as (prog, ch):
        scratch = [Buffer(r, segments=[(s, r) for s in range(n)]) for r in range(n)]
        for r in range(n):
            inp, out, me = input_of(r), output_of(r), Rank(r)
            for j, p in enumerate(peers(r, n)):
                ready_handshake(ch, r, [p], [p], tb=j)
                ch[(r, p)].put_packets(scratch[p][r], inp[p], tb=j)
            me.copy(out[r], inp[r], tb=0)
            for j, p in enumerate(peers(r, n)):
                me.unpack_packets(out[p], scratch[r][p], tb=j)
    return prog.to_plan()


def build_alltoallv_simple(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                           inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                           max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """All-to-all-v through scratch (any buffers): block ``j`` copies the rows for its peer ``p``
    into slot ``p`` of the rank's scratch and signals ``p``; after ``p``'s signal it reads the
    rows ``p`` staged for it from ``p``'s scratch into output segment ``p``; a closing handshake
    keeps the scratch alive while ``p`` may still read it. Block 0 copies the own rows."""
    n = ranks
    with mesh_program("alltoallv_simple", AllToAllV, ranks, instances, inplace, "Simple",
                      num_threads_per_block, name, min_message_size, max_message_size) as (prog, ch):
        scratch = [Buffer(r, segments=[(r, p) for p in range(n)]) for r in range(n)]
        for r in range(n):
            inp, out, me = input_of(r), output_of(r), Rank(r)
            for j, p in enumerate(peers(r, n)):
                me.copy(scratch[r][p], inp[p], tb=j)
                data_handshake(ch, r, [p], [p], tb=j)
                ch[(r, p)].get(out[p], scratch[p][r], tb=j)
                data_handshake(ch, r, [p], [p], tb=j)
            me.copy(out[r], inp[r], tb=0)
    return prog.to_plan()


def build_alltoallv_zero_copy(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                              inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                              max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Zero-copy all-to-all-v (registered outputs): block ``j`` writes the rows for its peer ``p``
    straight into output segment ``r`` of ``p`` (after the ready handshake), then signals ``p``
    and waits for ``p``'s signal. Block 0 copies the own rows."""
    n = ranks
    with mesh_program("alltoallv_zero_copy", AllToAllV, ranks, instances, inplace, "Simple",
                      num_threads_per_block, name, min_message_size, max_message_size) as (prog, ch):
        for r in range(n):
            inp, out, me = input_of(r), output_of(r), Rank(r)
            for j, p in enumerate(peers(r, n)):
                ready_handshake(ch, r, [p], [p], tb=j)
                ch[(r, p)].put(output_of(p)[r], inp[p], tb=j)
                data_handshake(ch, r, [p], [p], tb=j)
            me.copy(out[r], inp[r], tb=0)
    return prog.to_plan()


def build_alltoallv_port(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                         inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                         max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Copy-engine all-to-all-v (any buffers; the copy engine moves the rows between GPUs, no SM
    does). A port put copies each segment as its whole scratch slot (the copy engine cannot read a
    count, docs/dsl.md), so the rows travel slot to slot: rank ``r``'s scratch holds a send slot
    per peer (segment ``p``: the rows for ``p``) and a receive slot per peer (segment ``n + q``: the
    rows ``q`` sent). Block ``j`` (one per peer ``p``) stages input segment ``p`` into send slot
    ``p``; after a barrier block 0, which has done the ready handshake with every peer (its
    receive slot is free again), puts each send slot into the peer's receive slot ``r`` with a
    signal, waits for every peer's signal and flushes its channels (the next launch restages the
    send slots); after a second barrier block ``j`` unpacks receive slot ``p`` into output segment
    ``p``. Block ``n`` copies the rank's own rows meanwhile. Every put moves the call's capacity
    rows: this plan suits large, even counts (the rows per peer near the capacity)."""
    n = ranks
    with mesh_program("alltoallv_port", AllToAllV, ranks, instances, inplace, "Simple", num_threads_per_block,
                      name, min_message_size, max_message_size) as (prog, ready):
        port = port_mesh([(s, d) for s in range(n) for d in range(n) if s != d])
        scratch = [Buffer(r, segments=[(r, p) for p in range(n)] + [(q, r) for q in range(n)]) for r in range(n)]
        for r in range(n):
            inp, out, me, ps = input_of(r), output_of(r), Rank(r), peers(r, n)
            group = list(range(n))            # block 0 and the peers' blocks
            me.copy(out[r], inp[r], tb=n)
            ready_handshake(ready, r, ps, ps, tb=0)
            for j, p in enumerate(ps, 1):
                me.copy(scratch[r][p], inp[p], tb=j)
            me.barrier(group)
            for p in ps:
                port[(r, p)].put_with_signal(scratch[p][n + r], scratch[r][p], tb=0)
            for p in ps:
                port[(r, p)].wait(tb=0, data_sync=SyncType.none)
            for p in ps:
                port[(r, p)].flush(tb=0, data_sync=SyncType.after)
            me.barrier(group)
            for j, p in enumerate(ps, 1):
                me.copy(out[p], scratch[r][n + p], tb=j)
    return check_port_requests("alltoallv_port", prog.to_plan())
