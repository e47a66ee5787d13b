"""Pass 2 (fusion): one test per rule, plus the cases that must not fuse."""

from __future__ import annotations

import pytest

from mscclang import (
    AllReduce,
    Buffer,
    BufferType,
    CollectiveProgram,
    LoopIterationContext,
    MemoryChannel,
    PortChannel,
    Rank,
    Semaphore,
    SwitchChannel,
    SyncType,
    TestCollective,
)
from mscclang.compiler import fuse
from mscclang.compiler.fuse import try_fuse
from mscclang.compiler.ir import IROp
from mscclang.plan.models import ChannelType, OpName


def prog(n=2, f=2, **kw):
    return CollectiveProgram("f", AllReduce(n, f, False), n, **kw)


def fused(p, rank=0, tb=0):
    return fuse(p.ir).ranks[rank].tbs[tb]


def nm(ops):
    return [o.name.value for o in ops]


def inp(r):
    return Rank(r).get_input_buffer()


def out(r):
    return Rank(r).get_output_buffer()


def test_nop_rules():
    a, b = IROp(OpName.nop), IROp(OpName.nop)
    assert try_fuse(a, b) is a
    bar = IROp(OpName.barrier, barrier_id=0, barrier_tbs=[0, 1])
    assert try_fuse(IROp(OpName.nop), bar) is bar
    assert try_fuse(bar, IROp(OpName.nop)) is bar


def test_pipeline_ending_in_after_sync_absorbs_nop():
    with prog() as p:
        ch = MemoryChannel(1, 0)
        MemoryChannel(0, 1).signal(0)
        with LoopIterationContext(1024, 1):
            ch.wait(0, data_sync=SyncType.after)
        Rank(0).barrier([0])
    ops = fused(p)
    assert nm(ops) == ["pipeline"]


def test_signal_wait_flush_merge_over_disjoint_channels():
    with prog(n=3) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(2, 0)
        a.signal(0, data_sync=SyncType.before)
        b.signal(0, data_sync=SyncType.after)
        a.wait(0)
        b.wait(0)
        a.signal(0, relaxed=True)
        b.signal(0)  # different op (signal vs rlxsignal): no fusion
        pa, pb = PortChannel(1, 0), PortChannel(2, 0)
        pa.flush(1)
        pb.flush(1)
    ops = fused(p)
    assert nm(ops) == ["signal", "wait", "rlxsignal", "signal"]
    assert ops[0].channels == [0, 1] and ops[0].data_sync == int(SyncType.both)
    assert ops[1].channels == [0, 1]
    f = fused(p, tb=1)
    assert nm(f) == ["flush"] and f[0].channels == [0, 1] and f[0].channel_type == ChannelType.port


def test_same_channel_signals_stay_separate():
    with prog() as p:
        a = MemoryChannel(1, 0)
        a.signal(0)
        a.signal(0)
    assert nm(fused(p)) == ["signal", "signal"]


def test_semaphore_merges():
    with prog() as p:
        s0, s1 = Semaphore(0, 1), Semaphore(0, 1)
        s0.acquire(0)
        s1.acquire(0)
        s0.release(0)
        s1.release(0)
    ops = fused(p)
    assert nm(ops) == ["sem_acquire", "sem_release"]
    assert ops[0].semaphores == [0, 1] and ops[1].semaphores == [0, 1]


@pytest.mark.parametrize("method, op", [("put", "put"), ("put_with_signal", "pws"),
                                        ("put_with_signal_and_flush", "pwsf"), ("put_packets", "ppkt")])
def test_multi_put_family_port(method, op):
    with prog(n=3) as p:
        a, b = PortChannel(1, 0), PortChannel(2, 0)
        s1, s2 = Buffer(1, 2), Buffer(2, 2)
        getattr(a, method)(s1[0:1], inp(0)[0:1], 0)
        getattr(b, method)(s2[1:2], inp(0)[1:2], 0)
    ops = fused(p)
    assert nm(ops) == [op]
    assert [(r.rank, r.index) for r in ops[0].dst] == [(1, 0), (2, 1)]
    assert [r.index for r in ops[0].src] == [0, 1]
    assert ops[0].channels == [0, 1]


def test_multi_put_memory_and_size_mismatch():
    with prog(n=3) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(2, 0)
        a.put(out(1)[0:1], inp(0)[0:1], 0)
        b.put(out(2)[0:1], inp(0)[0:1], 0)
        a.put(out(1)[2:4], inp(0)[2:4], 0)  # two chunks: not fused with one-chunk puts
    ops = fused(p)
    assert nm(ops) == ["put", "put"] and len(ops[0].dst) == 2


