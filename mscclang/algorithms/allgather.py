"""Allgather programs of the library (``AllGather(ranks, 1, inplace)``: input one chunk, output
``ranks`` chunks; rank ``r``'s input is output chunk ``r`` everywhere).

Memory-ordering rules as in :mod:`mscclang.algorithms.allreduce`.
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import check_common, handshake, make_program, mesh, peers, plan_name, signal_all, wait_all
from mscclang.dsl import AllGather, Buffer, Rank, SyncType
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_allgather_ll", "build_allgather_simple", "build_allgather_zero_copy"]


def build_allgather_ll(ranks: int, instances: int = 1, num_threads_per_block: int = 512,
                       inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                       max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """LL allgather: thread block ``j`` packs the input into the ``j``-th peer's scratch (slot
    of the sender) and unpacks that peer's packets into its output chunk; block 0 also copies
    the input into the rank's own output chunk (out of place). Double scratch."""
    algo = "allgather_ll"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), AllGather(n, 1, inplace), n, instances, "LL",
                        num_threads_per_block, min_message_size, max_message_size, double_scratch=True)
    with prog:
        scratch = [Buffer(r, n) for r in range(n)]
        ch = mesh(n)
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            out = rank.get_output_buffer()
            ps = peers(r, n)
            for j, p in enumerate(ps):
                ch[(r, p)].put_packets(scratch[p][r:r + 1], inp[0:1], tb=j)
            if not inplace:
                rank.copy(out[r:r + 1], inp[0:1], tb=0)
            for j, p in enumerate(ps):
                rank.unpack_packets(out[p:p + 1], scratch[r][p:p + 1], tb=j)
    return prog.to_plan()


def build_allgather_simple(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                           inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                           max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Allgather through scratch (any buffers): every rank copies its input into its scratch
    and signals every peer; after the peers' signals it reads every peer's scratch into its
    output (one multi-source ``get``) and copies its own input (out of place); a final
    signal/wait keeps every rank from reusing its scratch while a peer may still read it. One
    thread block per instance."""
    algo = "allgather_simple"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), AllGather(n, 1, inplace), n, instances,
                        "Simple", num_threads_per_block, min_message_size, max_message_size)
    with prog:
        scratch = [Buffer(r, 1) for r in range(n)]
        ch = mesh(n)
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            out = rank.get_output_buffer()
            ps = peers(r, n)
            rank.copy(scratch[r][0:1], inp[0:1], tb=0)
            signal_all(ch, r, ps, 0, data_sync=SyncType.before)
            wait_all(ch, r, ps, 0, data_sync=SyncType.after)
            for p in ps:
                ch[(r, p)].get(out[p:p + 1], scratch[p][0:1], tb=0)
            if not inplace:
                rank.copy(out[r:r + 1], inp[0:1], tb=0)
            signal_all(ch, r, ps, 0, data_sync=SyncType.before)
            wait_all(ch, r, ps, 0, data_sync=SyncType.after)
    return prog.to_plan()


def build_allgather_zero_copy(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                              inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                              max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Zero-copy allgather (symmetric buffers): after a relaxed ready handshake every rank puts
    its input straight into its chunk of every peer's output (one multi-destination ``put``),
    copies it into its own output (out of place), then signals every peer and waits for theirs.
    One thread block per instance."""
    algo = "allgather_zero_copy"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), AllGather(n, 1, inplace), n, instances,
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
                ch[(r, p)].put(Rank(p).get_output_buffer()[r:r + 1], inp[0:1], tb=0)
            if not inplace:
                rank.copy(out[r:r + 1], inp[0:1], tb=0)
            signal_all(ch, r, ps, 0, data_sync=SyncType.before)
            wait_all(ch, r, ps, 0, data_sync=SyncType.after)
    return prog.to_plan()
