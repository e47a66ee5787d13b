"""The torch.distributed backend on CUDA tensors, under torchrun, as a user runs it.

Two ranks: one GPU each, or both on one GPU (``MSCCLANG_RANKS_PER_GPU=2``: the inner group and
the references are then gloo through host copies, since NCCL refuses two ranks on one GPU).
``tools/backend_checks.py`` runs every mapped op, async Works, the inner group, DDP and FSDP2
(parameters bit-identical to the reference group), tensor parallelism over a DeviceMesh,
torch.compile, CUDA-graph capture of ``dist.all_reduce`` and the per-call overhead;
``examples/ddp_mscclang.py`` is the README's example.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def _capacity() -> int:
    try:
        from mscclang.runtime.workers import worker_capacity

        return worker_capacity()
    except Exception:  # noqa: BLE001 - no CUDA: skip
        return 0


@pytest.fixture
def torchrun_env() -> dict:
    if _capacity() < 2:
        pytest.skip("needs 2 ranks: 2 CUDA GPUs, or one with MSCCLANG_RANKS_PER_GPU=2")
    if os.environ.get("MSCCLANG_ENABLE_NVLS"):
        pytest.skip("refusing to run GPU tests with MSCCLANG_ENABLE_NVLS set")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["NCCL_NVLS_ENABLE"] = "0"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _torchrun(env: dict, script: Path, *args: str, timeout: int) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(port), str(script), *args],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_torch_callers_on_cuda_tensors(torchrun_env, tmp_path):
    out = tmp_path / "backend.json"
    p = _torchrun(torchrun_env, ROOT / "tools" / "backend_checks.py", "--out", str(out), timeout=240)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    print(json.dumps(res))
    bad = {k: v for k, v in res["checks"].items() if v != "ok"}
    assert not bad, bad
    for name in ("ddp", "fsdp2", "graph", "tensor_parallel", "compiled", "overhead"):
        assert res["checks"].get(name) == "ok", name
    assert p.returncode == 0, p.stderr[-3000:]


def test_ddp_example_on_cuda_tensors(torchrun_env):
    p = _torchrun(torchrun_env, ROOT / "examples" / "ddp_mscclang.py", timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for r in (0, 1):
        assert f"ddp_mscclang: rank {r}: 50 steps on mscclang and on" in p.stdout, p.stdout[-2000:]
        assert "parameters bit-identical" in p.stdout


def test_a_rank_dying_mid_training_on_cuda_tensors(torchrun_env, tmp_path):
    """Rank 1 leaves at step 5 of a DDP training on CUDA tensors: rank 0's collective ends in an
    error (the runtime's CollectiveTimeout) within the group's timeout, and
    destroy_process_group() returns. The GPU runs the collectives asynchronously, so the error of
    step 5's collective may surface at the next step's first call (device call 7 of session 9:
    CollectiveTimeout after 10.000 s, at step 6)."""
    out = tmp_path / "dead.json"
    p = _torchrun(torchrun_env, ROOT / "tools" / "backend_dead_peer.py", "--out", str(out), "--timeout", "10",
                  timeout=150)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    print(json.dumps(res))
    assert res["raised"] == "CollectiveTimeout" and res["step"] in (5, 6) and res["seconds"] < 10 + 15, res
    assert res["destroyed"] is True, res
