"""Allreduce programs of the library.

Each ``build_*`` function writes one DSL program for ``ranks`` ranks with one chunk per rank
(``AllReduce(ranks, 1, inplace)``) and returns the compiled plan; ``instances`` replicates it
(more thread blocks, each on an interleaved share of every chunk). In-place programs write their
results into the input buffer, which is the output buffer (as MSCCL++ programs do), so the
compiler sees every alias.

Memory-ordering rules followed by every program (design section 5, docs/semantics.md):

* LL programs only write packets into peers' double-buffered scratch: the packets' flags order
  them and no signal is needed.
* A peer's input/output is touched only after that peer's relaxed "ready" signal of this launch
  (zero-copy programs); a peer's scratch is read only after its data signal of this launch.
* Data is published with a non-relaxed signal preceded by a block sync (``data_sync`` before),
  and read after the matching wait followed by a block sync.
* A rank never exits while a peer may still touch its buffers: every remote access is followed
  by a signal that the owner waits for before it finishes.
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
    sender_slot,
    signal_all,
    wait_all,
)
from mscclang.dsl import AllReduce, Buffer, LoopIterationContext, Rank, Semaphore, SyncType, ThreadBlockGroup
from mscclang.errors import DSLError
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = [
    "build_oneshot_ll", "build_twostep_ll", "build_rsag_simple", "build_rsag_zero_copy",
    "build_rsag_pipelined",
]


def build_oneshot_ll(ranks: int, instances: int = 1, num_threads_per_block: int = 512,
                     inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                     max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """One-shot LL allreduce (the latency path).

    Thread block ``c`` of every rank owns chunk ``c``: it packs its chunk of the input as LL
    packets into every peer's scratch (one multi-destination ``ppkt``), then reduces its own
    input chunk with the packets every peer sent for that chunk into the output (one ``repkt``).
    Scratch: one slot of ``ranks`` chunks per peer, double buffered. Two ops per block.
    """
    algo = "allreduce_oneshot_ll"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), AllReduce(n, 1, inplace), n, instances, "LL",
                        num_threads_per_block, min_message_size, max_message_size, double_scratch=True)
    with prog:
        scratch = [Buffer(r, (n - 1) * n) for r in range(n)]
        ch = mesh(n)
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            out = inp if inplace else rank.get_output_buffer()
            for c in range(n):
                for p in peers(r, n):
                    s = sender_slot(r, p) * n + c
                    ch[(r, p)].put_packets(scratch[p][s:s + 1], inp[c:c + 1], tb=c)
                got = [scratch[r][sender_slot(q, r) * n + c:sender_slot(q, r) * n + c + 1] for q in peers(r, n)]
                rank.reduce(inp[c:c + 1], got, tb=c, dst_chunk=out[c:c + 1], packet=True)
    return prog.to_plan()


def build_twostep_ll(ranks: int, instances: int = 1, num_threads_per_block: int = 512,
                     inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                     max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Two-step LL allreduce: packet reduce-scatter, then packet all-gather.

    Rank ``r`` owns chunk ``r``. Thread block ``j`` serves the ``j``-th peer ``p``: it packs
    ``p``'s chunk of the input into ``p``'s scratch (slot ``r``), then takes its share (a thread
    block group of all ``ranks - 1`` blocks) of reducing chunk ``r`` with the packets of every
    peer, writing the result to the output and as packets into every peer's scratch
    (``respkt``), and finally unpacks ``p``'s reduced chunk into the output (``upkt``).
    Scratch: ``ranks`` reduce-scatter slots then ``ranks`` all-gather slots, double buffered.
    """
    algo = "allreduce_twostep_ll"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), AllReduce(n, 1, inplace), n, instances, "LL",
                        num_threads_per_block, min_message_size, max_message_size, double_scratch=True)
    with prog:
        scratch = [Buffer(r, 2 * n) for r in range(n)]
        ch = mesh(n)
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            out = inp if inplace else rank.get_output_buffer()
            ps = peers(r, n)
            group = ThreadBlockGroup(list(range(len(ps))))
            for j, p in enumerate(ps):
                ch[(r, p)].put_packets(scratch[p][r:r + 1], inp[p:p + 1], tb=j)
            got = [scratch[r][q:q + 1] for q in ps]
            rank.reduce(inp[r:r + 1], got, tb_group=group, dst_chunk=out[r:r + 1], packet=True)
            for p in ps:
                ch[(r, p)].put_packets(scratch[p][n + r:n + r + 1], out[r:r + 1], tb_group=group)
            for j, p in enumerate(ps):
                rank.unpack_packets(out[p:p + 1], scratch[r][n + p:n + p + 1], tb=j)
    return prog.to_plan()


