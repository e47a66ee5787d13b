"""``Communicator.warm_up``: one collective call that loads every plan the selector can pick,
so that no later call pays a plan's first load. On simulated ranks over the library's plans: the
warm-up's calls cover every plan a later call of any size up to ``max_bytes`` runs (LL below the
heuristic's threshold and Simple above), every rank warms the same plans, and bad arguments are
refused on every rank before any call."""

from __future__ import annotations

import random

import pytest
import torch

from mscclang.comm import CommError
from mscclang.comm.sim_ranks import run_ranks
from mscclang.comm.warmup import message_sizes
from tests.harness.sim_plans import library_plans

N = 2
NAMES = ["allreduce_oneshot_ll", "allreduce_rsag_simple", "allgather_ll", "allgather_zero_copy"]
MAX = 1 << 19


def test_warm_up_covers_every_later_choice():
    plans = library_plans(NAMES, N)
    rng = random.Random(7)
    sizes = sorted({rng.randrange(1, MAX // 4 // N) * N for _ in range(12)} | {MAX // 4 // N * N})

    def body(comm):
        warmed = comm.warm_up(["all_reduce", "all_gather"], dtype=torch.float32, max_bytes=MAX)
        later = []
        for n in sizes:
            comm.all_reduce(torch.randn(n))
            later.append(("allreduce", comm.last.plan.name))
            comm.all_gather(torch.randn(n // N))
            later.append(("allgather", comm.last.plan.name))
        return warmed, later

    results, world, fb = run_ranks(N, body, plans=plans, engine="reference")
    (warmed, later), (warmed1, _) = results
    assert [(w.collective, w.nbytes, w.buffers, w.plan) for w in warmed] == \
        [(w.collective, w.nbytes, w.buffers, w.plan) for w in warmed1], "every rank warms alike"
    seen = {(w.collective, w.plan) for w in warmed}
    assert set(later) <= seen, f"later calls ran plans the warm-up did not: {set(later) - seen}"
    ar = {w.plan for w in warmed if w.collective == "allreduce"}
    assert any("oneshot" in p for p in ar) and any("rsag" in p for p in ar), ar
    assert {w.buffers for w in warmed} == {"ordinary", "symmetric"}
    assert max(w.nbytes for w in warmed) <= MAX


def test_message_sizes_hold_every_bound():
    plans = library_plans(["allreduce_oneshot_ll", "allreduce_rsag_simple"], N)

    def body(comm):
        return message_sizes(comm, "allreduce", 2, MAX), [
            (v.min_bytes, v.max_bytes) for v in comm.selector.catalog.matching("allreduce", N)]

    (sizes, bounds), _ = run_ranks(N, body, plans=plans)[0]
    assert sizes == sorted(set(sizes)) and all(s % 2 == 0 for s in sizes)   # whole bf16 elements
    assert 256 * 1024 in sizes and 256 * 1024 + 2 in sizes   # the heuristic's LL/Simple switch
    for lo, hi in bounds:
        for b in (lo, hi, hi + 1):
            if 0 < b <= MAX:
                assert -(-b // 2) * 2 in sizes


@pytest.mark.parametrize("kw,word", [
    ({"dtype": "bf16"}, "dtype"), ({"max_bytes": 0}, "max_bytes"), ({"max_bytes": True}, "max_bytes"),
    ({"collectives": ["broadcast"]}, "broadcast"), ({"collectives": ["gather"]}, "gather")])
def test_warm_up_refuses_bad_arguments(kw, word):
    def body(comm):
        with pytest.raises(CommError, match=word):
            comm.warm_up(**kw)
        return True

    assert run_ranks(N, body, plans=library_plans(["allreduce_oneshot_ll"], N))[0] == [True, True]
