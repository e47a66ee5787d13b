"""The helpers of ``mscclang.algorithms.common``: each records exactly the ops a hand-written
DSL loop would (op kinds, thread blocks, channels, chunks, sync flags, order), checked on the
program's recorded IR before compilation."""

from __future__ import annotations

import pytest

from mscclang.algorithms.common import (
    announce_ready,
    await_ready,
    data_handshake,
    get_from_peers,
    input_of,
    library_program,
    mesh,
    mesh_program,
    output_of,
    peers,
    put_to_peers,
    ready_handshake,
    reduce_packets_from_peers,
    send_packets_to_peers,
    stage_peer_chunks,
    unpack_packets_from_peers,
)
from mscclang.dsl import AllGather, AllReduce, Broadcast, Buffer, BufferType, SyncType
from mscclang.dsl._context import get_program
from mscclang.errors import DSLError
from mscclang.plan.models import OpName


def _program(n: int = 4, inplace: bool = False):
    return library_program("t", AllReduce, n, 1, inplace, "Simple", 256, None, 0, 1 << 30)


def _ops(prog, rank: int, tb: int):
    return prog.ir.ranks[rank].tbs[tb]


def _where(ref) -> tuple[int, BufferType, int, int, bool]:
    return ref.rank, BufferType(ref.buffer), ref.index, ref.size, ref.remote


def _channel_peer(prog, rank: int, op) -> int:
    return prog.ir.ranks[rank].memory[op.channels[0]]


def test_library_program_checks_and_names() -> None:
    prog = library_program("algo", AllGather, 3, 2, True, "LL", 512, None, 16, 4096, double_scratch=True)
    assert (prog.name, prog.num_ranks, prog.instances, prog.protocol) == ("algo.r3.i2", 3, 2, "LL")
    assert prog.use_double_scratch_buffer and prog.instr_fusion and prog.auto_sync
    assert (prog.min_message_size, prog.max_message_size, prog.num_threads_per_block) == (16, 4096, 512)
    assert prog.collective.inplace
    named = library_program("b", Broadcast, 4, 1, False, "Simple", 1024, "mine", 0, 1, root=2)
    assert named.name == "mine" and named.collective.root == 2
    with pytest.raises(DSLError, match="algo: ranks must be an int >= 2, got 1"):
        library_program("algo", AllGather, 1, 1, False, "LL", 512, None, 0, 1)
    with pytest.raises(DSLError, match="algo: instances must be a positive int, got 0"):
        library_program("algo", AllGather, 2, 0, False, "LL", 512, None, 0, 1)


def test_mesh_program_enters_the_program_with_its_channels() -> None:
    with mesh_program("algo", AllGather, 3, 2, True, "LL", 512, None, 16, 4096, double_scratch=True) as (prog, ch):
        assert get_program() is prog and prog.name == "algo.r3.i2" and prog.use_double_scratch_buffer
        assert sorted(ch) == [(s, d) for s in range(3) for d in range(3) if s != d]
        assert [prog.ir.ranks[r].memory for r in range(3)] == [[1, 2], [0, 2], [0, 1]]
    with pytest.raises(DSLError, match="no active program"):
        get_program()
    with mesh_program("algo", AllGather, 3, 1, False, "LL", 512, None, 0, 1, channels=lambda n: {}) as (prog, ch):
        assert ch == {} and prog.ir.ranks[0].memory == []
    with pytest.raises(DSLError, match="algo: ranks must be an int >= 2, got 1"):
        with mesh_program("algo", AllGather, 1, 1, False, "LL", 512, None, 0, 1):
            pass


def test_output_of_is_the_input_in_place() -> None:
    with _program():
        assert output_of(1, inplace=True).buffer_type == BufferType.input
        assert output_of(1).buffer_type == BufferType.output
        assert input_of(2).rank == 2 and input_of(2).buffer_type == BufferType.input


def test_ready_handshake_signals_then_waits_relaxed() -> None:
    prog = _program()
    with prog:
        ch = mesh(4)
        ready_handshake(ch, 1, to=[0, 2], frm=[3], tb=0)
    ops = _ops(prog, 1, 0)
    assert [(o.name, _channel_peer(prog, 1, o), o.data_sync) for o in ops] == [
        (OpName.rlxsignal, 0, int(SyncType.none)), (OpName.rlxsignal, 2, int(SyncType.none)),
        (OpName.rlxwait, 3, int(SyncType.after))]


