"""Copy-engine programs of the library: collectives of one node whose data moves over port
channels (docs/semantics.md, "Transports": within a node a port put is a copy-engine copy into the peer's IPC
mapping, so no SM moves data between GPUs).

Rules every program here follows, besides those of :mod:`mscclang.algorithms.allreduce`:

* Port ops use the Simple protocol (no packets), the plans are single buffered, and every put
  moves one chunk range (one contiguous byte range per copy).
* Each rank posts its port requests from thread block 0 only; the SMs do local work only
  (copies and reductions of the rank's own memory), on a group of thread blocks.
* A peer's buffers are written only after that peer's relaxed ready signal of this launch (over
  a memory channel: all ranks share one node).
* A port ``put`` orders nothing on the sender (the copy may still read its source after the
  kernel ended): every channel is flushed before the block ends (its last request is a ``pwsf``,
  or a ``flush`` follows), which waits until the copy engine finished every request of the
  channel, so the next launch reuses no buffer a copy still reads.
* The receiver waits for the signal that follows the data on the channel (``pws``/``pwsf``:
  each channel's requests are served in order, so a signal covers every earlier put).
* At most :data:`~mscclang.algorithms.common.MAX_PORT_REQUESTS` port requests per rank and launch.

All of them write straight into peers' outputs (zero-copy): buffer mode ``symmetric``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from mscclang.algorithms.common import (check_common, check_port_requests, input_of, library_program, mesh,
                                        output_of, peers, port_mesh, ready_handshake, sender_slot)
from mscclang.dsl import AllGather, AllReduce, AllToAll, Buffer, Rank, SyncType, ThreadBlockGroup
from mscclang.errors import DSLError
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_allgather_port", "build_alltoall_port", "build_allreduce_port_pipelined", "default_reduce_blocks"]

#: thread blocks that do a program's local copy or reduction, by default
DEFAULT_SM_BLOCKS = 16


def default_reduce_blocks(ranks: int) -> int:
    """Reducing blocks of :func:`build_allreduce_port_pipelined` by default: 16 up to 4 ranks,
    8 above. An estimate, not a measurement: to keep pace with the reduce-scatter copies a rank
    reduces at ``(ranks + 1) / (ranks - 1)`` times its copy engine's rate, 3x at 2 ranks (~1.2
    TB/s of local reads and writes for a copy engine at about 393 GB/s), 1.3x at 8 ranks."""
    return DEFAULT_SM_BLOCKS if ranks <= 4 else DEFAULT_SM_BLOCKS // 2


def _check_blocks(algorithm: str, what: str, blocks: object) -> int:
    if not isinstance(blocks, int) or isinstance(blocks, bool) or not 1 <= blocks <= 64:
        raise DSLError(f"{algorithm}: {what} must be an int in 1..64, got {blocks!r}")
    return blocks


def _all_pairs(n: int) -> list[tuple[int, int]]:
    return [(s, d) for s in range(n) for d in range(n) if s != d]


def _copy_engine_exchange(prog: Any, n: int, copy_blocks: int, src_chunk: Callable[[int], int],
                          own: Union[int, str, None]) -> None:
    """The body shared by the copy-engine allgather and all-to-all: on every rank ``r``, after a
    relaxed ready handshake, thread block 0 puts input chunk ``src_chunk(p)`` into chunk ``r`` of
    every peer ``p``'s output (``pws``, one copy per peer); blocks ``1 .. copy_blocks`` (a
    thread block group) copy input chunk ``own`` (``"own"``: chunk ``r``; None: no copy) into
    the rank's own output chunk meanwhile; then block 0 waits for every peer's signal and, last,
    flushes its channels (nothing the launch does reuses the input before)."""
    with prog:
        ready = mesh(n)
        port = port_mesh(_all_pairs(n))
        copiers = ThreadBlockGroup(list(range(1, 1 + copy_blocks)))
        for r in range(n):
            inp, out, ps = input_of(r), output_of(r), peers(r, n)
            ready_handshake(ready, r, ps, ps, 0)
            for p in ps:
                c = src_chunk(p)
                port[(r, p)].put_with_signal(output_of(p)[r:r + 1], inp[c:c + 1], tb=0)
            if own is not None:
                c = r if own == "own" else own
                Rank(r).copy(out[r:r + 1], inp[c:c + 1], tb_group=copiers)
            for p in ps:
                port[(r, p)].wait(tb=0, data_sync=SyncType.none)
            for p in ps:
                port[(r, p)].flush(tb=0, data_sync=SyncType.after)


def build_allgather_port(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                         inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                         max_message_size: int = MAX_MESSAGE_SIZE,
                         copy_blocks: int = DEFAULT_SM_BLOCKS) -> Plan:
    """Copy-engine allgather (symmetric buffers): after a relaxed ready handshake thread block 0
    puts the input into the rank's chunk of every peer's output with ``pws`` (one copy per peer),
    then waits for every peer's signal and finally flushes its channels. Out of place, blocks
    ``1 .. copy_blocks`` (a thread block group) copy the input into the rank's own output chunk
    meanwhile. The flush comes last: nothing the launch does reuses the input, so the block
    waits for its copies only once everything else is done."""
    algo = "allgather_port"
    check_common(algo, ranks, instances)
    _check_blocks(algo, "copy_blocks", copy_blocks)
    prog = library_program(algo, AllGather, ranks, instances, inplace, "Simple", num_threads_per_block,
                           name, min_message_size, max_message_size)
    # the input (chunk 0) to every peer; out of place also into the own output chunk
    _copy_engine_exchange(prog, ranks, copy_blocks, lambda p: 0, None if inplace else 0)
    return check_port_requests(algo, prog.to_plan())


def build_alltoall_port(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                        inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                        max_message_size: int = MAX_MESSAGE_SIZE,
                        copy_blocks: int = DEFAULT_SM_BLOCKS) -> Plan:
    """Copy-engine all-to-all (symmetric buffers, out of place only): after a relaxed ready
    handshake thread block 0 puts each peer's chunk of the input into that peer's output with
    ``pws`` (one copy per peer), waits for every peer's signal and flushes its channels; blocks
    ``1 .. copy_blocks`` copy the rank's own chunk meanwhile."""
    algo = "alltoall_port"
    check_common(algo, ranks, instances)
    _check_blocks(algo, "copy_blocks", copy_blocks)
    if inplace:
        raise DSLError(f"{algo}: only out of place (a peer's chunk would overwrite one still to be sent)")
    prog = library_program(algo, AllToAll, ranks, instances, inplace, "Simple", num_threads_per_block,
                           name, min_message_size, max_message_size)
    # input chunk p to peer p, the own chunk r into the own output
    _copy_engine_exchange(prog, ranks, copy_blocks, lambda p: p, "own")
    return check_port_requests(algo, prog.to_plan())


