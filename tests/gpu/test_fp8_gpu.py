"""GPU tests of the fp8 collectives (``pytest -m gpu tests/gpu/test_fp8_gpu.py``; two ranks may
share one GPU with ``MSCCLANG_RANKS_PER_GPU=2``): all_reduce and reduce_scatter of
float8_e4m3fn / float8_e5m2 with both accumulation dtypes, all_gather and all_to_all, through the
communicator on the library's plans, compared bit for bit with the simulator running the chosen
plan (docs/semantics.md, "FP8 reductions"), on sizes that do not divide evenly and sums that
overflow (saturation), eager and in CUDA graphs, on the interpreter and the specialised kernel."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

F = "tests.harness.fp8_checks"


def _ok(results):
    fails = [f for r in results for f in r["failures"]]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:20])
    assert all(r["checked"] > 0 for r in results)
    assert not any(p == "nccl" for r in results for p in r["plans"]), results[0]["plans"]


def _numels(n: int) -> list[int]:
    return [n * 7, n * 4099, n * 16411]


@pytest.mark.parametrize("coll", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"])
@pytest.mark.parametrize("specialize", ["never", "always"])
def test_fp8_eager_equals_simulator(pool, coll, specialize):
    _ok(pool.run(f"{F}:check_fp8", coll, numels=_numels(pool.world_size), specialize=specialize))


def test_fp8_all_reduce_odd_counts(pool):
    _ok(pool.run(f"{F}:check_fp8", "all_reduce", numels=[1, 3, 1001, (1 << 20) + 5], inplace=(True,)))


@pytest.mark.parametrize("coll", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"])
def test_fp8_cuda_graph_replay_equals_simulator(pool, coll):
    n = pool.world_size
    _ok(pool.run(f"{F}:check_fp8", coll, numels=[n * 512, n * 4099], graph=True))