def test_puts_to_same_bytes_do_not_fuse():
    with prog() as p:
        a = MemoryChannel(1, 0)
        a.put(out(1)[0:1], inp(0)[0:1], 0)
        a.put(out(1)[0:1], inp(0)[1:2], 0)
    assert nm(fused(p)) == ["put", "put"]


def test_rppkt_same_source_multi_destination():
    with prog(n=3) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(2, 0)
        s0, s1, s2 = Buffer(0, 1), Buffer(1, 1), Buffer(2, 1)
        a.read_put_packets(s1[0:1], s0[0:1], 0)
        b.read_put_packets(s2[0:1], s0[0:1], 0)
    ops = fused(p)
    assert nm(ops) == ["rppkt"] and len(ops[0].src) == 1 and len(ops[0].dst) == 2


def test_multi_get():
    with prog(n=3) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(2, 0)
        a.get(out(0)[1:2], inp(1)[1:2], 0)
        b.get(out(0)[2:3], inp(2)[2:3], 0)
    ops = fused(p)
    assert nm(ops) == ["get"] and len(ops[0].src) == 2 and ops[0].channels == [0, 1]


def test_reduce_gains_sources():
    with prog(n=3) as p:
        r0 = Rank(0)
        r0.reduce(inp(0)[0:1], [inp(0)[1:2]], tb=0, dst_chunk=out(0)[0:1])
        r0.reduce(out(0)[0:1], [inp(0)[2:3]], tb=0)
        a, b = MemoryChannel(1, 0), MemoryChannel(2, 0)
        a.reduce(out(0)[3:4], [inp(1)[3:4]], tb=1)
        b.reduce(out(0)[3:4], [inp(2)[3:4]], tb=1)
        s = Buffer(0, 4)
        r0.reduce(out(0)[5:6], [s[0:1]], tb=2, packet=True)
        r0.reduce(out(0)[5:6], [s[1:2]], tb=2, packet=True)
    ops = fused(p)
    assert nm(ops) == ["re"]
    assert [(r.buffer.value, r.index) for r in ops[0].src] == [("i", 0), ("i", 1), ("i", 2)]
    assert [(r.buffer.value, r.index) for r in ops[0].dst] == [("o", 0)]
    t1 = fused(p, tb=1)
    assert nm(t1) == ["rre"] and [r.rank for r in t1[0].src] == [0, 1, 2] and t1[0].channels == [0, 1]
    t2 = fused(p, tb=2)
    assert nm(t2) == ["repkt"] and len(t2[0].src) == 3


def test_reduce_with_other_destination_not_merged():
    with prog(n=3) as p:
        r0 = Rank(0)
        r0.reduce(inp(0)[0:1], [inp(0)[1:2]], tb=0, dst_chunk=out(0)[0:1])
        r0.reduce(inp(0)[0:1], [inp(0)[2:3]], tb=0, dst_chunk=out(0)[0:1])  # first source differs
    assert nm(fused(p)) == ["re", "re"]


def test_reduce_then_put_becomes_res_and_rres():
    with prog() as p:
        ch = MemoryChannel(1, 0)
        Rank(0).reduce(inp(0)[0:1], [inp(0)[1:2]], tb=0)
        ch.put(out(1)[0:1], inp(0)[0:1], tb=0)
        ch.reduce(inp(0)[2:3], [inp(1)[2:3]], tb=1)
        ch.put(out(1)[2:3], inp(0)[2:3], tb=1)
        ch.put(Buffer(1, 1)[0:1], inp(0)[2:3], tb=1)
        ch.put(inp(1)[3:4], inp(0)[2:3], tb=1)  # a peer chunk nobody read: fused too
    ops = fused(p)
    assert nm(ops) == ["res"] and ops[0].channel_type == ChannelType.memory
    assert [(d.remote, d.rank) for d in ops[0].dst] == [(False, 0), (True, 1)]
    t1 = fused(p, tb=1)
    assert nm(t1) == ["rres"] and len(t1[0].dst) == 4


def _rre_writeback(dst_of_put, n=3, instr_fusion=True):
    """rank 0 read-reduces chunk 0 of every peer's input into its output, then puts the result
    into ``dst_of_put(peer)`` of each peer."""
    with prog(n=n, f=2, instr_fusion=instr_fusion) as p:
        chans = {q: MemoryChannel(q, 0) for q in range(1, n)}
        cur = inp(0)[0:1]
        for q in range(1, n):
            chans[q].reduce(cur, [inp(q)[0:1]], tb=0, local_dst_chunk=out(0)[0:1])
            cur = out(0)[0:1]
        for q in range(1, n):
            chans[q].put(dst_of_put(q), out(0)[0:1], tb=0)
    return p


