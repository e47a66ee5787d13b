"""DSL surface: names and signatures, recording, DSL errors, determinism, no state leaks."""

from __future__ import annotations

import inspect
import json

import pytest

import mscclang
import mscclang.dsl as dsl
from mscclang import (
    JSON,
    AlgoSpec,
    AllGather,
    AllReduce,
    AllToAll,
    Broadcast,
    Buffer,
    BufferType,
    CollectiveProgram,
    DSLError,
    LoopIterationContext,
    MemoryChannel,
    PortChannel,
    Rank,
    ReduceOperationType,
    ReduceScatter,
    ReplicationPolicy,
    Semaphore,
    SendRecv,
    SwitchChannel,
    SyncType,
    TestCollective,
    ThreadBlockGroup,
)
from mscclang.plan import load_plan
from mscclang.plan.check import validate_plan
from mscclang.plan.models import OpName


def names(plan, rank=0, tb=0):
    return [op.name.value for op in plan.gpus[rank].threadblocks[tb].ops]


def handshake_allgather(n=2, **kw):
    """A Simple allgather with a ready handshake, put, then publish."""
    with CollectiveProgram("ag", AllGather(n, 1, True), n, **kw) as prog:
        for r in range(n):
            for p in range(n):
                if p == r:
                    continue
                ch = MemoryChannel(p, r)
                tb = p if p < r else p - 1
                ch.signal(tb, data_sync=SyncType.none, relaxed=True)
                ch.wait(tb, data_sync=SyncType.after, relaxed=True)
                ch.put(Rank(p).get_output_buffer()[r:r + 1], Rank(r).get_output_buffer()[r:r + 1], tb)
                ch.signal(tb, data_sync=SyncType.before)
                ch.wait(tb, data_sync=SyncType.after)
    return prog


# ---------------------------------------------------------------- names and signatures


def test_star_import_gives_every_dsl_name():
    ns: dict = {}
    exec("from mscclang import *", ns)
    for name in dsl.__all__:
        assert name in ns, name
    assert set(dsl.__all__) <= set(mscclang.__all__)


@pytest.mark.parametrize("module, names_", [
    ("program", ["CollectiveProgram"]),
    ("collectives", ["AllGather", "AllReduce", "ReduceScatter", "AllToAll", "SendRecv", "TestCollective", "Broadcast"]),
    ("rank", ["Rank", "Buffer", "BaseBuffer", "Semaphore"]),
    ("channel", ["MemoryChannel", "PortChannel", "SwitchChannel"]),
    ("general", ["JSON"]),
    ("loop", ["LoopIterationContext"]),
    ("thread_block_group", ["ThreadBlockGroup"]),
    ("utils", ["AlgoSpec", "ReplicationPolicy"]),
])
def test_module_layout_mirrors_mscclpp(module, names_):
    import importlib

    mod = importlib.import_module(f"mscclang.dsl.{module}")
    for n in names_:
        assert hasattr(mod, n), f"mscclang.dsl.{module}.{n}"


def test_program_signature_and_defaults():
    sig = inspect.signature(CollectiveProgram.__init__)
    defaults = {k: v.default for k, v in sig.parameters.items() if v.default is not inspect.Parameter.empty}
    assert defaults == dict(instances=1, protocol="Simple", instr_fusion=True, auto_sync=True,
                            replication_policy=ReplicationPolicy.interleaved, reuse_resources=False,
                            num_threads_per_block=1024, use_double_scratch_buffer=False, buffer_alignment=16,
                            min_message_size=0, max_message_size=2**64 - 1, strict=False, consistent=None, batch_invariant=None,
                            chunk_unit=None, replicated_residual=None)
    # MSCCL++'s parameters, in MSCCL++'s order; ours (strict, consistent, batch_invariant, chunk_unit) come after them
    assert list(sig.parameters)[-5:] == ["strict", "consistent", "batch_invariant", "chunk_unit", "replicated_residual"]
    assert list(sig.parameters)[1:4] == ["name", "collective", "num_ranks"]


def test_channel_method_signatures():
    assert list(inspect.signature(MemoryChannel.signal).parameters) == ["self", "tb", "data_sync", "relaxed"]
    assert inspect.signature(MemoryChannel.signal).parameters["data_sync"].default == SyncType.both
    assert list(inspect.signature(MemoryChannel.put).parameters) == ["self", "dst_chunk", "src_chunk", "tb", "tb_group"]
    assert list(inspect.signature(MemoryChannel.reduce).parameters) == [
        "self", "local_src_chunk", "remote_src_chunks", "tb", "tb_group", "local_dst_chunk", "reduce_op",
        "src_position"]   # MSCCL++'s, then ours
    assert list(inspect.signature(Rank.reduce).parameters) == [
        "self", "src_chunk", "other_chunks", "tb", "tb_group", "dst_chunk", "reduce_op", "packet", "src_position"]
    assert list(inspect.signature(PortChannel.put_with_signal_and_flush).parameters) == ["self", "dst_chunk", "src_chunk", "tb"]
    assert list(inspect.signature(SwitchChannel.SwitchChannelRankView.reduce).parameters) == [
        "self", "buffer_offset", "size", "dst_chunk", "tb", "reduce_op"]


