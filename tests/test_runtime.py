"""CPU tests of the GPU runtime: NVRTC builds for sm_90, the layout static_asserts, device-plan
packing and load-time refusals. No GPU needed."""

from __future__ import annotations


import pytest

from mscclang.errors import PlanError
from mscclang.errors import RuntimeUnavailable
from mscclang.plan.dtypes import kernel_dtype
from mscclang.plan.io import load_plan, plan_to_json
from mscclang.plan.layout import make_layout, total_length
from mscclang.plan.models import (
    REDUCE_OP_NAMES,
    BufferRef, ChannelDesc, ChannelType, Op, OpName, PacketType, RemoteBuffer, ThreadBlockChannels,
)
from mscclang.runtime import build, device_plan as dp, packing as pk, structs
from mscclang.plan import samples as sp
from tests.harness.nvrtc import needs_nvrtc


@needs_nvrtc
def test_layout_static_asserts_compile_and_catch_drift():
    src = structs.layout_asserts()
    assert src.count("static_assert") > 60
    build.compile_source(src, "sm_90", name="layout_asserts.cu")
    drifted = src.replace("__builtin_offsetof(DevOp, total) == 24", "__builtin_offsetof(DevOp, total) == 28")
    assert drifted != src
    with pytest.raises(Exception, match="drifted"):
        build.compile_source(drifted, "sm_90", name="drifted.cu")


@needs_nvrtc
def test_every_variant_builds_for_sm90():
    mods = build.build_all("sm_90", jobs=2)  # disk cache: `mscclang build-kernel` fills it
    assert [m.dtype for m in mods] == list(build.DTYPES)
    for m in mods:
        assert m.cubin[:4] == b"\x7fELF"
        ops = ("sum",) if kernel_dtype(m.dtype).accumulates else REDUCE_OP_NAMES   # fp8: the sum only
        assert len(PacketType) * len(ops) == build.module_kernels(m.dtype)
        for pkt in (p.code for p in PacketType):
            for op in ops:
                for nt in (1024, 512):
                    assert build.kernel_name(m.dtype, pkt, op, nt).encode() in m.cubin


def test_packet_types_name_their_code_and_alignment():
    from mscclang.runtime.state import packet_code

    assert [(p.code, p.size, p.align) for p in PacketType] == [("ll8", 8, 4), ("ll16", 16, 8)]
    assert PacketType.of(None) is PacketType.LL16 and PacketType.of("ll8") is PacketType.of(PacketType.LL8)
    assert packet_code(None) == "ll16" and packet_code(PacketType.LL8) == "ll8" and packet_code("Ll16") == "ll16"
    with pytest.raises(RuntimeUnavailable, match="unknown packet type 'LL4'; use 'LL8' or 'LL16'"):
        packet_code("LL4")


def test_kernel_variant_by_block_size():
    assert build.block_variant(1024) == 1024 and build.block_variant(513) == 1024
    assert build.block_variant(512) == 512 and build.block_variant(64) == 512
    assert build.kernel_name("f16", "ll16", "sum", 128) == "mscclang_f16_ll16_sum_t512"
    assert build.kernel_name("f16", "ll16", "sum", 1024) == "mscclang_f16_ll16_sum"
    with pytest.raises(Exception, match="threads per block"):
        build.block_variant(2048)


def test_struct_offsets_natural_alignment():
    assert structs.DEV_OP.offsets["total"] == 24
    assert structs.DEV_OP.size == 48
    assert structs.PLAN_HEADER.size % 8 == 0
    hdr = structs.PLAN_HEADER.pack(magic=1, n_blocks=3, block_table=4096)
    back = structs.PLAN_HEADER.unpack(hdr)
    assert back["magic"] == 1 and back["n_blocks"] == 3 and back["block_table"] == 4096
    with pytest.raises(KeyError):
        structs.PLAN_HEADER.pack(nope=1)


def _walk(region: bytes):
    """Parse a packed block region back into (kind, n_src, n_dst, pieces, total, aux) tuples."""
    head = structs.BLOCK_HEADER.unpack(region)
    pos = structs.BLOCK_HEADER.size
    out = []
    for _ in range(head["n_ops"]):
        op = structs.DEV_OP.unpack(region, pos)
        n = op["n_src"] + op["n_dst"]
        p = pos + structs.DEV_OP.size + (2 * n + 7) // 8 * 8 + (2 * op["n_ids"] + 7) // 8 * 8
        pieces = []
        for _ in range(op["n_pieces"]):
            words = [int.from_bytes(region[p + 8 * i:p + 8 * i + 8], "little") for i in range(2 + n)]
            pieces.append((words[0], words[1], tuple(words[2:])))
            p += 8 * (2 + n)
        assert p - pos == op["bytes"]
        out.append((op, pieces))
        pos += op["bytes"]
    assert pos == head["bytes"]
    return out


