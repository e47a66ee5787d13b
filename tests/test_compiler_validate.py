"""Pass 1 (validation): every error with its message."""

from __future__ import annotations

import warnings

import pytest

from mscclang import (
    AllReduce,
    Buffer,
    CollectiveProgram,
    DSLError,
    DSLWarning,
    LoopIterationContext,
    MemoryChannel,
    MscclangWarning,
    PortChannel,
    Rank,
    Semaphore,
)
from mscclang.compiler import validate
from mscclang.compiler.ir import IROp, IRProgram, Ref
from mscclang.compiler.validate import MAX_THREADBLOCKS
from mscclang.plan.models import BufferKind, ChannelType, OpName

I, O, S = BufferKind.input, BufferKind.output, BufferKind.scratch


def base(n=2) -> IRProgram:
    """A recorded program with one memory channel each way and 2 scratch chunks per rank."""
    with CollectiveProgram("v", AllReduce(n, 1, False), n) as p:
        for r in range(n):
            Buffer(r, 2)
        MemoryChannel(1, 0)
        MemoryChannel(0, 1)
    return p.ir.copy()


def add(ir: IRProgram, rank: int, tb: int, op: IROp) -> IRProgram:
    ir.ranks[rank].ensure_tb(tb).append(op)
    return ir


def loc(rank, kind, index, size=1):
    return Ref(rank, kind, index, size)


def rem(rank, kind, index, size=1):
    return Ref(rank, kind, index, size, remote=True)


def test_valid_program_passes_unchanged():
    ir = add(base(), 0, 0, IROp(OpName.copy, src=[loc(0, I, 0)], dst=[loc(0, O, 0)]))
    out = validate(ir)
    assert out is not ir and out == ir


@pytest.mark.parametrize("op, msg", [
    (IROp(OpName.copy, src=[loc(0, I, 1, 2)], dst=[loc(0, O, 0, 2)], origin="Rank(0).copy(tb=3)"),
     r"rank 0, tb 3, op 0 \(Rank\(0\).copy\(tb=3\)\): source input\[1:3\] is out of bounds \(rank 0's input buffer has 2 chunks\)"),
    (IROp(OpName.copy, src=[loc(0, I, 0, 2)], dst=[loc(0, O, 0, 1)]),
     r"rank 0, tb 3, op 0 \(copy\): size mismatch: source input\[0:2\] has 2 chunks, destination output\[0:1\] has 1"),
    (IROp(OpName.copy, src=[loc(1, I, 0)], dst=[loc(0, O, 0)]),
     r"local source input\[0:1\] belongs to rank 1, not 0"),
    (IROp(OpName.cpkt, src=[loc(0, I, 0)], dst=[loc(0, O, 0)]),
     r"rank 0, tb 3, op 0 \(cpkt\): destination output\[0:1\] holds LL packets and must be a scratch buffer"),
    (IROp(OpName.ppkt, src=[loc(0, I, 0)], dst=[rem(1, O, 0)], channel_type=ChannelType.memory, channels=[0]),
     r"destination remote rank 1 output\[0:1\] holds LL packets and must be a scratch buffer"),
    (IROp(OpName.repkt, src=[loc(0, I, 0), loc(0, I, 1)], dst=[loc(0, I, 0)]),
     r"packet source input\[1:2\] holds LL packets"),
    (IROp(OpName.put, src=[loc(0, I, 0)], dst=[rem(1, S, 2)], channel_type=ChannelType.memory, channels=[0]),
     r"destination remote rank 1 scratch\[2:3\] is out of bounds \(rank 1's scratch buffer has 2 chunks\)"),
    (IROp(OpName.put, src=[loc(0, I, 0)], dst=[rem(1, S, 0)], channel_type=ChannelType.memory, channels=[5]),
     r"rank 0, tb 3, op 0 \(put\): memory channel 5 does not exist \(rank 0 has 1\)"),
    (IROp(OpName.put, src=[loc(0, I, 0)], dst=[rem(0, S, 0)], channel_type=ChannelType.memory, channels=[0]),
     r"destination remote rank 0 scratch\[0:1\] is on rank 0, which the op's channels do not reach \(peers \[1\]\)"),
    (IROp(OpName.put, src=[loc(0, I, 0)], dst=[rem(1, S, 0)]),
     r"is remote but the op uses no channel"),
    (IROp(OpName.re, src=[loc(0, I, 0), loc(0, I, 1, 1)], dst=[loc(0, O, 0, 2)]),
     r"size mismatch among operands"),
    (IROp(OpName.sem_acquire, semaphores=[0]), r"semaphore 0 does not exist \(rank 0 has 0\)"),
    (IROp(OpName.glre, src=[Ref(0, I, 0, 1, switch=0)], dst=[loc(0, O, 0)], channel_type=ChannelType.switch,
          channels=[0]), r"switch channel 0 does not exist \(rank 0 has 0\)"),
])
def test_op_errors(op, msg):
    ir = add(base(), 0, 3, op)
    with pytest.raises(DSLError, match=msg):
        validate(ir)


