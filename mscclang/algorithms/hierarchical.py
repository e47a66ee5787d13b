"""Hierarchical programs of the library, for several nodes: memory channels between the GPUs of
a node, port channels between nodes (docs/semantics.md, "Transports": between nodes a port put goes through an
existing engine, NCCL point-to-point; a memory channel cannot leave its node).

The node layout is a parameter of every program here: ``gpus_per_node`` consecutive ranks form a
node (the launcher's numbering, :mod:`mscclang.runtime.topology`); rank ``r`` is GPU
``r % gpus_per_node`` of node ``r // gpus_per_node``. Its *local peers* are the other GPUs of its
node, its *remote peers* the GPUs with the same local index on the other nodes; every port
channel joins remote peers, every memory channel local peers, so the runtime's topology check
accepts the plan on that layout (and on any layout whose nodes hold whole nodes of it). With one
GPU per node every channel is a port channel (two GPUs of one machine can run the inter-node
path as two one-GPU nodes, ``MSCCLANG_GPUS_PER_NODE=1``).

Rules, besides those of :mod:`mscclang.algorithms.allreduce` and :mod:`mscclang.algorithms.port`:

* Before writing a remote peer's buffers a rank waits for that peer's ready signal of this
  launch, sent over the port channel (port channels have no relaxed signal).
* Port ops use the Simple protocol, single-buffered plans, one chunk range per put; every
  channel's last request is a ``pwsf`` or is followed by a ``flush``.
* Every chunk is addressed with single-chunk references, so ``instances > 1`` replicates the
  programs consistently (each reference maps to the same instance piece everywhere).

Both write peers' outputs directly (zero-copy): buffer mode ``symmetric``.
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import (Channels, PortChannels, announce_ready, await_ready, check_common,
                                        check_port_requests, data_handshake, input_of, library_program,
                                        local_peers, mesh, node_layout, output_of, port_mesh, put_to_peers,
                                        read_reduce, remote_peers)
from mscclang.dsl import AllGather, AllReduce, Buffer, Rank, SyncType
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_allgather_hierarchical", "build_allreduce_hierarchical"]


def _channels(n: int, gpus_per_node: int, nodes: int) -> tuple[Channels, PortChannels]:
    """Memory channels between local peers, port channels between remote peers."""
    local = [(s, d) for s in range(n) for d in local_peers(s, gpus_per_node)]
    remote = [(s, d) for s in range(n) for d in remote_peers(s, gpus_per_node, nodes)]
    return mesh(n, local), port_mesh(remote)


def _ready(mem: Channels, port: PortChannels, r: int, lp: list[int], rp: list[int]) -> None:
    """This launch has started: a relaxed signal to every local peer and a port signal to every
    remote peer; then wait for theirs."""
    announce_ready(mem, r, lp, 0)
    for q in rp:
        port[(r, q)].signal(tb=0, data_sync=SyncType.none)
    await_ready(mem, r, lp, 0)
    for q in rp:
        port[(r, q)].wait(tb=0, data_sync=SyncType.after)


def build_allreduce_hierarchical(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                                 inplace: bool = False, name: Optional[str] = None,
                                 min_message_size: int = 0, max_message_size: int = MAX_MESSAGE_SIZE,
                                 gpus_per_node: Optional[int] = None) -> Plan:
    """Hierarchical allreduce (symmetric buffers) for ``ranks / gpus_per_node`` nodes.

    With ``N`` nodes and ``G`` GPUs per node, the ``N * G`` chunks form ``G`` shards of ``N``
    chunks: GPU ``l`` of every node owns shard ``l`` (chunks ``l * N .. l * N + N - 1``) and,
    within it, GPU ``l`` of node ``m`` owns chunk ``l * N + m``. Rank ``r = m * G + l``, on one
    thread block:

    1. ready handshake with its local peers (memory, relaxed) and remote peers (port);
    2. intra-node reduce-scatter: read-reduce shard ``l`` from every local peer's input into
       its output (``rre``, one per chunk);
    3. inter-node reduce-scatter: ``pws`` chunk ``l * N + m'`` of that partial result into its
       slot of remote peer ``(m', l)``'s scratch; wait for every remote peer's signal and reduce
       their slots into chunk ``l * N + m``;
    4. inter-node all-gather: ``pwsf`` chunk ``l * N + m`` into every remote peer's output (the
       flush covers the channel's earlier copies too); wait for every remote peer's chunk;
    5. intra-node all-gather: put the whole shard into every local peer's output, then a data
       signal/wait with the local peers (it also keeps each rank alive until its local peers
       no longer read its input).

    Port requests per rank and instance: ``3 * (N - 1)`` plus ``N - 1`` flushes. Scratch: one
    slot per remote peer (``N - 1`` chunks).

    Both reductions add in rank order (the node's GPUs, then the nodes' partial sums), so with
    ``G > 1`` an element is ``(x0 + x1) + (x2 + x3)``, not the canonical sum: the plan says
    ``batch_invariant`` false (the canonical sum would move raw inputs between nodes). With one
    GPU per node step 3 is one sum over every rank in rank order, and the plan promises it.
    """
    algo = "allreduce_hierarchical"
    check_common(algo, ranks, instances)
    nodes, g = node_layout(algo, ranks, gpus_per_node)
    prog = library_program(algo, AllReduce, ranks, instances, inplace, "Simple", num_threads_per_block,
                           name, min_message_size, max_message_size, batch_invariant=g == 1)
    n = ranks
    with prog:
        mem, port = _channels(n, g, nodes)
        scratch = [Buffer(r, nodes - 1) for r in range(n)]
        for r in range(n):
            m, lo = divmod(r, g)
            me, inp, out = Rank(r), input_of(r), output_of(r, inplace)
            lp, rp = local_peers(r, g), remote_peers(r, g, nodes)
            shard = [lo * nodes + j for j in range(nodes)]
            _ready(mem, port, r, lp, rp)
            # 2. intra-node reduce-scatter of shard lo
            for c in shard:
                if lp:
                    read_reduce(mem, r, inp[c:c + 1], [(q, input_of(q)[c:c + 1]) for q in lp], out[c:c + 1], 0)
                elif not inplace:
                    me.copy(out[c:c + 1], inp[c:c + 1], tb=0)
            # 3. inter-node reduce-scatter of chunk lo * N + m
            for q in rp:
                c = lo * nodes + q // g
                slot = remote_peers(q, g, nodes).index(r)   # my slot in q's scratch
                port[(r, q)].put_with_signal(scratch[q][slot:slot + 1], out[c:c + 1], tb=0)
            for q in rp:
                port[(r, q)].wait(tb=0, data_sync=SyncType.after)
            own = lo * nodes + m
            # the remote peers' slots hold their nodes' partial sums in node order: this node's at m
            me.reduce(out[own:own + 1], [scratch[r][k:k + 1] for k in range(len(rp))], tb=0, src_position=m)
            # 4. inter-node all-gather of the reduced chunk
            for q in rp:
                port[(r, q)].put_with_signal_and_flush(output_of(q, inplace)[own:own + 1], out[own:own + 1], tb=0)
            for q in rp:
                port[(r, q)].wait(tb=0, data_sync=SyncType.after)
            # 5. intra-node all-gather of shard lo
            if lp:
                for c in shard:
                    put_to_peers(mem, r, lp, dst=lambda q, c=c: output_of(q, inplace)[c:c + 1],
                                 src=lambda q, c=c: out[c:c + 1], tb=0)
                data_handshake(mem, r, lp, lp, 0)
    return check_port_requests(algo, prog.to_plan())


def build_allgather_hierarchical(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                                 inplace: bool = False, name: Optional[str] = None,
                                 min_message_size: int = 0, max_message_size: int = MAX_MESSAGE_SIZE,
                                 gpus_per_node: Optional[int] = None) -> Plan:
    """Hierarchical allgather (symmetric buffers) for ``ranks / gpus_per_node`` nodes.

    Rank ``r`` (GPU ``l`` of node ``m``), on one thread block: ready handshake with local
    (memory, relaxed) and remote (port) peers; ``pws`` of its input into chunk ``r`` of every
    remote peer's output (the inter-node link carries one chunk per remote peer); out of place,
    a copy of the input into its own output chunk; wait for every remote peer's chunk; then put
    the ``N`` chunks of GPU ``l`` of every node into every local peer's output; flush the port
    channels (the input is not reused before, so the flush waits as late as possible); a final
    data signal/wait with the local peers. Port requests per rank and instance: ``2 * (N - 1)``
    plus ``N - 1`` flushes.
    """
    algo = "allgather_hierarchical"
    check_common(algo, ranks, instances)
    nodes, g = node_layout(algo, ranks, gpus_per_node)
    prog = library_program(algo, AllGather, ranks, instances, inplace, "Simple", num_threads_per_block,
                           name, min_message_size, max_message_size)
    n = ranks
    with prog:
        mem, port = _channels(n, g, nodes)
        for r in range(n):
            inp, out = input_of(r), output_of(r)
            lp, rp = local_peers(r, g), remote_peers(r, g, nodes)
            _ready(mem, port, r, lp, rp)
            for q in rp:
                port[(r, q)].put_with_signal(output_of(q)[r:r + 1], inp[0:1], tb=0)
            if not inplace:
                Rank(r).copy(out[r:r + 1], inp[0:1], tb=0)
            for q in rp:
                port[(r, q)].wait(tb=0, data_sync=SyncType.after)
            if lp:
                for c in sorted(rp + [r]):
                    src = inp if c == r else out
                    idx = 0 if c == r else c
                    put_to_peers(mem, r, lp, dst=lambda q, c=c: output_of(q)[c:c + 1],
                                 src=lambda q, s=src, i=idx: s[i:i + 1], tb=0)
            for q in rp:
                port[(r, q)].flush(tb=0, data_sync=SyncType.none)
            if lp:
                data_handshake(mem, r, lp, lp, 0)
    return check_port_requests(algo, prog.to_plan())
