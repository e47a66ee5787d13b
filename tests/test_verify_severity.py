"""Severity classes of the verifier (issue 14, item 4): a hazard that exists only because a
relaxed signal/wait publishes multimem (switch-channel) stores is a warning of its own kind, a
plain missing synchronisation stays a race."""

from __future__ import annotations

import numpy as np

from mscclang.plan.models import Plan
from mscclang.sim.engine import Simulation
from mscclang.sim.planbuilder import PlanBuilder, S
from mscclang.sim.program import compile_program


def switch_allreduce(final: str = "strong") -> Plan:
    """2-rank in-place switch allreduce (glres over the outputs); ``final`` is how the ranks
    publish the multimem stores at the end: ``strong`` signal/wait, ``relaxed`` rlxsignal/rlxwait,
    or ``none`` (no final synchronisation at all)."""
    b = PlanBuilder(f"switch_allreduce_{final}", "allreduce", 2, 2, 2, inplace=True)
    for r in range(2):
        p = 1 - r
        sw = b.switch(r, "o", [0, 1])
        b.nop(r, 0)
        b.op(r, 0, "rlxsignal", channels=[p])
        b.op(r, 0, "rlxwait", channels=[p])
        b.nop(r, 0)
        b.op(r, 0, "glres", src=[S(sw, r, 1)], dst=[S(sw, r, 1)], reduce_op="sum")
        b.nop(r, 0)
        if final != "none":
            b.op(r, 0, "rlxsignal" if final == "relaxed" else "signal", channels=[p])
            b.op(r, 0, "rlxwait" if final == "relaxed" else "wait", channels=[p])
            b.nop(r, 0)
    return b.build()


def _races(plan) -> list:
    prog = compile_program(plan, 32, 32)
    inputs = [np.zeros(32, np.uint8) for _ in range(2)]
    sim = Simulation(prog, inputs, dtype=np.dtype(np.float32), launches=2)
    sim.run()
    return [p for p in sim.problems if p.kind == "race"]


def test_race_records_whether_only_a_relaxed_edge_orders_it() -> None:
    relaxed = _races(switch_allreduce("relaxed"))
    assert relaxed and all(p.details["exec_ordered"] for p in relaxed)
    missing = _races(switch_allreduce("none"))
    assert missing and not all(p.details["exec_ordered"] for p in missing)
