"""Terms of the verify budget's estimate (:mod:`mscclang.sim.budget`) that the measured table
showed missing or wrong: channel ends a plan declares, the fused symbolic run's shadows, the
clock copies packet writes keep. Deterministic and cheap: estimates and allocations, no run."""

from __future__ import annotations

import numpy as np
import pytest

from mscclang.plan import load_plan
from mscclang.sim.budget import Limits, estimate_runs, size_cost
from tools.budget_table import full_ring


def test_a_thousand_rank_ring_estimate_grows_with_its_channel_count():
    """A ring whose ranks declare a channel to every other rank (999,000 channel ends, two used
    per rank) was estimated as the same ring with two channels per rank: 2.6x too low. The
    simulator pairs every declared end and keeps its state in every run."""
    few, full = load_plan(full_ring(1000, all_peers=False)), load_plan(full_ring(1000))
    shape = [(16, 16, 16)]
    a, b = estimate_runs(few, shape, 2, 2), estimate_runs(full, shape, 2, 2)
    assert b.terms["channel_ends"] == 2 * 1000 * 999 and a.terms["channel_ends"] == 2 * 2000
    assert b.memory_bytes - a.memory_bytes >= 999_000 * 100, (a.memory_bytes, b.memory_bytes)
    assert b.seconds > 1.5 * a.seconds, (a.seconds, b.seconds)


def _fused_oneshot(n: int = 8):
    from mscclang.algorithms import ALGORITHMS

    info = ALGORITHMS["allreduce_add_rms_norm_oneshot_ll"]
    return info.builder(n, instances=1, num_threads_per_block=info.default_threads,
                        inplace=info.inplace_modes[0], min_message_size=info.min_message_size,
                        max_message_size=info.max_message_size)


def test_fused_symbolic_run_shadows_are_estimated_at_the_simulators_granule():
    """A fused plan's symbolic run keeps one shadow row per 4 bytes (the simulator's default
    granule: ``run_fused`` passes none), never skipped; the estimate took the coarsest granule
    verify would use, so the 8-rank fused runs with the symbolic check were estimated at a
    quarter of their memory. The symbolic run's estimate must cover the rows the simulator
    allocates and fills (input, output, residual) and stay within 2x of all it allocates."""
    from mscclang.plan.collectives import spec_from_plan
    from mscclang.plan.layout import make_layouts
    from mscclang.sim.state import RankMemory

    plan = _fused_oneshot()
    n, hidden, rows = len(plan.gpus), 8, 2048
    ib = rows * hidden * 4
    shape = (ib, ib, ib, hidden * 4)
    with_sym = estimate_runs(plan, [], 0, 1, itemsizes=[4], symbolic_size=shape)
    without = estimate_runs(plan, [shape], 1, 1, itemsizes=[4])
    nsym = n * plan.gpus[0].input_chunks
    spec = spec_from_plan(plan)
    mems = [RankMemory(plan, spec, r, lay, nsym, 4, True)
            for r, lay in enumerate(make_layouts(plan, ib, ib, hidden * 4))]
    filled = sum(m.shadow[k].nbytes + m.expr[k].nbytes for m in mems for k in ("in", "out", "res"))
    allocated = sum(v.nbytes for m in mems for d in (m.shadow, m.expr) for v in d.values())
    extra = with_sym.memory_bytes - without.memory_bytes
    assert filled <= extra and with_sym.memory_bytes <= 2 * allocated, (filled, extra, allocated)


