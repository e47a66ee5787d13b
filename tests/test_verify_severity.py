"""Severity classes of the verifier (issue 14, item 4): a hazard that exists only because a
relaxed signal/wait publishes multimem (switch-channel) stores is a warning of its own kind, a
plain missing synchronisation stays a race."""

from __future__ import annotations

import numpy as np

from mscclang.plan.models import Plan
from mscclang.sim.engine import Simulation
from mscclang.sim.planbuilder import PlanBuilder, S
from mscclang.sim.program import sim_program
from tests.harness.sim_plans import switch_allreduce


def _races(plan) -> list:
    prog = sim_program(plan, 32, 32)
    inputs = [np.zeros(32, np.uint8) for _ in range(2)]
    sim = Simulation(prog, inputs, dtype=np.dtype(np.float32), launches=2)
    sim.run()
    return [p for p in sim.problems if p.kind == "race"]


def test_race_records_whether_only_a_relaxed_edge_orders_it() -> None:
    relaxed = _races(switch_allreduce("relaxed"))
    assert relaxed and all(p.details["exec_ordered"] for p in relaxed)
    missing = _races(switch_allreduce("none"))
    assert missing and not all(p.details["exec_ordered"] for p in missing)


def nvls_zero_copy_allreduce(n: int, final_relaxed: bool) -> Plan:
    """The shape of MSCCL++'s single-node NVLS zero-copy allreduce: a relaxed ready handshake,
    each rank load-reduces its chunk through the switch channel and multimem-stores it to every
    rank, then a final handshake (relaxed upstream) before the ranks read their outputs."""
    from mscclang.dsl import (AllReduce, BufferType, CollectiveProgram, MemoryChannel, Rank,
                              SwitchChannel, SyncType)

    with CollectiveProgram("nvls_zc", AllReduce(n, 1, True), n) as prog:
        sw = SwitchChannel(rank_list=list(range(n)), buffer_type=BufferType.input)
        ch = {(q, g): MemoryChannel(q, g) for g in range(n) for q in range(n) if q != g}
        for g in range(n):
            for q in range(n):
                if q != g:
                    ch[(q, g)].signal(tb=0, relaxed=True)
            for q in range(n):
                if q != g:
                    ch[(q, g)].wait(tb=0, relaxed=True, data_sync=SyncType.after)
        for g in range(n):
            buf = Rank(g).get_input_buffer()
            sw.at_rank(g).reduce(buffer_offset=g, size=1, dst_chunk=buf[g:g + 1], tb=0)
            sw.at_rank(g).broadcast(src_chunk=buf[g:g + 1], buffer_offset=g, size=1, tb=0)
        for g in range(n):
            for q in range(n):
                if q != g:
                    ch[(q, g)].signal(tb=0, relaxed=final_relaxed, data_sync=SyncType.before)
            for q in range(n):
                if q != g:
                    ch[(q, g)].wait(tb=0, relaxed=final_relaxed)
    return prog.to_plan()


def test_upstream_nvls_shape_is_a_warning_and_strong_sync_is_clean() -> None:
    from mscclang.sim import verify

    rep = verify(nvls_zero_copy_allreduce(4, final_relaxed=True), schedules=3)
    assert rep.kinds() == {"multimem-relaxed"} and rep.ok and rep.exit_code(strict=True) == 1, str(rep)
    assert all("glres" in p.message for p in rep.problems)
    clean = verify(nvls_zero_copy_allreduce(4, final_relaxed=False), schedules=3)
    assert clean.ok and not clean.problems and clean.exit_code(strict=True) == 0, str(clean)