def test_sync_type_combines():
    assert SyncType.before | SyncType.after == SyncType.both
    assert BufferType.input.value == "i" and BufferType.scratch.value == "s"
    assert ReduceOperationType.max.value == "max"


# ---------------------------------------------------------------- collectives


@pytest.mark.parametrize("coll, cin, cout, name", [
    (AllGather(4, 2, False), 2, 8, "allgather"),
    (AllReduce(4, 2, False), 8, 8, "allreduce"),
    (ReduceScatter(4, 2, False), 8, 2, "reducescatter"),
    (AllToAll(4, 2, False), 8, 8, "alltoall"),
    (SendRecv(4, 2, False), 2, 2, "sendrecv"),
    (Broadcast(4, 2, 3), 2, 2, "broadcast"),
    (TestCollective(4, 3, 5), 3, 5, "test"),
])
def test_collective_chunk_counts(coll, cin, cout, name):
    assert (coll.input_chunks, coll.output_chunks, coll.name) == (cin, cout, name)
    with CollectiveProgram("x", coll, 4):
        assert Rank(1).get_input_buffer().size == cin
        assert Rank(1).get_output_buffer().size == cout


def test_postcondition_as_data():
    post = AllReduce(2, 1, False).postcondition()
    assert post[(1, 0)].reduced and set(post[(1, 0)].sources) == {(0, 0), (1, 0)}
    post = AllGather(3, 1, False).postcondition()
    assert post[(0, 2)].sources == ((2, 0),) and not post[(0, 2)].reduced
    post = Broadcast(3, 2, root=1).postcondition()
    assert all(e.sources == ((1, c),) for (r, c), e in post.items())
    assert len(post) == 6
    pre = ReduceScatter(2, 1, False).precondition()
    assert pre[(1, 1)] == (1, 1) and len(pre) == 4


def test_broadcast_root_checked_and_emitted():
    with pytest.raises(DSLError, match="root 5"):
        Broadcast(4, 1, 5)
    with CollectiveProgram("bc", Broadcast(2, 1, 1), 2) as prog:
        ch = MemoryChannel(0, 1)
        ch.put(Rank(0).get_output_buffer()[0:1], Rank(1).get_input_buffer()[0:1], tb=0)
        ch.signal(0)
        MemoryChannel(1, 0).wait(0)
        Rank(1).copy(Rank(1).get_output_buffer()[0:1], Rank(1).get_input_buffer()[0:1], tb=1)
    plan = prog.to_plan()
    assert plan.root == 1 and plan.collective == "broadcast"
    validate_plan(plan)


# ---------------------------------------------------------------- recording and output


def test_json_is_plan_format_and_idempotent():
    prog = handshake_allgather(2)
    with prog:
        text1 = JSON()
        text2 = JSON()
    assert text1 == text2 == prog.to_json()
    data = json.loads(text1)
    assert data["format"] == "mscclang.plan/1"
    plan = load_plan(text1)
    validate_plan(plan)
    assert names(plan) == ["rlxsignal", "rlxwait", "nop", "put", "nop", "signal", "wait", "nop"]


def test_to_json_does_not_replicate_twice():
    prog = handshake_allgather(2, instances=2)
    a = prog.to_plan()
    b = prog.to_plan()
    assert len(a.gpus[0].threadblocks) == len(b.gpus[0].threadblocks) == 2
    assert a.gpus[0].output_chunks == 4 and a.chunk_factor == 2
    assert prog.to_json() == prog.to_json()
    prog.post_process_operations()  # MSCCL++ compatibility: must not replicate again
    assert len(prog.to_plan().gpus[0].threadblocks) == 2


def test_compiling_twice_gives_identical_bytes():
    a = handshake_allgather(4).to_json()
    b = handshake_allgather(4).to_json()
    assert a == b


