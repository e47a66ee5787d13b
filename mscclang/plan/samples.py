"""Hand-built plans (pydantic models, no DSL) that exercise every memory-channel, local and packet
op kind of the executor: used by the GPU tests, ``mscclang build-kernel --sample`` and the
measurements.

Every plan is a real allreduce or allgather, so its expected output is the collective's
definition (:func:`mscclang.plan.reference.reference_output`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from mscclang.plan.models import (
    BufferKind, BufferRef, ChannelDesc, ChannelType, Gpu, IterContext, Op, OpName, Plan,
    RemoteBuffer, RemoteBufferRefs, SemaphoreDesc, TbgInfo, ThreadBlock, ThreadBlockChannels,
)

I, O, S = BufferKind.input, BufferKind.output, BufferKind.scratch
MEM = ChannelType.memory


def _l(kind: BufferKind, index: int, size: int = 1) -> BufferRef:
    return BufferRef(type=kind, index=index, size=size)


def _r(bid: int, index: int, size: int = 1) -> BufferRef:
    return BufferRef(buffer_id=bid, index=index, size=size)


def _peers(n: int, r: int) -> list[int]:
    return [q for q in range(n) if q != r]


def _tb(tid: int, ops: list[Op], n_chan: int, n_remote: int) -> ThreadBlock:
    return ThreadBlock(
        id=tid, ops=ops,
        channels=[ThreadBlockChannels(channel_type=MEM, channel_ids=list(range(n_chan)))] if n_chan else [],
        remote_buffer_refs=[RemoteBufferRefs(access_channel_type=MEM, remote_buffer_ids=list(range(n_remote)))]
        if n_remote else [])


def _sig(relaxed: bool, n: int) -> Op:
    return Op(name=OpName.rlxsignal if relaxed else OpName.signal, channel_ids=list(range(n)), channel_type=MEM)


def _wait(relaxed: bool, n: int) -> Op:
    return Op(name=OpName.rlxwait if relaxed else OpName.wait, channel_ids=list(range(n)), channel_type=MEM)


def _gpu(r: int, n_in: int, n_out: int, n_scratch: int, tbs: list[ThreadBlock], peers: list[int],
         remote: tuple[BufferKind, ...] = (), connected: Optional[list[int]] = None, **fields: Any) -> Gpu:
    """Rank ``r`` with one memory channel to each of ``connected`` (default ``peers``) and, for each
    kind of ``remote`` in turn, a remote buffer of that kind on every peer."""
    return Gpu(id=r, input_chunks=n_in, output_chunks=n_out, scratch_chunks=n_scratch, threadblocks=tbs,
               channels=[ChannelDesc(channel_type=MEM, connected_to=peers if connected is None else connected)],
               remote_buffers=[RemoteBuffer(rank=q, type=t, access_channel_types=[MEM]) for t in remote for q in peers],
               **fields)


NOP = Op(name=OpName.nop)


def _plan(name: str, collective: str, n: int, gpus: list[Gpu], protocol: str = "Simple",
          double: bool = False, nthreads: int = 512) -> Plan:
    return Plan(name=name, collective=collective, protocol=protocol, num_threads_per_block=nthreads,
                use_double_scratch_buffer=double, gpus=gpus, num_ranks=n)


def allreduce_oneshot_ll(n: int = 2, nblocks: int = 1, nthreads: int = 512) -> Plan:
    """One-shot LL allreduce: each rank packs its whole input into every peer's scratch (ppkt),
    then reduces its input with the received packets (repkt). Blocks form one group."""
    gpus = []
    for r in range(n):
        peers = _peers(n, r)
        ops = []
        tbg = TbgInfo(tb_id=0, tbg_size=nblocks)
        for pi, q in enumerate(peers):
            slot_at_q = _peers(n, q).index(r) * n
            ops.append(Op(name=OpName.ppkt, channel_type=MEM, src_buff=[_l(I, 0, n)],
                          dst_buff=[_r(pi, slot_at_q, n)], tbg_info=tbg))
        ops.append(Op(name=OpName.repkt, reduce_op="sum",
                      src_buff=[_l(I, 0, n)] + [_l(S, k * n, n) for k in range(len(peers))],
                      dst_buff=[_l(O, 0, n)], tbg_info=tbg))
        tbs = []
        for t in range(nblocks):
            tops = [o.model_copy(update={"tbg_info": TbgInfo(tb_id=t, tbg_size=nblocks)} if o.tbg_info else {})
                    for o in ops]
            tbs.append(_tb(t, tops, len(peers), len(peers)))
        gpus.append(_gpu(r, n, n, n * (n - 1), tbs, peers, (S,)))
    return _plan(f"allreduce_oneshot_ll_{n}r_{nblocks}b", "allreduce", n, gpus, "LL", True, nthreads)


def allreduce_twostep_ll(n: int = 2) -> Plan:
    """Two-step LL allreduce: ppkt each peer's chunk to it, respkt (reduce own chunk, send the
    result as packets to every peer), upkt the peers' results."""
    gpus = []
    for r in range(n):
        peers = _peers(n, r)
        ops = [Op(name=OpName.ppkt, channel_type=MEM, src_buff=[_l(I, q)], dst_buff=[_r(pi, r)])
               for pi, q in enumerate(peers)]
        ops.append(Op(name=OpName.respkt, channel_type=MEM, reduce_op="sum",
                      src_buff=[_l(I, r)] + [_l(S, q) for q in peers],
                      dst_buff=[_l(O, r)] + [_r(pi, n + r) for pi in range(len(peers))]))
        ops += [Op(name=OpName.upkt, src_buff=[_l(S, n + q)], dst_buff=[_l(O, q)]) for q in peers]
        gpus.append(_gpu(r, n, n, 2 * n, [_tb(0, ops, len(peers), len(peers))], peers, (S,)))
    return _plan(f"allreduce_twostep_ll_{n}r", "allreduce", n, gpus, "LL", True)