def build_rsag_simple(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                      inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                      max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Read-reduce + write-back allreduce through scratch (Simple protocol, any buffers).

    Every rank copies the peers' chunks of its input into its own scratch (slots ``0..n-1``)
    and signals every peer (data signal). After the peers' signals, rank ``r`` reads chunk ``r``
    from every peer's scratch, reduces it with its own input into its output and writes the
    result into every peer's scratch slot ``n + r`` (one ``rres``); a second signal/wait round
    publishes the results, which every rank copies from its scratch into its output. Peers only
    ever touch each other's scratch. One thread block per instance.
    """
    algo = "allreduce_rsag_simple"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), AllReduce(n, 1, inplace), n, instances,
                        "Simple", num_threads_per_block, min_message_size, max_message_size)
    with prog:
        # slots 0..n-1: copies of the inputs; n..2n-1: reduced chunks (separate, so that the
        # reduction and the write-back fuse into one rres)
        scratch = [Buffer(r, 2 * n) for r in range(n)]
        ch = mesh(n)
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            out = inp if inplace else rank.get_output_buffer()
            ps = peers(r, n)
            for p in ps:  # chunk by chunk: with instances > 1 every reference must use one chunk range
                rank.copy(scratch[r][p:p + 1], inp[p:p + 1], tb=0)
            signal_all(ch, r, ps, 0, data_sync=SyncType.before)
            wait_all(ch, r, ps, 0, data_sync=SyncType.after)
            read_reduce(ch, r, inp[r:r + 1], [(p, scratch[p][r:r + 1]) for p in ps], out[r:r + 1], 0)
            for p in ps:
                ch[(r, p)].put(scratch[p][n + r:n + r + 1], out[r:r + 1], tb=0)
            signal_all(ch, r, ps, 0, data_sync=SyncType.before)
            wait_all(ch, r, ps, 0, data_sync=SyncType.after)
            for p in ps:
                rank.copy(out[p:p + 1], scratch[r][n + p:n + p + 1], tb=0)
    return prog.to_plan()


def build_rsag_zero_copy(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                         inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                         max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Zero-copy reduce-scatter + all-gather (symmetric buffers).

    After a relaxed ready handshake, rank ``r`` reads chunk ``r`` of every peer's input
    directly, reduces it with its own into its output and writes the result into chunk ``r`` of
    every peer's output (one ``rres``); a final signal/wait publishes the writes and keeps every
    rank alive until its peers are done with its buffers. One thread block per instance.
    """
    algo = "allreduce_rsag_zero_copy"
    check_common(algo, ranks, instances)
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), AllReduce(n, 1, inplace), n, instances,
                        "Simple", num_threads_per_block, min_message_size, max_message_size)
    with prog:
        ch = mesh(n)
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            out = inp if inplace else rank.get_output_buffer()
            ps = peers(r, n)
            handshake(ch, r, ps, ps, 0)
            remote_in = [(p, (Rank(p).get_input_buffer())[r:r + 1]) for p in ps]
            read_reduce(ch, r, inp[r:r + 1], remote_in, out[r:r + 1], 0)
            for p in ps:
                peer_out = Rank(p).get_input_buffer() if inplace else Rank(p).get_output_buffer()
                ch[(r, p)].put(peer_out[r:r + 1], out[r:r + 1], tb=0)
            signal_all(ch, r, ps, 0, data_sync=SyncType.before)
            wait_all(ch, r, ps, 0, data_sync=SyncType.after)
    return prog.to_plan()


def build_rsag_pipelined(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                         inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                         max_message_size: int = MAX_MESSAGE_SIZE, unit: int = 128 * 1024) -> Plan:
    """Pipelined read-reduce + write-back allreduce through scratch, for large messages.

    Two thread blocks per instance run the same ``LoopIterationContext`` over ``unit``-byte
    slices of every chunk. Block 0, per slice: copy the slice of every other rank's chunk of the
    input into scratch (slots ``0..n-1``), signal the peers, wait for theirs, read-reduce the
    slice of chunk ``r`` from the peers' scratch into local scratch slot ``n + r`` and write it
    into the peers' slot ``n + r`` too (``rres``), signal the peers again and release a
    semaphore. Block 1, per slice: wait for the
    peers' second signal and the semaphore, then copy every chunk's slice from scratch into the
    output. So block 1 copies out slice ``j`` while block 0 already works on slice ``j + 1``.
    Every block covers all chunks, so all blocks of all ranks run the same number of iterations
    at any message size.
    """
    algo = "allreduce_rsag_pipelined"
    check_common(algo, ranks, instances)
    if not isinstance(unit, int) or unit < 16 or unit % 16:
        raise DSLError(f"{algo}: unit must be a positive multiple of 16 bytes, got {unit!r}")
    n = ranks
    prog = make_program(plan_name(algo, n, instances, name), AllReduce(n, 1, inplace), n, instances,
                        "Simple", num_threads_per_block, min_message_size, max_message_size)
    with prog:
        # slots 0..n-1: copies of the inputs; n..2n-1: reduced chunks
        scratch = [Buffer(r, 2 * n) for r in range(n)]
        ready = mesh(n)   # block 0 -> peers' block 0: "my copy of your chunk's slice is in my scratch"
        done = mesh(n)    # block 0 -> peers' block 1: "your scratch holds my reduced slice"
        sems = [Semaphore(r, 0) for r in range(n)]
        with LoopIterationContext(unit, 1):
            for r in range(n):
                rank = Rank(r)
                inp = rank.get_input_buffer()
                out = inp if inplace else rank.get_output_buffer()
                ps = peers(r, n)
                for p in ps:
                    rank.copy(scratch[r][p:p + 1], inp[p:p + 1], tb=0)
                signal_all(ready, r, ps, 0, data_sync=SyncType.before)
                wait_all(ready, r, ps, 0, data_sync=SyncType.after)
                mine = scratch[r][n + r:n + r + 1]
                read_reduce(ready, r, inp[r:r + 1], [(p, scratch[p][r:r + 1]) for p in ps], mine, 0)
                for p in ps:
                    ready[(r, p)].put(scratch[p][n + r:n + r + 1], mine, tb=0)
                signal_all(done, r, ps, 0, data_sync=SyncType.before)
                sems[r].release(0, data_sync=SyncType.before)
                wait_all(done, r, ps, 1, data_sync=SyncType.none)
                sems[r].acquire(1, data_sync=SyncType.after)
                for c in range(n):
                    rank.copy(out[c:c + 1], scratch[r][n + c:n + c + 1], tb=1)
    return prog.to_plan()
