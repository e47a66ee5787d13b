"""Pass 5 (replication) and the dependency graph / cycle check."""

from __future__ import annotations

import re

import pytest

from mscclang import (
    AllGather,
    AllReduce,
    CollectiveProgram,
    CompileError,
    MemoryChannel,
    Rank,
    ReplicationPolicy,
    Semaphore,
)
from mscclang.compiler import build_graph, replicate, validate
from mscclang.plan.check import validate_plan


def allgather(n, instances, policy=ReplicationPolicy.interleaved):
    with CollectiveProgram("ag", AllGather(n, 1, False), n, instances=instances, replication_policy=policy) as p:
        for r in range(n):
            for q in range(n):
                if q != r:
                    ch = MemoryChannel(q, r)
                    tb = q if q < r else q - 1
                    ch.put(Rank(q).get_output_buffer()[r:r + 1], Rank(r).get_input_buffer()[0:1], tb)
                    ch.signal(tb)
                    ch.wait(tb)
            Rank(r).copy(Rank(r).get_output_buffer()[r:r + 1], Rank(r).get_input_buffer()[0:1], tb=n - 1)
    return p


@pytest.mark.parametrize("k", [1, 2, 3])
def test_interleaved_counts_never_k_squared(k):
    p = allgather(3, k)
    plan = p.to_plan()
    plan2 = p.to_plan()
    g = plan.gpus[0]
    assert len(g.threadblocks) == 3 * k
    assert (g.input_chunks, g.output_chunks) == (k, 3 * k)
    assert g.channels[0].connected_to == [p for p in (1, 2) for _ in range(k)]
    assert plan.chunk_factor == k
    assert plan == plan2
    validate_plan(plan)


def test_interleaved_mapping_of_blocks_channels_chunks():
    plan = allgather(2, 2).to_plan()
    tbs = plan.gpus[1].threadblocks
    # tb 0 of rank 1 (put to rank 0 of out chunk 1) -> tbs 0 and 1, chunks 1*2+0 and 1*2+1
    puts = [tb.ops[0] for tb in tbs[:2]]
    assert [op.dst_buff[0].index for op in puts] == [2, 3]
    assert [op.src_buff[0].index for op in puts] == [0, 1]
    assert [tb.channel_list(puts[0].channel_type) for tb in tbs[:2]] == [[0], [1]]


def test_replicating_twice_is_an_error():
    ir = validate(allgather(2, 2).ir)
    once = replicate(ir)
    with pytest.raises(CompileError, match="already replicated"):
        replicate(once)


def test_none_policy_keeps_rank_blocks_contiguous():
    plan = allgather(2, 2, ReplicationPolicy.none).to_plan()
    tbs = plan.gpus[1].threadblocks
    # rank 1's data goes to block 1 of rank 0's output = chunks 2..3 (instance 0 -> 2, 1 -> 3)
    puts = [tb.ops[0] for tb in tbs[:2]]
    assert [op.dst_buff[0].index for op in puts] == [2, 3]
    # the local copy into out block 1 of rank 1, instances 0 and 1
    copies = [tb.ops[0] for tb in tbs[2:4]]
    assert [op.dst_buff[0].index for op in copies] == [2, 3]
    validate_plan(plan)


def test_none_policy_on_allreduce_shifts_whole_buffer():
    with CollectiveProgram("ar", AllReduce(2, 1, False), 2, instances=3,
                           replication_policy=ReplicationPolicy.none) as p:
        Rank(0).copy(Rank(0).get_output_buffer()[1:2], Rank(0).get_input_buffer()[1:2], tb=0)
    tbs = p.to_plan().gpus[0].threadblocks
    assert [tb.ops[0].dst_buff[0].index for tb in tbs] == [1, 3, 5]


def test_none_policy_rejects_block_crossing_reference():
    with CollectiveProgram("ag", AllGather(2, 1, False), 2, instances=2,
                           replication_policy=ReplicationPolicy.none) as p:
        Rank(0).copy(Rank(0).get_output_buffer()[0:2], Rank(0).get_output_buffer()[0:2], tb=0)
    with pytest.raises(CompileError, match=r"rank 0, tb 0, op 0 .*crosses a block boundary"):
        p.to_plan()


