"""The device format of plans with segmented buffers (mscclang.runtime.counted): segment records
evaluated as the kernel evaluates them equal the simulator's pieces, rank by rank, block by block,
op by op; the count checks agree with the CPU rule and name what failed; the header carries the
counts; check_runnable takes such plans but refuses port channels over segments."""

from __future__ import annotations

import random

import pytest

from mscclang import AllToAllV, Buffer, PlanError, ThreadBlockGroup
from mscclang.algorithms.alltoallv import (build_alltoallv_ll, build_alltoallv_port, build_alltoallv_simple,
                                          build_alltoallv_zero_copy)
from mscclang.algorithms.common import input_of, mesh_program, output_of, peers
from mscclang.dsl import Rank
from mscclang.errors import CountsError, InvalidCall, NotPrepared
from mscclang.plan.models import MAX_MESSAGE_SIZE
from mscclang.plan.segments import CountedCall, check_counts, count_cases, counted_call
from mscclang.runtime.counted import (
    CHECK_EXPECT, CHECK_INPUT, CHECK_NONNEG, CHECK_OUTPUT, CHECK_SCRATCH, CountedLaunch, count_tables, counted_blob,
    counts_error_text, matrix, pack_counted,
)
from mscclang.runtime.device_plan import DOP_DATA, FLAG_SEGMENTS, check_runnable
from mscclang.runtime.spec_source import parse_region
from mscclang.runtime.structs import COUNT_CHECK, PLAN_HEADER
from mscclang.sim.program import sim_program
from tests.harness.counted_format import check_failure, evaluate_record, merged

BUILDERS = (build_alltoallv_ll, build_alltoallv_simple, build_alltoallv_zero_copy)


def _launch(call: CountedCall, r: int) -> CountedLaunch:
    return CountedLaunch(0x7000, call.row_bytes, call.capacity, call.in_rows[r], call.out_rows[r])


def _compare(plan, call: CountedCall) -> int:  # type: ignore[no-untyped-def]
    """Every data record of every rank and block, evaluated for ``call``, against the simulator's
    groups of the same op; returns how many records were compared."""
    prog = sim_program(plan, call.in_rows[0] * call.row_bytes, call.out_rows[0] * call.row_bytes, counted=call)
    tables = count_tables(plan)
    m = matrix(call.counts, call.in_rows, call.out_rows)
    seen = 0
    for r in range(len(plan.gpus)):
        packed = pack_counted(plan, r, _launch(call, r))
        for t, block in enumerate(packed.blocks):
            recs = [x for x in parse_region(block.region) if x.kind == DOP_DATA]
            groups = [(c.index, g) for c in prog.blocks[r][t] for g in c.groups]
            assert [str(x.index) for x in recs] == [i for i, _ in groups], (r, t)
            for rec, (i, g) in zip(recs, groups):
                assert rec.flags & FLAG_SEGMENTS and rec.total == 0
                got = merged(evaluate_record(rec, tables, m, call.row_bytes, call.capacity))
                assert got == merged(g.pieces), (plan.name, r, t, i)
                seen += 1
    return seen


@pytest.mark.parametrize("builder", BUILDERS, ids=lambda b: b.__name__)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_segment_records_evaluate_to_the_simulators_pieces(builder, n: int) -> None:
    plan = builder(n)
    check_runnable(plan)
    rng = random.Random(n)
    compared = 0
    for case in count_cases(n, seed=n):
        for row_bytes in (8, 48):
            cap = max([v for row in case.counts for v in row] + [0]) + rng.choice((0, 3))
            call = counted_call(plan, case.counts, row_bytes, capacity=cap,
                                out_rows=[sum(case.counts[p][r] for p in range(n)) + rng.randrange(3) for r in range(n)])
            compared += _compare(plan, call)
    assert compared >= len(count_cases(n)) * 2 * n * (n - 1)


