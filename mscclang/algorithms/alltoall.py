"""All-to-all programs of the library (``AllToAll(ranks, 1, inplace)``: rank ``r``'s output
chunk ``p`` is rank ``p``'s input chunk ``r``).

Memory-ordering rules as in :mod:`mscclang.algorithms.allreduce`.
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import check_common, handshake, make_program, mesh, peers, plan_name, signal_all, wait_all
from mscclang.dsl import AllToAll, Buffer, Rank, SyncType
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_alltoall_ll", "build_alltoall_simple", "build_alltoall_zero_copy"]


def build_alltoall_ll(ranks: int, instances: int = 1, num_threads_per_block: int = 512,
                      inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                      max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """LL all-to-all: thread block ``j`` packs the ``j``-th peer's chunk of the input into that
    peer's scratch (slot of the sender), then unpacks the chunk that peer sent into the output;
    block 0 also copies the rank's own chunk (out of place). Works in place: each block reads a
    chunk before it overwrites it. Double scratch."""
    algo = "alltoall_ll"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), AllToAll(n, 1, inplace), n, instances, "LL",
                        num_threads_per_block, min_message_size, max_message_size, double_scratch=True)
    with prog:
        scratch = [Buffer(r, n) for r in range(n)]
        ch = mesh(n)
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            out = inp if inplace else rank.get_output_buffer()
            ps = peers(r, n)
            for j, p in enumerate(ps):
                ch[(r, p)].put_packets(scratch[p][r:r + 1], inp[p:p + 1], tb=j)
            if not inplace:
                rank.copy(out[r:r + 1], inp[r:r + 1], tb=0)
            for j, p in enumerate(ps):
                rank.unpack_packets(out[p:p + 1], scratch[r][p:p + 1], tb=j)
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
    algo = "alltoall_simple"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), AllToAll(n, 1, inplace), n, instances,
                        "Simple", num_threads_per_block, min_message_size, max_message_size)
    with prog:
        scratch = [Buffer(r, n) for r in range(n)]
        ch = mesh(n)
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            out = inp if inplace else rank.get_output_buffer()
            ps = peers(r, n)
            for p in ps:
                rank.copy(scratch[r][p:p + 1], inp[p:p + 1], tb=0)
            signal_all(ch, r, ps, 0, data_sync=SyncType.before)
            wait_all(ch, r, ps, 0, data_sync=SyncType.after)
            for p in ps:
                ch[(r, p)].get(out[p:p + 1], scratch[p][r:r + 1], tb=0)
            if not inplace:
                rank.copy(out[r:r + 1], inp[r:r + 1], tb=0)
            signal_all(ch, r, ps, 0, data_sync=SyncType.before)
            wait_all(ch, r, ps, 0, data_sync=SyncType.after)
    return prog.to_plan()


def build_alltoall_zero_copy(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                             inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                             max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Zero-copy all-to-all (symmetric buffers, out of place only): after a relaxed ready
    handshake put each peer's chunk of the input straight into that peer's output (one
    multi-destination ``put``), copy the own chunk, then signal every peer and wait for theirs.
    One thread block per instance."""
    algo = "alltoall_zero_copy"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), AllToAll(n, 1, inplace), n, instances,
                        "Simple", num_threads_per_block, min_message_size, max_message_size)
    with prog:
        ch = mesh(n)
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            out = rank.get_output_buffer()
            ps = peers(r, n)
            handshake(ch, r, ps, ps, 0)
            for p in ps:
                ch[(r, p)].put(Rank(p).get_output_buffer()[r:r + 1], inp[p:p + 1], tb=0)
            rank.copy(out[r:r + 1], inp[r:r + 1], tb=0)
            signal_all(ch, r, ps, 0, data_sync=SyncType.before)
            wait_all(ch, r, ps, 0, data_sync=SyncType.after)
    return prog.to_plan()
