"""Hazard nops across pipeline iterations (compiler pass 4, :mod:`mscclang.compiler.slices`).

Iteration ``j`` of a pipeline runs every inner op over byte slice ``j`` of its own stream, with
no ``nop`` between iterations. An op late in the body (after its last ``nop``) and an op early in
the body (before its first ``nop``) of the next iteration are therefore unordered; they touch
disjoint bytes only when they are pipelined the same way. The simulator is the judge: a plan
without the cross-iteration ``nop`` races at a size where the slices meet, the compiled one does
not.
"""

from __future__ import annotations

import numpy as np
import pytest

from mscclang import (
    AllGather,
    AllReduce,
    Buffer,
    CollectiveProgram,
    LoopIterationContext,
    Rank,
)
from mscclang.compiler import insert_hazard_syncs
from mscclang.compiler.ir import Access
from mscclang.compiler.slices import ChunkClasses, StreamAccess, chunk_classes, same_slices
from mscclang.dsl import TestCollective
from mscclang.plan.io import plan_from_dict, plan_to_dict
from mscclang.plan.models import BufferKind
from mscclang.sim.engine import Simulation
from mscclang.sim.program import sim_program


def body_names(plan, rank=0, tb=0):
    return [o.name.value for o in plan.gpus[rank].threadblocks[tb].ops[0].ops]


def races(plan, in_bytes: int, out_bytes: int, launches: int = 1) -> list[str]:
    """Race reports of a round-robin and a random run (outputs are not checked)."""
    prog = sim_program(plan, in_bytes, out_bytes)
    rng = np.random.default_rng(0)
    found = []
    for sched in ("round_robin", "random"):
        ins = [rng.integers(0, 256, in_bytes, dtype=np.uint8) for _ in plan.gpus]
        sim = Simulation(prog, ins, dtype=np.float16, launches=launches, schedule=sched, seed=1)
        sim.run()
        found += [p.message for p in sim.problems if p.kind == "race"]
    return found


def without_first_nop(plan):
    """The plan with the first nop of rank 0 block 0's pipeline body removed."""
    d = plan_to_dict(plan)
    body = d["gpus"][0]["threadblocks"][0]["ops"][0]["ops"]
    k = next(i for i, o in enumerate(body) if o["name"] == "nop")
    del body[k]
    return plan_from_dict(d)


def slot_late_read_early():
    """Rank 0's body reads scratch slots 0-1 early and writes slot 1 alone late. With 96-byte
    chunks and a 64-byte unit, the write of iteration 0 covers slot 1's bytes [96, 160), which
    the read covers in iterations 1 and 2, with its threads split differently (slice positions
    32.. of one, 0.. of the other)."""
    with CollectiveProgram("xiter", TestCollective(1, 2, 2), 1) as p:
        r = Rank(0)
        s = Buffer(0, 2)
        i, o = r.get_input_buffer(), r.get_output_buffer()
        with LoopIterationContext(64, 1):
            r.copy(o[0:2], s[0:2], tb=0)   # early: reads slots 0-1
            r.copy(s[1:2], i[1:2], tb=0)   # late: writes slot 1
    return p.to_plan()


def test_write_late_read_early_in_the_next_iteration_gets_a_nop():
    plan = slot_late_read_early()
    # within one iteration: read s[0:2] then write s[1:2] (nop between); across iterations the
    # write of iteration j and the read of j+1 need the nop before the read
    assert body_names(plan) == ["nop", "copy", "nop", "copy"]
    assert races(plan, 192, 192) == []
    # the simulator agrees that the nop is needed: without it the write races with the read
    bad = races(without_first_nop(plan), 192, 192)
    assert any("op 0.2 copy (launch 1) writes" in m and "op 0.0 copy (launch 1) reads" in m
               and "rank0.scr" in m for m in bad), bad
    # and at a size where the chunk is a multiple of the unit the slices never meet
    assert races(without_first_nop(plan), 256, 256) == []


def test_same_way_pipelined_ranges_get_no_extra_nop():
    """Copy into a scratch range, then out of it: every iteration touches its own slice of the
    same ranges (the input and output grids are the same), so no cross-iteration nop, at any
    size (odd sizes clip the streams the same way)."""
    with CollectiveProgram("same", AllReduce(2, 2, False), 2) as p:
        for r in range(2):
            rk = Rank(r)
            s = Buffer(r, 4)
            with LoopIterationContext(48, 1):
                rk.copy(s[0:4], rk.get_input_buffer()[0:4], tb=0)
                rk.copy(rk.get_output_buffer()[0:4], s[0:4], tb=0)
    plan = p.to_plan()
    assert body_names(plan) == ["copy", "nop", "copy"]
    for size in (64, 208, 388, 2048):
        assert races(plan, size, size, launches=2) == [], size


def clipped_differently():
    """Allgather, 2 ranks, 2 chunks per rank: with 24-byte inputs chunk 0 of every block is 16
    bytes and chunk 1 is 8. Rank 0 copies slots 0-1 out to output chunks 0-1 (stream lengths 16,
    8) early, and refills them from output chunks 1-2 (lengths 8, 16) late: the same scratch
    range, clipped differently, so with a 16-byte unit slot 1's first bytes are in iteration 0 of
    the write and iteration 1 of the read."""
    with CollectiveProgram("clip", AllGather(2, 2, False), 2) as p:
        r = Rank(0)
        s = Buffer(0, 2)
        o = r.get_output_buffer()
        with LoopIterationContext(16, 1):
            r.copy(o[0:2], s[0:2], tb=0)
            r.copy(s[0:2], o[1:3], tb=0)
    return p.to_plan()