def test_rre_write_back_into_the_ranges_it_read_becomes_rres():
    p = _rre_writeback(lambda q: inp(q)[0:1])
    ops = fused(p)
    assert nm(ops) == ["rres"]
    assert [(r.rank, r.remote, r.buffer.value, r.index) for r in ops[0].src] == [
        (0, False, "i", 0), (1, True, "i", 0), (2, True, "i", 0)]
    assert [(r.rank, r.remote, r.buffer.value, r.index) for r in ops[0].dst] == [
        (0, False, "o", 0), (1, True, "i", 0), (2, True, "i", 0)]
    assert ops[0].channels == [0, 1]
    # compiled: one rres, no hazard nop between a reduction and its write-back
    plan = p.to_plan()
    assert [o.name.value for o in plan.gpus[0].threadblocks[0].ops] == ["rres"]


def test_partial_overlap_with_a_range_read_is_not_a_write_back():
    # the put's destination starts inside the range the reduction read: element i of the write
    # would clobber element i+1 of the read, read by another thread
    with prog(n=2, f=2) as p:
        ch = MemoryChannel(1, 0)
        ch.reduce(inp(0)[0:2], [inp(1)[0:2]], tb=0, local_dst_chunk=out(0)[0:2])
        ch.put(inp(1)[1:3], out(0)[0:2], tb=0)
    assert nm(fused(p)) == ["rre", "put"]
    # a write-back into a range the reduction writes too (two writes of one range) stays apart
    with prog(n=2, f=2) as p:
        ch = MemoryChannel(1, 0)
        ch.reduce(inp(0)[0:1], [inp(1)[0:1]], tb=0, local_dst_chunk=out(0)[0:1])
        ch.put(inp(1)[0:1], out(0)[0:1], tb=0)
        ch.put(inp(1)[0:1], out(0)[0:1], tb=0)
    assert nm(fused(p)) == ["rres", "put"]


