"""Reduce-scatter programs of the library (``ReduceScatter(ranks, 1, inplace)``: input
``ranks`` chunks, output one chunk; rank ``r`` ends with input chunk ``r`` reduced over all
ranks, summed in rank order in one reduction op, as :mod:`mscclang.algorithms.allreduce` does). In
place, the output is input chunk ``r``.

Memory-ordering rules as in :mod:`mscclang.algorithms.allreduce`.
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import (data_handshake, input_of, mesh_program, peers, read_reduce,
                                        ready_handshake, reduce_packets_from_peers, send_packets_to_peers,
                                        stage_peer_chunks)
from mscclang.dsl import Buffer, Chunk, Rank, ReduceScatter
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_reducescatter_ll", "build_reducescatter_simple", "build_reducescatter_zero_copy"]


def _out(r: int, inplace: bool) -> Chunk:
    """Rank ``r``'s output chunk (input chunk ``r`` in place)."""
    rank = Rank(r)
    return rank.get_input_buffer()[r] if inplace else rank.get_output_buffer()[0]


def build_reducescatter_ll(ranks: int, instances: int = 1, num_threads_per_block: int = 512,
                           inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                           max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """LL reduce-scatter: thread block ``j`` packs the ``j``-th peer's chunk of the input into
    that peer's scratch (slot of the sender); then all blocks (a thread block group) reduce the
    rank's own chunk with every peer's packets into the output (``repkt``). Double scratch."""
    n = ranks
    with mesh_program("reducescatter_ll", ReduceScatter, ranks, instances, inplace, "LL",
                      num_threads_per_block, name, min_message_size, max_message_size,
                      double_scratch=True) as (prog, ch):
        scratch = [Buffer(r, n) for r in range(n)]
        for r in range(n):
            inp, ps = input_of(r), peers(r, n)
            send_packets_to_peers(ch, r, ps, scratch, src=lambda p: inp[p])
            reduce_packets_from_peers(r, ps, scratch[r], own=inp[r], dst=_out(r, inplace))
    return prog.to_plan()


def build_reducescatter_simple(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                               inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                               max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Reduce-scatter through scratch (any buffers): copy the peers' chunks of the input into
    scratch, signal; after the peers' signals read-reduce the own chunk from every peer's
    scratch and the own input, in rank order, into the output (``rre``); a final signal/wait keeps every rank from reusing its
    scratch while a peer may still read it. One thread block per instance."""
    n = ranks
    with mesh_program("reducescatter_simple", ReduceScatter, ranks, instances, inplace, "Simple",
                      num_threads_per_block, name, min_message_size, max_message_size) as (prog, ch):
        scratch = [Buffer(r, n) for r in range(n)]
        for r in range(n):
            inp, ps = input_of(r), peers(r, n)
            stage_peer_chunks(r, ps, scratch[r], inp)
            data_handshake(ch, r, ps, ps, 0)
            read_reduce(ch, r, inp[r], [(p, scratch[p][r]) for p in ps], _out(r, inplace), 0)
            data_handshake(ch, r, ps, ps, 0)
    return prog.to_plan()


def build_reducescatter_zero_copy(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                                  inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                                  max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Zero-copy reduce-scatter (symmetric buffers): after a relaxed ready handshake read chunk
    ``r`` of every peer's input directly and sum it with the own in rank order into the output
    (``rre``);
    a final signal/wait keeps every rank alive until its peers finished reading its input. One
    thread block per instance."""
    n = ranks
    with mesh_program("reducescatter_zero_copy", ReduceScatter, ranks, instances, inplace, "Simple",
                      num_threads_per_block, name, min_message_size, max_message_size) as (prog, ch):
        for r in range(n):
            inp, ps = input_of(r), peers(r, n)
            ready_handshake(ch, r, ps, ps, 0)
            read_reduce(ch, r, inp[r], [(p, input_of(p)[r]) for p in ps], _out(r, inplace), 0)
            data_handshake(ch, r, ps, ps, 0)
    return prog.to_plan()
