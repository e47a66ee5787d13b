"""The tuner's CPU half: candidates from the catalog, extra variants compiled and verified in the
simulator (broken ones rejected), and measurements turned into threshold rules."""

import dataclasses

import pytest

from mscclang.comm.catalog import Catalog
from mscclang.comm.sim_ranks import catalog_of, stub_plan
from mscclang.comm.tune import NCCL_KEY, CandidateKey, build_table, candidates, compile_extra
from mscclang.comm.tuning import load_tuning, tuning_to_json

A = CandidateKey("ar_ll", 1, 512)
B = CandidateKey("ar_simple", 16, 1024)


def test_build_table_merges_runs_and_orders_candidates():
    K = 1024
    measured = {"allreduce": {
        1 * K: {A: 2.0, B: 9.0, NCCL_KEY: 9.7},
        4 * K: {A: 2.5, B: 9.5, NCCL_KEY: 10.0},
        64 * K: {A: 12.0, B: 8.0, NCCL_KEY: 11.0},
        1 << 30: {A: 99999.0, B: 4000.0, NCCL_KEY: 3200.0},
    }}
    t = build_table(measured, 2, machine="2x test", source="unit test")
    rules = [(r.max_bytes, [c.label() for c in r.candidates]) for r in t.rules]
    assert rules == [
        (4 * K, ["ar_ll i1 t512", "ar_simple i16 t1024", "nccl"]),
        (64 * K, ["ar_simple i16 t1024", "nccl", "ar_ll i1 t512"]),
        (None, ["nccl", "ar_simple i16 t1024", "ar_ll i1 t512"]),
    ]
    assert t.rules[0].candidates[0].us == 2.5
    # the table round-trips through the file format and selects as measured
    t2 = load_tuning(tuning_to_json(t))
    assert t2.rule_for("allreduce", 2, "float16", 3000).candidates[0].plan == "ar_ll"
    assert t2.rule_for("allreduce", 2, "float16", 5000).candidates[0].plan == "ar_simple"
    assert t2.rule_for("allreduce", 2, "float16", 1 << 40).candidates[0].is_nccl


def test_build_table_keep_limits_candidates():
    measured = {"allgather": {1024: {CandidateKey(f"a{i}", 1, 512): float(i + 1) for i in range(6)}}}
    t = build_table(measured, 2, keep=3)
    assert [c.plan for c in t.rules[0].candidates] == ["a0", "a1", "a2"]


def test_candidates_group_inplace_variants():
    plans = [stub_plan("allreduce", 2, name="x.r2.i1"), stub_plan("allreduce", 2, name="x.r2.i1", inplace=True),
             stub_plan("allreduce", 2, name="x.r2.i4"), stub_plan("allgather", 2, name="y.r2.i1")]
    keys = candidates(catalog_of(plans), "allreduce", 2)
    assert [(k.algorithm, k.instances) for k in keys] == [("x", 1), ("x", 4)]


def test_compile_extra_verifies_and_rejects(monkeypatch, tmp_path):
    algorithms = pytest.importorskip("mscclang.algorithms")
    pytest.importorskip("mscclang.sim")
    good = algorithms.ALGORITHMS["allgather_ll"]

    def broken_builder(ranks, instances=1, num_threads_per_block=512, inplace=False, **kw):
        # an allgather plan with no ops: it never delivers the peers' blocks
        return stub_plan("allgather", ranks, name=f"broken.r{ranks}.i{instances}", protocol="LL")

    broken = dataclasses.replace(good, name="allgather_broken", builder=broken_builder,
                                 inplace_modes=(False,))
    monkeypatch.setattr(algorithms, "ALGORITHMS", {"allgather_ll": good, "allgather_broken": broken})
    cat = Catalog()
    res = compile_extra(cat, ["allgather"], 2, [2], [], tmp_path)
    added = sorted(v.key for v in res.added)
    assert added == ["allgather_ll.r2.i2.t512", "allgather_ll.r2.i2.t512.inplace"]
    assert [k for k, _ in res.rejected] == ["allgather_broken.r2.i2.t512"]
    assert "verify" in res.rejected[0][1]
    assert {p.name for p in tmp_path.iterdir()} == {a + ".json" for a in added}
    # the saved plans load back as a catalog the communicator can use
    again = Catalog.from_dir(tmp_path)
    assert sorted(v.key for v in again) == added
    assert {v.instances for v in again} == {2}
    # a second pass compiles nothing new
    assert compile_extra(cat, ["allgather"], 2, [2], [], None).added == []


def test_tune_worker_forces_each_candidate_over_the_simulator():
    """The GPU tuner's per-candidate step (force the candidate, run, check, confirm it ran),
    over the simulator: every shipped allreduce/allgather candidate that fits 4 KiB runs."""
    import torch

    from mscclang.bench.tune_worker import TuneWorker
    from mscclang.bench.worker import BenchConfig
    from mscclang.comm.catalog import default_plans_dir
    from mscclang.comm.sim_ranks import run_ranks
    from mscclang.comm.tuning import load_tuning

    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")
    cat = Catalog.from_dir(folder)

    def body(comm):
        w = object.__new__(TuneWorker)
        w.rank, w.world = comm.rank, comm.world_size
        w.cfg = BenchConfig(colls=[], sizes=[], impls=[], modes=[], dtype="float16")
        w.device, w.dtype, w.esz, w.seed = torch.device("cpu"), torch.float16, 2, 3
        w.barrier = lambda: None
        w.comm = comm
        w.sym = (comm.empty(4096, dtype=torch.uint8), comm.empty(4096, dtype=torch.uint8))
        out = []
        for coll in ("allreduce", "allgather"):
            for key in candidates(comm.catalog, coll, 2):
                if not any(v.fits(4096) for v in comm.catalog.find_all(key.algorithm, coll, 2,
                                                                        key.instances, key.threads)):
                    continue
                ok, err, cell, plan = w.check_candidate(coll, 4096, key)
                out.append((key.label(), ok, err, plan))
        return out

    results, world, fb = run_ranks(2, body, catalog=cat, tuning=load_tuning(), engine="sim",
                                   refuse_unaligned=16)
    labels = [r[0] for r in results[0]]
    assert any(lab.startswith("allreduce_oneshot_ll") for lab in labels)
    assert any(lab.startswith("allgather_zero_copy") for lab in labels)
    for res in results:
        for label, ok, err, plan in res:
            assert ok, (label, err)
            assert plan.startswith(label.split()[0])