def _tbg_plan(n: int):  # type: ignore[no-untyped-def]
    """Thread-block groups over segments: a copy of every input segment into its scratch slot
    (several pieces, packed into slots) split over 3 blocks, puts over 2, a copy over 2."""
    with mesh_program("a2av_tbg", AllToAllV, n, 1, False, "Simple", 1024, None, 0, MAX_MESSAGE_SIZE) as (prog, ch):
        scratch = [Buffer(r, segments=[(r, p) for p in range(n)]) for r in range(n)]
        for r in range(n):
            inp, out, me = input_of(r), output_of(r), Rank(r)
            me.copy(scratch[r][0:n], inp[0:n], tb_group=ThreadBlockGroup([0, 1, 2]))
            for j, p in enumerate(peers(r, n)):
                ch[(r, p)].put(output_of(p)[r], inp[p], tb_group=ThreadBlockGroup([3 + 2 * j, 4 + 2 * j]))
            me.copy(out[r], scratch[r][r], tb_group=ThreadBlockGroup([0, 1]))
    return prog.to_plan()


@pytest.mark.parametrize("n", [2, 4])
def test_thread_block_groups_split_the_run_time_total_as_the_simulator(n: int) -> None:
    plan = _tbg_plan(n)
    assert any(op.tbg_info is not None and op.tbg_info.tbg_size == 3 for op in plan.gpus[0].threadblocks[0].ops)
    for case in count_cases(n, rows=5, seed=n):
        for row_bytes in (8, 24):
            cap = max([v for row in case.counts for v in row] + [1]) + 1
            assert _compare(plan, counted_call(plan, case.counts, row_bytes, capacity=cap)) > 0


def test_segment_records_do_not_depend_on_sizes_or_counts() -> None:
    plan = build_alltoallv_simple(4)
    a = pack_counted(plan, 1, CountedLaunch(0, 8, 4, 10, 10))
    b = pack_counted(plan, 1, CountedLaunch(0, 64, 100, 1000, 2000))
    assert [x.region for x in a.blocks] == [x.region for x in b.blocks]


def test_the_tables_name_each_buffer_once_and_list_the_checks_in_order() -> None:
    n = 3
    plan = build_alltoallv_ll(n)
    t = count_tables(plan)
    for g in plan.gpus:
        for sb in g.segments or ():
            assert t.entries(t.lists[(g.id, sb.type)], len(sb.counts)) == sb.entries()
    kinds = [c.kind for c in t.checks]
    assert kinds == sorted(kinds, key=[CHECK_NONNEG, CHECK_EXPECT, CHECK_INPUT, CHECK_OUTPUT, CHECK_SCRATCH].index)
    assert kinds.count(CHECK_EXPECT) == n and kinds.count(CHECK_INPUT) == n and kinds.count(CHECK_SCRATCH) == n
    assert len(set(t.words)) <= n * n and len(t.words) == len({tuple(t.words[s:s + n]) for s in t.lists.values()}) * n


@pytest.mark.parametrize("builder", BUILDERS, ids=lambda b: b.__name__)
def test_the_device_checks_agree_with_the_cpu_rule(builder) -> None:
    n = 4
    plan = builder(n)
    tables = count_tables(plan)
    rng = random.Random(7)
    fails = 0
    for _ in range(300):
        counts = [[-1 if rng.random() < 0.01 else rng.choice((0, 1, 2, 3, 5)) for _ in range(n)] for _ in range(n)]
        ins = [rng.randrange(6, 16) for _ in range(n)]
        outs = [rng.randrange(6, 16) for _ in range(n)]
        cap = rng.randrange(3, 7)
        call = CountedCall(tuple(map(tuple, counts)), 8, tuple(ins), tuple(outs), cap)
        try:
            check_counts(plan, call)
            cpu = None
        except CountsError as e:
            cpu = str(e)
        dev = check_failure(tables, matrix(counts, ins, outs), cap)
        assert (cpu is None) == (dev is None), (counts, ins, outs, cap, cpu, dev)
        fails += dev is not None
    assert 0 < fails < 300


