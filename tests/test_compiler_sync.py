"""Passes 3 and 4: data-sync nops and hazard nops (including the packet rule)."""

from __future__ import annotations

import pytest

from mscclang import (
    AllReduce,
    Buffer,
    BufferType,
    CollectiveProgram,
    MemoryChannel,
    Rank,
    Semaphore,
    SwitchChannel,
    SyncType,
)
from mscclang.compiler import insert_hazard_syncs, insert_syncs
from mscclang.compiler.ir import Access, conflicts
from mscclang.plan.models import BufferKind


def nm(ops):
    return [o.name.value for o in ops]


def synced(p, rank=0, tb=0):
    return insert_syncs(p.ir).ranks[rank].tbs[tb]


def hazards(p, rank=0, tb=0):
    return insert_hazard_syncs(p.ir).ranks[rank].tbs[tb]


def inp(r):
    return Rank(r).get_input_buffer()


def out(r):
    return Rank(r).get_output_buffer()


def prog(**kw):
    return CollectiveProgram("s", AllReduce(2, 2, False), 2, **kw)


@pytest.mark.parametrize("ds, expect", [
    (SyncType.none, ["signal"]),
    (SyncType.before, ["nop", "signal"]),
    (SyncType.after, ["signal", "nop"]),
    (SyncType.both, ["nop", "signal", "nop"]),
])
def test_data_sync_flags(ds, expect):
    with prog() as p:
        MemoryChannel(1, 0).signal(0, data_sync=ds)
    assert nm(synced(p)) == expect


def test_adjacent_syncs_share_one_nop_and_barriers_absorb_nops():
    with prog() as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        a.signal(0)
        a.wait(0)
        Rank(0).barrier([0, 1])
        s = Semaphore(0, 1)
        s.acquire(0)
        Rank(0).copy(out(0)[0:1], inp(0)[0:1], tb=0)
        s.release(0, data_sync=SyncType.before)
    assert nm(synced(p)) == ["nop", "signal", "nop", "wait", "barrier", "sem_acquire", "nop", "copy", "nop",
                             "sem_release"]


def test_sync_inside_pipeline_body():
    from mscclang import LoopIterationContext

    with prog() as p:
        a = MemoryChannel(1, 0)
        with LoopIterationContext(4096, 2):
            a.put(out(1)[0:2], inp(0)[0:2], tb=0)
            a.signal(0, data_sync=SyncType.before)
    ops = synced(p)
    assert nm(ops) == ["pipeline"] and nm(ops[0].body) == ["put", "nop", "signal"]


# ---------------------------------------------------------------- hazards


def test_read_after_write_gets_nop_read_after_read_does_not():
    with prog() as p:
        r = Rank(0)
        r.copy(out(0)[0:1], inp(0)[0:1], tb=0)
        r.copy(out(0)[1:2], inp(0)[0:1], tb=0)  # both read in[0]: fine
        r.copy(inp(0)[1:2], out(0)[0:1], tb=0)  # reads out[0] written by op 0: RAW
        r.copy(out(0)[1:2], inp(0)[3:4], tb=0)  # writes out[1] (written before the nop? no: after)
    assert nm(hazards(p)) == ["copy", "copy", "nop", "copy", "copy"]


def test_write_after_read_and_write_after_write():
    with prog() as p:
        r = Rank(0)
        r.copy(out(0)[0:2], inp(0)[0:2], tb=0)
        r.copy(inp(0)[1:2], out(0)[3:4], tb=0)  # writes in[1], which op 0 read: WAR
        r.copy(inp(0)[1:2], out(0)[2:3], tb=1)
        r.copy(inp(0)[1:2], out(0)[3:4], tb=1)  # WAW
    assert nm(hazards(p)) == ["copy", "nop", "copy"]
    assert nm(hazards(p, tb=1)) == ["copy", "nop", "copy"]


def test_nop_and_barrier_clear_the_ranges():
    with prog() as p:
        r = Rank(0)
        r.copy(out(0)[0:1], inp(0)[0:1], tb=0)
        r.barrier([0])
        r.copy(inp(0)[0:1], out(0)[0:1], tb=0)
    assert nm(hazards(p)) == ["copy", "nop", "copy"]


def test_remote_ranges_are_tracked():
    with prog() as p:
        a = MemoryChannel(1, 0)
        a.put(out(1)[0:2], inp(0)[0:2], tb=0)
        a.reduce(inp(0)[3:4], [out(1)[1:2]], tb=0)  # reads the peer's bytes just written
        a.put(out(1)[2:3], inp(0)[2:3], tb=1)
        a.put(out(1)[3:4], inp(0)[2:3], tb=1)  # disjoint: no nop
    assert nm(hazards(p)) == ["put", "nop", "rre"]
    assert nm(hazards(p, tb=1)) == ["put", "put"]


