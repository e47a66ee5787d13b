"""Allreduce programs of the library.

Each ``build_*`` function writes one DSL program for ``ranks`` ranks with one chunk per rank
(``AllReduce(ranks, 1, inplace)``) and returns the compiled plan; ``instances`` replicates it
(more thread blocks, each on an interleaved share of every chunk). In-place programs write their
results into the input buffer, which is the output buffer (as MSCCL++ programs do), so the
compiler sees every alias.

Memory-ordering rules followed by every program (docs/semantics.md):

* LL programs only write packets into peers' double-buffered scratch: the packets' flags order
  them and no signal is needed.
* A peer's input/output is touched only after that peer's relaxed "ready" signal of this launch
  (zero-copy programs); a peer's scratch is read only after its data signal of this launch.
* Data is published with a non-relaxed signal preceded by a block sync (``data_sync`` before),
  and read after the matching wait followed by a block sync.
* A rank never exits while a peer may still touch its buffers: every remote access is followed
  by a signal that the owner waits for before it finishes.

Every program sums each element in one reduction op over the ranks' chunks in rank order 0..n-1,
the rank's own at its place (``src_position``): the canonical sum (docs/semantics.md, "Batch
invariance"), the same on every rank, at every size and in every plan, which each plan promises
(``batch_invariant``).
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import (check_common, data_handshake, input_of, library_program, mesh,
                                        mesh_program, output_of, peers, put_to_peers, read_reduce,
                                        ready_handshake, reduce_packets_from_peers, send_packets_to_peers,
                                        sender_slot, signal_all, stage_peer_chunks,
                                        unpack_packets_from_peers, wait_all)
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
    n = ranks

    def slot(sender: int, receiver: int, c: int) -> int:
        """Where ``sender``'s packets of chunk ``c`` land in ``receiver``'s scratch."""
        return sender_slot(sender, receiver) * n + c

    with mesh_program("allreduce_oneshot_ll", AllReduce, ranks, instances, inplace, "LL",
                      num_threads_per_block, name, min_message_size, max_message_size,
                      double_scratch=True) as (prog, ch):
        scratch = [Buffer(r, (n - 1) * n) for r in range(n)]
        for r in range(n):
            rank, inp, out, ps = Rank(r), input_of(r), output_of(r, inplace), peers(r, n)
            for c in range(n):
                for p in ps:
                    ch[(r, p)].put_packets(scratch[p][slot(r, p, c)], inp[c], tb=c)
                got = [scratch[r][slot(q, r, c)] for q in ps]   # the peers in rank order
                rank.reduce(inp[c], got, tb=c, dst_chunk=out[c], packet=True, src_position=r)
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
    n = ranks
    with mesh_program("allreduce_twostep_ll", AllReduce, ranks, instances, inplace, "LL",
                      num_threads_per_block, name, min_message_size, max_message_size,
                      double_scratch=True) as (prog, ch):
        scratch = [Buffer(r, 2 * n) for r in range(n)]
        for r in range(n):
            inp, out, ps = input_of(r), output_of(r, inplace), peers(r, n)
            group = ThreadBlockGroup(list(range(len(ps))))
            send_packets_to_peers(ch, r, ps, scratch, src=lambda p: inp[p])
            reduce_packets_from_peers(r, ps, scratch[r], own=inp[r], dst=out[r], group=group)
            for p in ps:
                ch[(r, p)].put_packets(scratch[p][n + r], out[r], tb_group=group)
            unpack_packets_from_peers(r, ps, scratch[r], dst=lambda p: out[p], slot_base=n)
    return prog.to_plan()


def build_rsag_simple(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                      inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                      max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Read-reduce + write-back allreduce through scratch (Simple protocol, any buffers).

    Every rank copies the peers' chunks of its input into its own scratch (slot ``p`` holds
    chunk ``p``) and signals every peer (data signal). After the peers' signals, rank ``r`` reads
    chunk ``r`` from slot ``r`` of every peer's scratch, sums it with its own input in rank order
    into its output and writes the result back into the very slot it read (one ``rres``: every
    element is read, reduced and written back by the same thread). A second signal/wait round publishes
    the results, which every rank copies from its scratch slots into its output. Scratch: one
    slot per chunk (``ranks`` chunks, slot ``r`` unused on rank ``r``). Peers only ever touch
    each other's scratch. One thread block per instance.
    """
    n = ranks
    with mesh_program("allreduce_rsag_simple", AllReduce, ranks, instances, inplace, "Simple",
                      num_threads_per_block, name, min_message_size, max_message_size) as (prog, ch):
        scratch = [Buffer(r, n) for r in range(n)]
        for r in range(n):
            rank, inp, out, ps = Rank(r), input_of(r), output_of(r, inplace), peers(r, n)
            stage_peer_chunks(r, ps, scratch[r], inp)
            data_handshake(ch, r, ps, ps, 0)
            read_reduce(ch, r, inp[r], [(p, scratch[p][r]) for p in ps], out[r], 0)
            # write-back into the slots just read (fused into the rres above)
            put_to_peers(ch, r, ps, dst=lambda p: scratch[p][r], src=lambda p: out[r], tb=0)
            data_handshake(ch, r, ps, ps, 0)
            for p in ps:
                rank.copy(out[p], scratch[r][p], tb=0)
    return prog.to_plan()