def test_write_back_only_for_remote_reads_of_read_reduce():
    # a local reduction followed by a put into a peer: nothing remote was read, plain res
    with prog(n=2, f=2) as p:
        Rank(0).reduce(inp(0)[0:1], [inp(0)[1:2]], tb=0, dst_chunk=out(0)[0:1])
        MemoryChannel(1, 0).put(out(1)[0:1], out(0)[0:1], tb=0)
    assert nm(fused(p)) == ["res"]
    # the put writes the *local* source the reduction read: not a write-back, not fused
    with prog(n=2, f=2) as p:
        ch = MemoryChannel(1, 0)
        ch.reduce(inp(0)[0:1], [inp(1)[0:1]], tb=0, local_dst_chunk=out(0)[0:1])
        Rank(0).copy(inp(0)[0:1], out(0)[0:1], tb=0)
    assert nm(fused(p)) == ["rre", "copy"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_fused_write_back_verifies_in_simulator(ranks):
    """The fused rres reads each peer's chunk and writes the result back into it; with a ready
    handshake before and a done handshake after, the simulator finds no race, and the output
    and every peer's written-back chunk hold the reduction."""
    from mscclang.sim import verify

    with CollectiveProgram("wb", AllReduce(ranks, 1, True), ranks) as p:
        ch = {(a, b): MemoryChannel(b, a) for a in range(ranks) for b in range(ranks) if a != b}
        for r in range(ranks):
            others = [q for q in range(ranks) if q != r]
            for q in others:
                ch[(r, q)].signal(0, relaxed=True, data_sync=SyncType.none)
            for q in others:
                ch[(r, q)].wait(0, relaxed=True, data_sync=SyncType.after)
            cur = inp(r)[r:r + 1]
            for q in others:
                ch[(r, q)].reduce(cur, [inp(q)[r:r + 1]], tb=0, local_dst_chunk=inp(r)[r:r + 1])
                cur = inp(r)[r:r + 1]
            for q in others:
                ch[(r, q)].put(inp(q)[r:r + 1], inp(r)[r:r + 1], tb=0)
            for q in others:
                ch[(r, q)].signal(0, data_sync=SyncType.before)
            for q in others:
                ch[(r, q)].wait(0, data_sync=SyncType.after)
    plan = p.to_plan()
    names = [o.name.value for o in plan.gpus[0].threadblocks[0].ops]
    assert names.count("rres") == 1 and "put" not in names and "rre" not in names
    rep = verify(plan, schedules=4)
    assert rep.ok, str(rep)


def test_reduce_then_put_of_other_chunk_stays():
    with prog() as p:
        ch = MemoryChannel(1, 0)
        Rank(0).reduce(inp(0)[0:1], [inp(0)[1:2]], tb=0)
        ch.put(out(1)[0:1], inp(0)[1:2], tb=0)
    assert nm(fused(p)) == ["re", "put"]


def test_packet_reduce_rules():
    with prog(n=3) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(2, 0)
        s = Buffer(0, 8)
        s1, s2 = Buffer(1, 4), Buffer(2, 4)
        r0 = Rank(0)
        # repkt + ppkt + ppkt -> respkt
        r0.reduce(inp(0)[0:1], [s[0:1]], tb=0, packet=True)
        a.put_packets(s1[0:1], inp(0)[0:1], tb=0)
        b.put_packets(s2[0:1], inp(0)[0:1], tb=0)
        # repkt + cpkt -> recpkt ; + ppkt -> recspkt ; + rppkt of the copy -> recspkt
        r0.reduce(inp(0)[1:2], [s[1:2]], tb=1, packet=True)
        r0.copy_packets(s[4:5], inp(0)[1:2], tb=1)
        a.put_packets(s1[1:2], inp(0)[1:2], tb=1)
        b.read_put_packets(s2[1:2], s[4:5], tb=1)
        # repkt + cpkt -> recpkt (alone)
        r0.reduce(inp(0)[2:3], [s[2:3]], tb=2, packet=True)
        r0.copy_packets(s[5:6], inp(0)[2:3], tb=2)
    t0 = fused(p, tb=0)
    assert nm(t0) == ["respkt"] and len(t0[0].dst) == 3
    t1 = fused(p, tb=1)
    assert nm(t1) == ["recspkt"]
    assert [(d.remote, d.index) for d in t1[0].dst] == [(False, 1), (False, 4), (True, 1), (True, 1)]
    t2 = fused(p, tb=2)
    assert nm(t2) == ["recpkt"] and [d.index for d in t2[0].dst] == [2, 5]


def test_glre_gstore_become_glres_and_lone_glre_stays():
    with CollectiveProgram("nvls", AllReduce(2, 2, True), 2) as p:
        sw = SwitchChannel([0, 1], BufferType.input)
        for r in range(2):
            v = sw.at_rank(r)
            v.reduce(r * 2, 1, inp(r)[r * 2:r * 2 + 1], tb=0)
            v.broadcast(inp(r)[r * 2:r * 2 + 1], r * 2, 1, tb=0)
            v.reduce(r * 2 + 1, 1, out(r)[0:1], tb=1)  # lone glre into the output
    t0 = fused(p, tb=0)
    assert nm(t0) == ["glres"]
    assert t0[0].src[0].switch == 0 and t0[0].dst[0].switch == 0
    assert nm(fused(p, tb=1)) == ["glre"]
    plan = p.to_plan()
    assert [o.name.value for o in plan.gpus[1].threadblocks[1].ops] == ["glre"]


def test_glre_into_other_chunk_is_not_fused():
    with CollectiveProgram("nvls", TestCollective(2, 2, 2), 2) as p:
        sw = SwitchChannel([0, 1], BufferType.input)
        v = sw.at_rank(0)
        v.reduce(0, 1, out(0)[0:1], tb=0)
        v.broadcast(out(0)[0:1], 1, 1, tb=0)
    assert nm(fused(p)) == ["glre", "gstore"]


def test_fusion_needs_same_tbg_and_can_be_disabled():
    from mscclang import ThreadBlockGroup

    with prog(n=3, instr_fusion=False) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(2, 0)
        a.signal(0)
        b.signal(0)
        MemoryChannel(0, 1).wait(0)
        MemoryChannel(0, 2).wait(0)
    plan = p.to_plan()
    assert [o.name.value for o in plan.gpus[0].threadblocks[0].ops] == ["nop", "signal", "nop", "signal", "nop"]
    with prog(n=3) as p:
        g = ThreadBlockGroup([0, 1])
        a, b = MemoryChannel(1, 0), MemoryChannel(2, 0)
        a.put(out(1)[0:2], inp(0)[0:2], tb_group=g)
        b.put(out(2)[0:2], inp(0)[0:2], tb=0)
    assert nm(fused(p)) == ["put", "put"]