def test_failed_checks_name_the_rank_the_entry_and_the_bound() -> None:
    plan = build_alltoallv_zero_copy(4)
    t = count_tables(plan)
    good = [[1, 2, 3, 4] for _ in range(4)]
    ins, outs = [10] * 4, [16] * 4

    def text(counts, ins=ins, outs=outs, expect=None, cap=8) -> str:  # type: ignore[no-untyped-def]
        f = check_failure(t, matrix(counts, ins, outs, expect), cap)
        assert f is not None
        return counts_error_text(**f)

    assert check_failure(t, matrix(good, ins, outs), 8) is None
    bad = [row[:] for row in good]
    bad[1][3] = -2
    assert text(bad) == "count [1][3] is -2 (a segment of rank 1): counts must be at least 0"
    bad = [row[:] for row in good]
    bad[0][2] = 70
    assert text(bad, ins=[100] * 4, outs=[64] * 4, cap=100) == (
        "rank 2: its output segments hold 79 rows (the counts it receives), more than its output's 64 rows")
    assert text(good, ins=[10, 9, 10, 10]) == (
        "rank 1: its input segments hold 10 rows (the counts it sends), more than its input's 9 rows")
    expect = [[-1] * 4 for _ in range(4)]
    expect[1][3] = 5
    assert text(good, expect=expect) == "rank 1 expects 5 rows from rank 3, rank 3 sends 2"
    expect[1][3] = 2
    assert check_failure(t, matrix(good, ins, outs, expect), 8) is None
    lp = count_tables(build_alltoallv_simple(4))
    f = check_failure(lp, matrix(good, ins, outs), 3)
    assert counts_error_text(**f) == "rank 0: count [0][3] = 4 rows passes the capacity of 3 rows (a scratch segment)"


def test_the_header_carries_the_counts_and_the_tables_follow_the_plan() -> None:
    plan = build_alltoallv_ll(2)
    t = count_tables(plan)
    blob = PLAN_HEADER.pack(magic=1, n_blocks=2, block_table=PLAN_HEADER.size) + b"\x01" * 40
    launch = CountedLaunch(0xABCD00, 16, 9, 4, 5)
    out = counted_blob(blob, t, launch)
    assert out[PLAN_HEADER.size:len(blob)] == blob[PLAN_HEADER.size:]
    h = PLAN_HEADER.unpack(out)
    assert (h["counts"], h["row_bytes"], h["capacity"], h["n_ranks"], h["n_checks"]) == (0xABCD00, 16, 9, 2, len(t.checks))
    assert h["seg_table"] % 16 == 0 and h["check_table"] % 16 == 0 and h["seg_table"] >= len(blob)
    words = [int.from_bytes(out[h["seg_table"] + 4 * i:h["seg_table"] + 4 * i + 4], "little") for i in range(len(t.words))]
    assert tuple(words) == t.words
    c = COUNT_CHECK.unpack(out, h["check_table"] + COUNT_CHECK.size * (len(t.checks) - 1))
    assert (c["kind"], c["rank"], c["first"], c["count"]) == (t.checks[-1].kind, t.checks[-1].rank, t.checks[-1].first,
                                                              t.checks[-1].count)


def test_port_puts_of_scratch_segments_run_as_whole_slot_copies() -> None:
    """The copy-engine all-to-all-v is runnable (its port puts move whole scratch slots), and its
    device plan for a launch carries the proxy's script with one whole-slot copy per peer."""
    plan = build_alltoallv_port(4)
    check_runnable(plan)
    packed = pack_counted(plan, 1, CountedLaunch(0, 16, 6, 10, 10))
    copies = [c for ch in packed.port.channels for t in ch.triggers for c in t.copies]
    assert sorted((c.src_off, c.dst_off, c.length) for c in copies) == [
        (p * 6 * 16, (4 + 1) * 6 * 16, 6 * 16) for p in (0, 2, 3)]


def test_the_specialised_kernel_leaves_segment_plans_to_the_interpreter() -> None:
    from mscclang.errors import SpecUnsupported
    from mscclang.runtime.spec_source import generate

    plan = build_alltoallv_simple(2)
    with pytest.raises(SpecUnsupported, match="runs on the interpreter"):
        generate(plan, pack_counted(plan, 0, CountedLaunch(0, 8, 4, 8, 8)), "f32", "ll16", "sum")