def build_rsag_zero_copy(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                         inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                         max_message_size: int = MAX_MESSAGE_SIZE) -> Plan:
    """Zero-copy reduce-scatter + all-gather (symmetric buffers).

    After a relaxed ready handshake, rank ``r`` reads chunk ``r`` of every peer's input
    directly, sums it with its own in rank order into its output and writes the result into chunk ``r`` of
    every peer's output (one ``rres``); a final signal/wait publishes the writes and keeps every
    rank alive until its peers are done with its buffers. One thread block per instance.
    """
    n = ranks
    with mesh_program("allreduce_rsag_zero_copy", AllReduce, ranks, instances, inplace, "Simple",
                      num_threads_per_block, name, min_message_size, max_message_size) as (prog, ch):
        for r in range(n):
            inp, out, ps = input_of(r), output_of(r, inplace), peers(r, n)
            ready_handshake(ch, r, ps, ps, 0)
            read_reduce(ch, r, inp[r], [(p, input_of(p)[r]) for p in ps], out[r], 0)
            put_to_peers(ch, r, ps, dst=lambda p: output_of(p, inplace)[r], src=lambda p: out[r], tb=0)
            data_handshake(ch, r, ps, ps, 0)
    return prog.to_plan()


def build_rsag_pipelined(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                         inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                         max_message_size: int = MAX_MESSAGE_SIZE, unit: int = 128 * 1024) -> Plan:
    """Pipelined read-reduce + write-back allreduce through scratch, for large messages.

    Two thread blocks per instance run the same ``LoopIterationContext`` over ``unit``-byte
    slices of every chunk. Block 0, per slice: copy the slice of every other rank's chunk of the
    input into scratch (slot ``p`` holds chunk ``p``), signal the peers, wait for theirs,
    read-reduce the slice of chunk ``r`` from slot ``r`` of every peer's scratch and its own
    input (in rank order) into its own slot ``r`` and write the result back into the slots it read (one ``rres``: each element is
    read, reduced and written back by the same thread), signal the peers again and release a
    semaphore. Block 1, per slice: wait for the peers' second signal and the semaphore, then
    copy every chunk's reduced slice from scratch into the output. So block 1 copies out slice
    ``j`` while block 0 already works on slice ``j + 1``. Every block covers all chunks (block 1
    copies the own chunk too, rather than block 0 reducing into the output), so all blocks of
    all ranks run the same number of iterations at any message size. Scratch: one slot per
    chunk (``ranks`` chunks), half of what a separate result area would take.
    """
    algo = "allreduce_rsag_pipelined"
    check_common(algo, ranks, instances)  # before the unit, as the other builders check first
    if not isinstance(unit, int) or unit < 16 or unit % 16:
        raise DSLError(f"{algo}: unit must be a positive multiple of 16 bytes, got {unit!r}")
    prog = library_program(algo, AllReduce, ranks, instances, inplace, "Simple", num_threads_per_block,
                           name, min_message_size, max_message_size)
    n = ranks
    with prog:
        scratch = [Buffer(r, n) for r in range(n)]
        ready = mesh(n)   # block 0 -> peers' block 0: "my copy of your chunk's slice is in my scratch"
        done = mesh(n)    # block 0 -> peers' block 1: "your scratch holds my reduced slice"
        sems = [Semaphore(r, 0) for r in range(n)]
        with LoopIterationContext(unit, 1):
            for r in range(n):
                rank, inp, out, ps = Rank(r), input_of(r), output_of(r, inplace), peers(r, n)
                # block 0: stage, reduce this rank's slice, write it back where it was read
                stage_peer_chunks(r, ps, scratch[r], inp)
                data_handshake(ready, r, ps, ps, 0)
                mine = scratch[r][r]
                read_reduce(ready, r, inp[r], [(p, scratch[p][r]) for p in ps], mine, 0)
                put_to_peers(ready, r, ps, dst=lambda p: scratch[p][r], src=lambda p: mine, tb=0)
                signal_all(done, r, ps, 0, data_sync=SyncType.before)
                sems[r].release(0, data_sync=SyncType.before)
                # block 1: once every reduced slice is in, copy them all out
                wait_all(done, r, ps, 1, data_sync=SyncType.none)
                sems[r].acquire(1, data_sync=SyncType.after)
                for c in range(n):
                    rank.copy(out[c], scratch[r][c], tb=1)
    return prog.to_plan()
