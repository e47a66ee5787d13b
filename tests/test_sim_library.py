"""Every correct hand-built plan of :mod:`tests.harness.sim_plans` verifies clean (the broken
variants in ``test_verify_broken.py`` start from these and damage one thing)."""

from __future__ import annotations

import pytest

from mscclang.sim import verify
from tests.harness.sim_plans import (
    get_allreduce, ll_allreduce, ll_oneshot_allreduce, pipelined_allgather, port_allgather, rppkt_allgather,
    sem_barrier_allgather, simple_allgather, switch_allreduce, zero_copy_allreduce,
)

GOOD = {
    "ll_allreduce": ll_allreduce,
    "ll_allreduce_single_scratch": lambda: ll_allreduce(double=False),
    "ll_oneshot_allreduce": ll_oneshot_allreduce,
    "simple_allgather": simple_allgather,
    "zero_copy_allreduce": zero_copy_allreduce,
    "get_allreduce": get_allreduce,
    "sem_barrier_allgather": sem_barrier_allgather,
    "pipelined_allgather": pipelined_allgather,
    "port_allgather": port_allgather,
    "switch_allreduce": switch_allreduce,
    "rppkt_allgather": rppkt_allgather,
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_plan_verifies(name: str) -> None:
    rep = verify(GOOD[name](), schedules=6, launches=3)
    assert rep.ok, str(rep)
    assert rep.runs >= 6 * len(rep.sizes)
