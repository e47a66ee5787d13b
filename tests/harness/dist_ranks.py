"""Spawned CPU ranks of torch.distributed for the tests: :func:`spawn_ranks` starts ``world``
processes over a FileStore, each initialises a default group (gloo, or the ``mscclang`` backend)
and runs one named function; every rank's result, error or death (a signal, an abort inside gloo)
comes back, so a test sees a crash as a failure instead of hanging or dying with the ranks."""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass
class RankResult:
    """What one rank ended with: ``value`` (the function's return value), or ``error`` (its
    traceback), or ``exitcode`` (the process died before reporting; negative: the signal)."""

    rank: int
    value: Any = None
    error: Optional[str] = None
    exitcode: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode is None


def _rank_main(rank: int, world: int, init_file: str, backend: str, timeout_s: float, target: str,
               args: tuple, q: Any) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        import torch.distributed as dist

        import mscclang.distributed  # noqa: F401 - registers the backend

        dist.init_process_group(backend, store=dist.FileStore(init_file, world), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        mod, _, fn = target.partition(":")
        value = getattr(importlib.import_module(mod), fn)(rank, *args)
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put(RankResult(rank, error=traceback.format_exc()))
        return
    q.put(RankResult(rank, value=value))   # before the teardown, which waits for the peers
    dist.destroy_process_group()


def spawn_ranks(tmp_path: Path, target: str, *args: Any, world: int = 2, backend: str = "gloo",
                timeout_s: float = 30.0, wait_s: float = 120.0) -> list[RankResult]:
    """Run ``target`` (``"module:function"``, called as ``function(rank, *args)``) on ``world``
    spawned ranks whose default group is ``backend`` with collective timeout ``timeout_s``; the
    ranks' results in rank order. A rank still running after ``wait_s`` is killed and reported
    with its exit code (as is one whose teardown has not ended 10 s after the last report)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = str(tmp_path / f"store-{time.monotonic_ns()}")
    procs = [ctx.Process(target=_rank_main, args=(r, world, init, backend, timeout_s, target, args, q))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, RankResult] = {}
    deadline = time.monotonic() + wait_s
    try:
        while len(got) < world and time.monotonic() < deadline:
            try:
                res = q.get(timeout=0.5)
                got[res.rank] = res
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in got and p.exitcode is not None:
                        try:   # its report may still be in the queue
                            res = q.get(timeout=1.0)
                            got[res.rank] = res
                        except queue.Empty:
                            got[r] = RankResult(r, exitcode=p.exitcode)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(5)
    while True:   # reports that came after the deadline
        try:
            res = q.get(timeout=0.1)
        except queue.Empty:
            break
        got.setdefault(res.rank, res)
    return [got.get(r, RankResult(r, exitcode=procs[r].exitcode)) for r in range(world)]