def test_semaphores_and_barriers_replicated():
    with CollectiveProgram("sb", AllReduce(2, 1, False), 2, instances=2) as p:
        s = Semaphore(0, 1)
        s.acquire(0)
        s.release(0)
        Rank(0).barrier([0, 1])
    g = p.to_plan().gpus[0]
    assert [x.init_value for x in g.semaphores] == [1, 1]
    bars = [[(op.barrier_id, op.barrier_tbs) for op in tb.ops if op.barrier_id is not None] for tb in g.threadblocks]
    assert bars == [[(0, [0, 2])], [(1, [1, 3])], [(0, [0, 2])], [(1, [1, 3])]]
    sems = [op.semaphore_ids for op in g.threadblocks[1].ops if op.semaphore_ids]
    assert sems == [[1], [1]]


# ---------------------------------------------------------------- dependency graph


def test_graph_has_signal_wait_edges():
    ir = validate(allgather(2, 1).ir)
    g = build_graph(ir)
    # rank 0 tb 0: put, signal, wait ; rank 1 tb 0 likewise
    assert g.has_edge((0, 0, 1), (1, 0, 2))
    assert g.has_edge((1, 0, 1), (0, 0, 2))


def test_wait_before_signal_cycle_named():
    with CollectiveProgram("dl", AllReduce(2, 1, False), 2) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        a.wait(0)
        a.signal(0)
        b.wait(0)
        b.signal(0)
    with pytest.raises(CompileError, match=r"dependency cycle .*rank [01] tb 0 op \d \((wait|signal), "
                                             r"test_compiler_replicate\.py:\d+\)"):
        p.to_plan()


def test_barrier_cycle():
    with CollectiveProgram("dl", AllReduce(2, 1, False), 2) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        # rank 0: tb 1 waits for rank 1 before the barrier; rank 1 only signals after its tb 0
        # passed a barrier with tb 1, which itself waits for rank 0's tb 0 after rank 0's barrier
        a.wait(1)
        Rank(0).barrier([0, 1])
        a.signal(0)
        b.wait(1)
        Rank(1).barrier([0, 1])
        b.signal(0)
    with pytest.raises(CompileError, match=r"barrier"):
        p.to_plan()


def test_packet_read_before_own_write_is_a_cycle():
    from mscclang import Buffer

    with CollectiveProgram("dl", AllReduce(2, 1, False), 2) as p:
        s = Buffer(0, 1)
        Rank(0).unpack_packets(Rank(0).get_output_buffer()[0:1], s[0:1], tb=0)
        Rank(0).copy_packets(s[0:1], Rank(0).get_input_buffer()[0:1], tb=0)
    with pytest.raises(CompileError, match=r"rank 0 tb 0 op \d \((upkt|cpkt), test_compiler_replicate\.py:\d+\)"):
        p.to_plan()


def test_semaphore_cycle():
    with CollectiveProgram("dl", AllReduce(2, 1, False), 2) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        s = Semaphore(0, 0)
        s.release(1)
        s.acquire(0)
        a.signal(0)
        b.wait(0)
        b.signal(0)
        a.wait(1)
        # rank 0 tb 1 released before waiting: fine so far; now make tb 1 wait first
    p.to_plan()
    with CollectiveProgram("dl", AllReduce(2, 1, False), 2) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        s = Semaphore(0, 0)
        a.wait(1)
        s.release(1)
        s.acquire(0)
        a.signal(0)
        b.wait(0)
        b.signal(0)
    with pytest.raises(CompileError, match=r"sem_acquire|sem_release"):
        p.to_plan()


# ---------------------------------------------------------------- interleaved-replication trap
# (mscclpp-notes section 10 item 35)


