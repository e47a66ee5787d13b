"""Communicator.all_to_all_v on the library's all-to-all-v plans, run by the simulator (one thread
per rank): every rank's bytes against a reference written with plain torch, at 2, 4 and 8 ranks,
uneven and zero counts, fp8 and wide rows, with and without ``out``; bad counts raise CountsError
on every rank; an engine that runs no plan with segments sends the call to torch.distributed."""

from __future__ import annotations

import pytest
import torch

from mscclang.comm.sim_ranks import run_ranks
from mscclang.errors import CountsError, InvalidCall
from tests.harness.sim_plans import library_plans

ALGOS = ["alltoallv_ll", "alltoallv_simple", "alltoallv_zero_copy"]


def _plans(n: int, algos: list = ALGOS) -> list:
    """The all-to-all-v plans and the all-gather the count exchange runs on."""
    return library_plans(list(algos) + ["allgather_ll"], n)


def _counts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(0, 5, (n, n), generator=g)
    m[torch.rand(n, n, generator=g) < 0.3] = 0     # zeros among them
    m[0, n - 1] = 9                                # one skewed pair
    return m.tolist()


def _inputs(n: int, counts: list[list[int]], shape: tuple, dtype: torch.dtype) -> list[torch.Tensor]:
    xs = []
    for r in range(n):
        g = torch.Generator().manual_seed(100 + r)
        x = torch.randn((sum(counts[r]) + 1, *shape), generator=g)   # a spare row x does not send
        xs.append(x.to(dtype))
    return xs


def _reference(counts: list[list[int]], xs: list[torch.Tensor], r: int) -> torch.Tensor:
    """What rank r receives, in plain torch: for each rank p in order, the rows p sent to r."""
    parts = [xs[p][sum(counts[p][:r]): sum(counts[p][: r + 1])] for p in range(len(xs))]
    return torch.cat(parts)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("given_out", [True, False])
def test_all_to_all_v_matches_torch_on_every_rank(n: int, given_out: bool) -> None:
    counts = _counts(n, n)
    xs = _inputs(n, counts, (6,), torch.bfloat16)
    cap = max(sum(counts[p][q] for p in range(n)) for q in range(n)) + 2

    def body(comm):
        r = comm.rank
        send = torch.tensor(counts[r], dtype=torch.int64)
        out = torch.full((cap, 6), -7.0, dtype=torch.bfloat16) if given_out else None
        got, recv = comm.all_to_all_v(xs[r], send, out=out)
        return got, recv, comm.last_all_to_all_v

    res, world, fb = run_ranks(n, body, plans=_plans(n), engine="sim")
    for r, (got, recv, plan) in enumerate(res):
        want = _reference(counts, xs, r)
        assert recv.dtype == torch.int64 and recv.tolist() == [counts[p][r] for p in range(n)]
        assert torch.equal(got[: len(want)].view(torch.int16), want.view(torch.int16)), r   # the same bits
        if given_out:
            assert (got[len(want):] == -7.0).all()   # the rows past the received ones are left alone
        else:
            assert got.shape == want.shape
        assert plan is not None and plan.startswith("alltoallv_")
    assert fb.calls == []


@pytest.mark.parametrize("algo", ALGOS)
def test_each_plan_moves_fp8_and_wide_rows(algo: str) -> None:
    n = 4
    counts = _counts(n, 7)
    xs = _inputs(n, counts, (3, 8), torch.float8_e4m3fn)
    cap = 40

    def body(comm):
        out = torch.zeros((cap, 3, 8), dtype=torch.float8_e4m3fn)
        if algo == "alltoallv_zero_copy":
            out = comm.empty(cap, 3, 8, dtype=torch.float8_e4m3fn)
            x = comm.empty(*xs[comm.rank].shape, dtype=torch.float8_e4m3fn)
            x.copy_(xs[comm.rank])
        else:
            x = xs[comm.rank]
        got, _ = comm.all_to_all_v(x, torch.tensor(counts[comm.rank], dtype=torch.int32), out=out)
        return got.clone(), comm.last_all_to_all_v

    res, _, _ = run_ranks(n, body, plans=_plans(n, [algo]), engine="sim")
    for r, (got, plan) in enumerate(res):
        want = _reference(counts, xs, r)
        assert torch.equal(got[: len(want)].view(torch.uint8), want.view(torch.uint8)), r
        assert plan.startswith(algo)


