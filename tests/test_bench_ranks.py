"""The bench's mscclang cells at 4 and 8 ranks on the CPU: views into the symmetric pools run the
shipped n-rank plans on the simulator (selected by world size through plans/index.json and the
tuning file's generic rules) and pass the bench's own check; a wrong result fails it."""

from __future__ import annotations

import pytest
import torch

from mscclang.bench.worker import BenchConfig, BenchWorker
from mscclang.comm.catalog import Catalog, default_plans_dir
from mscclang.plan.collectives import collective
from mscclang.comm.sim_ranks import run_ranks
from mscclang.comm.tuning import load_tuning


def _worker(comm, dtype):
    w = object.__new__(BenchWorker)
    w.rank, w.world = comm.rank, comm.world_size
    w.cfg = BenchConfig(colls=[], sizes=[], impls=[], modes=[], dtype=dtype)
    w.device = torch.device("cpu")
    w.dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    w.esz = torch.empty((), dtype=w.dtype).element_size()
    w.seed = 7
    w.barrier = lambda: None
    w.comm = comm
    return w


@pytest.mark.parametrize("n", [4, 8])
def test_mscclang_cells_at_n_ranks(n):
    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")
    pool = 1024 * n * 2

    def body(comm):
        w = _worker(comm, "bfloat16")
        w.sym = (comm.empty(pool, dtype=torch.uint8), comm.empty(pool, dtype=torch.uint8))
        out = []
        for coll in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
            nbytes = 1024 * n // 2
            cell = w.make_cell(coll, "mscclang", nbytes)
            ok, err = w.check(coll, cell)
            out.append((coll, ok, err, comm.last.label()))
        # the same check fails on a corrupted all_reduce result
        cell = w.make_cell("all_reduce", "mscclang", 1024)
        real = cell.op

        def wrong():
            real()
            cell.out.reshape(-1)[3] += 2.0

        cell.op = wrong
        out.append(("corrupted", *w.check("all_reduce", cell), ""))
        return out

    results, world, fb = run_ranks(n, body, catalog=Catalog.from_dir(folder), tuning=load_tuning(),
                                   engine="sim", refuse_unaligned=16)
    assert fb.calls == []
    for res in results:
        for coll, ok, err, label in res[:-1]:
            assert ok, (coll, err, label)
            assert "nccl" not in label and f".r{n}." in label, label
        assert res[-1][1] is False and "wrong" in res[-1][2]


@pytest.mark.parametrize("n", [3, 4, 8])
def test_busbw_factors_for_n(n):
    assert collective("all_reduce").busbw(n) == pytest.approx(2 * (n - 1) / n)
    for coll in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collective(coll).busbw(n) == pytest.approx((n - 1) / n)


@pytest.mark.parametrize("n", [2, 4])
def test_ordinary_tensor_cells_on_the_simulator(n):
    """The bench's ``ordinary`` implementation: the same Communicator calls on plain torch.empty
    tensors (not symmetric), prepared first and captured inside comm.graph_capture(); on the
    shipped plans, run by the simulator, they pass the bench's check without falling back, and
    the check catches a corrupted result."""
    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")

    def body(comm):
        w = _worker(comm, "bfloat16")
        out = []
        for coll in ("all_reduce", "all_gather", "reduce_scatter"):
            cell = w.make_cell(coll, "ordinary", 2048 * n)
            assert not comm.is_symmetric(cell.inp) and not comm.is_symmetric(cell.out)
            assert cell.capture is not None and cell.capture.__func__ is type(comm).graph_capture
            ok, err = w.check(coll, cell)
            out.append((coll, ok, err, comm.last.label()))
        cell = w.make_cell("all_reduce", "ordinary", 1024)
        real = cell.op

        def wrong():
            real()
            cell.out.reshape(-1)[5] -= 2.0

        cell.op = wrong
        out.append(("corrupted", *w.check("all_reduce", cell), ""))
        return out

    results, _, fb = run_ranks(n, body, catalog=Catalog.from_dir(folder), tuning=load_tuning(),
                               engine="sim", refuse_unaligned=16)
    assert fb.calls == []
    for res in results:
        for coll, ok, err, label in res[:-1]:
            assert ok, (coll, err, label)
            assert not label.startswith(("nccl", "gloo")), label
        assert res[-1][1] is False and "wrong" in res[-1][2]