def test_a_plan_with_segments_is_not_packed_for_a_message_size() -> None:
    from mscclang.runtime.packing import pack_blocks

    with pytest.raises(PlanError, match="execute_counted"):
        pack_blocks(build_alltoallv_ll(2), 0, 1024, 1024)


# -- the executor's launch, on the host (fake CUDA, fake collaborators) ------------------------


class _Tensor:
    """What the launch reads of a CUDA tensor."""

    def __init__(self, nbytes: int, addr: int) -> None:
        import torch

        self.dtype, self.is_cuda, self.device = torch.int32, True, "cuda:0"
        self._n, self._a = nbytes // 4, addr

    def data_ptr(self) -> int:
        return self._a

    def numel(self) -> int:
        return self._n

    def element_size(self) -> int:
        return 4

    def get_device(self) -> int:
        return 0

    def is_contiguous(self) -> bool:
        return True


class _FakeExecutor:
    """The executor's parts a counted launch uses; device memory is a dict of uploaded blobs."""

    def __init__(self, plan, rank: int = 0, others: bytes = b"") -> None:  # type: ignore[no-untyped-def]
        import types

        from mscclang.runtime.device_plan import sync_layout
        from mscclang.runtime.state import Context, LoadedPlan

        self.blobs: dict[int, bytes] = {}
        self.runs: list[tuple] = []
        self.capturing = False
        self.lp = LoadedPlan(plan, False, "ll16", "sum", plan.num_threads_per_block, len(plan.gpus[rank].threadblocks))
        self.abort = types.SimpleNamespace(aborted=False, state=lambda: 0, user_thread=None)
        self.comm = types.SimpleNamespace(rank=rank, world_size=len(plan.gpus), device=0,
                                          allgather_bytes=lambda data, tag: [data] + [others or data] * (len(plan.gpus) - 1))
        self.launcher = types.SimpleNamespace(current_stream=lambda: 5, stream_capturing=lambda s: self.capturing)
        self.kernels = types.SimpleNamespace(interpreter=lambda *a, **kw: 77, fit=lambda *a: None)
        self.grown: list[int] = []

        def ensure(lp, i, o, need):  # type: ignore[no-untyped-def]
            self.grown.append(need)
            if lp.ctx is None or lp.ctx.scratch_bytes < need:
                lp.ctx = Context(sync_layout(plan, rank), 0x1000, 0x200000, need, {}, {})
            return lp.ctx

        def addresses(lp, ctx, si, so, packed, area=0):  # type: ignore[no-untyped-def]
            from mscclang.runtime.device_plan import Addresses

            return Addresses(ctx.sync_base, ctx.scratch_base, 0, 0xE000, [0xF000], [(0xA0000 + 256 * k, 2)
                             for k in range(len(plan.gpus[rank].remote_buffers))], [(1, 2, 3)] * len(lp.table(rank).memory))

        from mscclang.runtime.contexts import ContextPool

        # the real upload (pack_blob, the counted part, the DevPlan) over these fakes
        self.contexts = types.SimpleNamespace(ensure=ensure, addresses=addresses)
        self.contexts.upload = lambda *a, **kw: ContextPool.upload(self.contexts, *a, **kw)

    def load(self, plan):  # type: ignore[no-untyped-def]
        return self.lp

    def _packet(self, lp, p) -> str:  # type: ignore[no-untyped-def]
        return "ll16"

    def run(self, lp, ent, opr, in_ptr, out_ptr, in_bytes, out_bytes, s) -> None:  # type: ignore[no-untyped-def]
        self.runs.append((ent.blob, ent.func, opr.mode, in_ptr, out_ptr, in_bytes, out_bytes, s))


@pytest.fixture
def fake_cuda(monkeypatch):  # type: ignore[no-untyped-def]
    from mscclang.runtime import cuda as cu

    mem: dict[int, bytes] = {}
    nxt = [0x7000_0000]

    def mem_alloc(n: int) -> int:
        p = nxt[0]
        nxt[0] += (n + 255) // 256 * 256
        return p

    monkeypatch.setattr(cu, "mem_alloc", mem_alloc)
    monkeypatch.setattr(cu, "htod", lambda p, data, stream=0: mem.__setitem__(p, bytes(data)))
    return mem