def test_counts_over_capacity_raise_on_every_rank() -> None:
    n = 2

    def body(comm):
        x = torch.ones(8, 4)
        try:
            comm.all_to_all_v(x, torch.tensor([2, 6]), out=torch.zeros(5, 4))   # rank 1 gets 12 rows into 5
        except CountsError as e:
            return str(e)
        return None

    res, _, _ = run_ranks(n, body, plans=_plans(n), engine="sim")
    assert res[0] == res[1] and res[0] is not None and "rank 1: it receives 12 rows" in res[0]


def test_negative_and_short_x_raise_on_every_rank() -> None:
    n = 2

    def body(comm):
        msgs = []
        for counts, rows in (([1, -1], 4), ([3, 3], 4)):
            try:
                comm.all_to_all_v(torch.ones(rows, 4), torch.tensor(counts), out=torch.zeros(8, 4))
            except CountsError as e:
                msgs.append(str(e))
        return msgs

    res, _, _ = run_ranks(n, body, plans=_plans(n), engine="sim")
    assert res[0] == res[1]
    assert "count [0][1] is -1" in res[0][0] and "add up to 6 rows, more than its x's 4 rows" in res[0][1]


def test_bad_arguments_are_refused_naming_them() -> None:
    def body(comm):
        out = []
        for args, kw in (((torch.ones(4, 4), torch.tensor([1.0, 1.0])), {}),
                         ((torch.ones(4, 4), torch.tensor([1, 1, 1])), {}),
                         ((torch.ones(4, 4), torch.tensor([1, 1])), {"out": torch.zeros(4, 4, dtype=torch.float16)}),
                         ((torch.ones(4, 3, dtype=torch.float16), torch.tensor([1, 1])), {}),
                         ((torch.ones(4, 4), torch.tensor([1, 1])), {"out": torch.zeros(4, 5)})):
            try:
                comm.all_to_all_v(*args, **kw)
            except InvalidCall as e:
                out.append(str(e))
        return out

    res, world, _ = run_ranks(2, body, plans=_plans(2))
    msgs = res[0]
    assert len(msgs) == 5 and res[1] == [m.replace("rank 0", "rank 1") for m in msgs]
    assert "send_counts must be an integer tensor of 2 entries (one per rank), got torch.float32" in msgs[0]
    assert "send_counts must be an integer tensor of 2 entries (one per rank), got torch.int64 of shape (3,)" in msgs[1]
    assert "out has dtype torch.float16, x torch.float32" in msgs[2]
    assert "rows must be a positive multiple of 4 bytes" in msgs[3]
    assert "must be rows of one shape" in msgs[4]
    assert world.launches == []   # refused before the count exchange


def test_an_engine_without_segments_falls_back_to_torch(monkeypatch) -> None:
    from mscclang.comm.sim_backend import SimLaunch

    monkeypatch.setattr(SimLaunch, "runnable", lambda self, plan: "the GPU executor does not run such plans yet"
                        if plan.has_segments() else None)
    n = 3
    counts = _counts(n, 3)
    xs = _inputs(n, counts, (4,), torch.float32)

    def body(comm):
        got, recv = comm.all_to_all_v(xs[comm.rank], torch.tensor(counts[comm.rank]), out=torch.zeros(30, 4))
        return got, comm.last_all_to_all_v

    res, _, fb = run_ranks(n, body, plans=_plans(n), engine="sim")
    for r, (got, plan) in enumerate(res):
        want = _reference(counts, xs, r)
        assert plan is None and torch.equal(got[: len(want)], want)
    assert fb.calls == ["all_to_all_v"] * n


def test_expectations_and_capacities_that_disagree_raise_on_every_rank() -> None:
    n = 2

    def body(comm):
        msgs = []
        r = comm.rank
        try:   # rank 1 expects 3 rows from rank 0, which sends it 2
            comm.all_to_all_v(torch.ones(4, 4), torch.tensor([2, 2]), expect_counts=torch.tensor([2, 2] if r == 0 else [3, 2]))
        except CountsError as e:
            msgs.append(str(e))
        try:   # outputs of different capacities, none given
            comm.all_to_all_v(torch.ones(4, 4), torch.tensor([2, 2]), out=torch.zeros(4 + r, 4))
        except CountsError as e:
            msgs.append(str(e))
        got, _ = comm.all_to_all_v(torch.full((4, 4), float(r)), torch.tensor([2, 2]), out=torch.zeros(4 + r, 4),
                                   capacity=5)
        return msgs, got

    res, _, _ = run_ranks(n, body, plans=_plans(n), engine="sim")
    assert res[0][0] == res[1][0]
    assert "rank 1 expects 3 rows from rank 0, but rank 0 sends it 2" in res[0][0][0]
    assert "passed a capacity of 5 rows, rank 0 4" in res[0][0][1]
    for r, (_, got) in enumerate(res):
        assert torch.equal(got[:4], torch.cat([torch.zeros(2, 4), torch.ones(2, 4)]))


