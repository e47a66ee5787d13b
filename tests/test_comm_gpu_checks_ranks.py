"""The communicator's GPU test commands (tests.harness.comm_checks.check_collective, as
tests/gpu/test_comm_gpu.py calls them) at 4 and 8 ranks on the CPU: the shipped plans/ and
tuning file select the plans by world size, the simulator runs them, the GPU runtime's granule
rule applies, the torch.distributed fallback is off. Sums over more than 2 ranks are checked
within the any-order summation bound; everything else bit for bit."""

from __future__ import annotations

import types

import pytest
import torch

from tests.harness import comm_checks as gpu_checks
from mscclang.runtime.state import runtime_granule
from mscclang.comm.sim_ranks import run_ranks
from mscclang.comm.tuning import load_tuning

COLLS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"]


def run_check(catalog, n, coll, **kw):
    def body(comm):
        w = types.SimpleNamespace(rank=comm.rank, world_size=comm.world_size,
                                  state={"mscclang.comm/False": comm})
        return gpu_checks.check_collective(w, coll, **kw)

    results, world, fb = run_ranks(n, body, catalog=catalog, tuning=load_tuning(), engine="sim",
                                   granule=runtime_granule, refuse_unaligned=16, fallback=False)
    return results, world, fb


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("coll", COLLS)
def test_check_collective_on_n_ranks(catalog, n, coll):
    # tests/gpu/_numels(n) minus the 4M-element one (the simulator's time)
    numels = [n * 7, n * 513]
    dtypes = ("bfloat16",) if n == 8 else ("float32",)
    results, world, fb = run_check(catalog, n, coll, dtypes=dtypes, numels=numels, ops=("sum", "max"))
    fails = [f for r in results for f in r["failures"]]
    assert not fails, "\n".join(fails[:4])
    assert all(r["checked"] > 0 for r in results)
    plans = results[0]["plans"]
    assert plans and not any(p == "nccl" for p in plans), plans
    assert fb.calls == [] and world.launches
    # every launch ran an n-rank plan of the library
    assert all(f".r{n}." in name for name in world.launches), sorted(set(world.launches))


@pytest.mark.parametrize("n", [4, 8])
def test_bound_catches_a_wrong_engine(catalog, n, monkeypatch):
    """An engine that adds a rank's input twice is caught by the bound on every rank."""
    import mscclang.sim as sim

    real = sim.run

    def doubled(plan, inputs, **kw):
        outs = real(plan, inputs, **kw)
        if plan.collective == "allreduce":
            return [o + inputs[1][: o.size] for o in outs]
        return outs

    monkeypatch.setattr(sim, "run", doubled)
    results, _, _ = run_check(catalog, n, "all_reduce", dtypes=("float32",), numels=[n * 513],
                              symmetric=(False,), inplace=(False,))
    for r in results:
        assert len(r["failures"]) == 1 and "(bound)" in r["failures"][0], r


def test_expectation_modes():
    xs = [torch.ones(8, dtype=torch.bfloat16) * (q + 1) for q in range(4)]
    assert gpu_checks._expectation("all_reduce", 0, 4, xs, "sum", 0).how == "bound"
    assert gpu_checks._expectation("all_reduce", 0, 4, xs, "max", 0).how == "exact"
    assert gpu_checks._expectation("all_gather", 0, 4, xs, "sum", 0).how == "exact"
    e = gpu_checks._expectation("reduce_scatter", 3, 4, xs, "sum", 0)
    assert e.approx.tolist() == [10.0, 10.0] and e.count_bad(torch.full((2,), 10.0, dtype=torch.bfloat16)) == 0
    assert e.count_bad(torch.full((2,), 9.0, dtype=torch.bfloat16)) == 2