def test_a_counted_launch_uploads_a_plan_with_the_counts_and_reuses_it(fake_cuda) -> None:
    from mscclang.runtime.counted import counted_scratch_bytes, run_counted_launch

    plan = build_alltoallv_ll(2)
    ex = _FakeExecutor(plan)
    launch = CountedLaunch(0xC0_0000, 16, 5, 10, 12)
    inp, out = _Tensor(160, 0x9000_0000), _Tensor(192, 0x9100_0000)
    run_counted_launch(ex, plan, inp, out, launch)
    run_counted_launch(ex, plan, inp, out, launch)
    assert len(fake_cuda) == 1 and ex.grown == [counted_scratch_bytes(plan, launch)]
    (p, blob), = fake_cuda.items()
    h = PLAN_HEADER.unpack(blob)
    t = count_tables(plan)
    assert (h["counts"], h["row_bytes"], h["capacity"], h["n_ranks"], h["n_checks"]) == (0xC0_0000, 16, 5, 2, len(t.checks))
    assert ex.runs == [(p, 77, "direct", 0x9000_0000, 0x9100_0000, 160, 192, 5)] * 2
    assert ex._last_call == f"alltoallv of 160 B in, 192 B out i32 on plan {plan.name} LL16 (counted)"
    ex.capturing = True   # a new launch shape cannot be set up inside a capture; a known one runs
    run_counted_launch(ex, plan, inp, out, launch)
    with pytest.raises(NotPrepared, match="launch it once before capturing"):
        run_counted_launch(ex, plan, inp, out, CountedLaunch(0xC0_0000, 16, 6, 10, 12))


def test_a_counted_launch_refuses_what_it_cannot_run(fake_cuda) -> None:
    from mscclang.runtime.counted import run_counted_launch

    plan = build_alltoallv_ll(2)
    ex = _FakeExecutor(plan)
    with pytest.raises(InvalidCall, match="row_bytes must be a positive multiple of 8"):
        run_counted_launch(ex, plan, _Tensor(160, 0x1000), _Tensor(160, 0x2000), CountedLaunch(0, 12, 5, 10, 10))
    with pytest.raises(InvalidCall, match="the output holds 160 bytes, the launch needs 192"):
        run_counted_launch(ex, plan, _Tensor(160, 0x1000), _Tensor(160, 0x2000), CountedLaunch(0, 16, 5, 10, 12))
    ex = _FakeExecutor(plan, others=b"16 7")
    with pytest.raises(InvalidCall, match="the same row_bytes and capacity on every rank, got rank 0: 16 5, rank 1: 16 7"):
        run_counted_launch(ex, plan, _Tensor(160, 0x1000), _Tensor(192, 0x2000), CountedLaunch(0, 16, 5, 10, 12))
    zc = build_alltoallv_zero_copy(2)
    ex = _FakeExecutor(zc)
    ex.lp.zero_copy = True
    ex.comm.symmetric_of = lambda p: None
    with pytest.raises(InvalidCall, match="run it on symmetric buffers"):
        run_counted_launch(ex, zc, _Tensor(160, 0x1000), _Tensor(192, 0x2000), CountedLaunch(0, 16, 5, 10, 12))
    assert not fake_cuda


def test_a_launch_that_does_not_fit_is_refused_at_every_call(fake_cuda) -> None:
    """The kernel's fit is checked before the device plan is kept: a second call of a shape that
    does not fit is refused again, never launched."""
    from mscclang.runtime.counted import run_counted_launch

    plan = build_alltoallv_ll(2)
    ex = _FakeExecutor(plan)

    def fit(*a):  # type: ignore[no-untyped-def]
        raise PlanError("rank 0: 2 blocks do not fit")

    ex.kernels.fit = fit
    launch = CountedLaunch(0xC0_0000, 16, 5, 10, 12)
    for _ in range(2):
        with pytest.raises(PlanError, match="do not fit"):
            run_counted_launch(ex, plan, _Tensor(160, 0x9000_0000), _Tensor(192, 0x9100_0000), launch)
    assert ex.runs == [] and not fake_cuda
