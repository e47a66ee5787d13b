"""Single-buffered LL scratch reused across launches (issue 14, fidelity item 1).

Nothing touches a scratch between launches, and LL readers take only packets that carry their
launch's flag, so reusing a single-buffered packet scratch is a hazard only where no chain of
edges orders an earlier launch's access of a slot before the later launch's packet write into
it. The plans here are the regression cases: MSCCL++'s single-buffered two-step packet allreduce
(``allreduce_naivy``) and its put-packets unit test must verify; a one-shot packet allreduce
without double scratch must not (``test_verify_broken.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mscclang import CollectiveProgram, MemoryChannel, Rank, TestCollective
from mscclang.dsl import Buffer
from mscclang.sim import verify

ROOT = Path(__file__).resolve().parent.parent
NAIVE = ROOT / "tests" / "programs" / "allreduce_ll_naive_single.py"


def put_packets_plan(n: int = 2):
    """MSCCL++'s ``put_packet_test`` shape: every rank packs its one input chunk into a
    single-buffered scratch chunk of every peer; nobody reads the packets."""
    with CollectiveProgram("put_packets_test", TestCollective(n, 1, 0), n, protocol="LL",
                           use_double_scratch_buffer=False) as prog:
        for src in range(n):
            data = Rank(src).get_input_buffer()
            for dst in range(n):
                if dst != src:
                    scratch = Buffer(dst, 1)
                    MemoryChannel(dst, src).put_packets(scratch[0:1], data[0:1], tb=0)
    return prog.to_plan()


def _hazards(rep) -> list[str]:
    return [f"{p.kind}: {p.message}" for p in rep.problems if p.kind in ("race", "deadlock")]


@pytest.mark.parametrize("launches", [2, 4])
def test_put_packets_into_single_scratch_is_not_a_race(launches: int) -> None:
    rep = verify(put_packets_plan(), launches=launches, schedules=4)
    assert rep.runs and not _hazards(rep), str(rep)


@pytest.mark.parametrize("ranks", [2, 4])
def test_single_buffered_two_step_packet_allreduce_verifies(ranks: int) -> None:
    from mscclang.cli.compile_cmd import compile_file
    plan = compile_file(NAIVE, ["--num_gpus", str(ranks)])
    assert not plan.use_double_scratch_buffer
    rep = verify(plan, launches=4, schedules=4)
    assert rep.ok, str(rep)