def test_nested_pipeline_in_ir_rejected():
    inner = IROp(OpName.pipeline, iter_context=(64, 1), body=[IROp(OpName.copy, src=[loc(1, I, 0)], dst=[loc(1, O, 0)])])
    copy = IROp(OpName.copy, src=[loc(1, I, 0)], dst=[loc(1, O, 0)])
    ir = add(base(), 1, 0, IROp(OpName.pipeline, iter_context=(64, 1), body=[inner, copy]))
    with pytest.raises(DSLError, match=r"rank 1, tb 0, op 0.0 \(pipeline\): pipelines cannot be nested"):
        validate(ir)


def test_pipeline_without_data_op_rejected():
    ir = add(base(), 1, 0, IROp(OpName.pipeline, iter_context=(64, 1),
                                body=[IROp(OpName.wait, channel_type=ChannelType.memory, channels=[0])]))
    with pytest.raises(DSLError, match=r"rank 1, tb 0, op 0 \(pipeline\): a pipeline body needs at least one data op"):
        validate(ir)


def test_too_many_thread_blocks():
    ir = base()
    ir.ranks[1].ensure_tb(MAX_THREADBLOCKS)
    with pytest.raises(DSLError, match=rf"rank 1 uses {MAX_THREADBLOCKS + 1} thread blocks; at most {MAX_THREADBLOCKS}"):
        validate(ir)


def test_barrier_errors():
    ir = base()
    add(ir, 0, 0, IROp(OpName.barrier, barrier_id=0, barrier_tbs=[0, 1]))
    add(ir, 0, 1, IROp(OpName.barrier, barrier_id=0, barrier_tbs=[0, 1]))
    add(ir, 0, 1, IROp(OpName.barrier, barrier_id=0, barrier_tbs=[0, 1]))
    with pytest.raises(DSLError, match=r"rank 0: barrier id 0 is reached a different number of times by its "
                                       r"thread blocks \(tb 0: 1, tb 1: 2\)"):
        validate(ir)
    ir = base()
    add(ir, 0, 0, IROp(OpName.barrier, barrier_id=0, barrier_tbs=[0, 4]))
    with pytest.raises(DSLError, match=r"barrier member tb 4 does not exist"):
        validate(ir)


# ---------------------------------------------------------------- signal / wait balance


def _per_channel_unbalanced(strict: bool) -> CollectiveProgram:
    """Two channels 0->1; rank 0 signals twice on the first, rank 1 waits once on each paired
    channel: balanced per rank pair (MSCCL++ accepts it) but not per channel."""
    with CollectiveProgram("b", AllReduce(2, 1, False), 2, strict=strict) as p:
        a0, a1 = MemoryChannel(1, 0), MemoryChannel(1, 0)
        b0, b1 = MemoryChannel(0, 1), MemoryChannel(0, 1)
        a0.signal(0)
        a0.signal(0)
        b0.wait(0)
        b1.wait(0)
    return p


def test_balance_is_per_channel_not_per_rank_pair_strict():
    with pytest.raises(DSLError, match=r"unbalanced signal/wait: rank 0 signals 2 times on its memory channel 0 "
                                       r"to rank 1, but rank 1 waits 1 times on the paired memory channel 0 "
                                       r"\(and 1 more unbalanced channels\) \[strict mode\]"):
        _per_channel_unbalanced(strict=True).to_plan()


def test_unbalanced_per_channel_is_a_warning_by_default():
    """MSCCL++'s DSL compiles it, so ours does too: one DSLWarning per unbalanced channel, naming
    ranks, channels and counts, attributed to the caller's line, and the plan is emitted."""
    p = _per_channel_unbalanced(strict=False)
    with pytest.warns(DSLWarning) as record:
        plan = p.to_plan()
    msgs = [str(w.message) for w in record if issubclass(w.category, DSLWarning)]
    assert len(msgs) == 2
    assert msgs[0].startswith("unbalanced signal/wait: rank 0 signals 2 times on its memory channel 0 to rank 1, "
                              "but rank 1 waits 1 times on the paired memory channel 0")
    assert msgs[1].startswith("unbalanced signal/wait: rank 0 signals 0 times on its memory channel 1 to rank 1, "
                              "but rank 1 waits 1 times on the paired memory channel 1")
    assert all(w.filename == __file__ for w in record)
    assert [o.name for o in plan.gpus[0].threadblocks[0].ops if o.name != OpName.nop] == [OpName.signal] * 2
    assert issubclass(DSLWarning, MscclangWarning) and issubclass(MscclangWarning, UserWarning)


