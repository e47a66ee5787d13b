"""GPU regression tests of the trust issue (``pytest -m gpu tests/gpu``): the serving pattern of
one CUDA graph per batch size on shared plans, capture after prepare across collectives, sizes,
dtypes, layouts and buffer kinds, bad arguments at every entry point, in-place plans imported from
MSCCL++ through ``mscclang run``, ranks that disagree on a call, concurrency, and faults (a peer
killed or hung, eager and graph). Worker commands: :mod:`tests.harness.trust_checks`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness.trust_checks import library_inplace_mscclpp

pytestmark = pytest.mark.gpu

T = "tests.harness.trust_checks"


def _ok(results):
    fails = [f for r in results for f in r["failures"]]
    if fails:   # shown at once (run with -s), not only in the summary
        print("\nFAILURES:\n" + "\n".join(fails[:10]), flush=True)
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:20])
    assert all(r["checked"] > 0 for r in results)


def test_serving_graphs_shared_plans(pool):
    """Defect 0: graphs of batch 1..16 x 8192 bf16 (16K..256K, batches 8 and 16 on one plan),
    captured in batch order after prepare, replayed grouped and interleaved with eager calls
    mixed in: every replay exact (the batch-8 graph used to read freed scratch)."""
    res = pool.run(f"{T}:serving_graphs", rounds=150)
    _ok(res)
    assert res[0]["checked"] >= 3000


def test_serving_graphs_every_batch_prepared_first(pool):
    """Every batch prepared, then every graph captured: the batch-16 prepare grows the context
    that batch 8 was prepared on, and the batch-8 capture must still find its entry."""
    _ok(pool.run(f"{T}:serving_graphs", rounds=40, prepare_first=True, seed=150))


def test_serving_graphs_large_batches_symmetric(pool):
    """Defect 2 in the serving pattern: batches 32..512 (512K..8M) on ordinary and symmetric
    tensors capture after prepare and replay exactly."""
    _ok(pool.run(f"{T}:serving_graphs", batches=(32, 64, 128, 256, 512), rounds=10, seed=200))
    _ok(pool.run(f"{T}:serving_graphs", batches=(1, 8, 16, 128, 512), rounds=10, sym=True, seed=300))


@pytest.mark.parametrize("coll", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                  "broadcast", "send_recv"])
def test_prepare_then_capture_matrix(pool, coll):
    """Defect 2: every call prepare accepts captures (1K..256M x dtypes x in/out of place x
    symmetric/ordinary)."""
    _ok(pool.run(f"{T}:prepare_capture", colls=(coll,), sizes=(1 << 10, 1 << 16, 1 << 20, 2 << 20),
                 dtypes=("float16", "bfloat16", "float32", "int32"), name=f"cap{coll}", specialize="never"))
    _ok(pool.run(f"{T}:prepare_capture", colls=(coll,), sizes=(8 << 20, 64 << 20, 256 << 20),
                 dtypes=("bfloat16", "float32"), replays=1, name=f"capbig{coll}", seed=700, specialize="never"))
    # the default policy: prepare builds the plan-specialised kernel, the capture records it
    _ok(pool.run(f"{T}:prepare_capture", colls=(coll,), sizes=(1 << 10, 2 << 20, 8 << 20),
                 dtypes=("bfloat16",), name=f"capspec{coll}", seed=900))


def test_bad_inputs_raise_and_leave_it_usable(pool):
    """Defect 1: a CPU tensor (or another GPU's) at every entry point raises a clear error before
    the GPU sees it; the communicator and the executor stay usable and exact."""
    res = pool.run(f"{T}:bad_inputs")
    _ok(res)
    for r in res:
        assert "cuda" in r["raised"]["all_reduce cpu"], r["raised"]
        assert "Executor.execute cpu" in r["raised"]


def test_ranks_disagree(pool):
    """Defect 4: rank 0 all_reduce of 1024 elements, the others 1M: a clear error on every rank
    naming what each called (or a timeout that does), then the communicator works again."""
    res = pool.run(f"{T}:disagree")
    for r in res:
        assert r["raised"], r
        assert "disagree" in r["raised"] or "last calls" in r["raised"], r
        assert "cuIpcOpenMemHandle" not in r["raised"], r
        assert r["elapsed_s"] < 60, r
        assert r["after"] == "ok", r


def test_concurrency(pool, own_gpus):
    """Needs NCCL between the ranks (skips when ranks share a GPU: "Duplicate GPU detected")."""
    _ok(pool.run(f"{T}:concurrency", iters=30))


def test_inplace_plans_imported_from_mscclpp_run_exact(pool, tmp_path):
    """Defect 3: in-place plans imported from MSCCL++ run in place through ``mscclang run``. The
    export and import up to the launch: tests/test_mscclpp_export.py (CPU)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for f in library_inplace_mscclpp(tmp_path):
        ours = tmp_path / (f.stem + ".ours.json")
        r = subprocess.run([sys.executable, "-m", "mscclang", "import-mscclpp", str(f), "-o", str(ours)],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        r = subprocess.run([sys.executable, "-m", "mscclang", "run", str(ours), "--size", "1K", "--size", "1M",
                            "--iters", "20"], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0 and "BAD" not in r.stdout, r.stdout + r.stderr


def test_executor_refuses_mismatched_layout(pool, own_gpus):
    """Needs NCCL between the ranks (skips when ranks share a GPU: "Duplicate GPU detected")."""
    res = pool.run(f"{T}:layout_refusals")
    for r in res:
        assert not r["failures"], r


def _fault(tmp_path, **kw):
    args = [sys.executable, "-m", "tools.faults", "--out", str(tmp_path / "r.json")]
    for k, v in kw.items():
        args += [f"--{k}", str(v)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp_path / "r.json").read_text())


@pytest.mark.parametrize("mode,size,fault", [("eager", 4096, "kill"), ("graph", 4096, "kill"),
                                             ("eager", 8 << 20, "kill"), ("graph", 4096, "hang")])
def test_dead_or_hung_peer_surfaces(tmp_path, pool, mode, size, fault):
    """A peer killed (or hung) mid-stream: the survivor raises CollectiveTimeout within the
    timeout (graph replays too, through the watchdog), a later call raises, close() returns."""
    res = _fault(tmp_path, mode=mode, size=size, fault=fault, timeout=5)
    assert res["type"] == "CollectiveTimeout", res
    assert res["time_to_error_s"] is not None and res["time_to_error_s"] < 5 + 10, res
    assert res["next_call"] == "CollectiveTimeout", res
    assert res["close_returned"], res
