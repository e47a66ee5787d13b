"""The bench's result check (reference and error bound), exercised on the CPU with one rank
emulating what every rank computes: right results pass, wrong, unwritten or corrupted ones fail."""

import pytest
import torch

from mscclang.bench.cells import Cell
from mscclang.bench.worker import BenchConfig, BenchWorker, gen_input, iters_for


def worker(rank, world, dtype):
    w = object.__new__(BenchWorker)
    w.rank, w.world = rank, world
    w.cfg = BenchConfig(colls=[], sizes=[], impls=[], modes=[], dtype=dtype)
    w.device = torch.device("cpu")
    w.dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
               "int32": torch.int32}[dtype]
    w.esz = torch.empty((), dtype=w.dtype).element_size()
    w.seed = 7
    w.barrier = lambda: None
    return w


def oracle(w, coll, numel_in, seed):
    """What a correct collective leaves in this rank's output."""
    n, r, dt = w.world, w.rank, w.dtype
    xs = [gen_input(seed, p, numel_in, dt, w.device) for p in range(n)]
    if coll == "all_reduce":
        acc = xs[0].float() if dt.is_floating_point else xs[0].clone()
        for x in xs[1:]:
            acc = (acc + (x.float() if dt.is_floating_point else x))
        return acc.to(dt)
    if coll == "reduce_scatter":
        k = numel_in // n
        acc = sum((x[r * k:(r + 1) * k].float() if dt.is_floating_point else x[r * k:(r + 1) * k]) for x in xs)
        return acc.to(dt)
    if coll == "all_gather":
        return torch.cat(xs)
    if coll == "all_to_all":
        k = numel_in // n
        return torch.cat([x[r * k:(r + 1) * k] for x in xs])
    return xs[0].clone()


def make(w, coll, numel_in, corrupt=None):
    n = w.world
    out_numel = {"all_gather": numel_in * n, "reduce_scatter": numel_in // n}.get(coll, numel_in)
    inp = torch.empty(numel_in, dtype=w.dtype)
    out = inp if coll in ("all_reduce", "broadcast") else torch.empty(out_numel, dtype=w.dtype)
    cell = Cell(None, inp, out, numel_in)

    def op():
        res = oracle(w, coll, numel_in, w.seed)
        if corrupt == "skip":
            return
        if corrupt == "one":
            res[len(res) // 3] += 3 if not w.dtype.is_floating_point else 1.0
        out.copy_(res)

    cell.op = op
    return cell


COLLS = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"]


@pytest.mark.parametrize("coll", COLLS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int32"])
@pytest.mark.parametrize("rank,world", [(0, 2), (1, 2), (2, 4)])
def test_correct_results_pass(coll, dtype, rank, world):
    w = worker(rank, world, dtype)
    ok, err = w.check(coll, make(w, coll, 96 * world))
    assert ok, err


@pytest.mark.parametrize("coll", COLLS)
@pytest.mark.parametrize("corrupt", ["one", "skip"])
def test_wrong_or_unwritten_results_fail(coll, corrupt):
    # rank 1: an unwritten in-place output still holds rank 1's input, not the result
    w = worker(1, 2, "bfloat16")
    ok, err = w.check(coll, make(w, coll, 4096, corrupt))
    assert not ok and err


def test_iters_scale_down_with_size():
    assert iters_for(1024) > iters_for(64 << 20) > iters_for(1 << 30) >= 2
    assert iters_for(1024, 0.5) == 100 and iters_for(1 << 20, 0.5) == 25


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mscclang_cells_over_the_simulator(dtype):
    """The bench's mscclang cells (views into two symmetric pools) run the shipped plans on the
    simulator and pass the bench's own check."""
    from mscclang.comm.catalog import Catalog, default_plans_dir
    from mscclang.comm.sim_ranks import run_ranks
    from mscclang.comm.tuning import load_tuning

    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")

    def body(comm):
        w = worker(comm.rank, comm.world_size, dtype)
        w.comm = comm
        w.sym = (comm.empty(8192, dtype=torch.uint8), comm.empty(8192, dtype=torch.uint8))
        out = []
        for coll in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
            for nbytes in (1024, 8192):
                cell = w.make_cell(coll, "mscclang", nbytes)
                ok, err = w.check(coll, cell)
                out.append((coll, nbytes, ok, err, comm.last.label()))
        return out

    results, world, fb = run_ranks(2, body, catalog=Catalog.from_dir(folder), tuning=load_tuning(),
                                   engine="sim", refuse_unaligned=16)
    assert fb.calls == []
    for res in results:
        for coll, nbytes, ok, err, label in res:
            assert ok, (coll, nbytes, err, label)
            assert not label.startswith(("nccl", "gloo")), label