def test_recv_counts_outlive_the_next_call() -> None:
    n = 2

    def body(comm):
        r = comm.rank
        _, first = comm.all_to_all_v(torch.ones(4, 4), torch.tensor([1, 3], dtype=torch.int32), out=torch.zeros(6, 4))
        comm.all_to_all_v(torch.ones(4, 4), torch.tensor([2, 2], dtype=torch.int32), out=torch.zeros(6, 4))
        return first.tolist()

    res, _, _ = run_ranks(n, body, plans=_plans(n), engine="sim")
    assert res == [[1, 1], [3, 3]]


def test_a_repeated_call_chooses_its_plan_once(monkeypatch) -> None:
    """The plan choice is remembered per slot size, row alignment and symmetry: the catalog is
    scanned once for repeated calls, again for a slot size that changes the choice."""
    from mscclang.comm.catalog import Catalog

    scans = []
    real = Catalog.matching
    monkeypatch.setattr(Catalog, "matching", lambda self, coll, n, *a, **kw: (
        scans.append(coll) if coll == "alltoallv" else None, real(self, coll, n, *a, **kw))[1])
    n = 2
    counts = _counts(n, 5)
    xs = _inputs(n, counts, (8,), torch.bfloat16)          # 16-byte rows: LL can move them

    def body(comm):
        plans = []
        for cap in (16, 16, 16, 1 << 17, 1 << 17):    # 2 MiB slots, past LL's range: the Simple plan
            comm.all_to_all_v(xs[comm.rank], torch.tensor(counts[comm.rank]), out=torch.zeros(cap, 8).bfloat16())
            plans.append(comm.last_all_to_all_v.split(".")[0])
        return plans

    res, _, _ = run_ranks(n, body, plans=_plans(n), engine="sim")
    assert res[0] == res[1] and res[0][:3] == ["alltoallv_ll"] * 3 and res[0][3:] == ["alltoallv_simple"] * 2
    assert len(scans) == 2 * n                       # two choices on each rank


@pytest.mark.parametrize("n", [2, 4])
def test_a_tuning_rule_picks_the_copy_engine_plan_or_torch(n: int) -> None:
    """The copy-engine ``alltoallv_port`` runs where a tuning rule names it (never by itself),
    exact on every rank with counts below and at the capacity; a rule naming nccl first sends the
    call to torch.distributed; a rule naming the zero-copy plan on ordinary tensors is passed
    over for the next choice."""
    from mscclang.comm.tuning import TuningTable

    counts = _counts(n, 11)
    xs = _inputs(n, counts, (6,), torch.bfloat16)
    cap = max(max(row) for row in counts)   # the capacity: the largest count (some segments at it)

    def table(*plans: str) -> TuningTable:
        return TuningTable(rules=[{"collective": "all_to_all_v", "candidates": [{"plan": p} for p in plans]}]
                           if plans else [])

    def body(comm):
        r = comm.rank
        out = torch.zeros((n * cap, 6), dtype=torch.bfloat16)
        got, recv = comm.all_to_all_v(xs[r], torch.tensor(counts[r]), out=out, capacity=cap)
        return got.clone(), comm.last_all_to_all_v

    algos = ALGOS + ["alltoallv_port"]
    for rule, want_plan in ((table("alltoallv_port"), "alltoallv_port"), (table(), "alltoallv_simple"),   # rows of 12 bytes: no LL
                            (table("alltoallv_zero_copy", "alltoallv_port"), "alltoallv_port"),
                            (table("nccl", "alltoallv_port"), None)):
        res, _, fb = run_ranks(n, body, plans=_plans(n, algos), engine="sim", tuning=rule)
        for r, (got, plan) in enumerate(res):
            want = _reference(counts, xs, r)
            assert torch.equal(got[: len(want)].view(torch.int16), want.view(torch.int16)), (want_plan, r)
            assert (plan or "").split(".")[0] == (want_plan or ""), (rule, plan)
        assert bool(fb.calls) == (want_plan is None)
