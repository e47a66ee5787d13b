"""The traced kernel variant's buffer layout and its decoding (mscclang.runtime.trace), on the
CPU: a buffer written as the kernel writes it decodes to one event per plan op, in the plan's
order per block, merged over the op's device records; the traced kernels are a module of their
own (the untraced one does not change) and carry their own names."""

from __future__ import annotations

from pathlib import Path

import pytest

from mscclang.errors import PlanError
from mscclang.plan.io import load_plan
from mscclang.runtime import build
from mscclang.runtime.packing import pack_blocks
from mscclang.runtime.trace import chrome_trace, decode, record_ops, trace_words
from mscclang.viz.graph import build_graph
from mscclang.viz.timing import apply_trace

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["allreduce_rsag_zero_copy.r2.i32.inplace", "allreduce_oneshot_ll.r2.i1.inplace",
                                  "allgather_port.r2.i1"])
def test_a_buffer_written_as_the_kernel_writes_it_decodes_per_op(name):
    f = ROOT / "plans" / f"{name}.json"
    if not f.is_file():
        pytest.skip("the shipped plans are not here")
    plan = load_plan(f)
    events = []
    for rank in range(plan.world_size):
        packed = pack_blocks(plan, rank, 1 << 16, 1 << 16 if plan.collective != "allgather" else 2 << 16)
        regions = [b.region for b in packed.blocks]
        lay = trace_words([b.n_records for b in packed.blocks])
        words = [0] * lay.words
        words[0] = lay.stride
        t = 10_000 + 1000 * rank
        for b, region in enumerate(regions):
            for i, _ in enumerate(record_ops(region)):
                words[1 + b * lay.stride + 2 * i] = t
                words[2 + b * lay.stride + 2 * i] = t + 500
                t += 700
        rt = decode(plan, rank, regions, words)
        assert rt.problems == [] and rt.t0_ns == 10_000 + 1000 * rank
        ev = rt.events
        for tb in plan.gpus[rank].threadblocks:
            mine = [e for e in ev if e["tid"] == tb.id]
            assert [e["args"]["index"] for e in sorted(mine, key=lambda e: e["ts"])] == list(range(len(tb.ops)))
            assert all(e["dur"] >= 0.5 for e in mine)   # at least one record of 500 ns
        assert min(e["ts"] for e in ev) == 0.0
        events += ev
    tr = chrome_trace(events, plan)
    # the plan picture takes the measured trace like the predicted one
    timed = apply_trace(build_graph(plan), tr)
    assert timed.total_us > 0 and timed.critical


def test_a_buffer_that_does_not_fit_is_refused():
    plan = load_plan(ROOT / "plans" / "allreduce_oneshot_ll.r2.i1.inplace.json")
    packed = pack_blocks(plan, 0, 4096, 4096)
    regions = [b.region for b in packed.blocks]
    with pytest.raises(PlanError, match="does not fit"):
        decode(plan, 0, regions, [3, 0, 0])
    lay = trace_words([b.n_records for b in packed.blocks])
    rt = decode(plan, 0, regions, [lay.stride] + [0] * (lay.words - 1))   # nothing ran
    assert rt.events == [] and rt.problems == ["rank 0: no op ran"]


def test_traced_kernels_are_a_module_of_their_own():
    plain, traced = build.module_source("f32"), build.module_source("f32", traced=True)
    assert "MSCCLANG_TRACED" not in plain and traced.startswith("#define MSCCLANG_TRACED\n")
    # the same kernels, made traced by the macro (the epilogue kernels have no traced variant)
    assert plain.replace("MSCCLANG_EPI_KERNELS_DT(f32, DT_F32)\n", "") in traced and "EPI" not in traced
    assert build.kernel_name("f32", "ll16", "sum", 512, traced=True) == "mscclang_f32_ll16_sum_t512_trace"
    assert build.kernel_name("f32", "ll16", "sum") == "mscclang_f32_ll16_sum"


@pytest.mark.slow
def test_the_traced_module_compiles_and_the_untraced_one_has_no_trace_kernel():
    try:
        build.nvrtc_version()
    except Exception as e:  # noqa: BLE001 - no NVRTC here
        pytest.skip(f"NVRTC unavailable: {e}")
    cub = build.compile_source(build.module_source("i32", traced=True), "sm_90", name="mscclang_i32_trace.cu")
    assert b"mscclang_i32_ll16_sum_trace" in cub and b"mscclang_i32_ll16_sum\x00" not in cub