def test_ranges_clipped_differently_are_not_pipelined_the_same_way():
    plan = clipped_differently()
    assert body_names(plan) == ["nop", "copy", "nop", "copy"]
    assert races(plan, 24, 48) == []
    bad = races(without_first_nop(plan), 24, 48)
    assert any("op 0.2 copy (launch 1) writes" in m and "op 0.0 copy (launch 1) reads" in m
               and "rank0.scr" in m for m in bad), bad


def test_plain_and_packet_views_of_one_slot_across_iterations():
    with CollectiveProgram("pk", TestCollective(1, 2, 2), 1, protocol="LL") as p:
        r = Rank(0)
        s = Buffer(0, 2)
        i, o = r.get_input_buffer(), r.get_output_buffer()
        with LoopIterationContext(32, 1):
            r.unpack_packets(o[0:1], s[0:1], tb=0)   # packet read of slot 0 (plain units 0-1)
            r.copy(s[1:2], i[0:1], tb=0)             # plain write of plain chunk 1: same bytes
    plan = p.to_plan()
    assert body_names(plan) == ["nop", "upkt", "nop", "copy"]


def test_barrier_or_nop_between_tail_and_head_needs_nothing_more():
    with CollectiveProgram("sep", TestCollective(1, 2, 2), 1) as p:
        r = Rank(0)
        s = Buffer(0, 2)
        i, o = r.get_input_buffer(), r.get_output_buffer()
        with LoopIterationContext(64, 1):
            r.copy(s[1:2], i[1:2], tb=0)   # early write of slot 1
            r.copy(o[0:2], s[0:2], tb=0)   # late read of slots 0-1: WAR into the next iteration
            r.copy(o[0:1], i[0:1], tb=0)   # writes o[0], which the late read wrote: nop before it
    plan = p.to_plan()
    # within an iteration: a nop before op 1 (RAW on s[1]) and before op 2 (WAW on o[0]). Across:
    # only op 2 (after the last nop) meets op 0 (before the first) of the next iteration, and
    # they share no bytes; the read of s[0:2] and the next write of s[1] have a nop between them
    assert body_names(plan) == ["copy", "nop", "copy", "nop", "copy"]
    assert races(plan, 192, 192) == []


def test_cross_iteration_pass_is_in_the_driver_and_off_with_auto_sync():
    with CollectiveProgram("off", TestCollective(1, 2, 2), 1, auto_sync=False) as p:
        r = Rank(0)
        s = Buffer(0, 2)
        i, o = r.get_input_buffer(), r.get_output_buffer()
        with LoopIterationContext(64, 1):
            r.copy(o[0:2], s[0:2], tb=0)
            r.copy(s[1:2], i[1:2], tb=0)
    assert body_names(p.to_plan()) == ["copy", "copy"]
    tbs = insert_hazard_syncs(p.ir).ranks[0].tbs[0]
    assert [o.name.value for o in tbs[0].body] == ["nop", "copy", "nop", "copy"]
    assert "across pipeline iterations" in tbs[0].body[0].origin


# ------------------------------------------------------------------------------- the rule itself
def _sa(start, end, lengths, packet=False, write=False):
    return StreamAccess(Access(("L", BufferKind.scratch), start, end, write, packet), tuple(lengths))


def test_same_slices_rule():
    a, b = frozenset({("block", 0)}), frozenset({("block", 1)})
    assert same_slices(_sa(0, 2, [a, b]), _sa(0, 2, [a, b]))
    assert not same_slices(_sa(0, 2, [a, b]), _sa(1, 2, [b]))            # another first chunk
    assert not same_slices(_sa(0, 2, [a, b]), _sa(0, 2, [b, b]))         # clipped differently
    assert same_slices(_sa(0, 2, [a, a]), _sa(0, 2, [a, b]))             # only the last differs
    assert not same_slices(_sa(0, 2, [a]), _sa(0, 2, [b], packet=True))  # plain vs packet view
    # packet views: the last chunk's length decides where slot padding is written
    assert not same_slices(_sa(0, 2, [a], packet=True), _sa(0, 2, [frozenset()], packet=True))
    assert same_slices(_sa(0, 2, [frozenset()], packet=True), _sa(0, 2, [frozenset()], packet=True))


@pytest.mark.parametrize("coll, n, chunks, expect", [
    (AllGather(2, 2, False), 2, (2, 4), (2, {BufferKind.input, BufferKind.output})),
    (AllReduce(2, 2, False), 2, (4, 4), (4, {BufferKind.input, BufferKind.output})),
    (TestCollective(1, 2, 4), 1, (2, 4), (2, {BufferKind.input})),
])
def test_chunk_classes(coll, n, chunks, expect):
    with CollectiveProgram("c", coll, n) as p:
        Rank(0).copy(Rank(0).get_output_buffer()[0:1], Rank(0).get_input_buffer()[0:1], tb=0)
    assert (p.ir.ranks[0].input_chunks, p.ir.ranks[0].output_chunks) == chunks
    cc = chunk_classes(p.ir, 0)
    assert (cc.block_chunks, set(cc.periodic)) == expect
    assert isinstance(cc, ChunkClasses)
    if BufferKind.output in cc.periodic:
        assert cc.of(BufferKind.output, expect[0]) == cc.of(BufferKind.input, 0)
    else:
        assert cc.of(BufferKind.output, 0) != cc.of(BufferKind.input, 0)