def build_allreduce_port_pipelined(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                                   inplace: bool = False, name: Optional[str] = None,
                                   min_message_size: int = 0, max_message_size: int = MAX_MESSAGE_SIZE,
                                   steps: int = 4, reduce_blocks: Optional[int] = None) -> Plan:
    """Pipelined copy-engine allreduce (symmetric buffers): reduce-scatter by port puts into the
    peers' scratch, reduction on the SMs, all-gather by port puts into the peers' outputs.

    Rank ``r`` owns shard ``r`` (chunk ``r`` of ``ranks``), cut into ``steps`` pipeline steps:
    ``AllReduce(ranks, steps)``, chunk ``c * steps + s`` is step ``s`` of shard ``c``. After a
    relaxed ready handshake thread block 0 posts every reduce-scatter copy at once, step by step
    (``pws`` of step ``s`` of shard ``p`` into slot ``(r, s)`` of peer ``p``'s scratch), so the
    copy engines stream them back to back. Then, per step ``s``: block 0 waits for every peer's
    signal of step ``s``; blocks ``0 .. reduce_blocks - 1`` (a thread block group, between two
    barriers) reduce step ``s`` of the own shard from the input and the peers' slots into the
    output (one ``re``, the ranks in rank order); block 0 puts the result into every peer's output (``put``; ``pwsf`` at the last
    step, whose signal covers the earlier puts of the channel and whose flush keeps the next
    launch from reusing a buffer a copy still reads). While step ``s`` is reduced, the copies
    of the later steps are in flight, and each channel's all-gather copies queue behind its
    reduce-scatter copies, so the copy engines never wait for the SMs except at the last step.
    Finally block 0 waits for every peer's all-gather signal. Scratch: one slot per peer and
    step (``(ranks - 1) * steps`` chunks). Port requests per rank: ``2 * (ranks - 1) * steps``
    puts plus one flush per peer.

    ``reduce_blocks`` (default :func:`default_reduce_blocks`): the reduction must keep up with
    the copy engines. A rank reduces ``(ranks + 1) / ranks`` times the message (reads and
    writes) while its copy engine moves ``(ranks - 1) / ranks`` of it in the reduce-scatter, so
    the SM bandwidth it needs falls with the rank count.
    """
    algo = "allreduce_port_pipelined"
    check_common(algo, ranks, instances)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise DSLError(f"{algo}: steps must be a positive int, got {steps!r}")
    if reduce_blocks is None:
        reduce_blocks = default_reduce_blocks(ranks)
    _check_blocks(algo, "reduce_blocks", reduce_blocks)
    k = steps

    def collective(n: int, _chunks: int, inplace: bool) -> AllReduce:
        return AllReduce(n, k, inplace=inplace)  # one chunk per pipeline step of every shard

    prog = library_program(algo, collective, ranks, instances, inplace, "Simple", num_threads_per_block,
                           name, min_message_size, max_message_size)
    n = ranks
    group = list(range(reduce_blocks))
    reducers = ThreadBlockGroup(group)

    def slot(sender: int, receiver: int, s: int) -> int:
        """Where ``sender``'s step ``s`` lands in ``receiver``'s scratch."""
        return sender_slot(sender, receiver) * k + s

    with prog:
        ready = mesh(n)
        port = port_mesh(_all_pairs(n))
        scratch = [Buffer(r, (n - 1) * k) for r in range(n)]
        for r in range(n):
            me, inp, out, ps = Rank(r), input_of(r), output_of(r, inplace), peers(r, n)
            ready_handshake(ready, r, ps, ps, 0)
            # reduce-scatter copies of every step, posted at once (one fused pws)
            for s in range(k):
                for p in ps:
                    c = p * k + s
                    port[(r, p)].put_with_signal(scratch[p][slot(r, p, s):slot(r, p, s) + 1], inp[c:c + 1], tb=0)
            for s in range(k):
                c = r * k + s
                for p in ps:
                    port[(r, p)].wait(tb=0, data_sync=SyncType.none)
                me.barrier(group)       # every reducer sees the peers' step s
                got = [scratch[r][slot(q, r, s):slot(q, r, s) + 1] for q in ps]   # the peers in rank order
                me.reduce(inp[c:c + 1], got, tb_group=reducers, dst_chunk=out[c:c + 1], src_position=r)
                me.barrier(group)       # block 0 sees the whole reduced step
                for p in ps:
                    dst = output_of(p, inplace)[c:c + 1]
                    if s == k - 1:
                        port[(r, p)].put_with_signal_and_flush(dst, out[c:c + 1], tb=0)
                    else:
                        port[(r, p)].put(dst, out[c:c + 1], tb=0)
            for p in ps:
                port[(r, p)].wait(tb=0, data_sync=SyncType.after)
    return check_port_requests(algo, prog.to_plan())
