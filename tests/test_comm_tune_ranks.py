"""The tuner at 4 and 8 ranks on the CPU: the shipped catalog has candidates for every collective
the tuner measures, the GPU tuner's per-candidate step forces and checks each one over the
simulator, and the table it builds carries rules for that world size."""

from __future__ import annotations

import pytest
import torch

from mscclang.comm.tune import NCCL_KEY, build_table, candidates


@pytest.mark.parametrize("n", [4, 8])
def test_candidates_exist_for_every_collective(catalog, n):
    for coll in ("allreduce", "allgather", "reducescatter", "alltoall"):
        keys = candidates(catalog, coll, n)
        assert keys, (coll, n)
        for k in keys:
            assert catalog.find_all(k.algorithm, coll, n, k.instances, k.threads), (coll, k)


@pytest.mark.parametrize("n", [4, 8])
def test_build_table_has_rules_for_n(catalog, n):
    keys = candidates(catalog, "allreduce", n)
    measured = {"allreduce": {1024: {keys[0]: 5.0, NCCL_KEY: 9.0}, 1 << 20: {keys[-1]: 30.0, NCCL_KEY: 20.0}}}
    table = build_table(measured, n, machine=f"{n}x test")
    rules = [r for r in table.rules if r.collective == "allreduce"]
    assert rules and all(r.world_size == n for r in rules)


@pytest.mark.parametrize("n", [4, 8])
def test_tune_worker_checks_candidates_at_n_ranks(catalog, n):
    from mscclang.bench.tune_worker import TuneWorker
    from mscclang.bench.worker import BenchConfig
    from mscclang.comm.sim_ranks import run_ranks
    from mscclang.comm.tuning import load_tuning

    nbytes = 2048 * n

    def body(comm):
        w = object.__new__(TuneWorker)
        w.rank, w.world = comm.rank, comm.world_size
        w.cfg = BenchConfig(colls=[], sizes=[], impls=[], modes=[], dtype="bfloat16")
        w.device, w.dtype, w.esz, w.seed = torch.device("cpu"), torch.bfloat16, 2, 3
        w.barrier = lambda: None
        w.comm = comm
        w.sym = (comm.empty(nbytes * n, dtype=torch.uint8), comm.empty(nbytes * n, dtype=torch.uint8))
        out = []
        for coll in ("allreduce", "allgather"):
            for key in candidates(comm.catalog, coll, n)[:3]:
                if not any(v.fits(nbytes) for v in comm.catalog.find_all(key.algorithm, coll, n,
                                                                          key.instances, key.threads)):
                    continue
                ok, err, cell, plan = w.check_candidate(coll, nbytes, key)
                out.append((key.label(), ok, err, plan))
        return out

    results, world, fb = run_ranks(n, body, catalog=catalog, tuning=load_tuning(), engine="sim",
                                   refuse_unaligned=16)
    assert results[0], "no candidate fits"
    for res in results:
        for label, ok, err, plan in res:
            assert ok, (label, err)
            assert f".r{n}." in plan, plan
    assert all(f".r{n}." in name for name in world.launches)
