"""Send/recv programs of the library (``SendRecv(ranks, 1, inplace)``: rank ``r`` sends its
input to rank ``r + 1`` and receives rank ``r - 1``'s input, modulo ``ranks``).

Memory-ordering rules as in :mod:`mscclang.algorithms.allreduce`.
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import check_common, make_program, mesh, plan_name
from mscclang.dsl import Buffer, Rank, SendRecv, SyncType
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_sendrecv_ll", "build_sendrecv_simple", "build_sendrecv_zero_copy"]


def _ring(n: int) -> list[tuple[int, int]]:
    """Channel pairs ``(src, dst)`` between ring neighbours, one per ordered pair."""
    pairs: list[tuple[int, int]] = []
    for r in range(n):
        for p in sorted({(r + 1) % n, (r - 1) % n}):
            pairs.append((r, p))
    return pairs


def build_sendrecv_ll(ranks: int, instances: int = 1, num_threads_per_block: int = 512,
                      inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                      max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """LL send/recv: pack the input into the next rank's scratch, unpack the previous rank's
    packets into the output. Double scratch; one thread block per instance.

    With more than two ranks nothing flows back from the receiver to the sender, so the sender
    first waits for the receiver's relaxed "launch started" word (sent at the start of its
    launch); otherwise it could run two launches ahead and overwrite packets of the
    double-buffered scratch that the receiver has not read yet. With two ranks every rank
    receives from the rank it sends to, which bounds the lead to one launch."""
    algo = "sendrecv_ll"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), SendRecv(n, 1, inplace), n, instances, "LL",
                        num_threads_per_block, min_message_size, max_message_size, double_scratch=True)
    with prog:
        scratch = [Buffer(r, 1) for r in range(n)]
        ch = mesh(n, _ring(n))
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            out = inp if inplace else rank.get_output_buffer()
            nxt, prv = (r + 1) % n, (r - 1) % n
            if n > 2:
                ch[(r, prv)].signal(0, data_sync=SyncType.none, relaxed=True)
                ch[(r, nxt)].wait(0, data_sync=SyncType.after, relaxed=True)
            ch[(r, nxt)].put_packets(scratch[nxt][0:1], inp[0:1], tb=0)
            rank.unpack_packets(out[0:1], scratch[r][0:1], tb=0)
    return prog.to_plan()


def build_sendrecv_simple(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                          inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                          max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Send/recv through the receiver's scratch (any buffers): tell the previous rank that this
    launch started (relaxed), wait for the next rank's word, put the input into its scratch and
    signal it; wait for the previous rank's data signal and copy the scratch into the output.
    One thread block per instance."""
    algo = "sendrecv_simple"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), SendRecv(n, 1, inplace), n, instances,
                        "Simple", num_threads_per_block, min_message_size, max_message_size)
    with prog:
        scratch = [Buffer(r, 1) for r in range(n)]
        ch = mesh(n, _ring(n))
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            out = inp if inplace else rank.get_output_buffer()
            nxt, prv = (r + 1) % n, (r - 1) % n
            ch[(r, prv)].signal(0, data_sync=SyncType.none, relaxed=True)
            ch[(r, nxt)].wait(0, data_sync=SyncType.after, relaxed=True)
            ch[(r, nxt)].put(scratch[nxt][0:1], inp[0:1], tb=0)
            ch[(r, nxt)].signal(0, data_sync=SyncType.before)
            ch[(r, prv)].wait(0, data_sync=SyncType.after)
            rank.copy(out[0:1], scratch[r][0:1], tb=0)
    return prog.to_plan()


def build_sendrecv_zero_copy(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                             inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                             max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Zero-copy send/recv (symmetric buffers, out of place only): after the relaxed ready word
    of the next rank, put the input straight into its output and signal it; wait for the
    previous rank's signal before finishing. One thread block per instance."""
    algo = "sendrecv_zero_copy"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), SendRecv(n, 1, inplace), n, instances,
                        "Simple", num_threads_per_block, min_message_size, max_message_size)
    with prog:
        ch = mesh(n, _ring(n))
        for r in range(n):
            inp = Rank(r).get_input_buffer()
            nxt, prv = (r + 1) % n, (r - 1) % n
            ch[(r, prv)].signal(0, data_sync=SyncType.none, relaxed=True)
            ch[(r, nxt)].wait(0, data_sync=SyncType.after, relaxed=True)
            ch[(r, nxt)].put(Rank(nxt).get_output_buffer()[0:1], inp[0:1], tb=0)
            ch[(r, nxt)].signal(0, data_sync=SyncType.before)
            ch[(r, prv)].wait(0, data_sync=SyncType.after)
    return prog.to_plan()
