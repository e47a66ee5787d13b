"""Stand-ins for a GPU worker process's main function (``WorkerPool._main``), for the pool's
start on a machine without GPUs. Module level: a spawned process imports them by name."""
from __future__ import annotations

import os
import time
from typing import Any, Optional


def _serve(conn: Any) -> None:
    conn.send(("ready", None))
    while conn.recv() is not None:
        conn.send(("ok", None))


def rank1_fails(rank: int, world: int, port: int, timeout_s: float, conn: Any, env: dict,
                device: Optional[int] = None) -> None:
    """Rank 1 fails its start as a CUDA context out of memory does; every other rank waits for it
    (as rank 0 waits at the store) far longer than any test."""
    if rank == 1:
        conn.send(("error", "torch.AcceleratorError: CUDA error: out of memory"))
        return
    time.sleep(600)


def rank1_exits(rank: int, world: int, port: int, timeout_s: float, conn: Any, env: dict,
                device: Optional[int] = None) -> None:
    """Rank 1's process ends without a word (killed by the OS); the others wait for it."""
    if rank == 1:
        os._exit(3)
    time.sleep(600)


def all_ready(rank: int, world: int, port: int, timeout_s: float, conn: Any, env: dict,
              device: Optional[int] = None) -> None:
    """Every rank starts and answers until the pool closes."""
    _serve(conn)


def never_ready(rank: int, world: int, port: int, timeout_s: float, conn: Any, env: dict,
                device: Optional[int] = None) -> None:
    """No rank ever answers."""
    time.sleep(600)
