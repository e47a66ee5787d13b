"""GPU tests of ``Communicator.all_reduce_add_rms_norm`` (``pytest -m gpu tests/gpu``; two ranks
on one GPU with ``MSCCLANG_RANKS_PER_GPU=2``): the library's fused plans on the GPU equal the
simulator bit for bit and torch's reference within 4 ulps, eager and under CUDA-graph replay.
Reuses the session's worker pool (tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

F = "tests.harness.fused_checks"


def _ok(results):
    fails = [f for r in results for f in r["failures"]]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:20])
    assert all(r["checked"] > 0 and r["plans"] for r in results)


def test_fused_norm_eager(pool):
    _ok(pool.run(f"{F}:check_fused_norm"))


def test_fused_norm_cuda_graph(pool):
    _ok(pool.run(f"{F}:check_fused_norm", graph=True, dtypes=("bfloat16",)))