def test_packet_rule():
    with prog() as p:
        r = Rank(0)
        s = Buffer(0, 4)
        # packet write -> packet read of the same slot: flags order it, no nop
        r.copy_packets(s[0:1], inp(0)[0:1], tb=0)
        r.unpack_packets(out(0)[0:1], s[0:1], tb=0)
        # packet read -> packet write of the same slot: nop
        r.copy_packets(s[0:1], inp(0)[1:2], tb=0)
        # packet write -> packet write of the same slot: nop
        r.copy_packets(s[1:2], inp(0)[2:3], tb=1)
        r.copy_packets(s[1:2], inp(0)[3:4], tb=1)
        # plain write of scratch chunk 2 overlaps packet slot 1 (bytes 2C..4C): nop
        r.copy_packets(s[1:2], inp(0)[0:1], tb=2)
        r.copy(s[2:3], inp(0)[0:1], tb=2)
        # plain chunk 1 and packet slot 1 do not overlap (packet slot 1 = plain units 2..3)
        r.copy(s[1:2], inp(0)[0:1], tb=3)
        r.copy_packets(s[1:2], inp(0)[1:2], tb=3)
    assert nm(hazards(p)) == ["cpkt", "upkt", "nop", "cpkt"]
    assert nm(hazards(p, tb=1)) == ["cpkt", "nop", "cpkt"]
    assert nm(hazards(p, tb=2)) == ["cpkt", "nop", "copy"]
    assert nm(hazards(p, tb=3)) == ["copy", "cpkt"]


def test_conflicts_table():
    def acc(write, packet, start=0, end=2):
        return Access(("L", BufferKind.scratch), start, end, write, packet)

    assert not conflicts(acc(False, False), acc(False, False))
    assert conflicts(acc(True, False), acc(False, False))
    assert conflicts(acc(False, False), acc(True, False))
    assert not conflicts(acc(True, True), acc(False, True))
    assert conflicts(acc(False, True), acc(True, True))
    assert conflicts(acc(True, True), acc(True, True))
    assert conflicts(acc(True, True), acc(False, False))
    assert not conflicts(acc(True, False, 0, 2), acc(True, False, 2, 4))


def test_switch_ranges_are_tracked():
    with prog() as p:
        sw = SwitchChannel([0, 1], BufferType.input)
        Rank(0).copy(inp(0)[0:1], out(0)[0:1], tb=0)
        sw.at_rank(0).broadcast(inp(0)[1:2], 0, 1, tb=0)  # stores into in[0] of every member
    assert nm(hazards(p)) == ["copy", "nop", "gstore"]


def test_auto_sync_false_skips_hazards():
    with prog(auto_sync=False) as p:
        r = Rank(0)
        r.copy(out(0)[0:1], inp(0)[0:1], tb=0)
        r.copy(inp(0)[1:2], out(0)[0:1], tb=0)
    assert [o.name.value for o in p.to_plan().gpus[0].threadblocks[0].ops] == ["copy", "copy"]
    with prog() as p:
        r = Rank(0)
        r.copy(out(0)[0:1], inp(0)[0:1], tb=0)
        r.copy(inp(0)[1:2], out(0)[0:1], tb=0)
    assert [o.name.value for o in p.to_plan().gpus[0].threadblocks[0].ops] == ["copy", "nop", "copy"]


# in-place collectives: input and output are one memory --------------------------------------
def _inplace(collective, ops):
    """A program over ``collective`` whose rank-0 block 0 runs ``ops(p)``; hazard ops of it."""
    with CollectiveProgram("alias", collective, 2) as p:
        ops(p)
    return nm(hazards(p))


def test_inplace_allreduce_input_and_output_chunks_are_the_same_bytes():
    from mscclang import AllReduce as AR

    def body(p):
        Rank(0).copy(out(0)[1:2], inp(0)[0:1], tb=0)   # writes output chunk 1 ...
        Rank(0).copy(out(0)[3:4], inp(0)[1:2], tb=0)   # ... which is input chunk 1: read-after-write

    assert _inplace(AR(2, 2, True), body) == ["copy", "nop", "copy"]
    assert _inplace(AR(2, 2, False), body) == ["copy", "copy"]     # distinct buffers


def test_inplace_allgather_input_is_this_ranks_block_of_the_output():
    from mscclang import AllGather

    def reads_own_block(p):
        # rank 0's input chunk 0 is its output chunk 0 (rank 0's block); output chunk 1 is rank 1's
        Rank(0).copy(out(0)[0:1], Buffer(0, 1)[0:1], tb=0)
        Rank(0).copy(out(0)[1:2], inp(0)[0:1], tb=0)

    assert _inplace(AllGather(2, 1, True), reads_own_block) == ["copy", "nop", "copy"]

    def other_block(p):
        Rank(0).copy(out(0)[1:2], Buffer(0, 1)[0:1], tb=0)   # rank 1's block: not the input
        Rank(0).copy(Buffer(0, 1)[0:1], inp(0)[0:1], tb=0)

    assert _inplace(AllGather(2, 1, True), other_block) == ["copy", "copy"]


def test_inplace_reducescatter_output_is_inside_the_input():
    from mscclang import ReduceScatter

    def body(p):
        Rank(0).copy(out(0)[0:1], inp(0)[1:2], tb=0)    # output 0 == input 0 on rank 0
        Rank(0).copy(Buffer(0, 1)[0:1], inp(0)[0:1], tb=0)  # reads input 0: after the write above

    assert _inplace(ReduceScatter(2, 1, True), body) == ["copy", "nop", "copy"]
    assert _inplace(ReduceScatter(2, 1, False), body) == ["copy", "copy"]


def test_inplace_alias_of_a_peer_buffer():
    from mscclang import AllGather

    def body(p):
        ch = MemoryChannel(1, 0)
        ch.put(out(1)[1:2], inp(0)[0:1], tb=0)     # rank 1's output chunk 1 is its input chunk 0
        ch.get(Buffer(0, 1)[0:1], inp(1)[0:1], tb=0)  # ... read back through the input alias

    assert _inplace(AllGather(2, 1, True), body) == ["put", "nop", "get"]
    assert _inplace(AllGather(2, 1, False), body) == ["put", "get"]