def allreduce_copyfwd_ll(n: int = 2, send_fused: bool = False) -> Plan:
    """LL allreduce through local packet copies: cpkt each peer's chunk into local scratch, rppkt
    it to the peer, then recpkt + rppkt (or recspkt when ``send_fused``), then upkt."""
    gpus = []
    for r in range(n):
        peers = _peers(n, r)
        ops = []
        for pi, q in enumerate(peers):
            ops.append(Op(name=OpName.cpkt, src_buff=[_l(I, q)], dst_buff=[_l(S, 2 * n + q)]))
            ops.append(Op(name=OpName.rppkt, channel_type=MEM, src_buff=[_l(S, 2 * n + q)], dst_buff=[_r(pi, r)]))
        srcs = [_l(I, r)] + [_l(S, q) for q in peers]
        if send_fused:
            ops.append(Op(name=OpName.recspkt, channel_type=MEM, reduce_op="sum", src_buff=srcs,
                          dst_buff=[_l(O, r), _l(S, 3 * n + r)] + [_r(pi, n + r) for pi in range(len(peers))]))
        else:
            ops.append(Op(name=OpName.recpkt, reduce_op="sum", src_buff=srcs, dst_buff=[_l(O, r), _l(S, 3 * n + r)]))
            ops.append(Op(name=OpName.rppkt, channel_type=MEM, src_buff=[_l(S, 3 * n + r)],
                          dst_buff=[_r(pi, n + r) for pi in range(len(peers))]))
        ops += [Op(name=OpName.upkt, src_buff=[_l(S, n + q)], dst_buff=[_l(O, q)]) for q in peers]
        gpus.append(_gpu(r, n, n, 4 * n, [_tb(0, ops, len(peers), len(peers))], peers, (S,)))
    return _plan(f"allreduce_copyfwd_ll_{n}r{'_fused' if send_fused else ''}", "allreduce", n, gpus, "LL", True)


