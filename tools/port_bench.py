"""Port-channel measurements for notes/ports.md (2 GPUs): ``python3 -m tools.port_bench
--out DIR [--two-nodes] [--plan NAME=FILE ...]``.

One process per GPU, torch.distributed (NCCL, NVLink multicast off) and mscclang's executor in
the same processes. Every timing is a CUDA graph of several calls, median of 5 replays, after a
checked call on fresh data (int32 data for the bit-exact checks, bf16 for timing).

* one node: the port (copy-engine) round trip against the memory-channel one; allgather of 1 GiB
  by the copy-engine plan, by the library (SM) and by NCCL; plans given with ``--plan`` (e.g. the
  library's copy-engine allreduce and all-to-all); SMs freed: a bf16 matmul loop on another stream
  while a 256 MiB allgather loops, with each implementation.
* ``--two-nodes``: the GPUs as one-GPU "nodes" (MSCCLANG_GPUS_PER_NODE=1, NCCL_P2P_DISABLE=1,
  NCCL_SHM_DISABLE=1): the port-only allgather and allreduce through the engine against NCCL,
  1 MiB to 256 MiB, with NCCL_DEBUG=INFO transport lines kept in the log.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from mscclang.bench.worker import capture_graph, timed_blocks

MiB = 1 << 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _graph_time(fn: Callable[[], None], calls: int, reps: int = 5) -> float:
    """Median microseconds per call of ``calls`` calls captured in one CUDA graph."""
    import torch.distributed as dist

    fn()   # first-time set-up outside the capture
    g, _ = capture_graph(lambda: [fn() for _ in range(calls)])
    times = sorted(timed_blocks(g.replay, calls, reps, dist.barrier))
    return times[len(times) // 2]


def _worker(rank: int, world: int, port: int, args: Any, q: Any) -> None:
    out: dict = {"rank": rank, "results": []}
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                                device_id=torch.device(f"cuda:{rank}"))
        from mscclang.runtime.bootstrap import Bootstrap as RtComm
        from mscclang.runtime.executor import Executor
        from tests.harness import port_plans as pp
        from mscclang.cli.run_checks import expectation, make_input

        rt = RtComm(store=dist.PrefixStore("mscclang", store), rank=rank, world_size=world, device=rank)
        ex = Executor(rt, timeout_s=20.0)
        dev = torch.device(f"cuda:{rank}")
        res = out["results"]

        def check(plan: Any, n_in: int, n_out: int, sym: bool) -> tuple[Any, Any, int]:
            inputs = [make_input(r, n_in, torch.int32, 7, dev) for r in range(world)]
            if sym:
                o = rt.alloc(n_out, torch.int32)
                # an in-place allgather reads its input from its own block of the output
                i = o[rank * n_in:(rank + 1) * n_in] if plan.inplace else rt.alloc(n_in, torch.int32)
            else:
                i, o = torch.empty(n_in, dtype=torch.int32, device=dev), torch.empty(n_out, dtype=torch.int32, device=dev)
            i.copy_(inputs[rank])
            ex.execute(plan, i, o)
            ex.synchronize()
            return i, o, expectation(plan, inputs, "sum", rank).count_bad(o)

        def run_plan(name: str, plan: Any, total: int, coll: str, sym: bool) -> None:
            per = total // world if coll == "allgather" else total
            n_in, n_out = per // 4, total // 4
            i, o, bad = check(plan, n_in, n_out, sym)
            us = _graph_time(lambda: ex.execute(plan, i, o), 5 if total >= 64 * MiB else 10)
            res.append({"what": name, "bytes": total, "us": us, "bad": bad})
            del i, o

        def nccl(coll: str, total: int) -> None:
            dt = torch.bfloat16
            if coll == "allgather":
                i = torch.randn(total // 2 // world, dtype=dt, device=dev)
                o = torch.empty(total // 2, dtype=dt, device=dev)
                fn = lambda: dist.all_gather_into_tensor(o, i)   # noqa: E731
            elif coll == "alltoall":
                i = torch.randn(total // 2, dtype=dt, device=dev)
                o = torch.empty_like(i)
                fn = lambda: dist.all_to_all_single(o, i)   # noqa: E731
            else:
                i = torch.randn(total // 2, dtype=dt, device=dev)
                fn = lambda: dist.all_reduce(i)   # noqa: E731
            res.append({"what": f"nccl {coll}", "bytes": total,
                        "us": _graph_time(fn, 5 if total >= 64 * MiB else 10), "bad": 0})

        if not args.two_nodes:
            for port_ in (True, False):
                plan = pp.pingpong(port_)
                i, o, bad = check(plan, 1, 2, True)
                us = _graph_time(lambda: ex.execute(plan, i, o), 200)
                res.append({"what": f"pingpong {'port' if port_ else 'memory'} (3 one-way hops)", "bytes": 4,
                            "us": us, "bad": bad})
            ag = pp.allgather_pwsf(world, inplace=True)
            for total in (16 * MiB, 256 * MiB, 1024 * MiB):
                run_plan("copy-engine allgather, in place (test_port_allgather_pwsf_inplace)", ag, total,
                         "allgather", True)
                nccl("allgather", total)
            for spec in args.plan:
                name, _, path = spec.partition("=")
                from mscclang.plan.io import load_plan

                plan = load_plan(Path(path).read_text())
                for total in (256 * MiB, 1024 * MiB):
                    run_plan(name, plan, total, plan.collective, True)
                    nccl(plan.collective, total)
            # SMs freed: matmul throughput alone and beside a 256 MiB allgather loop
            a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
            b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
            mm_stream = torch.cuda.Stream()

            def mm_time(n: int = 20) -> float:
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(mm_stream):
                    e0.record()
                    for _ in range(n):
                        torch.matmul(a, b)
                    e1.record()
                return (e0, e1)

            mm_time(5)   # cuBLAS warm-up (workspace, heuristics) outside the baseline
            torch.cuda.synchronize()
            e0, e1 = mm_time()
            torch.cuda.synchronize()
            alone = e0.elapsed_time(e1)
            total = 256 * MiB
            n_in = total // world // 4
            i, o, bad = check(ag, n_in, total // 4, True)
            x = torch.randn(total // 2 // world, dtype=torch.bfloat16, device=dev)
            y = torch.empty(total // 2, dtype=torch.bfloat16, device=dev)
            impls = {"copy-engine plan": lambda: ex.execute(ag, i, o),
                     "nccl": lambda: dist.all_gather_into_tensor(y, x)}
            try:
                from mscclang.comm import Communicator

                cm = Communicator.from_torch()
                xs = cm.empty(total // 2 // world, dtype=torch.bfloat16)
                ys = cm.empty(total // 2, dtype=torch.bfloat16)
                cm.prepare("all_gather", xs, ys)
                impls["library (SM plan)"] = lambda: cm.all_gather(xs, out=ys)
            except Exception as e:  # noqa: BLE001
                res.append({"what": "library communicator", "error": f"{type(e).__name__}: {e}"})
            for name, fn in impls.items():
                fn()
                g, _ = capture_graph(lambda: [fn() for _ in range(10)])
                s = torch.cuda.Stream()
                torch.cuda.synchronize()
                dist.barrier()
                with torch.cuda.stream(s):
                    for _ in range(6):
                        g.replay()
                e0, e1 = mm_time()
                torch.cuda.synchronize()
                res.append({"what": f"matmul beside 256 MiB allgather loop: {name}", "bytes": total,
                            "matmul_ms": e0.elapsed_time(e1), "alone_ms": alone,
                            "loss": 1.0 - alone / e0.elapsed_time(e1)})
        else:
            for plan, coll in ((pp.allgather_port_only(world), "allgather"), (pp.allreduce_port_2(), "allreduce")):
                for total in args.sizes:
                    run_plan(f"engine {coll} ({plan.name})", plan, total, coll, False)
                    nccl(coll, total)
        ex.close()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    q.put(out)


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.port_bench")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--two-nodes", action="store_true")
    p.add_argument("--plan", action="append", default=[], help="NAME=plan.json to time beside NCCL")
    p.add_argument("--sizes", default="1,4,16,64,256", help="two-node sizes in MiB (comma list)")
    args = p.parse_args(argv)
    args.sizes = [int(x) * MiB for x in args.sizes.split(",") if x]
    import torch.multiprocessing as mp

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.two_nodes:
        os.environ.update({"MSCCLANG_GPUS_PER_NODE": "1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
                           "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo")})
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    outs = [q.get(timeout=900) for _ in procs]
    for pr in procs:
        pr.join(timeout=60)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "ports_two_nodes.json" if args.two_nodes else "ports_one_node.json"
    (args.out / name).write_text(json.dumps(outs, indent=1))
    for o in sorted(outs, key=lambda x: x["rank"]):
        if "error" in o:
            print(f"rank {o['rank']} error: {o['error']}")
        for r in o["results"]:
            if o["rank"] == 0:
                print(json.dumps(r))
    return 0 if all("error" not in o for o in outs) else 1


if __name__ == "__main__":
    sys.exit(main())
