"""One worker process per visible GPU, kept alive and driven by commands.

A :class:`WorkerPool` spawns ``world_size`` processes; each binds GPU ``rank``, joins a TCPStore,
and builds a :class:`~mscclang.runtime.bootstrap.Bootstrap` and an
:class:`~mscclang.runtime.executor.Executor`. ``pool.run("module:function", *args)`` calls
``function(worker, *args)`` on every rank at once and returns the per-rank results (exceptions
come back as ``WorkerError`` with the rank's traceback). Used by the GPU tests (one pool for the
whole session) and by ``mscclang run``.

``settings.ranks_per_gpu`` (``MSCCLANG_RANKS_PER_GPU``, default 1) workers may share a GPU, for
functional tests on a machine with fewer GPUs than ranks only: ranks on one GPU run in separate
processes (separate CUDA contexts, IPC between them works as between GPUs) and their kernels
time-share the GPU, so every cross-rank wait may last a scheduler time slice. Timings taken this
way mean nothing, and NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import importlib
import os
import socket
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from mscclang.config import Settings, settings, worker_env
from mscclang.errors import MscclangError, WorkerError


@dataclass
class RankFailure:
    """Why a command failed on one rank. ``expected``: the exception was an mscclang error (bad
    input, a plan this machine refuses, a collective timeout), which is reported by its type and
    message alone; anything else is a bug and keeps its traceback."""

    rank: int
    kind: str
    message: str
    traceback: str = ""
    expected: bool = False

    def describe(self) -> str:
        if self.expected or not self.traceback:
            return f"rank {self.rank}: {self.kind}: {self.message}"
        return f"rank {self.rank}:\n{self.traceback}"


def device_of_rank(rank: int, visible: int, share: int = 1) -> int:
    """The GPU that rank ``rank`` binds when ``share`` ranks share each of ``visible`` GPUs: the
    pool's binding ``rank // share``, wrapped onto the visible GPUs (so two ranks on a one-GPU
    machine both get GPU 0 rather than a GPU that does not exist)."""
    if visible < 1:
        raise WorkerError(f"no GPU to bind rank {rank} to ({visible} visible)")
    if share < 1:
        raise WorkerError(f"{share} ranks per GPU: must be at least 1")
    if rank < 0:
        raise WorkerError(f"rank {rank} is negative")
    return (rank // share) % visible


def nccl_refusal(share: Optional[int] = None) -> Optional[str]:
    """Why NCCL cannot run between the ranks of a pool here, or None when it can: NCCL refuses two
    ranks on one GPU ("Duplicate GPU detected"), so with ``share`` (default
    ``settings.ranks_per_gpu``) above 1 every test or command that needs NCCL between ranks must skip."""
    n = settings.ranks_per_gpu if share is None else share
    if n > 1:
        return f"needs one GPU per rank for NCCL (MSCCLANG_RANKS_PER_GPU={n}: ranks share a GPU)"
    return None


def worker_capacity() -> int:
    """How many workers a pool can start here: visible GPUs x ``settings.ranks_per_gpu``."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return visible * settings.ranks_per_gpu


@dataclass
class Worker:
    """What a command function receives on its rank."""

    rank: int
    world_size: int
    comm: Any
    executor: Any
    state: dict = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recv_from(conn: Any, proc: Any, rank: int, timeout_s: Optional[float] = None) -> tuple[str, Any]:
    """The next message of rank ``rank``'s worker, without hanging on a worker that died (its
    exit code reported as a WorkerError) or, with ``timeout_s``, one that stays silent."""
    import time

    start = time.monotonic()
    while not conn.poll(0.5):
        if not proc.is_alive():
            if conn.poll(0):  # it sent its last message before it left
                break
            raise WorkerError(f"rank {rank}: worker process exited (code {proc.exitcode}) without answering")
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise WorkerError(f"rank {rank}: no answer from the worker within {timeout_s:.0f} s")
    try:
        return conn.recv()
    except EOFError as e:
        raise WorkerError(f"rank {rank}: worker closed its pipe (exit code {proc.exitcode})") from e


