"""GPU test session: one worker process per visible GPU, kept for the whole session.

Skipped cleanly without CUDA or with fewer than 2 GPUs. World size = visible GPUs, or
``MSCCLANG_TEST_WORLD`` (2 .. visible GPUs) to use the first ones only.
"""

from __future__ import annotations

import os

import pytest


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


@pytest.fixture(scope="session")
def pool():
    if _gpus() < 2:
        pytest.skip("needs at least 2 CUDA GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if os.environ.get("MSCCLANG_ENABLE_NVLS"):
        pytest.skip("refusing to run GPU tests with MSCCLANG_ENABLE_NVLS set")
    from mscclang.runtime.launch import WorkerPool

    world = os.environ.get("MSCCLANG_TEST_WORLD")
    n = int(world) if world else None
    if n is not None and not 2 <= n <= _gpus():
        pytest.skip(f"MSCCLANG_TEST_WORLD={n} needs 2 <= n <= {_gpus()} visible GPUs")
    p = WorkerPool(world_size=n, timeout_s=float(os.environ.get("MSCCLANG_TEST_TIMEOUT_S", "10")))
    yield p
    p.close()