@pytest.mark.parametrize("name", sorted(sp.SAMPLES))
@pytest.mark.parametrize("nbytes", [1024, 3000, 12290])
def test_sample_plans_pack(name, nbytes):
    plan = load_plan(plan_to_json(sp.SAMPLES[name](2)))
    dp.check_runnable(plan)
    out_bytes = nbytes * 2 if plan.collective == "allgather" else nbytes
    for r in range(2):
        packed = pk.pack_blocks(plan, r, nbytes, out_bytes)
        assert len(packed.blocks) == len(plan.gpus[r].threadblocks)
        for b in packed.blocks:
            assert len(b.region) % 16 == 0
            for op, pieces in _walk(b.region):
                if op["kind"] == dp.DOP_DATA:
                    assert op["total"] == sum(p[0] for p in pieces)
                    assert all(0 <= p[1] <= p[0] for p in pieces)


def test_copy_pieces_follow_layout():
    plan = sp.allgather_simple(2)
    packed = pk.pack_blocks(plan, 1, 3000, 6000)
    ops = _walk(packed.blocks[0].region)
    copy_op, pieces = ops[0]
    assert copy_op["kind"] == dp.DOP_DATA and copy_op["n_src"] == 1 and copy_op["n_dst"] == 1
    lay = make_layout(plan, 1, 3000, 6000)
    want = lay.pieces([(plan.gpus[1].threadblocks[0].ops[0].src_buff[0].type, 0),
                       (plan.gpus[1].threadblocks[0].ops[0].dst_buff[0].type, 1)], 1)
    assert [(p[0], p[2]) for p in pieces] == [(w.length, w.offsets) for w in want]
    assert total_length(want) == 3000


def test_packet_writes_cover_whole_slots():
    # rank 1 owns the clipped chunk at 3000 bytes: its packet copy must still fill the slot
    plan = sp.allreduce_copyfwd_ll(2)
    packed = pk.pack_blocks(plan, 1, 3000, 3000)
    recs = _walk(packed.blocks[0].region)
    lay = make_layout(plan, 1, 3000, 3000)
    recpkt = [(o, p) for o, p in recs if o["kind"] == dp.DOP_DATA and o["n_src"] == 2 and o["n_dst"] == 2]
    assert recpkt, "recpkt record missing"
    op, pieces = recpkt[0]
    assert pieces[0][0] == lay.chunk_bytes and pieces[0][1] == 3000 - lay.chunk_bytes
    cpkt = [p for o, p in recs if o["kind"] == dp.DOP_DATA and o["n_src"] == 1 and o["n_dst"] == 1
            and o["flags"] == 0]
    assert cpkt and cpkt[0][0][0] == lay.chunk_bytes


def test_tbg_and_pipeline_records():
    plan = sp.allreduce_oneshot_ll(2, nblocks=4)
    packed = pk.pack_blocks(plan, 0, 4096, 4096)
    for t, b in enumerate(packed.blocks):
        for op, _ in _walk(b.region):
            assert op["tbg_member"] == t and op["tbg_size"] == 4 and op["tbg_unit"] == 16
    plan = sp.allgather_pipeline(2, unit=1024)
    packed = pk.pack_blocks(plan, 0, 5000, 10000)
    recs = _walk(packed.blocks[0].region)
    assert recs[0][0]["kind"] == dp.DOP_PIPELINE
    assert recs[0][0]["aux0"] == 1 and recs[0][0]["aux1"] == 5 and recs[0][0]["total"] == 1024


def test_channel_pairing_and_sync_layout():
    plan = sp.allreduce_scratch_simple(2)
    assert [(c.peer, c.ordinal) for c in plan.channel_ordinals(0, ChannelType.memory)] == [(1, 0)]
    assert dp.inbound_slots(plan, 0) == {(1, 0): 0}
    # an unpaired channel (rank 0 has two channels to rank 1, rank 1 one to rank 0) gets a slot
    plan.gpus[0].channels = [ChannelDesc(channel_type=ChannelType.memory, connected_to=[1, 1])]
    assert dp.inbound_slots(plan, 1) == {(0, 0): 0, (0, 1): 1}
    sl = dp.sync_layout(plan, 1)
    assert sl.expected == sl.inbound + 16 and sl.size % 256 == 0


def _with_op(plan, op, rank=0):
    plan.gpus[rank].threadblocks[0].ops.append(op)
    return plan


def test_port_channel_checks():
    plan = sp.allgather_simple(2)
    plan.gpus[1].channels.append(ChannelDesc(channel_type=ChannelType.port, connected_to=[0]))
    dp.check_runnable(plan)   # a declared port channel is carried (copy engine on one node)
    plan = _with_op(sp.allgather_simple(2), Op(name=OpName.flush, channel_type=ChannelType.port, channel_ids=[0]))
    with pytest.raises(PlanError, match=r"gpus\[0\]\.threadblocks\[0\]\.ops\[\d+\]\.channel_ids\[0\]: channel id 0 is outside"):
        dp.check_runnable(plan)


