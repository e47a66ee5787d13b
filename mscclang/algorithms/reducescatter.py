"""Reduce-scatter programs of the library (``ReduceScatter(ranks, 1, inplace)``: input
``ranks`` chunks, output one chunk; rank ``r`` ends with input chunk ``r`` reduced over all
ranks). In place, the output is input chunk ``r``.

Memory-ordering rules as in :mod:`mscclang.algorithms.allreduce`.
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import (
    check_common,
    handshake,
    make_program,
    mesh,
    peers,
    plan_name,
    read_reduce,
    signal_all,
    wait_all,
)
from mscclang.dsl import Buffer, Rank, ReduceScatter, SyncType, ThreadBlockGroup
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_reducescatter_ll", "build_reducescatter_simple", "build_reducescatter_zero_copy"]


def _out(rank: Rank, r: int, inplace: bool):
    """Rank ``r``'s output chunk (input chunk ``r`` in place)."""
    return rank.get_input_buffer()[r:r + 1] if inplace else rank.get_output_buffer()[0:1]


def build_reducescatter_ll(ranks: int, instances: int = 1, num_threads_per_block: int = 512,
                           inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                           max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """LL reduce-scatter: thread block ``j`` packs the ``j``-th peer's chunk of the input into
    that peer's scratch (slot of the sender); then all blocks (a thread block group) reduce the
    rank's own chunk with every peer's packets into the output (``repkt``). Double scratch."""
    algo = "reducescatter_ll"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), ReduceScatter(n, 1, inplace), n, instances, "LL",
                        num_threads_per_block, min_message_size, max_message_size, double_scratch=True)
    with prog:
        scratch = [Buffer(r, n) for r in range(n)]
        ch = mesh(n)
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            ps = peers(r, n)
            for j, p in enumerate(ps):
                ch[(r, p)].put_packets(scratch[p][r:r + 1], inp[p:p + 1], tb=j)
            group = ThreadBlockGroup(list(range(len(ps))))
            rank.reduce(inp[r:r + 1], [scratch[r][q:q + 1] for q in ps], tb_group=group,
                        dst_chunk=_out(rank, r, inplace), packet=True)
    return prog.to_plan()


def build_reducescatter_simple(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                               inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                               max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Reduce-scatter through scratch (any buffers): copy the peers' chunks of the input into
    scratch, signal; after the peers' signals read-reduce the own chunk from every peer's
    scratch into the output (``rre``); a final signal/wait keeps every rank from reusing its
    scratch while a peer may still read it. One thread block per instance."""
    algo = "reducescatter_simple"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), ReduceScatter(n, 1, inplace), n, instances,
                        "Simple", num_threads_per_block, min_message_size, max_message_size)
    with prog:
        scratch = [Buffer(r, n) for r in range(n)]
        ch = mesh(n)
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            ps = peers(r, n)
            for p in ps:
                rank.copy(scratch[r][p:p + 1], inp[p:p + 1], tb=0)
            signal_all(ch, r, ps, 0, data_sync=SyncType.before)
            wait_all(ch, r, ps, 0, data_sync=SyncType.after)
            read_reduce(ch, r, inp[r:r + 1], [(p, scratch[p][r:r + 1]) for p in ps], _out(rank, r, inplace), 0)
            signal_all(ch, r, ps, 0, data_sync=SyncType.before)
            wait_all(ch, r, ps, 0, data_sync=SyncType.after)
    return prog.to_plan()


def build_reducescatter_zero_copy(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                                  inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                                  max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Zero-copy reduce-scatter (symmetric buffers): after a relaxed ready handshake read chunk
    ``r`` of every peer's input directly and reduce it with the own into the output (``rre``);
    a final signal/wait keeps every rank alive until its peers finished reading its input. One
    thread block per instance."""
    algo = "reducescatter_zero_copy"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), ReduceScatter(n, 1, inplace), n, instances,
                        "Simple", num_threads_per_block, min_message_size, max_message_size)
    with prog:
        ch = mesh(n)
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            ps = peers(r, n)
            handshake(ch, r, ps, ps, 0)
            read_reduce(ch, r, inp[r:r + 1], [(p, Rank(p).get_input_buffer()[r:r + 1]) for p in ps],
                        _out(rank, r, inplace), 0)
            signal_all(ch, r, ps, 0, data_sync=SyncType.before)
            wait_all(ch, r, ps, 0, data_sync=SyncType.after)
    return prog.to_plan()