def _staged(instances, policy=ReplicationPolicy.interleaved, split_read=True, inplace=False):
    """Rank 0 stages its input in scratch with one 2-chunk copy, then copies the scratch out
    chunk by chunk (``split_read``) or with one 2-chunk copy; rank 1 copies its input out."""
    from mscclang import Buffer, TestCollective

    with CollectiveProgram("trap", TestCollective(2, 2, 2), 2, instances=instances,
                           replication_policy=policy) as p:
        s = Buffer(0, 2)
        r0 = Rank(0)
        r0.copy(s[0:2], r0.get_input_buffer()[0:2], tb=0)
        if split_read:
            r0.copy(r0.get_output_buffer()[0:1], s[0:1], tb=0)
            r0.copy(r0.get_output_buffer()[1:2], s[1:2], tb=0)
        else:
            r0.copy(r0.get_output_buffer()[0:2], s[0:2], tb=0)
        Rank(1).copy(Rank(1).get_output_buffer()[0:2], Rank(1).get_input_buffer()[0:2], tb=0)
    return p


def test_interleaved_trap_is_a_dsl_error_naming_both_ops():
    from mscclang import DSLError

    p = _staged(2)
    with pytest.raises(DSLError) as e:
        p.to_plan()
    msg = str(e.value)
    assert "instances=2" in msg and "interleaved" in msg
    assert "rank 0's scratch buffer" in msg and "[0:2]" in msg and "[0:1]" in msg
    # each op named with its DSL call and the program line that made it
    assert re.search(r"rank 0, tb 0, op 0 \(Rank\(0\)\.copy\(tb=0\), test_compiler_replicate\.py:\d+\) "
                     r"writes scratch\[0:2\]", msg), msg
    assert re.search(r"rank 0, tb 0, op 1 \(Rank\(0\)\.copy\(tb=0\), test_compiler_replicate\.py:\d+\) "
                     r"reads scratch\[0:1\]", msg), msg


def test_interleaved_trap_only_with_instances_and_interleaving():
    for p in (_staged(1), _staged(2, ReplicationPolicy.none), _staged(3, split_read=False)):
        validate_plan(p.to_plan())


def test_interleaved_trap_is_real_in_the_simulator():
    """What the error prevents: replicated anyway (passes run by hand, skipping validation),
    instance 0's block reads scratch chunk 2, which instance 1's block writes, with no order."""
    from mscclang.compiler import emit, fuse, insert_hazard_syncs, insert_syncs
    from mscclang.sim import verify

    ir = _staged(2).ir
    plan = emit(replicate(insert_hazard_syncs(insert_syncs(fuse(ir)))))
    rep = verify(plan, schedules=3, symbolic=False)
    races = [pr.message for pr in rep.problems if pr.kind == "race"]
    assert any("rank 0 tb 0" in m and "rank 0 tb 1" in m and "rank0.scr" in m for m in races), str(rep)
    # identical ranges everywhere: the same passes give a race-free plan
    ok = emit(replicate(insert_hazard_syncs(insert_syncs(fuse(_staged(2, split_read=False).ir)))))
    assert verify(ok, schedules=3, symbolic=False).passed()


def test_interleaved_read_only_sharing_and_ll_packets_are_allowed():
    """Two ops that only read the shared chunks, and LL packets written as one range and read as
    single chunks (the one-shot LL allreduce of MSCCL++'s examples), stay legal: flags order
    packet reads after their writes whichever block wrote them."""
    from mscclang import Buffer
    from mscclang.sim import verify

    n = 2
    with CollectiveProgram("ll", AllReduce(n, 1, False), n, instances=2, protocol="LL",
                           use_double_scratch_buffer=True) as p:
        scratch = [Buffer(r, n) for r in range(n)]
        for r in range(n):
            q = 1 - r
            MemoryChannel(q, r).put_packets(scratch[q][0:n], Rank(r).get_input_buffer()[0:n], tb=0)
        for r in range(n):
            for c in range(n):
                Rank(r).reduce(Rank(r).get_input_buffer()[c:c + 1], [scratch[r][c:c + 1]], tb=c,
                               dst_chunk=Rank(r).get_output_buffer()[c:c + 1], packet=True)
    plan = p.to_plan()
    assert verify(plan, schedules=3).passed()


