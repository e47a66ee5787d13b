"""How long one collective takes when rank processes time-share a GPU: a probe for the GPU suite's
stalls with two pools at once (a 4-rank and an 8-rank job, 12 processes on one GPU).

Run under torchrun, one job alone and then two at once, for example::

    MSCCLANG_RANKS_PER_GPU=8 torchrun --nproc-per-node 8 tools/slice_probe.py --tag alone8
    MSCCLANG_RANKS_PER_GPU=4 torchrun --master-port 29511 --nproc-per-node 4 tools/slice_probe.py --tag with8 &
    MSCCLANG_RANKS_PER_GPU=8 torchrun --master-port 29512 --nproc-per-node 8 tools/slice_probe.py --tag with4 &

Each rank runs ``--iters`` rounds of ``dist.all_reduce`` on bf16 tensors of three sizes (each
call waited for), and rank 0 prints one JSON line: per size the median, the 99th percentile and
the largest latency over all ranks, how many calls took over 1 s, and the job's start and end
(wall clock, so two jobs' overlap shows). Every result is checked against the sum of the ranks'
inputs. The only mscclang lines are ``import mscclang.distributed`` and
``init_process_group("mscclang")``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import mscclang.distributed  # noqa: F401 - registers the "mscclang" backend

SIZES = (1024, 256 * 1024, 8 * 1024 * 1024)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="slice_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300, help="rounds of the three sizes (default 300)")
    ap.add_argument("--tag", default="", help="a name for this job in the JSON line")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        print("slice_probe: run under torchrun", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("slice_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("mscclang")
    rank, world = dist.get_rank(), dist.get_world_size()
    # small integers: every order of the sum is exact, so the check is bit for bit
    base = {n: torch.arange(n, device="cuda", dtype=torch.float32).remainder(7).to(torch.bfloat16) for n in SIZES}
    want = {n: (b.float() * world + sum(range(world))).to(torch.bfloat16) for n, b in base.items()}
    tensors = {n: torch.empty_like(b) for n, b in base.items()}
    lat: dict[int, list[float]] = {n: [] for n in SIZES}
    bad = 0
    dist.barrier()
    start = time.time()
    for _ in range(args.iters):
        for n in SIZES:
            t = tensors[n]
            t.copy_(base[n]).add_(rank)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            torch.cuda.synchronize()
            lat[n].append(time.perf_counter() - t0)
            bad += int(not torch.equal(t, want[n]))
    end = time.time()
    mine = {n: sorted(v) for n, v in lat.items()}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"lat": mine, "bad": bad})
    if rank == 0:
        out: dict = {"tag": args.tag, "world": world, "ranks_per_gpu": os.environ.get("MSCCLANG_RANKS_PER_GPU", "1"),
                     "start": round(start, 2), "end": round(end, 2), "wrong_results": sum(g["bad"] for g in gathered)}
        for n in SIZES:
            every = sorted(x for g in gathered for x in g["lat"][n])
            out[f"{n * 2}B"] = {"median_ms": round(every[len(every) // 2] * 1e3, 3),
                                "p99_ms": round(every[int(len(every) * 0.99)] * 1e3, 3),
                                "max_ms": round(every[-1] * 1e3, 3), "over_1s": sum(x > 1.0 for x in every)}
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
