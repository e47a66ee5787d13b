"""GPU tests of the communicator (``pytest -m gpu tests/gpu``): every collective through
``mscclang.comm.Communicator`` on the library's plans (the torch.distributed fallback disabled,
so a call no plan serves fails), fp16/bf16/fp32/int32, element counts that do not divide evenly,
in place and out of place, plain and symmetric tensors, sum/min/max, and CUDA-graph replay on
fresh data. Reuses the session's worker pool (one process per GPU, tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

C = "tests.harness.comm_checks"


def _numels(n: int) -> list[int]:
    # message element counts divisible by n with odd per-rank blocks, small to 4M elements
    return [n * 7, n * 513, n * 4099, n * ((1 << 20) + 3)]


def _ok(results):
    fails = [f for r in results for f in r["failures"]]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:20])
    assert all(r["checked"] > 0 for r in results)
    assert not any(p == "nccl" for r in results for p in r["plans"]), results[0]["plans"]


@pytest.mark.parametrize("coll", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                  "broadcast", "send_recv"])
def test_collective_eager(pool, coll):
    n = pool.world_size
    _ok(pool.run(f"{C}:check_collective", coll, numels=_numels(n)))


@pytest.mark.parametrize("coll", ["all_reduce", "reduce_scatter"])
def test_reduce_ops(pool, coll):
    n = pool.world_size
    _ok(pool.run(f"{C}:check_collective", coll, dtypes=("bfloat16", "int32"), numels=[n * 999],
                 ops=("min", "max"), symmetric=(False,)))


def test_allreduce_odd_counts_and_large(pool):
    _ok(pool.run(f"{C}:check_collective", "all_reduce", dtypes=("float16", "bfloat16"),
                 numels=[1, 3, 1001, (8 << 20) + 5, 64 << 20], inplace=(True,)))


@pytest.mark.parametrize("coll", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_cuda_graph_replay(pool, coll):
    n = pool.world_size
    _ok(pool.run(f"{C}:check_collective", coll, dtypes=("bfloat16",), numels=[n * 512, n * 262147],
                 graph=True))


def test_fallback_logged_once(pool, own_gpus):
    res = pool.run(f"{C}:check_fallback_logged_once")
    for r in res:
        assert r["bad"] == 0 and r["mode"] == "nccl"
        assert len(r["logged"]) == 1, r["logged"]


def test_warm_up_loads_what_later_calls_run(pool):
    """Communicator.warm_up on the GPU: every warmed call ran a plan (none fell back), later calls
    of sizes it never ran use only plans it warmed, and every rank holds the same bytes after."""
    res = pool.run(f"{C}:check_warm_up")
    assert all(r["warmed"] == res[0]["warmed"] for r in res), "every rank warms alike"
    assert res[0]["warmed"] and not any(m == "nccl" for *_, m in res[0]["warmed"]), res[0]["warmed"]
    seen = {(c, p) for c, _, _, p, _ in res[0]["warmed"]}
    for r in res:
        assert set(r["later"]) <= seen, set(r["later"]) - seen
        assert r["digests"] == res[0]["digests"], "ranks differ after the warm-up"
