"""GPU tests of port channels (``pytest -m gpu``): the copy-engine proxy on one node and the
engine (NCCL point-to-point through nccl4py) between two one-GPU "nodes", eager and in CUDA
graphs, every result compared bit for bit (int32) with the reference and, for small sizes, with
the simulator; a peer that never calls ends in CollectiveTimeout and the executor recovers."""

from __future__ import annotations

import importlib.util

import pytest

from mscclang.plan.io import plan_to_json
from tests.harness import port_plans as pp

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("ports")]   # its own pool: started once (suite.sh)

C = "tests.harness.runtime_checks"
P = "tests.harness.port_checks"


def _ok(results):
    for r in results:
        assert r["bad"] == 0, f"rank {r['rank']}: {r}"


def _plans(world):
    out = {"allgather_pwsf": pp.allgather_pwsf(world), "allgather_put_flush_signal": pp.allgather_put_flush_signal(world),
           "allgather_port_only": pp.allgather_port_only(world)}
    if world == 2:
        out["sendrecv_pipelined"] = pp.sendrecv_pipelined()
        out["pingpong"] = pp.pingpong(True)
    return out


@pytest.mark.parametrize("name", ["allgather_pwsf", "allgather_put_flush_signal", "allgather_port_only"])
def test_port_plans_copy_engine(pool, name):
    j = plan_to_json(_plans(pool.world_size)[name])
    for nbytes in (1024, 65536 + 96, 1 << 20, 64 << 20):
        for dt in ("int32", "bfloat16"):
            _ok(pool.run(f"{C}:run_plan_check", j, nbytes, dt, None, "sum", 0, False, True))


def test_port_pipeline_copy_engine(pool):
    if pool.world_size != 2:
        pytest.skip("two-rank plan")
    j = plan_to_json(pp.sendrecv_pipelined(unit=1 << 16))
    for nbytes in (1 << 16, 1 << 18):   # checked against the simulator (no reference): small sizes
        _ok(pool.run(f"{P}:graph_replays", j, nbytes, "int32", 2))


@pytest.mark.parametrize("name", ["allgather_pwsf", "allgather_put_flush_signal"])
def test_port_plans_in_cuda_graphs(pool, name):
    j = plan_to_json(_plans(pool.world_size)[name])
    for nbytes in (4096, 1 << 20, 16 << 20):
        _ok(pool.run(f"{P}:graph_replays", j, nbytes, "int32", 6))


def test_port_peer_never_calls(pool):
    j = plan_to_json(pp.allgather_pwsf(pool.world_size))
    res = pool.run(f"{P}:peer_never_calls", j)
    r0 = res[0]
    assert r0["error"], r0
    assert r0["seconds"] < 60, r0
    assert all(r["bad_after_reset"] == 0 for r in res), res


@pytest.fixture(scope="module")
def two_nodes(own_gpus):
    """The same GPUs as one-GPU "nodes": port channels between them go through the engine."""
    if importlib.util.find_spec("nccl") is None:
        pytest.skip("nccl4py is not installed")
    from mscclang.runtime.workers import WorkerPool

    p = WorkerPool(world_size=2, timeout_s=15.0,
                   env={"MSCCLANG_GPUS_PER_NODE": "1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
                        "NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": "lo"})
    p.run(f"{C}:warm_kernels")   # no test's limit pays for an interpreter build
    yield p
    p.close()


def test_port_plans_two_nodes(two_nodes):
    j = plan_to_json(pp.allgather_port_only(2))
    for nbytes in (1024, 65536 + 96, 1 << 20, 16 << 20):
        _ok(two_nodes.run(f"{C}:run_plan_check", j, nbytes, "int32", None, "sum", 0, False, False))
    _ok(two_nodes.run(f"{P}:graph_replays", j, 1 << 20, "int32", 4, False))


def test_engine_peer_never_calls(two_nodes):
    j = plan_to_json(pp.allgather_port_only(2))
    res = two_nodes.run(f"{P}:peer_never_calls", j, 1 << 20, False)
    assert res[0]["error"] and res[0]["seconds"] < 60, res
    assert all(r["bad_after_reset"] == 0 for r in res), res


def test_memory_channel_plan_refused_between_nodes(two_nodes):
    j = plan_to_json(pp.allgather_pwsf(2))
    res = two_nodes.run(f"{P}:runnable_reason", j)
    assert all("different nodes" in r for r in res), res


LIBRARY = ["allgather_port.r{n}.i1", "allgather_port.r{n}.i1.inplace", "alltoall_port.r{n}.i1",
           "allreduce_port_pipelined.r{n}.i1.steps4", "allreduce_port_pipelined.r{n}.i1.steps8.inplace"]


@pytest.mark.parametrize("stem", LIBRARY)
def test_library_port_algorithms(pool, stem):
    """The shipped copy-engine algorithms, eager (int32, exact; bf16 within the sum's bound)
    and in CUDA graphs, on symmetric buffers."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "plans" / (stem.format(n=pool.world_size) + ".json")
    if not path.is_file():
        pytest.skip(f"no {path.name} for {pool.world_size} ranks")
    j = path.read_text()
    for nbytes in (1 << 20, (16 << 20) + 4096):
        for dt in ("int32", "bfloat16"):
            _ok(pool.run(f"{C}:run_plan_check", j, nbytes, dt, None, "sum", 0, False, True))
    _ok(pool.run(f"{P}:graph_replays", j, 4 << 20, "int32", 4))