def reset_executor(w: Worker) -> bool:
    """Pool command: reset the worker's executor (collectively, every rank at once). The pool runs
    it on every rank after a command failed on some rank, so the next command starts clean."""
    w.executor.reset()
    return True


def run_command(w: Worker, target: str, args: Sequence[Any] = (), kwargs: Optional[dict] = None) -> tuple[str, Any]:
    """One pool command on this rank: ``("ok", result)`` of ``function(w, *args, **kwargs)`` for
    ``target`` "module:function", or ``("error", RankFailure)`` for whatever it raised."""
    try:
        mod, fn = target.split(":")
        f = getattr(importlib.import_module(mod), fn)
        return "ok", f(w, *args, **(kwargs or {}))
    except BaseException as e:  # noqa: BLE001 - the failure goes back to the parent
        return "error", RankFailure(w.rank, type(e).__name__, str(e), traceback.format_exc(),
                                    isinstance(e, MscclangError))


def _worker_main(rank: int, world: int, port: int, timeout_s: float, conn: Any, env: dict,
                 device: Optional[int] = None) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: no traceback per worker
    import faulthandler

    # WorkerPool.dump_stacks: every thread's Python stack to stderr, the worker goes on
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    os.environ.update(env)
    os.environ.update(worker_env())   # NVLink multicast off; plans with up to 31 port side streams run
    # the commands check every launch themselves: an asynchronous exception from the watchdog
    # could land in the command loop instead of the command
    if not settings.is_set("async_error"):
        os.environ[Settings.async_error.name] = "log"
    try:
        import torch
        import torch.distributed as dist

        dev = rank if device is None else device
        torch.cuda.set_device(dev)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, wait_for_workers=False)
        from mscclang.runtime.bootstrap import Bootstrap
        from mscclang.runtime.executor import Executor

        comm = Bootstrap(store=store, rank=rank, world_size=world, device=dev, store_timeout_s=60.0)
        ex = Executor(comm, timeout_s=timeout_s)
        w = Worker(rank, world, comm, ex)
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - report any start failure
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        target, args, kwargs = msg
        reply = run_command(w, target, args, kwargs)
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - a result that cannot be pickled: say so
            conn.send(("error", RankFailure(rank, type(e).__name__, f"{target}: its result could not be sent "
                                            f"back: {e}", traceback.format_exc())))
    try:
        ex.close()
        comm.close()
    except Exception:  # noqa: BLE001
        pass


