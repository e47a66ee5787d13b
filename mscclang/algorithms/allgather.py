"""Allgather programs of the library (``AllGather(ranks, 1, inplace)``: input one chunk, output
``ranks`` chunks; rank ``r``'s input is output chunk ``r`` everywhere).

Memory-ordering rules as in :mod:`mscclang.algorithms.allreduce`.
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import (data_handshake, get_from_peers, input_of, mesh_program, output_of,
                                        peers, put_to_peers, ready_handshake, send_packets_to_peers,
                                        unpack_packets_from_peers)
from mscclang.dsl import AllGather, Buffer, Rank
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_allgather_ll", "build_allgather_simple", "build_allgather_zero_copy"]


def build_allgather_ll(ranks: int, instances: int = 1, num_threads_per_block: int = 512,
                       inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                       max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """LL allgather: thread block ``j`` packs the input into the ``j``-th peer's scratch (slot
    of the sender) and unpacks that peer's packets into its output chunk; block 0 also copies
    the input into the rank's own output chunk (out of place). Double scratch."""
    n = ranks
    with mesh_program("allgather_ll", AllGather, ranks, instances, inplace, "LL", num_threads_per_block,
                      name, min_message_size, max_message_size, double_scratch=True) as (prog, ch):
        scratch = [Buffer(r, n) for r in range(n)]
        for r in range(n):
            inp, out, ps = input_of(r), output_of(r), peers(r, n)
            send_packets_to_peers(ch, r, ps, scratch, src=lambda p: inp[0])
            if not inplace:
                Rank(r).copy(out[r], inp[0], tb=0)
            unpack_packets_from_peers(r, ps, scratch[r], dst=lambda p: out[p])
    return prog.to_plan()


def build_allgather_simple(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                           inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                           max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Allgather through scratch (any buffers): every rank copies its input into its scratch
    and signals every peer; after the peers' signals it reads every peer's scratch into its
    output (one multi-source ``get``) and copies its own input (out of place); a final
    signal/wait keeps every rank from reusing its scratch while a peer may still read it. One
    thread block per instance."""
    n = ranks
    with mesh_program("allgather_simple", AllGather, ranks, instances, inplace, "Simple",
                      num_threads_per_block, name, min_message_size, max_message_size) as (prog, ch):
        scratch = [Buffer(r, 1) for r in range(n)]
        for r in range(n):
            rank, inp, out, ps = Rank(r), input_of(r), output_of(r), peers(r, n)
            rank.copy(scratch[r][0], inp[0], tb=0)
            data_handshake(ch, r, ps, ps, 0)
            get_from_peers(ch, r, ps, dst=lambda p: out[p], src=lambda p: scratch[p][0], tb=0)
            if not inplace:
                rank.copy(out[r], inp[0], tb=0)
            data_handshake(ch, r, ps, ps, 0)
    return prog.to_plan()


def build_allgather_zero_copy(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                              inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                              max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Zero-copy allgather (symmetric buffers): after a relaxed ready handshake every rank puts
    its input straight into its chunk of every peer's output (one multi-destination ``put``),
    copies it into its own output (out of place), then signals every peer and waits for theirs.
    One thread block per instance."""
    n = ranks
    with mesh_program("allgather_zero_copy", AllGather, ranks, instances, inplace, "Simple",
                      num_threads_per_block, name, min_message_size, max_message_size) as (prog, ch):
        for r in range(n):
            inp, out, ps = input_of(r), output_of(r), peers(r, n)
            ready_handshake(ch, r, ps, ps, 0)
            put_to_peers(ch, r, ps, dst=lambda p: output_of(p)[r], src=lambda p: inp[0], tb=0)
            if not inplace:
                Rank(r).copy(out[r], inp[0], tb=0)
            data_handshake(ch, r, ps, ps, 0)
    return prog.to_plan()
