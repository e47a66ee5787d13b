"""mscclang.sim.run: numbers, dtypes, reduce ops, packet types, launches, schedules."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mscclang.cli.args import parse_size
from mscclang.errors import MscclangError, VerificationError
from mscclang.sim import Deadlock, run, verify

from tests.harness.sim_plans import (
    get_allreduce,
    ll_allreduce,
    ll_oneshot_allreduce,
    pipelined_allgather,
    port_allgather,
    rppkt_allgather,
    switch_allreduce,
    wait_cycle,
    zero_copy_allreduce,
)


def _ref_pair(a: np.ndarray, b: np.ndarray, op: str) -> np.ndarray:
    dt = a.dtype
    f = {"sum": np.add, "min": np.minimum, "max": np.maximum}[op]
    if dt in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        return f(a.astype(np.float32), b.astype(np.float32)).astype(dt)
    return f(a, b)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.int32])
@pytest.mark.parametrize("op", ["sum", "min", "max"])
@pytest.mark.parametrize("builder", [ll_allreduce, zero_copy_allreduce, get_allreduce, switch_allreduce])
def test_two_rank_allreduce_bit_exact(builder, dtype, op) -> None:
    rng = np.random.default_rng(7)
    n = 46  # not a multiple of the alignment: the last chunk is short
    if np.dtype(dtype).kind == "i":
        xs = [rng.integers(-2**31, 2**31 - 1, n, dtype=np.int64).astype(np.int32) for _ in range(2)]
    else:
        xs = [rng.standard_normal(n).astype(np.float32).astype(dtype) for _ in range(2)]
    ref = _ref_pair(xs[0], xs[1], op)   # int32 sums wrap, like the kernel
    for pt in ("LL16", "LL8"):
        outs = run(builder(), xs, reduce_op=op, packet_type=pt, launches=2, schedule="random", seed=3)
        for o in outs:
            assert o.dtype == np.dtype(dtype)
            assert np.array_equal(o.view(np.uint8), ref.view(np.uint8))


@pytest.mark.parametrize("builder", [pipelined_allgather, port_allgather, rppkt_allgather])
@pytest.mark.parametrize("schedule", ["round_robin", "random", "adversarial", "runahead"])
def test_allgather_outputs(builder, schedule) -> None:
    plan = builder()
    n = len(plan.gpus)
    xs = [np.arange(40, dtype=np.float32) + 100 * r for r in range(n)]
    outs = run(plan, xs, launches=3, schedule=schedule, seed=11)
    want = np.concatenate(xs)
    for o in outs:
        assert np.array_equal(o, want)


def test_inputs_are_refed_each_launch_and_inplace_aliases() -> None:
    xs = [np.full(16, 1.0, np.float32), np.full(16, 2.0, np.float32)]
    out = run(ll_allreduce(), xs, launches=3)     # in-place: input lives in the output
    assert all(np.array_equal(o, np.full(16, 3.0, np.float32)) for o in out)


def test_deadlock_raises_with_cycle() -> None:
    with pytest.raises(Deadlock) as ei:
        run(wait_cycle(), [np.zeros(8, np.float32)] * 2)
    assert isinstance(ei.value, VerificationError)
    assert "wait-for cycle" in str(ei.value)


def test_bad_inputs_rejected() -> None:
    with pytest.raises(VerificationError):
        run(ll_allreduce(), [np.zeros(8, np.float32)])
    with pytest.raises(VerificationError):
        run(ll_allreduce(), [np.zeros(8, np.float32), np.zeros(8, np.float16)])


def test_report_is_one_screen() -> None:
    rep = verify(ll_oneshot_allreduce(double=False), schedules=3)
    text = str(rep)
    assert not rep.ok and len(text.splitlines()) <= 24
    assert text.startswith("verify ll_oneshot_allreduce: FAILED")
    ok = verify(ll_allreduce(), schedules=3, sizes=[64, 1000])
    assert ok.ok and str(ok).startswith("verify ll_allreduce: OK") and ok.sizes == [64, 1000]


def test_parse_size() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("1K") == 1024
    assert parse_size("4M") == 4 << 20
    assert parse_size("2KiB") == 2048
    with pytest.raises((MscclangError, ValueError)):
        parse_size("lots")


def test_verify_rotation_includes_runahead_with_rotating_leads() -> None:
    from mscclang.sim import SCHEDULES

    assert SCHEDULES == ("round_robin", "random", "adversarial", "runahead")
    rep = verify(ll_allreduce(double=True), schedules=8, launches=3)
    assert rep.ok, str(rep)
    assert rep.schedules == list(SCHEDULES) * 2


def test_runahead_lead_is_checked_and_run_accepts_it() -> None:
    from mscclang.errors import PlanError
    from mscclang.sim import Simulation, sim_program

    plan = ll_allreduce(double=True)
    prog = sim_program(plan, 64, 64)
    with pytest.raises(PlanError, match="lead rank 2"):
        Simulation(prog, [np.zeros(64, np.uint8)] * 2, dtype=np.dtype(np.float16), schedule="runahead", lead=2)
    xs = [np.arange(16, dtype=np.float32) * (r + 1) for r in range(2)]
    for seed in (0, 1):   # lead = seed % ranks
        outs = run(plan, xs, launches=3, schedule="runahead", seed=seed)
        for o in outs:
            assert np.array_equal(o, xs[0] + xs[1])


def test_run_state_numbers_every_thread_once_blocks_then_hosts_then_proxies() -> None:
    """A run's threads: each rank's blocks in order, then one host per rank, then one proxy per
    (rank, port channel), in that order; every vector clock has one entry per thread."""
    from mscclang.plan import load_plan
    from mscclang.plan.collectives import spec_from_plan
    from mscclang.plan.models import ChannelType
    from mscclang.sim.engine import run_state
    from mscclang.sim.program import sim_program

    plan = load_plan("plans/allgather_port.r4.i1.json")
    st = run_state(sim_program(plan, 4096, 4 * 4096), spec_from_plan(plan), 0, 4)
    blocks = [a.tid for acts in st.block_actors for a in acts]
    hosts = [a.tid for a in st.hosts]
    proxies = [p.actor.tid for p in st.proxies.values()]
    assert blocks + hosts + proxies == list(range(st.nthreads)) and st.host_tids == set(hosts)
    assert len(blocks) == sum(len(g.threadblocks) for g in plan.gpus) and len(hosts) == 4
    ports = [(r, c) for r, g in enumerate(plan.gpus) for c in range(len(g.peers(ChannelType.port)))]
    assert ports and list(st.proxies) == ports
    assert all(len(a.vc) == st.nthreads for a in st.hosts + [p.actor for p in st.proxies.values()])
