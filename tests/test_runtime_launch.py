"""The worker pool's pipe handling (mscclang.runtime.launch.recv_from) without GPUs: answers come
through, a dead worker or a silent one raises WorkerError instead of hanging the pool; a pool
larger than the visible GPUs is refused with the count in the message."""

from __future__ import annotations

import multiprocessing as mp
import sys
import types

import pytest

from mscclang.runtime import launch
from mscclang.runtime.launch import WorkerError, recv_from


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
        launch.WorkerPool(world_size=n)