def test_refuses_switch_ops():
    plan = sp.allgather_simple(2)
    plan.gpus[0].channels.append(ChannelDesc(channel_type=ChannelType.switch, buffer_type="o",
                                             rank_groups=[{"size": 2, "ranks": [0, 1]}]))
    with pytest.raises(PlanError, match="MSCCLANG_ENABLE_NVLS"):
        dp.check_runnable(plan)


def test_refuses_too_many_channels_per_op():
    plan = sp.allgather_simple(2)
    g = plan.gpus[0]
    g.channels = [ChannelDesc(channel_type=ChannelType.memory, connected_to=[1] * 40)]
    g.threadblocks[0].channels = [ThreadBlockChannels(channel_type=ChannelType.memory, channel_ids=list(range(40)))]
    _with_op(plan, Op(name=OpName.signal, channel_type=ChannelType.memory, channel_ids=list(range(40))))
    with pytest.raises(PlanError, match="at most 32"):
        dp.check_runnable(plan)


def test_refuses_bad_semaphore_and_barrier():
    plan = _with_op(sp.allgather_simple(2), Op(name=OpName.sem_release, semaphore_ids=[3]))
    with pytest.raises(PlanError, match=r"ops\[\d+\]\.semaphore_ids\[0\]: semaphore 3 does not exist"):
        dp.check_runnable(plan)
    plan = _with_op(sp.allgather_simple(2), Op(name=OpName.barrier, barrier_id=99, num_threadblocks=1))
    with pytest.raises(PlanError, match="barrier id 99"):
        dp.check_runnable(plan)


def test_refuses_packets_outside_scratch_and_bad_buffer_ids():
    plan = _with_op(sp.allgather_simple(2), Op(name=OpName.cpkt, src_buff=[BufferRef(type="i", index=0, size=1)],
                                               dst_buff=[BufferRef(type="o", index=0, size=1)]))
    with pytest.raises(PlanError, match="must be in scratch"):
        pk.pack_blocks(plan, 0, 1024, 2048)
    plan = _with_op(sp.allgather_simple(2), Op(name=OpName.put, channel_type=ChannelType.memory,
                                               src_buff=[BufferRef(type="i", index=0, size=1)],
                                               dst_buff=[BufferRef(buffer_id=5, index=0, size=1)]))
    with pytest.raises(PlanError, match="buffer_id 5"):
        pk.pack_blocks(plan, 0, 1024, 2048)


def test_blob_header_and_tables():
    plan = sp.allreduce_oneshot_ll(2)
    packed = pk.pack_blocks(plan, 0, 1024, 1024)
    sync = dp.sync_layout(plan, 0)
    addr = dp.Addresses(0x1000, 0x20000, 0x800, 0x9000, [0x5000], [(0x30000, 2)], [(1, 2, 3)])
    blob = dp.pack_blob(plan, packed, addr, sync)
    h = structs.PLAN_HEADER.unpack(blob)
    assert h["magic"] == structs.CONSTANTS["MSCCLANG_PLAN_MAGIC"]
    assert h["flags"] == 0x1000 + dp.SYNC_FLAGS_OFF and h["n_channels"] == 1 and h["n_remote"] == 1
    ent = structs.BLOCK_ENTRY.unpack(blob, h["block_table"])
    assert ent["offset"] % 16 == 0 and blob[ent["offset"]:ent["offset"] + ent["bytes"]] == packed.blocks[0].region
    assert structs.REMOTE_BUF.unpack(blob, h["remote_table"]) == {"base": 0x30000, "kind": 2, "pad": 0}
    # the kernel reads its block entry at a fixed offset, right after the header
    assert h["block_table"] == structs.PLAN_HEADER.size
    assert structs.CHANNEL_DEV.unpack(blob, h["channel_table"]) == {"inbound": 1, "remote_inbound": 2, "expected": 3}
    assert int.from_bytes(blob[h["peer_abort_table"]:h["peer_abort_table"] + 8], "little") == 0x5000
    tables_end = h["channel_table"] + structs.CHANNEL_DEV.size
    assert h["block_table"] + structs.BLOCK_ENTRY.size * len(packed.blocks) <= h["peer_abort_table"]
    assert tables_end <= ent["offset"]


def test_size_dependent_limits():
    plan = sp.allreduce_oneshot_ll(2)
    plan.gpus[0].remote_buffers = [RemoteBuffer(rank=1, type="s", access_channel_types=["memory"])]
    with pytest.raises(PlanError, match="allgather|outside|needs"):
        pk.pack_blocks(sp.allgather_simple(2), 0, 1024, 1000)


def test_executor_dir_found():
    d = build.executor_dir()
    assert (d / "kernels.cu").is_file() and (d / "plan_layout.cuh").is_file()
    assert build.kernel_name("bf16", "ll8", "max") == "mscclang_bf16_ll8_max"