class WorkerPool:
    """``world_size`` GPU worker processes (default: every visible GPU; any number from 1 to the
    visible GPUs, or to :func:`worker_capacity` when ``MSCCLANG_RANKS_PER_GPU`` lets ranks share
    a GPU; rank r then binds GPU r // ranks_per_gpu). ``start_timeout_s`` bounds the workers'
    start (CUDA context, store, executor)."""

    def __init__(self, world_size: Optional[int] = None, timeout_s: float = 30.0,
                 env: Optional[dict] = None, start_timeout_s: float = 300.0) -> None:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        share = settings.ranks_per_gpu
        n = visible * share if world_size is None else world_size
        if n < 1 or n > visible * share:
            need = -(-max(n, 1) // share)
            raise WorkerError(f"a pool of {n} workers needs {need} visible GPU(s) at {share} rank(s) per GPU; "
                              f"{visible} visible")
        self.world_size = n
        self._share = share
        self._visible = visible
        self._timeout_s = timeout_s
        self._env = dict(env or {})
        self._start_timeout_s = start_timeout_s
        self._conns: list = []
        self._procs: list = []
        #: a command was interrupted while the workers ran it (e.g. a test's time limit): they may
        #: still be in it, out of step with each other, so the next command restarts the pool
        self.interrupted = False
        self.restarts = 0
        self._start()

    #: the function each worker process runs (module level, so a spawned process finds it)
    _main = staticmethod(_worker_main)

    def _start(self) -> None:
        """Start the workers and wait for each one's "ready". The first rank that fails (its
        error, or its process gone) ends the wait at once: the others, which may be waiting for
        it at the store, are killed and every failure is raised together, never a hang for the
        whole start limit."""
        import multiprocessing as mp
        import time
        from multiprocessing.connection import wait

        ctx = mp.get_context("spawn")
        port = _free_port()
        n, share = self.world_size, self._share
        for r in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=type(self)._main,
                            args=(r, n, port, self._timeout_s, b, dict(self._env),
                                  device_of_rank(r, self._visible, share)), daemon=True)
            p.start()
            self._conns.append(a)
            self._procs.append(p)
        pending = dict(enumerate(self._conns))
        errs: list[str] = []
        deadline = time.monotonic() + self._start_timeout_s
        while pending and not errs:
            ready = wait(list(pending.values()), timeout=0.5)
            for r, c in list(pending.items()):
                if c in ready:
                    try:
                        kind, val = c.recv()
                    except EOFError:   # its pipe closed: the process ended without a word
                        self._procs[r].join(timeout=5)
                        kind, val = "error", f"worker process exited (code {self._procs[r].exitcode}) while starting"
                elif not self._procs[r].is_alive():
                    kind, val = "error", f"worker process exited (code {self._procs[r].exitcode}) while starting"
                else:
                    continue
                del pending[r]
                if kind != "ready":
                    errs.append(f"rank {r}:\n{val}")
            if pending and not errs and time.monotonic() > deadline:
                errs.append(f"rank(s) {sorted(pending)}: not started within {self._start_timeout_s:.0f} s")
        if errs:
            if pending:
                errs.append(f"rank(s) {sorted(pending)} were still starting: stopped")
            for p in self._procs:
                if p.is_alive():
                    p.kill()
            self.close()
            raise WorkerError("workers failed to start:\n" + "\n".join(errs))

    def restart(self) -> None:
        """Kill every worker and start fresh ones (same settings): after an interrupted command
        the old ones may still run it, or wait for each other, forever."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=20)
        self._conns.clear()
        self._procs.clear()
        self.interrupted = False
        self.restarts += 1
        self._start()

    def run(self, target: str, *args: Any, reset_on_error: bool = True, **kwargs: Any) -> list[Any]:
        """Call ``target`` ("module:function") on every rank with the same arguments. When a rank
        fails, every rank's executor is reset (collectively) before WorkerError is raised. A
        command interrupted while the workers ran it (KeyboardInterrupt, a test framework's time
        limit) marks the pool :attr:`interrupted`; the next command first restarts it."""
        if self.interrupted:
            self.restart()
        try:
            return self._run(target, args, kwargs, reset_on_error)
        except WorkerError:
            raise
        except BaseException:
            self.interrupted = True
            raise

    def _run(self, target: str, args: tuple, kwargs: dict, reset_on_error: bool) -> list[Any]:
        for c in self._conns:
            c.send((target, args, kwargs))
        out: list[Any] = []
        errs: list[RankFailure] = []
        dead = False
        for r, c in enumerate(self._conns):
            try:
                kind, val = recv_from(c, self._procs[r], r)
            except WorkerError as e:
                kind, val, dead = "error", RankFailure(r, "WorkerError", str(e), expected=True), True
            if kind == "ok":
                out.append(val)
            else:
                out.append(None)
                errs.append(val if isinstance(val, RankFailure) else RankFailure(r, "Exception", str(val), str(val)))
        if errs:
            text = "\n".join(f.describe() for f in errs)
            if dead:
                self.interrupted = True   # the next command starts a fresh pool
                raise WorkerError("a worker process died; the pool restarts at its next command:\n" + text, errs)
            if reset_on_error:
                try:
                    self.run(f"{__name__}:reset_executor", reset_on_error=False)
                except WorkerError:
                    pass
            raise WorkerError(text, errs)
        return out

    def dump_stacks(self) -> None:
        """Every live worker writes each thread's Python stack to its stderr (SIGUSR1, through
        faulthandler) and goes on: where a command that does not answer is waiting."""
        import signal

        for p in self._procs:
            if p.is_alive() and p.pid is not None:
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        self._conns.clear()
        self._procs.clear()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, et: Any, *exc: Any) -> None:
        if et is not None and issubclass(et, KeyboardInterrupt):
            for p in self._procs:  # Ctrl-C: do not wait for the workers' current call
                if p.is_alive():
                    p.kill()
        self.close()