def allreduce_scratch_simple(n: int = 2) -> Plan:
    """Simple allreduce: ready handshake, put each peer's chunk into its scratch, signal/wait,
    res (reduce own chunk, write it into every peer's output), signal/wait."""
    gpus = []
    for r in range(n):
        peers = _peers(n, r)
        k = len(peers)
        # remote buffers: peers' scratch (0..k-1), peers' outputs (k..2k-1)
        ops = [_sig(True, k), _wait(True, k), NOP,
               Op(name=OpName.put, channel_type=MEM, src_buff=[_l(I, q) for q in peers],
                  dst_buff=[_r(pi, r) for pi in range(k)]),
               NOP, _sig(False, k), _wait(False, k), NOP,
               Op(name=OpName.res, channel_type=MEM, reduce_op="sum",
                  src_buff=[_l(I, r)] + [_l(S, q) for q in peers],
                  dst_buff=[_l(O, r)] + [_r(k + pi, r) for pi in range(k)]),
               NOP, _sig(False, k), _wait(False, k), NOP]
        gpus.append(_gpu(r, n, n, n, [_tb(0, ops, k, 2 * k)], peers, (S, O)))
    return _plan(f"allreduce_scratch_simple_{n}r", "allreduce", n, gpus)


def allreduce_read_simple(n: int = 2, fused: bool = False) -> Plan:
    """Zero-copy Simple allreduce: ready handshake, rre (read peers' inputs, reduce own chunk),
    then either put the result into peers' outputs + signal/wait, or (``fused``) rres; finally
    signal/wait and get... (get reads peers' results from their outputs when not fused)."""
    gpus = []
    for r in range(n):
        peers = _peers(n, r)
        k = len(peers)
        # remote buffers: peers' inputs (0..k-1), peers' outputs (k..2k-1)
        srcs = [_l(I, r)] + [_r(pi, r) for pi in range(k)]
        ops = [_sig(True, k), _wait(True, k), NOP]
        if fused:
            ops += [Op(name=OpName.rres, channel_type=MEM, reduce_op="sum", src_buff=srcs,
                       dst_buff=[_l(O, r)] + [_r(k + pi, r) for pi in range(k)]),
                    NOP, _sig(False, k), _wait(False, k), NOP]
        else:
            ops += [Op(name=OpName.rre, channel_type=MEM, reduce_op="sum", src_buff=srcs, dst_buff=[_l(O, r)]),
                    NOP, _sig(False, k), _wait(False, k), NOP,
                    Op(name=OpName.get, channel_type=MEM, src_buff=[_r(k + pi, q) for pi, q in enumerate(peers)],
                       dst_buff=[_l(O, q) for q in peers]),
                    NOP, _sig(False, k), _wait(False, k), NOP]
        gpus.append(_gpu(r, n, n, 0, [_tb(0, ops, k, 2 * k)], peers, (I, O)))
    return _plan(f"allreduce_read_simple_{n}r{'_fused' if fused else ''}", "allreduce", n, gpus)


def allgather_simple(n: int = 2) -> Plan:
    """Simple zero-copy allgather: copy own input into own output, ready handshake, put it into
    every peer's output, signal/wait."""
    gpus = []
    for r in range(n):
        peers = _peers(n, r)
        k = len(peers)
        ops = [Op(name=OpName.copy, src_buff=[_l(I, 0)], dst_buff=[_l(O, r)]),
               _sig(True, k), _wait(True, k), NOP,
               Op(name=OpName.put, channel_type=MEM, src_buff=[_l(I, 0)] * k, dst_buff=[_r(pi, r) for pi in range(k)]),
               NOP, _sig(False, k), _wait(False, k), NOP]
        gpus.append(_gpu(r, 1, n, 0, [_tb(0, ops, k, k)], peers, (O,)))
    return _plan(f"allgather_simple_{n}r", "allgather", n, gpus)


def allgather_put(n: int = 2, nblocks: int = 1, nthreads: int = 1024) -> Plan:
    """Zero-copy allgather over ``nblocks`` blocks (one thread-block group, one memory channel per
    block and peer): copy own input into own output, ready handshake, put the block's share of
    the input into every peer's output, signal/wait. For measuring how bandwidth scales with
    blocks."""
    gpus = []
    for r in range(n):
        peers = _peers(n, r)
        k = len(peers)
        tbs = []
        for b in range(nblocks):
            tbg = TbgInfo(tb_id=b, tbg_size=nblocks)
            ops = [Op(name=OpName.copy, src_buff=[_l(I, 0)], dst_buff=[_l(O, r)], tbg_info=tbg),
                   _sig(True, k), _wait(True, k), NOP,
                   Op(name=OpName.put, channel_type=MEM, src_buff=[_l(I, 0)] * k,
                      dst_buff=[_r(pi, r) for pi in range(k)], tbg_info=tbg),
                   NOP, _sig(False, k), _wait(False, k), NOP]
            tbs.append(ThreadBlock(
                id=b, ops=ops,
                channels=[ThreadBlockChannels(channel_type=MEM, channel_ids=[b * k + pi for pi in range(k)])],
                remote_buffer_refs=[RemoteBufferRefs(access_channel_type=MEM, remote_buffer_ids=list(range(k)))]))
        gpus.append(_gpu(r, 1, n, 0, tbs, peers, (O,), connected=peers * nblocks))
    return _plan(f"allgather_put_{n}r_{nblocks}b", "allgather", n, gpus, nthreads=nthreads)


