"""Does loading a CUDA module stall a collective in flight? Experiments on two ranks.

Run under a launcher, one process per GPU or two sharing one (``MSCCLANG_RANKS_PER_GPU=2``):

    MSCCLANG_RANKS_PER_GPU=2 torchrun --nproc-per-node 2 tools/load_probe.py [--timeout 10]

Rank 0 loads a fresh module (a trivial kernel built by NVRTC, its function then forced to load, as
lazy loading would at its first launch) or launches a torch kernel it never ran before, at a chosen
moment of a collective whose other half runs on rank 1. Each experiment prints one JSON line: how
long the load took, how long the collective took, and whether it failed (its kernels give up after
``--timeout`` seconds). The experiments:

* ``peer_first``: rank 1's kernel is already spinning for rank 0, which loads before launching its
  own half. A load that waits for the whole device (not only its own context) waits for that
  kernel, which waits for rank 0: a stall until the timeout.
* ``own_first``: rank 0's kernel is in flight (rank 1 launches 2 s later) and rank 0 loads: a load
  that waits for its own context's work takes about 2 s.
* ``own_first_thread``: as ``own_first`` with the load on another thread, while the launching thread
  makes small CUDA calls: whether a load blocks the rest of the process (the context's lock).
* ``port_thread``: rank 0 runs a port-channel plan (its copies enqueued at launch on side streams
  that wait for the kernel's triggers) and another thread loads during it: the load must wait for
  the side streams as well as the kernel; any host call the copies still needed would stall.
* ``torch_lazy``: ``peer_first`` with a never-run torch kernel instead of a module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
SRC = 'extern "C" __global__ void probe_%d(float* x) { if (x) x[threadIdx.x] += %d.0f; }'


def fresh_module(k: int) -> Callable[[], float]:
    """A loader of a new module (kernel ``probe_k``): built now, loaded and forced when called;
    returns the seconds the load took."""
    from cuda.bindings import driver as drv, nvrtc

    err, prog = nvrtc.nvrtcCreateProgram((SRC % (k, k)).encode(), b"probe.cu", 0, [], [])
    major, minor = torch.cuda.get_device_capability()
    opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtc: {err}")
    err, n = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * n
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    ctx = drv.cuCtxGetCurrent()[1]

    def load() -> float:
        drv.cuCtxSetCurrent(ctx)
        t = time.perf_counter()
        err, mod = drv.cuModuleLoadData(cubin)
        err, fn = drv.cuModuleGetFunction(mod, f"probe_{k}".encode())
        drv.cuFuncGetAttribute(drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, fn)   # forces a lazy load
        return time.perf_counter() - t

    return load


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=10.0, help="the kernels' spin bound (seconds)")
    ap.add_argument("--only", nargs="*", help="experiments to run (default: all)")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        print("run me with a launcher: torchrun --nproc-per-node 2 tools/load_probe.py", file=sys.stderr)
        return 2
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("two ranks")
    from cuda.bindings import driver as drv

    from mscclang import Communicator
    from mscclang.plan.io import load_plan

    # a launch that gave up is logged and acknowledged by the watchdog (its default, 'raise', would
    # raise asynchronously anywhere in the main thread); the next host call raises it
    os.environ["MSCCLANG_ASYNC_ERROR"] = "log"
    comm = Communicator.from_torch(fallback=False, runtime_options={"timeout_s": args.timeout, "specialize": "never"})
    ex = comm.backend.executor
    mode = drv.cuModuleGetLoadingMode()[1]
    ll = load_plan(ROOT / "plans" / "allreduce_oneshot_ll.r2.i1.json")
    port = load_plan(ROOT / "plans" / "allreduce_port_pipelined.r2.i1.steps4.json")
    x = torch.randn(1 << 16, device="cuda")
    y = torch.empty_like(x)
    xp, yp = torch.randn(1 << 20, device="cuda"), torch.empty(1 << 20, device="cuda")
    for p, a, b in ((ll, x, y), (port, xp, yp)):          # loaded, packed and warm before timing
        ex.execute(p, a, b)
        torch.cuda.synchronize()
    dist.barrier()

    def collective_wait(t: float) -> tuple[float, str]:
        """Wait for this rank's launches; seconds since ``t`` and the error ("" if none)."""
        try:
            comm.synchronize()   # bounded: raises CollectiveTimeout if a launch gave up
            return time.perf_counter() - t, ""
        except Exception as e:  # noqa: BLE001 - reported
            return time.perf_counter() - t, f"{type(e).__name__}: {str(e)[:200]}"

    def collective(p: Any, a: Any, b: Any) -> tuple[float, str]:
        t = time.perf_counter()
        try:
            ex.execute(p, a, b)
        except Exception as e:  # noqa: BLE001 - reported
            return time.perf_counter() - t, f"{type(e).__name__}: {str(e)[:200]}"
        return collective_wait(t)

    def report(name: str, **kw: Any) -> None:
        out = [None, None]
        dist.all_gather_object(out, kw)
        if rank == 0:
            print(json.dumps({"experiment": name, "loading_mode": str(mode), "ranks": out}), flush=True)

    def run(name: str, body: Callable[[], dict]) -> None:
        if args.only and name not in args.only:
            return
        dist.barrier()
        got = body()
        report(name, **got)
        errs = [None, None]
        dist.all_gather_object(errs, bool(got.get("error")))
        if any(errs):
            comm.reset()           # collective: after a timeout on either rank
        dist.barrier()

    k = [0]

    def next_loader() -> Callable[[], float]:
        k[0] += 1
        return fresh_module(k[0])

    def peer_first() -> dict:
        load = next_loader()
        if rank == 1:
            t = time.perf_counter()
            ex.execute(ll, x, y)                 # spins for rank 0
            dist.barrier()
            _, err = collective_wait(t)
            return {"collective_s": time.perf_counter() - t, "error": err}
        dist.barrier()
        took = load()
        secs, err = collective(ll, x, y)
        return {"load_s": took, "collective_s": secs, "error": err}

    def own_first() -> dict:
        load = next_loader()
        if rank == 1:
            dist.barrier()
            time.sleep(2.0)
            secs, err = collective(ll, x, y)
            return {"collective_s": secs, "error": err}
        t = time.perf_counter()
        ex.execute(ll, x, y)
        dist.barrier()
        took = load()
        _, err = collective_wait(t)
        return {"load_s": took, "collective_s": time.perf_counter() - t, "error": err}

    def threaded(p: Any, a: Any, b: Any, delay: float) -> dict:
        load = next_loader()
        if rank == 1:
            dist.barrier()
            time.sleep(delay)
            secs, err = collective(p, a, b)
            return {"collective_s": secs, "error": err}
        took: list = []
        th = threading.Thread(target=lambda: (time.sleep(0.2), took.append(load())))
        t = time.perf_counter()
        ex.execute(p, a, b)
        dist.barrier()
        th.start()
        small, worst = 0, 0.0
        while th.is_alive():                       # small CUDA calls of the launching thread
            s = time.perf_counter()
            torch.cuda.current_stream().query()
            worst = max(worst, time.perf_counter() - s)
            small += 1
            time.sleep(0.01)
        th.join()
        _, err = collective_wait(t)
        return {"load_s": took[0] if took else None, "collective_s": time.perf_counter() - t, "error": err,
                "small_calls": small, "slowest_small_call_s": worst}

    def torch_lazy() -> dict:
        if rank == 1:
            t = time.perf_counter()
            ex.execute(ll, x, y)
            dist.barrier()
            _, err = collective_wait(t)
            return {"collective_s": time.perf_counter() - t, "error": err}
        dist.barrier()
        t = time.perf_counter()
        torch.special.erfcx(torch.ones(8, dtype=torch.float64, device="cuda"))   # a kernel never run before
        took = time.perf_counter() - t
        secs, err = collective(ll, x, y)
        return {"load_s": took, "collective_s": secs, "error": err}

    run("peer_first", peer_first)
    run("own_first", own_first)
    run("own_first_thread", lambda: threaded(ll, x, y, 2.0))
    run("port_thread", lambda: threaded(port, xp, yp, 1.0))
    run("torch_lazy", torch_lazy)
    comm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