def test_balanced_program_gives_no_warning():
    with CollectiveProgram("ok", AllReduce(2, 1, False), 2, strict=True) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        a.signal(0)
        b.wait(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.to_plan()


def test_balance_per_direction_and_type():
    with CollectiveProgram("b", AllReduce(2, 1, False), 2, strict=True) as p:
        m01, m10 = MemoryChannel(1, 0), MemoryChannel(0, 1)
        p01, p10 = PortChannel(1, 0), PortChannel(0, 1)
        m01.signal(0)
        m10.wait(0)
        p10.signal(0)  # port signal from 1 to 0 ...
        m01.wait(1)  # ... consumed by a memory wait: wrong type
    with pytest.raises(DSLError, match=r"rank 0 signals 0 times on its memory channel 0 to rank 1, but rank 1 waits"
                                       r"|rank 1 signals 0 times on its memory channel 0 to rank 0, but rank 0 waits 1"):
        p.to_plan()


def test_port_put_with_signal_counts_as_signal():
    with CollectiveProgram("b", AllReduce(2, 1, False), 2) as p:
        p01, p10 = PortChannel(1, 0), PortChannel(0, 1)
        p01.put_with_signal(Rank(1).get_output_buffer()[0:1], Rank(0).get_input_buffer()[0:1], 0)
        p10.wait(0)
    p.to_plan()
    with CollectiveProgram("b", AllReduce(2, 1, False), 2, strict=True) as p:
        p01, p10 = PortChannel(1, 0), PortChannel(0, 1)
        p01.put_with_signal(Rank(1).get_output_buffer()[0:1], Rank(0).get_input_buffer()[0:1], 0)
    with pytest.raises(DSLError, match=r"rank 0 signals 1 times on its port channel 0 to rank 1, but rank 1 waits 0"):
        p.to_plan()


def test_signal_without_paired_channel():
    with CollectiveProgram("b", AllReduce(2, 1, False), 2, strict=True) as p:
        MemoryChannel(1, 0).signal(0)
    with pytest.raises(DSLError, match=r"rank 1 has no memory channel paired with it \(so nothing waits\)"):
        p.to_plan()
    with CollectiveProgram("b", AllReduce(2, 1, False), 2, strict=True) as p:
        MemoryChannel(1, 0).wait(0)
    with pytest.raises(DSLError, match=r"rank 0 waits 1 times on its memory channel 0 from rank 1, but rank 1 has no"):
        p.to_plan()


def test_pipeline_signals_counted_per_context():
    with CollectiveProgram("b", AllReduce(2, 1, False), 2, strict=True) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        with LoopIterationContext(1024, 1):
            a.put(Rank(1).get_output_buffer()[0:1], Rank(0).get_input_buffer()[0:1], tb=0)
            a.signal(0)
        b.wait(0)  # once, outside the pipeline: not the same count per launch
    with pytest.raises(DSLError, match=r"inside pipelines with unit=1024, num_chunks=1, per iteration"):
        p.to_plan()


# ---------------------------------------------------------------- semaphores


def test_semaphore_balance():
    with CollectiveProgram("s", AllReduce(2, 1, False), 2) as p:
        s = Semaphore(1, 1)
        s.acquire(0)
        s.acquire(1)
        s.release(0)
    with pytest.raises(DSLError, match=r"unbalanced semaphore: semaphore 0 of rank 1 is acquired 2 times and released 1 times"):
        p.to_plan()


def test_semaphore_zero_initial_value_rule():
    with CollectiveProgram("s", AllReduce(2, 1, False), 2) as p:
        s = Semaphore(0, 0)
        s.acquire(0)
        s.release(0)
        s.acquire(1)
        s.release(1)
    with pytest.raises(DSLError, match=r"semaphore 0 of rank 0 starts at 0, but every thread block that uses it "
                                       r"\(tbs \[0, 1\]\) acquires it before releasing it"):
        p.to_plan()
    with CollectiveProgram("s", AllReduce(2, 1, False), 2) as p:
        s = Semaphore(0, 0)
        s.release(0)
        s.acquire(1)
    p.to_plan()  # producer/consumer: fine
