"""The worker pool's pipe handling (mscclang.runtime.workers.recv_from) without GPUs: answers come
through, a dead worker or a silent one raises WorkerError instead of hanging the pool; a pool
larger than the visible GPUs is refused with the count in the message."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import types

import pytest

from mscclang.config import settings
from mscclang.runtime import workers
from mscclang.runtime.workers import WorkerError, recv_from


def _proc(alive: bool, code=None):
    return types.SimpleNamespace(is_alive=lambda: alive, exitcode=code)


def test_answer_comes_through():
    a, b = mp.Pipe()
    b.send(("ok", 7))
    assert recv_from(a, _proc(True), 0) == ("ok", 7)
    b.send(("ready", None))  # a worker that answered and then left
    assert recv_from(a, _proc(False, 0), 3) == ("ready", None)


def test_dead_worker_raises():
    a, _b = mp.Pipe()
    with pytest.raises(WorkerError, match=r"rank 5: worker process exited \(code -9\)"):
        recv_from(a, _proc(False, -9), 5)


def test_real_process_exit_is_seen():
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    p = ctx.Process(target=sys.exit, args=(3,))
    p.start()
    p.join(10)
    with pytest.raises(WorkerError, match=r"code 3"):
        recv_from(a, p, 1)


def test_silent_worker_times_out():
    a, _b = mp.Pipe()
    with pytest.raises(WorkerError, match="rank 2: no answer"):
        recv_from(a, _proc(True), 2, timeout_s=0.2)


@pytest.mark.parametrize("n", [3, 8])
def test_pool_larger_than_the_gpus_is_refused(n, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(WorkerError, match=f"{n} workers needs {n} visible GPU.*2 visible"):
        workers.WorkerPool(world_size=n)


def test_ranks_may_share_a_gpu_for_functional_tests(monkeypatch):
    """MSCCLANG_RANKS_PER_GPU=2 on one GPU: a pool of 2 is allowed (rank r binds GPU r // 2),
    3 is refused with the count it would need; bad values are named."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("MSCCLANG_RANKS_PER_GPU", "2")
    assert settings.ranks_per_gpu == 2 and workers.worker_capacity() == 2
    with pytest.raises(WorkerError, match="3 workers needs 2 visible GPU.*2 rank.*1 visible"):
        workers.WorkerPool(world_size=3)
    started = []

    class _Proc:
        def __init__(self, target, args, daemon):
            started.append(args)

        def start(self):
            raise RuntimeError("stop here")

    class _Ctx:
        def Pipe(self):
            return None, None

        def Process(self, target, args, daemon):
            return _Proc(target, args, daemon)

    import multiprocessing as mp

    monkeypatch.setattr(mp, "get_context", lambda kind: _Ctx())
    with pytest.raises(RuntimeError, match="stop here"):
        workers.WorkerPool(world_size=2)
    assert started[0][-1] == 0  # rank 0 binds GPU 0
    for bad in ("0", "two"):
        monkeypatch.setenv("MSCCLANG_RANKS_PER_GPU", bad)
        with pytest.raises(WorkerError, match="MSCCLANG_RANKS_PER_GPU"):
            settings.ranks_per_gpu


def test_a_worker_starts_with_nvlink_multicast_off_whatever_it_is_given(monkeypatch):
    """A pool worker sets nccl_env() over the environment it is given (NVLink multicast is never
    enabled), keeps a CUDA_DEVICE_MAX_CONNECTIONS and an MSCCLANG_ASYNC_ERROR it is given, and
    otherwise starts with 32 work queues and the watchdog logging."""
    import signal

    import torch

    def no_gpu(dev):
        raise RuntimeError("stop before CUDA")

    monkeypatch.setattr(signal, "signal", lambda *a: None)   # the worker ignores Ctrl-C; pytest must not
    monkeypatch.setattr(torch.cuda, "set_device", no_gpu)
    sent = []
    conn = types.SimpleNamespace(send=sent.append)
    keys = ("NCCL_NVLS_ENABLE", "CUDA_DEVICE_MAX_CONNECTIONS", "MSCCLANG_ASYNC_ERROR")
    for given, want in (({"NCCL_NVLS_ENABLE": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "12", "MSCCLANG_ASYNC_ERROR": "abort"},
                         ("0", "12", "abort")), ({}, ("0", "32", "log"))):
        for k in keys:
            monkeypatch.setenv(k, "x")     # restored after the test
            monkeypatch.delenv(k)
        workers._worker_main(0, 1, 1, 1.0, conn, given, device=0)
        assert tuple(os.environ.get(k) for k in keys) == want
        assert sent[-1][0] == "error" and "stop before CUDA" in sent[-1][1]


def test_an_interrupted_command_restarts_the_pool_before_the_next():
    """A test's time limit (or Ctrl-C) interrupts the parent while the workers still run the
    command, out of step with each other: every later command used to fail in a cascade (a rank
    answering 'reset' while its peer was still in the last test). The pool now restarts first."""
    pool = object.__new__(workers.WorkerPool)
    pool.interrupted = False
    pool.restarts = 0
    calls = []

    def restart():
        calls.append("restart")
        pool.interrupted = False

    def run_once(target, args, kwargs, reset_on_error):
        calls.append(target)
        if target == "slow":
            raise KeyboardInterrupt
        if target == "bad":
            raise WorkerError("rank 0: boom")
        return ["ok"]

    pool.restart = restart
    pool._run = run_once
    with pytest.raises(KeyboardInterrupt):
        pool.run("slow")
    assert pool.interrupted
    assert pool.run("next") == ["ok"]
    assert calls == ["slow", "restart", "next"]
    with pytest.raises(WorkerError):      # a failed command is not an interrupted one
        pool.run("bad")
    assert not pool.interrupted


def test_device_of_rank_follows_the_pool_binding_and_wraps_onto_visible_gpus():
    from mscclang.runtime.workers import WorkerError, device_of_rank

    assert [device_of_rank(r, 8) for r in range(4)] == [0, 1, 2, 3]
    assert [device_of_rank(r, 2, share=2) for r in range(4)] == [0, 0, 1, 1]
    assert [device_of_rank(r, 1) for r in range(2)] == [0, 0]  # faults on a one-GPU machine
    with pytest.raises(WorkerError, match="no GPU to bind rank 0"):
        device_of_rank(0, 0)
    with pytest.raises(WorkerError, match="0 ranks per GPU"):
        device_of_rank(0, 1, share=0)


def test_nccl_refusal_when_ranks_share_a_gpu(monkeypatch):
    from mscclang.runtime.workers import nccl_refusal

    monkeypatch.delenv("MSCCLANG_RANKS_PER_GPU", raising=False)
    assert nccl_refusal() is None
    monkeypatch.setenv("MSCCLANG_RANKS_PER_GPU", "2")
    assert "MSCCLANG_RANKS_PER_GPU=2" in nccl_refusal()
    assert nccl_refusal(share=1) is None


def test_pool_workers_can_import_the_test_harness():
    """GPU test bodies are named by string (``tests.harness.X:fn``): a spawned process, started
    the way the pool starts its workers, imports them (the parent's sys.path travels with spawn)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as p:
        assert p.apply(_import_harness) == "tests.harness.runtime_checks"


def _import_harness() -> str:
    import importlib

    return importlib.import_module("tests.harness.runtime_checks").__name__


def raise_plan_error(w, rank_to_fail):
    """Pool command for the tests below: an mscclang error on one rank, a result elsewhere."""
    from mscclang.errors import PlanError

    if w.rank == rank_to_fail:
        raise PlanError(f"rank {w.rank} needs 12 side streams", f"gpus[{w.rank}].channels")
    return w.rank


def raise_bug(w):
    """Pool command for the tests below: not an mscclang error (a bug)."""
    return {}["missing"]


REAL_POOL = workers.WorkerPool   # the CLI test below swaps the module's class for a stand-in


def _pool_answering(replies):
    """A WorkerPool whose workers already sent ``replies`` (one per rank), with no processes."""
    pool = object.__new__(REAL_POOL)
    pool.interrupted, pool.restarts = False, 0
    pool._conns, pool._procs, pool.worker_ends = [], [], []
    for reply in replies:
        ours, theirs = mp.Pipe()
        theirs.send(reply)
        pool._conns.append(ours)
        pool.worker_ends.append(theirs)   # kept open: the pool sends the command first
        pool._procs.append(types.SimpleNamespace(is_alive=lambda: True, exitcode=None))
    return pool


def test_a_refused_plan_reaches_the_caller_as_its_message_not_eight_tracebacks():
    """Seen on one H200 with eight ranks: `mscclang run` of a plan the executor refuses printed
    every rank's Python traceback. An mscclang error on a worker now comes back as its type and
    message per rank (a RankFailure record on WorkerError.failures); a bug keeps its traceback."""
    w = [workers.Worker(r, 3, None, None) for r in range(3)]
    replies = [workers.run_command(x, f"{__name__}:raise_plan_error", (1,)) for x in w]
    assert [k for k, _ in replies] == ["ok", "error", "ok"]
    f = replies[1][1]
    assert (f.rank, f.kind, f.expected) == (1, "PlanError", True) and "Traceback" in f.traceback
    pool = _pool_answering(replies)
    with pytest.raises(WorkerError) as e:
        pool.run("any:thing", reset_on_error=False)
    assert str(e.value) == "rank 1: PlanError: gpus[1].channels: rank 1 needs 12 side streams"
    assert "Traceback" not in str(e.value) and [x.rank for x in e.value.failures] == [1]
    bug = workers.run_command(w[0], f"{__name__}:raise_bug")
    assert bug[0] == "error" and not bug[1].expected
    pool = _pool_answering([bug, ("ok", 1), ("ok", 2)])
    with pytest.raises(WorkerError, match=r"(?s)rank 0:\nTraceback.*KeyError: 'missing'") as e:
        pool.run("any:thing", reset_on_error=False)
    assert e.value.failures[0].kind == "KeyError"


def test_the_cli_prints_a_refused_plan_in_one_line_per_rank(capsys, monkeypatch):
    """`mscclang run` on a plan the GPUs here refuse: exit 1, the refusal's message per rank, no
    traceback (the pool stands in for the GPU workers)."""
    from mscclang.cli import main as cli

    class Pool:
        world_size = 8

        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def run(self, *a, **k):   # every rank refuses the plan, as the GPU executor did
            replies = [workers.run_command(workers.Worker(r, 8, None, None), f"{__name__}:raise_plan_error", (r,))
                       for r in range(8)]
            return _pool_answering(replies).run("any:thing", reset_on_error=False)

    monkeypatch.setattr(workers, "worker_capacity", lambda: 8)
    monkeypatch.setattr(workers, "WorkerPool", Pool)
    from tests.harness.shipped import PLANS_DIR

    rc = cli.main(["run", str(PLANS_DIR / "allgather_hierarchical.r8.i4.gpus_per_node2.inplace.json"), "--sizes", "64K"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert "mscclang run: error: rank 0: PlanError: gpus[0].channels: rank 0 needs 12 side streams" in err
    assert err.count("PlanError") == 8


def _fake_pool(monkeypatch, main, world: int = 3, **kw):
    """A WorkerPool whose processes run ``main`` (tests/harness/fake_workers.py) instead of the
    GPU worker, on a machine that claims ``world`` GPUs."""
    import torch

    from tests.harness import fake_workers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: world)

    class Pool(workers.WorkerPool):
        _main = staticmethod(getattr(fake_workers, main))

    return Pool(world_size=world, **kw)


@pytest.mark.parametrize("main,said", [("rank1_fails", "CUDA error: out of memory"),
                                       ("rank1_exits", "exited (code 3) while starting")])
def test_a_rank_failing_its_start_ends_the_start_at_once(monkeypatch, main, said):
    """One rank's start fails (a CUDA context out of memory) while the others wait for it at the
    store: the pool raises at once naming that rank and kills the others, instead of waiting the
    start limit (it hung a GPU test past its 240 s limit) for ranks that can never start."""
    import time

    t = time.monotonic()
    with pytest.raises(WorkerError) as e:
        _fake_pool(monkeypatch, main, start_timeout_s=300.0)
    assert time.monotonic() - t < 30, "the start waited for ranks that cannot start"
    text = str(e.value)
    assert "rank 1:" in text and said in text, text
    assert "[0, 2] were still starting: stopped" in text, text


def test_the_start_limit_names_the_silent_ranks(monkeypatch):
    with pytest.raises(WorkerError, match=r"rank\(s\) \[0, 1\]: not started within 2 s"):
        _fake_pool(monkeypatch, "never_ready", world=2, start_timeout_s=2.0)


def test_ranks_that_start_make_a_pool(monkeypatch):
    pool = _fake_pool(monkeypatch, "all_ready")
    assert pool.world_size == 3 and all(p.is_alive() for p in pool._procs)
    pool.close()
    assert not any(p.is_alive() for p in pool._procs) or pool._procs == []