def test_one_way_ready_words() -> None:
    prog = _program()
    with prog:
        ch = mesh(4)
        announce_ready(ch, 2, [0], 1)
        await_ready(ch, 0, [1, 2, 3], 0)
    assert [(o.name, _channel_peer(prog, 2, o)) for o in _ops(prog, 2, 1)] == [(OpName.rlxsignal, 0)]
    assert [(o.name, _channel_peer(prog, 0, o)) for o in _ops(prog, 0, 0)] == [
        (OpName.rlxwait, 1), (OpName.rlxwait, 2), (OpName.rlxwait, 3)]


def test_data_handshake_publishes_then_waits() -> None:
    prog = _program()
    with prog:
        ch = mesh(4)
        data_handshake(ch, 0, to=[1], frm=[3], tb=0)
    assert [(o.name, _channel_peer(prog, 0, o), o.data_sync) for o in _ops(prog, 0, 0)] == [
        (OpName.signal, 1, int(SyncType.before)), (OpName.wait, 3, int(SyncType.after))]


def test_put_and_get_per_peer_chunks() -> None:
    prog = _program()
    with prog:
        ch = mesh(4)
        inp, ps = input_of(1), peers(1, 4)
        put_to_peers(ch, 1, ps, dst=lambda p: output_of(p)[1], src=lambda p: inp[p], tb=0)
        get_from_peers(ch, 1, ps, dst=lambda p: output_of(1)[p], src=lambda p: input_of(p)[1], tb=2)
    puts = _ops(prog, 1, 0)
    assert [o.name for o in puts] == [OpName.put] * 3
    assert [(_channel_peer(prog, 1, o), _where(o.dst[0]), _where(o.src[0])) for o in puts] == [
        (p, (p, BufferType.output, 1, 1, True), (1, BufferType.input, p, 1, False)) for p in ps]
    gets = _ops(prog, 1, 2)
    assert [(o.name, _channel_peer(prog, 1, o), _where(o.dst[0]), _where(o.src[0])) for o in gets] == [
        (OpName.get, p, (1, BufferType.output, p, 1, False), (p, BufferType.input, 1, 1, True)) for p in ps]


def test_stage_peer_chunks_copies_chunk_by_chunk() -> None:
    prog = _program()
    with prog:
        scratch = Buffer(2, 4)
        stage_peer_chunks(2, peers(2, 4), scratch, input_of(2))
    ops = _ops(prog, 2, 0)
    assert [(o.name, _where(o.dst[0]), _where(o.src[0])) for o in ops] == [
        (OpName.copy, (2, BufferType.scratch, p, 1, False), (2, BufferType.input, p, 1, False)) for p in (0, 1, 3)]


@pytest.mark.parametrize("base", [0, 4])
def test_packets_one_block_per_peer_one_slot_per_sender(base: int) -> None:
    prog = _program()
    with prog:
        scratch = [Buffer(r, 8) for r in range(4)]
        ch = mesh(4)
        inp, out, ps = input_of(2), output_of(2), peers(2, 4)
        send_packets_to_peers(ch, 2, ps, scratch, src=lambda p: inp[p], slot_base=base)
        unpack_packets_from_peers(2, ps, scratch[2], dst=lambda p: out[p], slot_base=base)
    for j, p in enumerate(ps):
        put, unpack = _ops(prog, 2, j)
        assert put.name == OpName.ppkt and _channel_peer(prog, 2, put) == p
        assert _where(put.dst[0]) == (p, BufferType.scratch, base + 2, 1, True)
        assert _where(put.src[0]) == (2, BufferType.input, p, 1, False)
        assert unpack.name == OpName.upkt
        assert _where(unpack.src[0]) == (2, BufferType.scratch, base + p, 1, False)
        assert _where(unpack.dst[0]) == (2, BufferType.output, p, 1, False)


def test_packet_reduce_shared_by_the_peer_blocks() -> None:
    prog = _program()
    with prog:
        scratch = [Buffer(r, 4) for r in range(4)]
        inp = input_of(0)
        reduce_packets_from_peers(0, peers(0, 4), scratch[0], own=inp[0], dst=output_of(0)[0])
    for tb in range(3):
        (op,) = _ops(prog, 0, tb)
        assert op.name == OpName.repkt and op.tbg == (tb, 3)
        assert [_where(s) for s in op.src] == [(0, BufferType.input, 0, 1, False)] + [
            (0, BufferType.scratch, q, 1, False) for q in (1, 2, 3)]
        assert _where(op.dst[0]) == (0, BufferType.output, 0, 1, False)