def allgather_pipeline(n: int = 2, unit: int = 1 << 16) -> Plan:
    """Allgather over two blocks, with a pipeline, a semaphore and a barrier: block 0 copies the
    input into scratch (pipelined) and releases a semaphore; block 1 acquires it, meets block 0 at
    a barrier, puts the scratch copy into every peer's output (pipelined) and its own output."""
    gpus = []
    for r in range(n):
        peers = _peers(n, r)
        k = len(peers)
        tb0 = [Op(name=OpName.pipeline, iter_context=IterContext(unit_size=unit, num_chunks=1),
                  ops=[Op(name=OpName.copy, src_buff=[_l(I, 0)], dst_buff=[_l(S, 0)])]),
               NOP, Op(name=OpName.sem_release, semaphore_ids=[0]),
               Op(name=OpName.barrier, barrier_id=0, num_threadblocks=2, barrier_tbs=[0, 1])]
        tb1 = [Op(name=OpName.sem_acquire, semaphore_ids=[0]), NOP,
               Op(name=OpName.barrier, barrier_id=0, num_threadblocks=2, barrier_tbs=[0, 1]),
               _sig(True, k), _wait(True, k), NOP,
               Op(name=OpName.pipeline, iter_context=IterContext(unit_size=unit, num_chunks=1),
                  ops=[Op(name=OpName.put, channel_type=MEM, src_buff=[_l(S, 0)] * k,
                          dst_buff=[_r(pi, r) for pi in range(k)])]),
               Op(name=OpName.copy, src_buff=[_l(S, 0)], dst_buff=[_l(O, r)]),
               NOP, _sig(False, k), _wait(False, k), NOP]
        gpus.append(_gpu(r, 1, n, 1, [_tb(0, tb0, 0, 0), _tb(1, tb1, k, k)], peers, (O,),
                         semaphores=[SemaphoreDesc(init_value=0)]))
    return _plan(f"allgather_pipeline_{n}r", "allgather", n, gpus)


def missing_signal(n: int = 2) -> Plan:
    """A broken plan: every rank waits on a signal nobody sends (for the timeout test)."""
    gpus = []
    for r in range(n):
        peers = _peers(n, r)
        k = len(peers)
        ops = [Op(name=OpName.copy, src_buff=[_l(I, 0, n)], dst_buff=[_l(O, 0, n)]), NOP, _wait(False, k), NOP]
        gpus.append(_gpu(r, n, n, 0, [_tb(0, ops, k, 0)], peers))
    return _plan(f"missing_signal_{n}r", "allreduce", n, gpus)


SAMPLES: dict[str, Callable[[int], Plan]] = {
    "allreduce_oneshot_ll": allreduce_oneshot_ll,
    "allreduce_oneshot_ll_4b": lambda n: allreduce_oneshot_ll(n, nblocks=4),
    "allreduce_twostep_ll": allreduce_twostep_ll,
    "allreduce_copyfwd_ll": allreduce_copyfwd_ll,
    "allreduce_copyfwd_ll_fused": lambda n: allreduce_copyfwd_ll(n, send_fused=True),
    "allreduce_scratch_simple": allreduce_scratch_simple,
    "allreduce_read_simple": allreduce_read_simple,
    "allreduce_read_simple_fused": lambda n: allreduce_read_simple(n, fused=True),
    "allgather_simple": allgather_simple,
    "allgather_pipeline": allgather_pipeline,
    "allgather_put_4b": lambda n: allgather_put(n, nblocks=4),
}