def test_interleaved_trap_through_a_peer_and_an_inplace_alias():
    """A put writes two chunks of the peer's output; the peer reads them as one chunk of its
    *input* (the same bytes in an in-place allreduce)."""
    from mscclang import Buffer, DSLError, SyncType

    with CollectiveProgram("trap", AllReduce(2, 1, True), 2, instances=2) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        a.put(Rank(1).get_output_buffer()[0:2], Rank(0).get_input_buffer()[0:2], tb=0)
        a.signal(0, data_sync=SyncType.before)
        b.wait(0, data_sync=SyncType.after)
        Rank(1).copy(Buffer(1, 1)[0:1], Rank(1).get_input_buffer()[1:2], tb=0)
    with pytest.raises(DSLError, match=r"rank 1's output buffer .*\[0:2\] and \[1:2\].*rank 0, tb 0, op 0 "
                                       r"\(MemoryChannel\(dst=1, src=0\)\.put\(tb=0\), [\w.]+:\d+\) writes remote rank 1 "
                                       r"output\[0:2\].*rank 1, tb 0, op 1 \(Rank\(1\)\.copy\(tb=0\), [\w.]+:\d+\) "
                                       r"reads input\[1:2\]"):
        p.to_plan()


# ---------------------------------------------------------------- signal -> wait across blocks


def _split_cycle(broken: bool):
    """Rank 0 signals rank 1 twice, from tb 1 and from tb 0; rank 1's tb 0 waits twice, then
    signals back, and rank 0's tb 0 waits for that. Broken: rank 0's tb 0 waits *before* its
    signal, so rank 1's second wait can never be satisfied."""
    with CollectiveProgram("split", AllReduce(2, 1, False), 2) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)   # rank 0's end, rank 1's end
        a.signal(1)
        if broken:
            a.wait(0)
            a.signal(0)
        else:
            a.signal(0)
            a.wait(0)
        b.wait(0)
        b.wait(0)
        b.signal(0)
    return p


def test_cross_block_signals_pair_with_waits():
    ir = validate(_split_cycle(broken=False).ir)
    g = build_graph(ir)
    # rank 1 tb 0's second wait needs both signals: one from each of rank 0's blocks
    r1 = [n for n in g.nodes if n[:2] == (1, 0) and re.search(r"\(wait, [\w.]+:\d+\)$", g.nodes[n]["label"])]
    second = sorted(r1)[1]
    preds = {u for u, _ in g.in_edges(second)}
    assert (0, 1, 0) in preds and (0, 0, 0) in preds
    _split_cycle(broken=False).to_plan()   # acyclic


def test_cross_rank_cycle_split_over_blocks_is_reported():
    with pytest.raises(CompileError) as e:
        _split_cycle(broken=True).to_plan()
    msg = str(e.value)
    assert "dependency cycle" in msg
    assert "rank 0 tb 0" in msg and "rank 1 tb 0" in msg
    assert re.search(r"\(signal, test_compiler_replicate\.py:\d+\)", msg)
    assert re.search(r"\(wait, test_compiler_replicate\.py:\d+\)", msg)


def test_cross_block_waits_use_a_lower_bound():
    """Waits spread over two blocks: each block's first wait needs only one signal, so two
    signals from one block followed by a wait on a second channel never form a false cycle."""
    with CollectiveProgram("spread", AllReduce(2, 1, False), 2) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        a.signal(0)
        a.signal(0)
        a.wait(0)
        b.wait(0)     # rank 1 tb 0
        b.signal(0)
        b.wait(1)     # rank 1 tb 1
    p.to_plan()
    g = build_graph(validate(p.ir))
    # each block's first wait follows rank 0's first signal only
    assert g.has_edge((0, 0, 0), (1, 0, 0)) and g.has_edge((0, 0, 0), (1, 1, 0))
    assert not g.has_edge((0, 0, 1), (1, 0, 0)) and not g.has_edge((0, 0, 1), (1, 1, 0))
