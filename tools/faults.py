"""Fault injection on 2 GPUs: a peer killed with SIGKILL, or hung (it stops calling), in the
middle of a stream of collectives, eager or CUDA-graph replays, on a size mscclang runs or one
the library hands to torch.distributed (NCCL).

Two plain processes (no launcher), a TCPStore served by the survivor (rank 0); the victim is
rank 1. The survivor keeps calling until something raises, and reports the exception, the time
from the victim's fault to the error, and whether ``close()`` returned. Run as::

    python3 -m tools.faults --mode graph --size 4096 --fault kill --timeout 10 --out r.json

NCCL-bound calls (``--path nccl``: a broadcast from a root no plan serves) cannot raise in the
process: torch's NCCL watchdog tears the survivor down after the timeout, which mscclang gives
the fallback group it makes. The parent then reports the survivor's exit and its time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, args: dict, q: Any) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ["MSCCLANG_TIMEOUT_S"] = str(args["timeout"])
    import torch
    import torch.distributed as dist

    from mscclang.config import settings
    from mscclang.runtime.workers import device_of_rank

    dev = device_of_rank(rank, torch.cuda.device_count(), settings.ranks_per_gpu)  # one GPU: both ranks on it
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False)
    from mscclang.comm import Communicator

    comm = Communicator(store=store, rank=rank, world_size=2, device=torch.device("cuda", dev),
                        runtime_options={"timeout_s": args["timeout"], "name": "faults"})
    numel = max(args["size"] // 2, 8)
    x = torch.randn(numel, device=f"cuda:{dev}").to(torch.bfloat16)
    nccl = args["path"] == "nccl"
    call = (lambda: comm.broadcast(x, root=1)) if nccl else (lambda: comm.all_reduce(x))
    if nccl:
        call()
    else:
        comm.prepare("all_reduce", x)
    g = None
    if args["mode"] == "graph":
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            call()
        torch.cuda.current_stream().wait_stream(s)
        step = g.replay
    else:
        step = call
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    store.set("warm/%d" % rank, b"1")
    store.wait(["warm/0", "warm/1"])
    if rank == 1:
        for _ in range(5):
            step()
        now = time.time()
        store.set("fault_at", repr(now).encode())
        q.put(("fault", now))
        time.sleep(0.2)   # let the queue's feeder thread send it
        if args["fault"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)   # hung: alive, never calls again
        return
    # the survivor: call until something raises (bounded by a deadline of its own)
    res: dict = {"calls": 0, "raised": None, "type": None}
    deadline = time.monotonic() + 10 * args["timeout"] + 60
    try:
        while time.monotonic() < deadline:
            step()
            res["calls"] += 1
            if res["calls"] % 100 == 0:
                torch.cuda.synchronize()
                comm.synchronize()
        res["raised"] = "nothing raised before the deadline"
    except BaseException as e:  # noqa: BLE001 - the point is what is raised
        res["raised"] = str(e)[:2000]
        res["type"] = type(e).__name__
    t_err = time.time()
    try:
        fault_at = float(store.get("fault_at").decode())
        res["time_to_error_s"] = t_err - fault_at
    except Exception as e:  # noqa: BLE001
        res["time_to_error_s"] = None
        res["store"] = str(e)
    # a later host-side call raises too
    try:
        comm.synchronize()
        res["next_call"] = "no error"
    except BaseException as e:  # noqa: BLE001
        res["next_call"] = type(e).__name__
    done = threading.Event()

    def _close() -> None:
        try:
            comm.close()
        finally:
            done.set()

    t0 = time.monotonic()
    th = threading.Thread(target=_close, daemon=True)
    th.start()
    res["close_returned"] = done.wait(60)
    res["close_s"] = time.monotonic() - t0
    q.put(("result", res))
    time.sleep(0.5)
    os._exit(0)


def run(mode: str, size: int, fault: str, timeout: float, path: str = "mscclang") -> dict:
    """One fault experiment; returns the survivor's report (or how it ended)."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    q = ctx.Queue()
    args = {"mode": mode, "size": size, "fault": fault, "timeout": timeout, "path": path}
    procs = [ctx.Process(target=_rank_main, args=(r, port, args, q), daemon=True) for r in range(2)]
    t0 = time.time()
    for p in procs:
        p.start()
    res: dict = {}
    fault_at = None
    limit = time.time() + 20 * timeout + 180
    import queue

    while time.time() < limit:
        try:
            kind, val = q.get(timeout=0.2)
        except queue.Empty:
            if not procs[0].is_alive():
                # torn down without a report (e.g. torch's NCCL watchdog)
                res = {"raised": None, "survivor_died": True, "type": "process ended",
                       "time_to_error_s": (time.time() - fault_at) if fault_at else None}
                break
            continue
        if kind == "fault":
            fault_at = val
        else:
            res = val
            break
    else:
        res = {"raised": None, "type": "parent deadline", "elapsed_s": time.time() - t0}
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)
    res["survivor_exitcode"] = procs[0].exitcode
    res.update(args)
    return res


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("eager", "graph"), default="eager")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--fault", choices=("kill", "hang"), default="kill")
    ap.add_argument("--path", choices=("mscclang", "nccl"), default="mscclang")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    res = run(a.mode, a.size, a.fault, a.timeout, a.path)
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