def test_packet_clock_copies_are_counted_per_packet_destination_and_scratch_half():
    """Every destination written as packets keeps a copy of the writer's clocks until a later
    launch overwrites it (a double scratch alternates halves, so two launches' worth at most);
    an unpack's plain output keeps none. The estimate counted both, for every launch: the
    128-rank ``allgather_ll`` (12.3 GiB measured) was refused at 22.1 GiB."""
    from mscclang.algorithms import ALGORITHMS
    from mscclang.sim.runner import message_to_bytes

    plan = ALGORITHMS["allgather_ll"].builder(32, instances=1, num_threads_per_block=512)
    assert plan.use_double_scratch_buffer
    ib, ob = message_to_bytes(plan, 1024)[:2]
    assert size_cost(plan, 1024, ib, ob).work.packet_writes == 32 * 31   # the puts, not the unpacks
    # at 32 ranks the clock copies are most of the logs: ten times the launches, not ten times the logs
    three, thirty = (estimate_runs(plan, [(1024, ib, ob)], 1, k, itemsizes=[4]).memory_bytes for k in (3, 30))
    assert thirty < 3 * three, (three, thirty)


def test_verify_holds_one_simulation_at_a_time(monkeypatch):
    """``verify`` frees each run's simulation before it builds the next (numeric runs and the
    symbolic one) when its estimate is large (``COLLECT_BETWEEN_RUNS``; a small verify skips the
    collection, which costs more than it frees), so the estimate's peak is one run's, not two:
    the 128-rank LL allgather's
    default verify (numeric runs, then the symbolic one) ran out of memory building the second
    simulation while the first still held its vector clocks."""
    import importlib
    import weakref

    from mscclang.algorithms import ALGORITHMS
    verify_mod = importlib.import_module("mscclang.sim.verify")

    alive: list = []
    most = [0]

    class Counted(verify_mod.Simulation):
        def __init__(self, *a, **k):
            most[0] = max(most[0], sum(1 for r in alive if r() is not None) + 1)
            super().__init__(*a, **k)
            alive.append(weakref.ref(self))

    monkeypatch.setattr(verify_mod, "Simulation", Counted)
    monkeypatch.setattr(verify_mod, "COLLECT_BETWEEN_RUNS", 0)   # this small verify as if it were large
    plan = ALGORITHMS["allreduce_oneshot_ll"].builder(4, instances=1, num_threads_per_block=512)
    rep = verify_mod.verify(plan, sizes=[4096], schedules=3)
    assert rep.runs >= 4 and len(alive) == rep.runs, (rep.runs, len(alive))
    assert most[0] == 1, f"{most[0]} simulations alive at once"


def test_a_second_run_adds_no_second_simulation():
    """With one simulation alive at a time, a verify of several runs peaks at its largest run."""
    from mscclang.algorithms import ALGORITHMS
    from mscclang.sim.budget import _actors
    from mscclang.sim.runner import message_to_bytes

    plan = ALGORITHMS["allgather_ll"].builder(32, instances=1, num_threads_per_block=512)
    shape = [(1024, *message_to_bytes(plan, 1024)[:2])]
    one, two = (estimate_runs(plan, shape, k, 3, itemsizes=[4]).memory_bytes for k in (1, 2))
    assert two - one < 32 * _actors(plan) ** 2 // 4, (one, two)


@pytest.mark.slow
def test_allgather_ll_at_128_ranks_one_run_fits_three_quarters_of_a_24_gib_machine():
    """One numeric run (``symbolic=False``) keeps 8 GiB of vector clocks and 4 GiB of packet
    clock copies: 12.3 GiB measured, and accepted under three quarters of a 24 GiB machine; with
    the symbolic run as well (one simulation alive at a time) it is accepted too."""
    from mscclang.algorithms import ALGORITHMS
    from mscclang.sim.dtypes import parse_dtype
    from mscclang.sim.verify import estimate_verify

    plan = ALGORITHMS["allgather_ll"].builder(128, instances=1, num_threads_per_block=512)
    dts = [parse_dtype(d) for d in ("float16", "float32")]
    one = estimate_verify(plan, [2048], dts, 1, 3, symbolic=False)
    both = estimate_verify(plan, [2048], dts, 1, 3)
    assert one.fits(Limits(int(0.75 * 24 * 2**30), 1e9)), one.memory_bytes
    assert 0.5 <= one.memory_bytes / (12.3 * 2**30) <= 2, one.memory_bytes
    assert both.fits(Limits(int(0.75 * 24 * 2**30), 1e9)), both.memory_bytes