def test_no_state_leaks_between_programs():
    def build():
        with CollectiveProgram("p", AllReduce(2, 1, False), 2) as prog:
            ch = MemoryChannel(1, 0)
            MemoryChannel(0, 1)
            s = Semaphore(0, 1)
            s.acquire(0)
            s.release(1)
            Rank(0).barrier([0, 1])
            Rank(0).barrier([0, 1])
            b = Buffer(0, 2)
            Rank(0).copy(b[0:1], Rank(0).get_input_buffer()[0:1], tb=0)
        return prog, ch, s, b

    p1, ch1, s1, b1 = build()
    p2, ch2, s2, b2 = build()
    assert (ch1.channel_id, ch2.channel_id) == (0, 0)
    assert (s1.id, s2.id) == (0, 0)
    assert (b1.offset, b2.offset) == (0, 0)
    plan = p2.to_plan()
    bar = [op for op in plan.gpus[0].threadblocks[0].ops if op.name == OpName.barrier]
    assert [op.barrier_id for op in bar] == [0, 0]
    assert p1.to_json() == p2.to_json()


def test_dsl_outside_program_raises():
    with pytest.raises(DSLError, match="no active program"):
        Rank(0)


def test_program_restores_outer_context():
    with CollectiveProgram("outer", AllReduce(2, 1, False), 2) as outer:
        with CollectiveProgram("inner", AllReduce(4, 1, False), 4):
            Rank(3)
        Rank(1)
        with pytest.raises(DSLError, match="rank 3 is out of range"):
            Rank(3)
    assert outer.num_ranks == 2


def test_from_spec():
    spec = AlgoSpec(name="ag", collective=AllGather(2, 1, True), nranks_per_node=2, world_size=2,
                    in_place=True, instances=2, protocol="Simple", num_threads_per_block=512)
    with CollectiveProgram.from_spec(spec) as prog:
        pass
    assert (prog.instances, prog.num_threads_per_block, prog.num_ranks) == (2, 512, 2)
    plan = prog.to_plan()
    assert plan.inplace and plan.num_threads_per_block == 512


def test_thread_block_group_records_tbg_info():
    with CollectiveProgram("g", AllReduce(2, 2, False), 2) as prog:
        grp = ThreadBlockGroup([3, 1])
        Rank(0).copy(Rank(0).get_output_buffer()[0:4], Rank(0).get_input_buffer()[0:4], tb_group=grp)
    plan = prog.to_plan()
    tbs = plan.gpus[0].threadblocks
    assert len(tbs) == 4 and tbs[0].ops == [] and tbs[2].ops == []
    assert (tbs[3].ops[0].tbg_info.tb_id, tbs[3].ops[0].tbg_info.tbg_size) == (0, 2)
    assert (tbs[1].ops[0].tbg_info.tb_id, tbs[1].ops[0].tbg_info.tbg_size) == (1, 2)
    validate_plan(plan)


def test_pipeline_wraps_ops_per_block():
    with CollectiveProgram("pl", AllReduce(2, 1, False), 2) as prog:
        with LoopIterationContext(unit=2**20, num_chunks=2):
            Rank(0).copy(Rank(0).get_output_buffer()[0:2], Rank(0).get_input_buffer()[0:2], tb=0)
            Rank(0).copy(Rank(0).get_input_buffer()[0:2], Rank(0).get_output_buffer()[0:2], tb=0)
        Rank(0).copy(Rank(0).get_output_buffer()[0:1], Rank(0).get_input_buffer()[1:2], tb=0)
    plan = prog.to_plan()
    ops = plan.gpus[0].threadblocks[0].ops
    assert ops[0].name == OpName.pipeline
    assert (ops[0].iter_context.unit_size, ops[0].iter_context.num_chunks) == (2**20, 2)
    # the hazard inside the body gets its own nop; the op after the pipeline reads what it wrote
    assert [o.name.value for o in ops[0].ops] == ["copy", "nop", "copy"]
    assert [o.name.value for o in ops[1:]] == ["nop", "copy"]


def test_nested_pipeline_rejected():
    with CollectiveProgram("pl", AllReduce(2, 1, False), 2):
        with LoopIterationContext(1024, 1):
            with pytest.raises(DSLError, match="nested pipelines"):
                with LoopIterationContext(1024, 1):
                    pass


# ---------------------------------------------------------------- DSL errors


