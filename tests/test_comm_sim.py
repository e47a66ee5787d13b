"""The communicator over the library's real plans, executed by the simulator (one thread per
rank): the selected plans compute each collective correctly for odd and even element counts,
in place and out of place. Skipped while the algorithm library or the simulator is missing."""

import pytest
import torch

algorithms = pytest.importorskip("mscclang.algorithms")
sim = pytest.importorskip("mscclang.sim")
if not hasattr(sim, "run"):  # pragma: no cover
    pytest.skip("mscclang.sim.run is not there yet", allow_module_level=True)

from mscclang.comm.sim_ranks import run_ranks  # noqa: E402
from mscclang.comm.tuning import tuning_from_dict  # noqa: E402
from tests.harness.sim_plans import library_plans  # noqa: E402

N = 2


def only(coll, name):
    """A tuning table that sends every call of ``coll`` to algorithm ``name``."""
    return tuning_from_dict({"format": "mscclang.tuning/1", "rules": [
        {"collective": coll, "candidates": [{"plan": name}]}]})


def ref_sum(xs):
    acc = xs[0].float()
    for x in xs[1:]:
        acc = (acc + x.float()).to(xs[0].dtype).float()
    return acc.to(xs[0].dtype)


def inputs(numel, dtype):
    gs = [torch.Generator().manual_seed(1000 + p) for p in range(N)]
    if dtype == torch.int32:
        return [torch.randint(-99, 99, (numel,), generator=g, dtype=dtype) for g in gs]
    return [torch.randn(numel, generator=g).to(dtype) for g in gs]


CASES = [(c, a) for c, names in [
    ("allreduce", ["allreduce_oneshot_ll", "allreduce_twostep_ll", "allreduce_rsag_simple",
                   "allreduce_rsag_zero_copy"]),
    ("allgather", ["allgather_ll", "allgather_zero_copy"]),
    ("reducescatter", ["reducescatter_ll", "reducescatter_simple", "reducescatter_zero_copy"]),
    ("alltoall", ["alltoall_ll", "alltoall_zero_copy"]),
    ("broadcast", ["broadcast_ll", "broadcast_simple"]),
] for a in names if a in algorithms.ALGORITHMS]


@pytest.mark.parametrize("coll,name", CASES)
@pytest.mark.parametrize("numel,dtype", [(14, torch.float16), (1002, torch.bfloat16), (6, torch.int32)])
def test_library_plan_through_communicator(coll, name, numel, dtype):
    plans = library_plans([name], N)

    def body(comm):
        r = comm.rank
        xs = inputs(numel, dtype)
        x = xs[r]
        got = {}
        if coll == "allreduce":
            got["oop"] = comm.all_reduce(x.clone(), out=torch.empty_like(x))
            t = x.clone()
            got["ip"] = comm.all_reduce(t)
        elif coll == "allgather":
            k = numel // N
            got["oop"] = comm.all_gather(x[:k].clone())
            buf = torch.zeros(N * k, dtype=dtype)
            buf[r * k:(r + 1) * k] = x[:k]
            comm.all_gather(buf[r * k:(r + 1) * k], out=buf)
            got["ip"] = buf
        elif coll == "reducescatter":
            k = numel // N
            got["oop"] = comm.reduce_scatter(x.clone())
            t = x.clone()
            comm.reduce_scatter(t, out=t[r * k:(r + 1) * k])
            got["ip"] = t[r * k:(r + 1) * k].clone()
        elif coll == "alltoall":
            got["oop"] = comm.all_to_all(x.clone(), out=torch.empty_like(x))
            got["ip"] = comm.all_to_all(x.clone())
        else:
            got["ip"] = comm.broadcast(x.clone(), root=0)
        return got, comm.last.label()

    results, world, fb = run_ranks(N, body, plans=plans, tuning=only(coll, name), engine="sim")
    assert fb.calls == [], "every call must run on the library plan"
    assert world.launches and all(n.startswith(name) for n in world.launches)
    xs = inputs(numel, dtype)
    k = numel // N
    for r, (got, label) in enumerate(results):
        if coll == "allreduce":
            want = ref_sum(xs)
        elif coll == "allgather":
            want = torch.cat([x[:k] for x in xs])
        elif coll == "reducescatter":
            want = ref_sum([x[r * k:(r + 1) * k] for x in xs])
        elif coll == "alltoall":
            want = torch.cat([x[r * k:(r + 1) * k] for x in xs])
        else:
            want = xs[0]
        for mode, t in got.items():
            assert torch.equal(t, want), (r, mode, label)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_shipped_defaults_and_plans_end_to_end(dtype):
    """The default tuning file and the shipped plans/ pick plans that compute every collective
    right on the simulator, odd element counts included (multi-block calls refused when their
    blocks are unaligned, as the GPU runtime does, and retried padded)."""
    from mscclang.comm.catalog import Catalog, default_plans_dir
    from mscclang.comm.tuning import load_tuning

    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")
    cat = Catalog.from_dir(folder)
    numel = 22 if dtype == torch.float16 else 14  # 44 / 56 bytes: blocks of 22 / 28 bytes

    def body(comm):
        r = comm.rank
        xs = inputs(numel, dtype)
        x = xs[r]
        got = {"ar": comm.all_reduce(x.clone()), "ag": comm.all_gather(x.clone()),
               "rs": comm.reduce_scatter(x.clone()), "a2a": comm.all_to_all(x.clone()),
               "bc": comm.broadcast(x.clone(), root=0)}
        return got

    results, world, fb = run_ranks(N, body, catalog=cat, tuning=load_tuning(), engine="sim",
                                   refuse_unaligned=16)
    assert fb.calls == []
    assert {name.split(".")[0] for name in world.launches} == {
        "allreduce_oneshot_ll", "allgather_ll", "reducescatter_ll", "alltoall_ll", "broadcast_ll"}
    xs = inputs(numel, dtype)
    k = numel // N
    for r, got in enumerate(results):
        assert torch.equal(got["ar"], ref_sum(xs))
        assert torch.equal(got["ag"], torch.cat(xs))
        assert torch.equal(got["rs"], ref_sum([x[r * k:(r + 1) * k] for x in xs]))
        assert torch.equal(got["a2a"], torch.cat([x[r * k:(r + 1) * k] for x in xs]))
        assert torch.equal(got["bc"], xs[0])
