"""Regression for the first GPU run of tests/gpu/test_comm_gpu.py: the same commands
(``tests.harness.comm_checks.check_collective``) with the same element counts, dtypes, buffer kinds
and in-place modes, on the CPU: the shipped tuning file and plans/, the GPU runtime's granule rule
(multi-block collectives padded to the plan's alignment) and its refusal of unaligned packet
offsets, the torch.distributed fallback disabled. Every call must run on a plan of the library
and compute the collective (simulator for bfloat16, the collective's definition for the rest)."""

import types

import pytest

from tests.harness import comm_checks as gpu_checks
from mscclang.runtime.state import runtime_granule
from mscclang.comm.sim_ranks import run_ranks
from mscclang.comm.tuning import load_tuning

N = 2
COLLS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"]
EAGER = [N * 7, N * 513, N * 4099, N * ((1 << 20) + 3)]  # tests/gpu: _numels(n)
GRAPH = [N * 512, N * 262147]  # tests/gpu: test_cuda_graph_replay


def run_check(catalog, coll, engine, **kw):
    def body(comm):
        w = types.SimpleNamespace(rank=comm.rank, world_size=comm.world_size,
                                  state={"mscclang.comm/False": comm})
        return gpu_checks.check_collective(w, coll, **kw)

    results, world, fb = run_ranks(N, body, catalog=catalog, tuning=load_tuning(), engine=engine,
                                   granule=runtime_granule, refuse_unaligned=16, fallback=False)
    fails = [f for r in results for f in r["failures"]]
    assert not fails, "\n".join(fails[:4])
    assert all(r["checked"] > 0 for r in results)
    assert not any(p == "nccl" for r in results for p in r["plans"]), results[0]["plans"]
    assert fb.calls == [] and world.launches
    return results, world


@pytest.mark.parametrize("coll", COLLS)
def test_gpu_shapes_bfloat16_on_the_simulator(catalog, coll):
    numels = sorted(set(EAGER + GRAPH))
    results, world = run_check(catalog, coll, "sim", dtypes=("bfloat16",), numels=numels)
    if coll in ("all_gather", "reduce_scatter", "all_to_all"):
        # the sizes that fell back on the GPU: odd blocks above the LL plans' range run staged
        assert any("(staged)" in p and "_ll" not in p for p in results[0]["plans"]), results[0]["plans"]


@pytest.mark.parametrize("coll", COLLS)
def test_gpu_shapes_other_dtypes_select_a_plan(catalog, coll):
    run_check(catalog, coll, "reference", dtypes=("float16", "float32", "int32"), numels=EAGER)


@pytest.mark.parametrize("coll", ["all_reduce", "reduce_scatter"])
def test_gpu_reduce_ops(catalog, coll):
    run_check(catalog, coll, "sim", dtypes=("bfloat16", "int32"), numels=[N * 999], ops=("min", "max"),
              symmetric=(False,))


def test_gpu_allreduce_odd_counts_and_large(catalog):
    run_check(catalog, "all_reduce", "reference", dtypes=("float16",),
              numels=[1, 3, 1001, (8 << 20) + 5], inplace=(True,))


@pytest.mark.parametrize("coll,numel", [("all_reduce", 64 << 20), ("all_gather", 64 << 20),
                                        ("reduce_scatter", 64 << 20), ("all_to_all", (64 << 20) + 2)])
def test_largest_sizes_select_a_plan(catalog, coll, numel):
    """Selection only (prepare, no launch) for the largest messages of the GPU tests."""
    import torch

    def body(comm):
        x = torch.empty(numel // N if coll == "all_gather" else numel, dtype=torch.bfloat16)
        return comm.prepare(coll, x).label()

    results, world, _ = run_ranks(N, body, catalog=catalog, tuning=load_tuning(),
                                  granule=runtime_granule, fallback=False)
    assert results[0] == results[1] and results[0] != "nccl" and world.launches == []
