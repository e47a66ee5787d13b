"""Send/recv programs of the library (``SendRecv(ranks, 1, inplace)``: rank ``r`` sends its
input to rank ``r + 1`` and receives rank ``r - 1``'s input, modulo ``ranks``).

Memory-ordering rules as in :mod:`mscclang.algorithms.allreduce`.
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import (Channels, data_handshake, input_of, mesh, mesh_program, output_of,
                                        ready_handshake)
from mscclang.dsl import Buffer, Rank, SendRecv
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_sendrecv_ll", "build_sendrecv_simple", "build_sendrecv_zero_copy"]


def _ring(n: int) -> Channels:
    """Channels between ring neighbours, one per ordered pair."""
    pairs: list[tuple[int, int]] = []
    for r in range(n):
        for p in sorted({(r + 1) % n, (r - 1) % n}):
            pairs.append((r, p))
    return mesh(n, pairs)


def _neighbours(r: int, n: int) -> tuple[int, int]:
    """The rank ``r`` sends to and the rank it receives from."""
    return (r + 1) % n, (r - 1) % n


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
    n = ranks
    with mesh_program("sendrecv_ll", SendRecv, ranks, instances, inplace, "LL", num_threads_per_block,
                      name, min_message_size, max_message_size, double_scratch=True, channels=_ring) as (prog, ch):
        scratch = [Buffer(r, 1) for r in range(n)]
        for r in range(n):
            inp, out = input_of(r), output_of(r, inplace)
            nxt, prv = _neighbours(r, n)
            if n > 2:
                ready_handshake(ch, r, to=[prv], frm=[nxt], tb=0)
            ch[(r, nxt)].put_packets(scratch[nxt][0], inp[0], tb=0)
            Rank(r).unpack_packets(out[0], scratch[r][0], tb=0)
    return prog.to_plan()


def build_sendrecv_simple(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                          inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                          max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Send/recv through the receiver's scratch (any buffers): tell the previous rank that this
    launch started (relaxed), wait for the next rank's word, put the input into its scratch and
    signal it; wait for the previous rank's data signal and copy the scratch into the output.
    One thread block per instance."""
    n = ranks
    with mesh_program("sendrecv_simple", SendRecv, ranks, instances, inplace, "Simple",
                      num_threads_per_block, name, min_message_size, max_message_size, channels=_ring) as (prog, ch):
        scratch = [Buffer(r, 1) for r in range(n)]
        for r in range(n):
            inp, out = input_of(r), output_of(r, inplace)
            nxt, prv = _neighbours(r, n)
            ready_handshake(ch, r, to=[prv], frm=[nxt], tb=0)
            ch[(r, nxt)].put(scratch[nxt][0], inp[0], tb=0)
            data_handshake(ch, r, to=[nxt], frm=[prv], tb=0)
            Rank(r).copy(out[0], scratch[r][0], tb=0)
    return prog.to_plan()


def build_sendrecv_zero_copy(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                             inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                             max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Zero-copy send/recv (symmetric buffers, out of place only): after the relaxed ready word
    of the next rank, put the input straight into its output and signal it; wait for the
    previous rank's signal before finishing. One thread block per instance."""
    n = ranks
    with mesh_program("sendrecv_zero_copy", SendRecv, ranks, instances, inplace, "Simple",
                      num_threads_per_block, name, min_message_size, max_message_size, channels=_ring) as (prog, ch):
        for r in range(n):
            nxt, prv = _neighbours(r, n)
            ready_handshake(ch, r, to=[prv], frm=[nxt], tb=0)
            ch[(r, nxt)].put(output_of(nxt)[0], input_of(r)[0], tb=0)
            data_handshake(ch, r, to=[nxt], frm=[prv], tb=0)
    return prog.to_plan()
