"""All-to-all programs of the library (``AllToAll(ranks, 1, inplace)``: rank ``r``'s output
chunk ``p`` is rank ``p``'s input chunk ``r``).

Memory-ordering rules as in :mod:`mscclang.algorithms.allreduce`.
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import (data_handshake, get_from_peers, input_of, mesh_program, output_of,
                                        peers, put_to_peers, ready_handshake, send_packets_to_peers,
                                        stage_peer_chunks, unpack_packets_from_peers)
from mscclang.dsl import AllToAll, Buffer, Rank
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_alltoall_ll", "build_alltoall_simple", "build_alltoall_zero_copy"]


def build_alltoall_ll(ranks: int, instances: int = 1, num_threads_per_block: int = 512,
                      inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                      max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """LL all-to-all: thread block ``j`` packs the ``j``-th peer's chunk of the input into that
    peer's scratch (slot of the sender), then unpacks the chunk that peer sent into the output;
    block 0 also copies the rank's own chunk (out of place). Works in place: each block reads a
    chunk before it overwrites it. Double scratch."""
    n = ranks
    with mesh_program("alltoall_ll", AllToAll, ranks, instances, inplace, "LL", num_threads_per_block,
                      name, min_message_size, max_message_size, double_scratch=True) as (prog, ch):
        scratch = [Buffer(r, n) for r in range(n)]
        for r in range(n):
            inp, out, ps = input_of(r), output_of(r, inplace), peers(r, n)
            send_packets_to_peers(ch, r, ps, scratch, src=lambda p: inp[p])
            if not inplace:
                Rank(r).copy(out[r], inp[r], tb=0)
            unpack_packets_from_peers(r, ps, scratch[r], dst=lambda p: out[p])
    return prog.to_plan()


def build_alltoall_simple(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                          inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                          max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """All-to-all through scratch (any buffers): every rank copies the peers' chunks of its
    input into its scratch and signals every peer; after the peers' signals it reads its chunk
    from every peer's scratch into its output (one multi-source ``get``) and copies its own
    chunk (out of place); a final signal/wait keeps every rank from reusing its scratch while a
    peer may still read it. Works in place (the input is copied before the output is written).
    One thread block per instance."""
    n = ranks
    with mesh_program("alltoall_simple", AllToAll, ranks, instances, inplace, "Simple",
                      num_threads_per_block, name, min_message_size, max_message_size) as (prog, ch):
        scratch = [Buffer(r, n) for r in range(n)]
        for r in range(n):
            inp, out, ps = input_of(r), output_of(r, inplace), peers(r, n)
            stage_peer_chunks(r, ps, scratch[r], inp)
            data_handshake(ch, r, ps, ps, 0)
            get_from_peers(ch, r, ps, dst=lambda p: out[p], src=lambda p: scratch[p][r], tb=0)
            if not inplace:
                Rank(r).copy(out[r], inp[r], tb=0)
            data_handshake(ch, r, ps, ps, 0)
    return prog.to_plan()


def build_alltoall_zero_copy(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                             inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                             max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Zero-copy all-to-all (symmetric buffers, out of place only): after a relaxed ready
    handshake put each peer's chunk of the input straight into that peer's output (one
    multi-destination ``put``), copy the own chunk, then signal every peer and wait for theirs.
    One thread block per instance."""
    n = ranks
    with mesh_program("alltoall_zero_copy", AllToAll, ranks, instances, inplace, "Simple",
                      num_threads_per_block, name, min_message_size, max_message_size) as (prog, ch):
        for r in range(n):
            inp, out, ps = input_of(r), output_of(r), peers(r, n)
            ready_handshake(ch, r, ps, ps, 0)
            put_to_peers(ch, r, ps, dst=lambda p: output_of(p)[r], src=lambda p: inp[p], tb=0)
            Rank(r).copy(out[r], inp[r], tb=0)
            data_handshake(ch, r, ps, ps, 0)
    return prog.to_plan()