def _errors():
    """(label, callable inside a 2-rank program, expected message fragment)."""
    def inp(r):
        return Rank(r).get_input_buffer()

    def out(r):
        return Rank(r).get_output_buffer()

    return [
        ("size mismatch copy", lambda: Rank(0).copy(out(0)[0:2], inp(0)[0:1], tb=0),
         r"rank 0, tb 0: Rank\(0\).copy: size mismatch"),
        ("wrong rank copy", lambda: Rank(0).copy(out(1)[0:1], inp(0)[0:1], tb=0),
         r"rank 0, tb 0: Rank\(0\).copy: destination rank 1 output\[0:1\] must belong to rank 0"),
        ("slice out of range", lambda: inp(0)[1:3], r"rank 0 input buffer\[1:3\]: out of bounds"),
        ("no tb", lambda: Rank(0).copy(out(0)[0:1], inp(0)[0:1]), r"either 'tb'"),
        ("negative tb", lambda: Rank(1).copy(out(1)[0:1], inp(1)[0:1], tb=-1),
         r"rank 1, tb -1: Rank\(1\).copy: thread block id -1 is outside"),
        ("packet dst not scratch", lambda: Rank(0).copy_packets(out(0)[0:1], inp(0)[0:1], tb=2),
         r"rank 0, tb 2: Rank\(0\).copy_packets: destination rank 0 output\[0:1\] holds packets and must be a scratch"),
        ("put_packets dst not scratch", lambda: MemoryChannel(1, 0).put_packets(out(1)[0:1], inp(0)[0:1], tb=0),
         r"MemoryChannel\(dst=1, src=0\).put_packets: destination rank 1 output\[0:1\] holds packets"),
        ("put to wrong rank", lambda: MemoryChannel(1, 0).put(out(0)[0:1], inp(0)[0:1], tb=0),
         r"rank 0, tb 0: MemoryChannel\(dst=1, src=0\).put: destination rank 0 output\[0:1\] must belong to rank 1"),
        ("channel to self", lambda: MemoryChannel(1, 1), r"rank 1: MemoryChannel\(dst_rank=1, src_rank=1\): a channel connects two different ranks"),
        ("channel rank range", lambda: PortChannel(2, 0), r"dst_rank 2 is out of range"),
        ("reduce no others", lambda: Rank(0).reduce(inp(0)[0:1], [], tb=0), r"other_chunks is empty"),
        ("packet reduce not scratch", lambda: Rank(0).reduce(inp(0)[0:1], [out(0)[0:1]], tb=0, packet=True),
         r"other chunk 0 rank 0 output\[0:1\] holds packets"),
        ("barrier duplicate", lambda: Rank(0).barrier([1, 1]), r"rank 0: Rank\(0\).barrier\(tb_list=\[1, 1\]\): a thread block is listed twice"),
        ("semaphore negative", lambda: Semaphore(0, -1), r"initial_value must be an int in 0..2147483647"),
        ("tb and group", lambda: Rank(0).copy(out(0)[0:1], inp(0)[0:1], tb=0, tb_group=ThreadBlockGroup([0])),
         r"give either 'tb' or 'tb_group'"),
        ("switch rank not in group", lambda: SwitchChannel([0], BufferType.input).at_rank(1),
         r"the rank is not in the group"),
        ("switch range", lambda: SwitchChannel([0, 1], BufferType.input).at_rank(0).reduce(1, 2, out(0)[0:2], tb=0),
         r"chunks 1..2 are out of bounds of rank 0's input buffer \(2 chunks\)"),
    ]


@pytest.mark.parametrize("label, fn, msg", _errors(), ids=[e[0] for e in _errors()])
def test_dsl_errors_name_rank_tb_call(label, fn, msg):
    with CollectiveProgram("e", AllReduce(2, 1, False), 2):
        with pytest.raises(DSLError, match=msg):
            fn()


def test_program_argument_errors():
    with pytest.raises(DSLError, match="protocol must be 'Simple' or 'LL'"):
        CollectiveProgram("x", AllReduce(2, 1, False), 2, protocol="LL128")
    with pytest.raises(DSLError, match="num_ranks is 4 but the collective"):
        CollectiveProgram("x", AllReduce(2, 1, False), 4)
    with pytest.raises(DSLError, match="instances must be a positive int"):
        CollectiveProgram("x", AllReduce(2, 1, False), 2, instances=0)


def test_packet_destination_checked_on_port_and_switch():
    with CollectiveProgram("e", AllReduce(2, 1, False), 2):
        with pytest.raises(DSLError, match="broadcast_packets needs a switch channel over scratch"):
            sw = SwitchChannel([0, 1], BufferType.input)
            b = Buffer(0, 1)
            sw.at_rank(0).broadcast_packets(b[0:1], 0, 1, tb=0)
        with pytest.raises(DSLError, match=r"PortChannel\(dst=1, src=0\).read_put_packets: source rank 0 input\[0:1\] holds packets"):
            PortChannel(1, 0).read_put_packets(Buffer(1, 1)[0:1], Rank(0).get_input_buffer()[0:1], tb=0)
