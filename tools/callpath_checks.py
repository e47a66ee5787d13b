#!/usr/bin/env python3
"""User-level checks of mscclang's call path, through the public API only
(``mscclang.Communicator.from_torch()`` on torch.distributed's default group).

Subcommands (each writes one JSON line of results to stdout, and to ``--out FILE``):

* ``stream --calls 2000 --seed S [--specialize never]``: eager calls on FRESH tensors, each a
  random collective (all_reduce, all_gather, reduce_scatter), dtype (fp16, bf16, fp32, int32) and
  size (log-uniform, 1 element to 4M elements), every result compared exactly with the reference
  (the inputs are small integers, so every sum is exact in every dtype and summation order);
  reports the total time, the calls, the mismatches and how many calls the Communicator handed to
  torch.distributed (``fallback_calls``).
  ``--specialize never`` runs with ``MSCCLANG_SPECIALIZE=never`` (for comparison).
* ``memory --sizes 10000``: that many distinct sizes of all_reduce (log-uniform, 1 element to 4M
  elements, bf16, each checked), then ``comm.memory()`` (its ``total_bytes`` and the whole dict).
  Default 10,000 sizes with CUDA, 100 on the CPU (each size is a gloo all_reduce there).
* ``first [--sizes B,B,...]``: per message size never seen before (default: 49,164 and 278,596
  bytes, then 10 sizes log-spaced from 475,252 to 16,371,612, bf16), the time of the first eager
  all_reduce of that size on fresh tensors and of the second (host wall time around the call and
  the device synchronisation, the slower rank), each result checked; one untimed call of another
  size first absorbs the process's one-time start-up. The same measurement as ``mscclang bench
  --first-calls``, through the public API only, so it also runs against an older mscclang.
  ``--profile N``: rank 0 also runs the first calls and the second calls under ``cProfile`` and
  reports the N functions of each with the most time of their own and the N functions of
  mscclang with the most cumulative time (``profile_first``, ``profile_second``): where a new
  size's host work goes; ``--profile-skip K`` leaves the first K sizes out (a plan's first call
  sets the plan up). ``stream --profile N`` does the same for
  the whole stream (``profile``).
* ``walk [--numel 1024] [--ordinary-numel 1048576]``: a memo hit's route as it runs (an in-place
  ``all_reduce`` of an ordinary fp32 tensor after three calls of it, under ``sys.setprofile``):
  its *stays* (entries into a mscclang file, returns included), the distinct files and the
  crossings between ``mscclang/comm`` and ``mscclang/runtime``; then rank 0's cProfile of 200
  calls on an ordinary tensor of ``--ordinary-numel`` elements, per call (where the host time of
  the ordinary, staged path goes).
* ``abort --mode graph|eager|hung --runs 3`` (CUDA only, 2 GPUs): rank 0 replays a captured CUDA
  graph of a 1,000-element bf16 all_reduce on a symmetric tensor (``comm.empty``), synchronising
  every 10 replays; its peer stops after 20 replays (graph, eager: the process exits; hung: it
  stays alive and never calls again); ``MSCCLANG_TIMEOUT_S=5``. Per run: how many of rank 0's
  replays completed and synchronised after the peer stopped before an exception
  (``mscclang.CollectiveTimeout``) reached it, and whether ``comm.close()`` returned. Mode eager:
  eager calls instead of graph replays. Every wait has a deadline; the children are killed.

``stream`` and ``memory`` print a progress line on stderr every few seconds. The options
``--ranks``, ``--out`` and ``--timeout`` go before or after the subcommand.

Launch: under ``torchrun --nproc-per-node N`` (stream, memory), or plainly: the script then starts
``--ranks`` processes itself (NCCL with CUDA, else gloo). Without CUDA, ``stream`` and ``memory``
run on the CPU, where the Communicator has no GPU runtime and every call goes through its
torch.distributed fallback (gloo); the JSON says so (``engine``). The CPU simulator is not
reachable through the public API. Exit status: 0 all checks passed, 1 a mismatch or a failed
rank, 2 a usage error (``abort`` without 2 CUDA GPUs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

COLLS = ("all_reduce", "all_gather", "reduce_scatter")
DTYPES = ("float16", "bfloat16", "float32", "int32")
MAX_NUMEL = 4 << 20
ABORT_NUMEL, PEER_REPLAYS, SYNC_EVERY, ABORT_TIMEOUT_S = 1000, 20, 10, 5
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: ``memory``'s default sizes: with CUDA, and on the CPU (each a gloo all_reduce, ~0.2 s)
MEMORY_SIZES, CPU_MEMORY_SIZES = 10000, 100
#: seconds between progress lines on stderr
PROGRESS_S = 5.0


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def small_ints(seed: int, rank: int, numel: int, dtype: Any, world: int, device: Any) -> Any:
    """Rank ``rank``'s input of call ``seed``: integers small enough that the sum over ``world``
    ranks is exact in every dtype (at most 256 in magnitude: bf16's exact integers)."""
    import torch

    k = max(1, min(16, 256 // world))
    g = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    return torch.randint(-k, k + 1, (numel,), generator=g, device=device, dtype=torch.int32).to(dtype)


def reference(coll: str, seed: int, rank: int, numel: int, dtype: Any, world: int, device: Any) -> Any:
    """The exact result (int64) of ``coll`` on every rank's :func:`small_ints` input of ``seed``."""
    import torch

    xs = [small_ints(seed, r, numel, dtype, world, device).to(torch.int64) for r in range(world)]
    if coll == "all_gather":
        return torch.cat(xs)
    total = torch.stack(xs).sum(0)
    if coll == "reduce_scatter":
        k = numel // world
        return total[rank * k:(rank + 1) * k]
    return total


class Rank:
    """One rank's side: the communicator and the checked calls."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        import mscclang

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.comm = mscclang.Communicator.from_torch()
        gpu = getattr(self.comm, "backend", None) is not None
        self.engine = ("mscclang GPU runtime" if gpu else
                       f"torch.distributed fallback on {self.device} (no mscclang GPU runtime here: every "
                       "call runs on " + ("NCCL" if self.cuda else "gloo") + ")")

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)

    def checked_call(self, coll: str, numel: int, dtype: Any, seed: int) -> tuple[float, bool, str]:
        """One eager call on fresh tensors: (seconds around the call and the sync, whether the
        result is exact, the plan that ran)."""
        import torch

        n = self.world
        if coll == "reduce_scatter":
            numel = max(n, numel - numel % n)
        x = small_ints(seed, self.rank, numel, dtype, n, self.device)
        self.sync()
        t0 = time.perf_counter()
        if coll == "all_reduce":
            out = self.comm.all_reduce(x)
        elif coll == "all_gather":
            out = self.comm.all_gather(x, out=torch.empty(numel * n, dtype=dtype, device=self.device))
        else:
            out = self.comm.reduce_scatter(x, out=torch.empty(numel // n, dtype=dtype, device=self.device))
        self.sync()
        dt = time.perf_counter() - t0
        ok = torch.equal(out.to(torch.int64), reference(coll, seed, self.rank, numel, dtype, n, self.device))
        last = getattr(self.comm, "last", None)
        return dt, ok, last.label() if last is not None and hasattr(last, "label") else ""

    def base(self, what: str) -> dict:
        """The fields every subcommand's result starts with."""
        return {"subcommand": what, "world_size": self.world, "engine": self.engine,
                "specialize": os.environ.get("MSCCLANG_SPECIALIZE", "(default)")}


class Profile:
    """cProfile around chosen calls of rank 0 (nothing elsewhere, or when ``top`` is 0)."""

    def __init__(self, top: int, rank: int) -> None:
        import cProfile

        self.top = top
        self.prof = cProfile.Profile() if top > 0 and rank == 0 else None

    def call(self, fn: Callable[[], Any]) -> Any:
        if self.prof is None:
            return fn()
        self.prof.enable()
        try:
            return fn()
        finally:
            self.prof.disable()

    def report(self) -> list[str]:
        """The ``top`` functions by own time, then the ``top`` functions of mscclang by
        cumulative time: 'tottime_ms cumtime_ms calls file:line(name)'."""
        if self.prof is None:
            return []
        import pstats

        st = pstats.Stats(self.prof)
        items = list(st.stats.items())   # type: ignore[attr-defined]
        own = sorted(items, key=lambda kv: -kv[1][2])[: self.top]
        cum = sorted((kv for kv in items if "/mscclang/" in kv[0][0]), key=lambda kv: -kv[1][3])[: self.top]
        out = []
        for title, rows in (("by own time", own), ("mscclang by cumulative time", cum)):
            out.append(f"-- {title}: own_ms cum_ms calls where")
            for (fname, line, name), (_cc, nc, tt, ct, _callers) in rows:
                where = "/".join(fname.split("/")[-2:])
                out.append(f"{tt * 1e3:9.2f} {ct * 1e3:9.2f} {nc:7d} {where}:{line}({name})")
        return out


class Progress:
    """Rank 0's progress line on stderr every :data:`PROGRESS_S` seconds: done, total, elapsed
    and the time left at the pace so far."""

    def __init__(self, r: Rank, what: str, total: int) -> None:
        self.show = r.rank == 0
        self.what, self.total = what, total
        self.t0 = self.last = time.perf_counter()

    def step(self, done: int) -> None:
        now = time.perf_counter()
        if self.show and done and now - self.last >= PROGRESS_S:
            self.last = now
            left = (now - self.t0) / done * (self.total - done)
            print(f"callpath_checks: {self.what} {done}/{self.total} in {now - self.t0:.0f} s, "
                  f"about {left:.0f} s left", file=sys.stderr, flush=True)


def stream(r: Rank, calls: int, seed: int, profile: int = 0) -> dict:
    """See the module docstring."""
    rng = random.Random(seed)
    prof = Profile(profile, r.rank)
    res = r.base("stream")
    mism: list[str] = []
    by_coll = {c: 0 for c in COLLS}
    fallback = 0
    call_s = 0.0
    t0 = time.perf_counter()
    bar = Progress(r, "calls", calls)
    for i in range(calls):
        bar.step(i)
        coll, dname = rng.choice(COLLS), rng.choice(DTYPES)
        numel = max(1, int(math.exp(rng.uniform(0.0, math.log(MAX_NUMEL)))))
        dt, ok, plan = prof.call(lambda: r.checked_call(coll, numel, _torch_dtype(dname), seed * 1_000_003 + i))
        call_s += dt
        by_coll[coll] += 1
        fallback += plan in ("nccl", "gloo")   # the fallback's label: the backend that ran it
        if not ok:
            mism.append(f"call {i}: {coll} {dname} {numel} elements ({plan})")
    res.update(seed=seed, calls=calls, total_s=round(time.perf_counter() - t0, 3), call_s=round(call_s, 3),
               mismatches=len(mism), first_mismatches=mism[:10], calls_by_collective=by_coll,
               fallback_calls=fallback)
    if prof.prof is not None:
        res["profile"] = prof.report()
    return res


def memory(r: Rank, sizes: Optional[int], seed: int) -> dict:
    """See the module docstring; ``sizes`` None: :data:`MEMORY_SIZES` with CUDA, else
    :data:`CPU_MEMORY_SIZES`."""
    import torch

    sizes = sizes or (MEMORY_SIZES if r.cuda else CPU_MEMORY_SIZES)
    rng = random.Random(seed)
    numels: list[int] = []
    seen: set[int] = set()
    while len(numels) < sizes:   # distinct, log-uniform, in random order
        numel = max(1, int(math.exp(rng.uniform(0.0, math.log(MAX_NUMEL)))))
        if numel not in seen:
            seen.add(numel)
            numels.append(numel)
    mism = 0
    t0 = time.perf_counter()
    bar = Progress(r, "sizes", sizes)
    for i, numel in enumerate(numels):
        bar.step(i)
        _, ok, _ = r.checked_call("all_reduce", numel, torch.bfloat16, seed * 1_000_003 + i)
        mism += not ok
    mem = r.comm.memory()
    res = r.base("memory")
    res.update(sizes=sizes, total_s=round(time.perf_counter() - t0, 3), mismatches=mism,
               total_bytes=mem.get("total_bytes"), memory=mem)
    return res


#: mscclang.bench.sizes.FIRST_CALL_SIZES, written out (this script also runs against an older mscclang)
FIRST_SIZES = (49_164, 278_596, 475_252, 704_240, 1_043_560, 1_546_368, 2_291_444, 3_395_516, 5_031_556,
               7_455_876, 11_048_288, 16_371_612)


def first_calls(r: Rank, sizes: list[int], seed: int, profile: int = 0, profile_skip: int = 0) -> dict:
    """See the module docstring."""
    import torch
    import torch.distributed as dist

    profs = [Profile(profile, r.rank), Profile(profile, r.rank)]
    plain = Profile(0, r.rank)
    r.checked_call("all_reduce", 4096, torch.bfloat16, seed)   # one-time start-up, not timed
    rows = []
    mism = 0
    for i, nbytes in enumerate(sizes):
        numel = max(1, nbytes // 2)
        times = []
        for k in range(2):
            dt, ok, plan = (profs[k] if i >= profile_skip else plain).call(
                lambda: r.checked_call("all_reduce", numel, torch.bfloat16, seed * 1_000_003 + 2 * i + k))
            t = torch.tensor([dt], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)   # the slower rank
            times.append(float(t.item()))
            mism += not ok
        rows.append({"bytes": numel * 2, "first_ms": round(times[0] * 1e3, 3), "second_ms": round(times[1] * 1e3, 3),
                     "ratio": round(times[0] / times[1], 2) if times[1] > 0 else None, "plan": plan})
    res = r.base("first")
    res.update(rows=rows, mismatches=mism)
    if profs[0].prof is not None:
        res.update(profile_first=profs[0].report(), profile_second=profs[1].report())
    return res


# ------------------------------------------------------------------------------------------ abort

def abort_rank(rank: int, port: int, mode: str, result_path: str) -> None:
    """One process of an abort run (rank 0 the survivor, rank 1 the peer that stops)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), MSCCLANG_TIMEOUT_S=str(ABORT_TIMEOUT_S))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    import mscclang

    init_group(rank, 2)
    comm = mscclang.Communicator.from_torch()
    x = comm.empty(ABORT_NUMEL, dtype=torch.bfloat16)
    x.fill_(1.0)
    comm.prepare("all_reduce", x)
    step: Callable[[], Any] = lambda: comm.all_reduce(x)   # noqa: E731
    if mode != "eager":
        g = torch.cuda.CUDAGraph()
        with comm.graph_capture():
            with torch.cuda.graph(g):
                comm.all_reduce(x)
        step = g.replay
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    if rank == 1:
        for _ in range(PEER_REPLAYS):
            step()
        torch.cuda.synchronize()
        if mode == "hung":
            time.sleep(3600)   # alive, never calls again (the parent kills it)
        os._exit(0)
    res: dict = {"synced_replays": 0, "exception": None, "exception_type": None, "collective_timeout": False}
    deadline = time.monotonic() + 20 * ABORT_TIMEOUT_S + 60
    launched = 0
    try:
        while time.monotonic() < deadline:
            step()
            launched += 1
            if launched % SYNC_EVERY == 0:
                torch.cuda.synchronize()
                comm.synchronize()
                res["synced_replays"] = launched
        res["exception"] = "nothing raised before the deadline"
    except BaseException as e:  # noqa: BLE001 - what reaches the caller is the point
        res["exception"], res["exception_type"] = str(e)[:500], type(e).__name__
        res["collective_timeout"] = isinstance(e, mscclang.CollectiveTimeout)
    # the peer made PEER_REPLAYS calls: every synchronised replay past those completed without it
    res["completed_after_peer_stopped"] = max(0, res["synced_replays"] - PEER_REPLAYS)
    done = threading.Event()

    def _close() -> None:
        try:
            comm.close()
        except BaseException as e:  # noqa: BLE001
            res["close_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            done.set()

    threading.Thread(target=_close, daemon=True).start()
    res["close_returned"] = done.wait(60)
    with open(result_path, "w") as f:
        json.dump(res, f)
    os._exit(0)


def abort(mode: str, runs: int) -> tuple[dict, int]:
    """``runs`` abort runs, two fresh processes each; the per-run reports."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = []
    for i in range(runs):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rank0.json")
            port = _free_port()
            procs = [ctx.Process(target=abort_rank, args=(r, port, mode, path), daemon=True) for r in range(2)]
            for p in procs:
                p.start()
            limit = time.monotonic() + 20 * ABORT_TIMEOUT_S + 180
            while time.monotonic() < limit and procs[0].is_alive():
                procs[0].join(1)
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(10)
            if os.path.isfile(path):
                with open(path) as f:
                    run = json.load(f)
            else:
                run = {"exception": "rank 0 left no report", "rank0_exitcode": procs[0].exitcode,
                       "timed_out": time.monotonic() >= limit}
        run["run"] = i
        out.append(run)
    res = {"subcommand": "abort", "mode": mode, "runs": out, "timeout_s": ABORT_TIMEOUT_S,
           "completed_after_peer_stopped": [r.get("completed_after_peer_stopped") for r in out],
           "close_returned": [r.get("close_returned") for r in out]}
    good = all(r.get("collective_timeout") and r.get("close_returned") for r in out)
    return res, EXIT_OK if good else EXIT_FAILED


# ------------------------------------------------------------------------------------- launching

def init_group(local: int, world: int) -> None:
    """The process group of one rank: NCCL with a GPU per rank; gloo (ranks time-sharing a GPU,
    ``MSCCLANG_RANKS_PER_GPU``, where NCCL refuses two ranks on one device, or no GPU)."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    have = torch.cuda.device_count()
    torch.cuda.set_device(local % have)
    if have >= world:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")


def walk(r: Rank, numel: int, ordinary_numel: int) -> dict:
    """The route of a memo hit, counted as it runs: ``Communicator.all_reduce`` in place on an
    ordinary tensor of ``numel`` fp32 elements, after three calls of the same tensor, under
    ``sys.setprofile``. A *stay* is each entry into a mscclang file (calls and returns both: the
    file the running frame is in changes to a mscclang file); ``files`` the distinct ones;
    ``crossings`` the moves between ``mscclang/comm`` and ``mscclang/runtime``. Then rank 0's
    cProfile of 200 calls on an ordinary tensor of ``ordinary_numel`` elements (the staged
    path's host time: where it goes)."""
    import cProfile
    import pstats

    import torch

    res = r.base("walk")
    x = torch.randn(numel, device=r.device)
    for _ in range(3):
        r.comm.all_reduce(x)
    r.sync()
    seen: list[str] = []

    def where(frame: Any) -> Optional[str]:
        f = frame.f_code.co_filename if frame is not None else ""
        return f.split("/mscclang/", 1)[1] if "/mscclang/" in f and "/tools/" not in f else None

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        now = where(frame if event == "call" else frame.f_back)
        if now is not None and (not seen or seen[-1] != now):
            seen.append(now)

    sys.setprofile(hook)
    try:
        r.comm.all_reduce(x)
    finally:
        sys.setprofile(None)
    r.sync()
    crossings = sum(1 for a, b in zip(seen, seen[1:]) if {a.split("/")[0], b.split("/")[0]} == {"comm", "runtime"})
    res.update(mismatches=0, numel=numel, stays=len(seen), files=len(set(seen)), crossings=crossings, route=seen,
               plan=getattr(r.comm.last, "label", lambda: None)() if r.comm.last is not None else None)
    y = torch.randn(ordinary_numel, device=r.device)
    for _ in range(5):
        r.comm.all_reduce(y)
    r.sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        r.comm.all_reduce(y)
    prof.disable()
    r.sync()
    st = pstats.Stats(prof)
    rows = sorted(((k, v) for k, v in st.stats.items() if "/mscclang/" in k[0]),   # type: ignore[attr-defined]
                  key=lambda kv: -kv[1][3])[:25]
    res["ordinary_profile"] = [f"{v[2] / 200 * 1e6:8.2f} {v[3] / 200 * 1e6:8.2f} {v[1] / 200:6.1f} "
                               f"{'/'.join(k[0].split('/')[-2:])}:{k[1]}({k[2]})" for k, v in rows]
    res["ordinary_profile_header"] = "own_us/call cum_us/call calls/call where (mscclang, by cumulative time)"
    res["ordinary_plan"] = r.comm.last.label() if r.comm.last is not None else None
    return res


def rank_main(args: argparse.Namespace) -> tuple[Optional[dict], int]:
    """This process's rank of ``stream``/``memory`` (the process group from the environment);
    rank 0's result (None elsewhere) and the exit status."""
    init_group(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    r = Rank()
    if args.cmd == "stream":
        res = stream(r, args.calls, args.seed, args.profile)
    elif args.cmd == "first":
        res = first_calls(r, args.sizes, args.seed, args.profile, args.profile_skip)
    elif args.cmd == "walk":
        res = walk(r, args.numel, args.ordinary_numel)
    else:
        res = memory(r, args.sizes, args.seed)
    r.sync()
    r.comm.close()
    return (res if r.rank == 0 else None), (EXIT_FAILED if res["mismatches"] else EXIT_OK)


def _spawned(index: int, args: argparse.Namespace, world: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(index), LOCAL_WORLD_SIZE=str(world))
    code = EXIT_FAILED
    try:
        res, code = rank_main(args)
        if res is not None:
            with open(path, "w") as f:
                json.dump(res, f)
    except BaseException as e:  # noqa: BLE001 - one line, then status 1
        print(f"callpath_checks: rank {index}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)   # no process-group teardown at exit (it has hung after CUDA graphs)


def spawn(args: argparse.Namespace) -> tuple[Optional[dict], int]:
    """``--ranks`` processes of :func:`rank_main`, stopped after ``--timeout`` seconds."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rank0.json")
        ctx = mp.start_processes(_spawned, args=(args, args.ranks, _free_port(), path), nprocs=args.ranks,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + args.timeout
        code = EXIT_OK
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    print(f"callpath_checks: still running after {args.timeout:.0f} s: stopped", file=sys.stderr)
                    code = EXIT_FAILED
                    break
        except Exception as e:  # noqa: BLE001 - a rank exited non-zero
            print(f"callpath_checks: {str(e).strip().splitlines()[0]}", file=sys.stderr)
            code = EXIT_FAILED
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(10)
        res = None
        if os.path.isfile(path):
            with open(path) as f:
                res = json.load(f)
    return res, code


def emit(res: dict, out: Optional[str]) -> None:
    """Print ``res`` as one JSON line (and write it to ``out`` when given)."""
    line = json.dumps(res)
    print(line, flush=True)
    if out:
        with open(out, "w") as f:
            f.write(line + "\n")


def _common(defaults: bool) -> argparse.ArgumentParser:
    """The options of every subcommand, taken before or after its name (``--ranks 2 stream`` or
    ``stream --ranks 2``): the main parser holds the defaults, a subcommand's copy only what is
    given there."""
    p = argparse.ArgumentParser(add_help=False)

    def d(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    p.add_argument("--ranks", type=int, default=d(2), help="processes to start without torchrun (default 2)")
    p.add_argument("--out", metavar="FILE", default=d(None), help="also write the JSON line to FILE")
    p.add_argument("--timeout", type=float, default=d(1800.0), metavar="S",
                   help="without torchrun: stop the ranks after S seconds (default 1800)")
    return p


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line (see the module docstring); usage errors exit with status 2."""
    ap = argparse.ArgumentParser(prog="callpath_checks.py", description=__doc__.split("\n\n")[0],
                                 parents=[_common(True)])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = _common(False)
    s = sub.add_parser("stream", parents=[common], help="random eager calls on fresh tensors, each checked")
    s.add_argument("--calls", type=int, default=2000)
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--specialize", choices=("default", "never"), default="default",
                   help="never: MSCCLANG_SPECIALIZE=never (interpreter kernel only)")
    s.add_argument("--profile", type=int, default=0, metavar="N", help="rank 0 under cProfile: the top N functions")
    m = sub.add_parser("memory", parents=[common], help="distinct all_reduce sizes, then comm.memory()")
    m.add_argument("--sizes", type=int, default=None,
                   help=f"distinct sizes (default {MEMORY_SIZES} with CUDA, {CPU_MEMORY_SIZES} on the CPU's gloo "
                        "fallback, where each takes a fraction of a second)")
    m.add_argument("--seed", type=int, default=1)
    f = sub.add_parser("first", parents=[common], help="first and second eager call of new message sizes")
    f.add_argument("--sizes", type=lambda t: [int(x) for x in t.split(",") if x], default=list(FIRST_SIZES),
                   help="comma list of byte counts (even: bf16 elements)")
    f.add_argument("--seed", type=int, default=1)
    f.add_argument("--profile", type=int, default=0, metavar="N", help="rank 0 under cProfile: the top N functions")
    f.add_argument("--profile-skip", type=int, default=0, metavar="K",
                   help="profile from the K-th size on (the sizes before set a plan up)")
    w = sub.add_parser("walk", parents=[common], help="a memo hit's route (stays, files, crossings) and the "
                       "ordinary-tensor path's profile")
    w.add_argument("--numel", type=int, default=1024)
    w.add_argument("--ordinary-numel", type=int, default=1 << 20)
    a = sub.add_parser("abort", parents=[common], help="a peer stops mid-stream (CUDA only, 2 GPUs)")
    a.add_argument("--mode", choices=("graph", "eager", "hung"), default="graph")
    a.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    if args.ranks < 2:
        ap.error("--ranks must be at least 2")
    if args.cmd == "stream" and args.calls < 1:
        ap.error("--calls must be at least 1")
    if args.cmd == "memory" and args.sizes is not None and not 1 <= args.sizes <= 100_000:
        ap.error("--sizes must be between 1 and 100000")
    if args.cmd == "abort" and args.runs < 1:
        ap.error("--runs must be at least 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    """Run the subcommand; the exit status (see the module docstring)."""
    args = parse_args(argv)
    under_torchrun = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if args.cmd == "abort":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        shared = int(os.environ.get("MSCCLANG_RANKS_PER_GPU", "1") or 1) >= 2
        if have < 2 and not (shared and have == 1):
            print(f"callpath_checks: abort needs 2 CUDA GPUs (CUDA graphs and a peer to stop), or one with "
                  f"MSCCLANG_RANKS_PER_GPU=2; this machine has {have}", file=sys.stderr)
            return EXIT_USAGE
        if under_torchrun:
            print("callpath_checks: abort starts its own two processes per run: run it without torchrun",
                  file=sys.stderr)
            return EXIT_USAGE
        res, code = abort(args.mode, args.runs)
        emit(res, args.out)
        return code
    if args.cmd == "stream" and args.specialize == "never":
        os.environ["MSCCLANG_SPECIALIZE"] = "never"   # inherited by spawned ranks
    if under_torchrun:
        res, code = rank_main(args)
        if res is not None:
            emit(res, args.out)
        sys.stdout.flush()
        os._exit(code)
    res, code = spawn(args)
    if res is None:
        print("callpath_checks: rank 0 reported nothing", file=sys.stderr)
        return EXIT_FAILED
    emit(res, args.out)
    return code if res.get("mismatches", 0) == 0 else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