def _written(plan, rank, packed, at):
    """A trace buffer of ``packed`` with record i of block b at ``at(b, i)`` = (start, end) or None."""
    regions = [b.region for b in packed.blocks]
    lay = trace_words([b.n_records for b in packed.blocks])
    words = [0] * lay.words
    words[0] = lay.stride
    for b, region in enumerate(regions):
        for i, _ in enumerate(record_ops(region)):
            se = at(b, i)
            if se is not None:
                words[1 + b * lay.stride + 2 * i], words[2 + b * lay.stride + 2 * i] = se
    return regions, words


def test_a_launch_that_departs_from_the_plan_says_where():
    plan = load_plan(ROOT / "plans" / "allreduce_oneshot_ll.r2.i1.inplace.json")
    packed = pack_blocks(plan, 0, 4096, 4096)
    n = len(record_ops(packed.blocks[0].region))
    assert n >= 2
    # record 1 of block 0 starts before record 0 ends; the last record of block 0 never ran
    regions, words = _written(plan, 0, packed, lambda b, i: None if (b, i) == (0, n - 1) else
                              ((5000, 9000) if (b, i) == (0, 0) else (6000 + 1000 * i, 6500 + 1000 * i)))
    rt = decode(plan, 0, regions, words)
    idx = [index for kind, index in record_ops(regions[0])]
    assert any(f"thread block 0 op {idx[1]}: started" in p and f"before op {idx[0]} ended" in p for p in rt.problems)
    if idx[-1] != idx[-2]:
        assert f"rank 0 thread block 0 op {idx[-1]}: did not run" in rt.problems


def test_ranks_are_put_on_one_time_base():
    from mscclang.runtime.trace import RankTrace, align

    a = RankTrace(0, 1_000_000, [{"ts": 0.0, "dur": 1.0, "pid": 0}])
    b = RankTrace(1, 1_002_500, [{"ts": 0.5, "dur": 1.0, "pid": 1}])
    got = align([b, a, RankTrace(2, 0, [])])
    assert sorted((e["pid"], e["ts"]) for e in got) == [(0, 0.0), (1, 3.0)]
    assert b.events[0]["ts"] == 0.5   # the traces are not changed


@pytest.mark.parametrize("name", ["alltoallv_ll.r2.i1", "alltoallv_simple.r4.i1", "alltoallv_port.r4.i1"])
def test_a_counted_launch_trace_names_each_segment_ops_rows(name):
    """A plan with segments: each segment op's event carries the count entries of its segments,
    the rows they held in this call and the bytes it moved (a port put: its whole slots); chunk
    ops carry none."""
    from mscclang.plan.segments import counted_call, moves_whole_slots, ref_entries
    from mscclang.runtime.counted import CountedLaunch, pack_counted

    plan = load_plan(ROOT / "plans" / f"{name}.json")
    n = plan.world_size
    counts = [[(3 * i + 5 * j) % 7 for j in range(n)] for i in range(n)]
    call = counted_call(plan, counts, 48, capacity=8)
    seen = 0
    for rank in range(n):
        launch = CountedLaunch(0, 48, 8, call.in_rows[rank], call.out_rows[rank])
        regions = [b.region for b in pack_counted(plan, rank, launch).blocks]
        lay = trace_words([len(record_ops(r)) for r in regions])
        words = [lay.stride] + [0] * (lay.words - 1)
        for b, region in enumerate(regions):
            for i, _ in enumerate(record_ops(region)):
                words[1 + b * lay.stride + 2 * i: 3 + b * lay.stride + 2 * i] = [100 + 10 * i, 105 + 10 * i]
        rt = decode(plan, rank, regions, words, counted=call)
        assert rt.problems == []
        for e in rt.events:
            tb = plan.gpus[rank].threadblocks[e["tid"]]
            op = tb.ops[e["args"]["index"]]
            entries = next((x for x in (ref_entries(plan, rank, tb, op, r) for r in list(op.src_buff) + list(op.dst_buff))
                            if x is not None), None)
            if entries is None:
                assert "rows" not in e["args"]
                continue
            rows = [counts[i][j] for i, j in entries]
            moved = 8 * len(rows) if moves_whole_slots(op) else sum(rows)
            assert e["args"]["rows"] == sum(rows) and e["args"]["bytes"] == 48 * moved, (name, op.name)
            assert e["args"]["segments"] == " ".join(f"[{i},{j}]={v}" for (i, j), v in zip(entries, rows))
            seen += 1
    assert seen
