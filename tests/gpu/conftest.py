"""GPU test session: one worker process per visible GPU, kept for the whole session.

Skipped cleanly without CUDA or with fewer than 2 GPUs. World size = visible GPUs, or
``MSCCLANG_TEST_WORLD`` (2 .. visible GPUs) to use the first ones only.

``MSCCLANG_RANKS_PER_GPU=2`` runs two ranks per GPU (functional checks on a one-GPU machine:
their kernels time-share the GPU; tests that need NCCL between the ranks skip, see
the ``own_gpus`` fixture).
"""

from __future__ import annotations

import os
import threading

import pytest


def _gpus() -> int:
    """Workers a pool can start here (visible GPUs x MSCCLANG_RANKS_PER_GPU)."""
    try:
        from mscclang.runtime.workers import worker_capacity

        return worker_capacity()
    except Exception:  # noqa: BLE001
        return 0


@pytest.fixture(scope="session")
def own_gpus() -> None:
    """Skips a test that needs one GPU per rank: NCCL (the fallback, the engine, the baselines)
    refuses two ranks on one GPU."""
    from mscclang.runtime.workers import nccl_refusal

    why = nccl_refusal()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="session")
def pool():
    if _gpus() < 2:
        pytest.skip("needs at least 2 CUDA GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if os.environ.get("MSCCLANG_ENABLE_NVLS"):
        pytest.skip("refusing to run GPU tests with MSCCLANG_ENABLE_NVLS set")
    from mscclang.runtime.workers import WorkerPool

    world = os.environ.get("MSCCLANG_TEST_WORLD")
    n = int(world) if world else None
    if n is not None and not 2 <= n <= _gpus():
        pytest.skip(f"MSCCLANG_TEST_WORLD={n} needs 2 <= n <= {_gpus()} workers")
    p = WorkerPool(world_size=n, timeout_s=float(os.environ.get("MSCCLANG_TEST_TIMEOUT_S", "10")))
    # interpreter modules loaded (or built, when MSCCLANG_CUBIN_DIR is stale) before any test's limit
    print(f"\nkernels loaded: {p.run('tests.harness.runtime_checks:warm_kernels')[0]}", flush=True)
    _watch(p, float(os.environ.get("MSCCLANG_TEST_DUMP_S", "180")))
    yield p
    p.close()


def _watch(pool, after_s: float) -> None:
    """A command of ``pool`` that has not answered after ``after_s`` seconds has every rank's
    Python stacks written to its stderr (the test's captured output), then goes on waiting: the
    test's own time limit (pytest-timeout) ends it, and the report shows where each rank was."""
    run = pool.run

    def watched(target, *args, **kwargs):
        timer = threading.Timer(after_s, pool.dump_stacks)
        timer.daemon = True
        timer.start()
        try:
            return run(target, *args, **kwargs)
        finally:
            timer.cancel()

    pool.run = watched


def pytest_runtest_logreport(report) -> None:
    """With ``MSCCLANG_TEST_DURATIONS=FILE``, one line per test phase as it ends (seconds, phase,
    outcome, test), and under a failed phase the end of its report and captured output: they
    survive a run cut by its time limit (pytest's own ``--durations`` table and failure reports
    print only at the end). Under xdist the controller alone writes it (the hook runs in each
    worker too, which wrote every line twice)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    path = os.environ.get("MSCCLANG_TEST_DURATIONS")
    if path and (report.when == "call" or report.duration > 1.0):
        with open(path, "a") as f:
            f.write(f"{report.duration:8.2f} {report.when:8} {report.outcome:7} {report.nodeid}\n")
            if report.failed:   # the reason too: a run cut by its time limit never prints its summary
                f.write("".join("    | " + line + "\n" for line in str(report.longrepr).splitlines()[-40:]))
                f.write("".join("    | " + line + "\n" for _, text in report.sections for line in text.splitlines()[-60:]))
