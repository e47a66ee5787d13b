"""``mscclang demo``: the main job. With two or more GPUs, real collectives (allreduce and
allgather) through :class:`mscclang.comm.Communicator`, checked and timed against NCCL on this
machine; without, the same calls on the CPU simulator (one thread per rank) over the shipped
plans, checked."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from mscclang.bench.sizes import format_size, parse_sizes
from mscclang.cli.args import GPU_DTYPES, SIZES_FORMS, sizes_arg
from mscclang.comm.catalog import Catalog
from mscclang.comm.tuning import load_tuning
from mscclang.config import nccl_env, worker_env
from mscclang.errors import InvalidCall
from mscclang.plan.dtypes import find_dtype

COLLS = ("all_reduce", "all_gather")


def _gpu_worker(rank: int, world: int, port: int, sizes: list[int], dtype_name: str, q: Any) -> None:
    os.environ.update(nccl_env())
    import torch
    import torch.distributed as dist

    from mscclang.bench.worker import gen_input
    from mscclang.comm import Communicator

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    info = find_dtype(dtype_name)
    dt, u = info.torch, info.unit_roundoff
    comm = Communicator.from_torch()
    rows = []
    esz = info.itemsize
    for coll in COLLS:
        for nbytes in sizes:
            numel = nbytes // esz
            per = numel // world
            xs = [gen_input(nbytes, p, numel if coll == "all_reduce" else per, dt, "cuda") for p in range(world)]
            if coll == "all_reduce":
                buf = comm.empty(numel, dtype=dt)
                buf.copy_(xs[rank])
                comm.all_reduce(buf)
                torch.cuda.synchronize()
                # a sum in any order, each step rounded (fp8: in the accumulation dtype, then
                # once per op): within the bench's error bound; int32 (u = 0) exact
                exact, mag = sum(x.double() for x in xs), sum(x.double().abs() for x in xs)
                ok = bool(((buf.double() - exact).abs() <= 2 * world * u * mag + u * exact.abs()).all())
                ours = lambda: comm.all_reduce(buf)  # noqa: E731
                ref_t = torch.empty(numel, dtype=dt, device="cuda")
                nccl = lambda: dist.all_reduce(ref_t)  # noqa: E731
            else:
                inp, out = comm.empty(per, dtype=dt), comm.empty(numel, dtype=dt)
                inp.copy_(xs[rank])
                comm.all_gather(inp, out=out)
                torch.cuda.synchronize()
                ok = _same_bits(out, torch.cat(xs))
                ours = lambda: comm.all_gather(inp, out=out)  # noqa: E731
                a, b = torch.empty(per, dtype=dt, device="cuda"), torch.empty(numel, dtype=dt, device="cuda")
                nccl = lambda: dist.all_gather_into_tensor(b, a)  # noqa: E731
            plan = comm.last.label() if comm.last else "?"

            def timed(fn: Any) -> float:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                dist.barrier()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(20):
                    fn()
                e.record()
                e.synchronize()
                return s.elapsed_time(e) * 1000 / 20

            try:
                nccl_us: Any = timed(nccl)
            except (RuntimeError, TypeError) as e:   # NCCL without this dtype (fp8 on older NCCL)
                nccl_us = f"- ({str(e).splitlines()[0][:60]})"
            rows.append((coll, nbytes, ok, timed(ours), nccl_us, plan))
    if rank == 0:
        q.put(rows)
    dist.barrier()
    torch.cuda.synchronize()
    os._exit(0)


#: bytes the demo holds per byte of the largest message: on a GPU, every rank's input (the
#: reference is computed on each GPU), the communicator's buffers and NCCL's, the float32 result;
#: on the simulator, per rank, the input, its copy, the result and the simulated buffers
_GPU_BYTES_PER_BYTE = 8
_SIM_BYTES_PER_BYTE = 12


def _check_sizes(sizes: list[int], per_byte: int, limit: int, what: str, raise_it: str) -> None:
    """Refuse (LimitError) a size whose demo would need more than ``limit`` bytes."""
    from mscclang.errors import LimitError
    from mscclang.units import format_bytes

    big = max(sizes)
    need = big * per_byte
    if need > limit:
        raise LimitError(f"--sizes {format_size(big)}: the demo needs about {format_bytes(need)} of {what} for it, "
                         f"more than the {format_bytes(limit)} {raise_it}; choose smaller sizes")


def _same_bits(a: Any, b: Any) -> bool:
    """Whether two tensors hold the same bytes (torch compares no fp8 tensors)."""
    import torch

    return a.shape == b.shape and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def check_demo_sizes(sizes: list[int], dtype: str, world: int) -> None:
    """Refuse (InvalidCall) a size the demo cannot run as given: its allgather gives each of the
    ``world`` ranks an equal share of whole ``dtype`` elements."""
    share = find_dtype(dtype).itemsize * world  # type: ignore[union-attr]
    for s in sizes:
        if s % share:
            raise InvalidCall(f"--sizes {format_size(s)}: {s} bytes do not split into whole {dtype} elements "
                              f"({share // world} bytes each) for each of {world} ranks; use a multiple of {share} bytes")


def run_gpus(sizes: list[int], dtype: str, world: int) -> int:
    import torch

    check_demo_sizes(sizes, dtype, world)
    import torch.multiprocessing as mp

    free = min(torch.cuda.mem_get_info(d)[0] for d in range(world))
    _check_sizes(sizes, world + _GPU_BYTES_PER_BYTE, free, "memory on each GPU", "free on the smallest GPU")

    os.environ.update(worker_env())   # inherited by the workers: NVLink multicast off, a queue per port side stream
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    from mscclang.bench.runner import _free_port

    port = _free_port()
    procs = [ctx.Process(target=_gpu_worker, args=(r, world, port, sizes, dtype, q)) for r in range(world)]
    for p in procs:
        p.start()
    rows = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    print(f"mscclang Communicator vs NCCL on {world} GPUs ({dtype}, eager, us per call)")
    print(f"{'collective':12s} {'size':>6s} {'check':>6s} {'mscclang':>10s} {'NCCL':>10s}  plan")
    bad = 0
    for coll, nbytes, ok, us, nccl_us, plan in rows:
        bad += not ok
        nccl_text = f"{nccl_us:10.2f}" if isinstance(nccl_us, float) else nccl_us
        print(f"{coll:12s} {format_size(nbytes):>6s} {'ok' if ok else 'WRONG':>6s} {us:10.2f} {nccl_text:>10s}  {plan}")
    return 1 if bad else 0


def run_simulator(sizes: list[int], dtype: str, world: int = 2) -> int:
    """No GPUs: the communicator over the shipped plans, executed by the CPU simulator."""
    import torch

    from mscclang.config import Settings, settings

    check_demo_sizes(sizes, dtype, world)
    _check_sizes(sizes, world * _SIM_BYTES_PER_BYTE, settings.sim_max_memory, "memory",
                 f"a simulation may use (set {Settings.sim_max_memory.name} to raise it)")
    from mscclang.comm.sim_ranks import run_ranks

    dt = find_dtype(dtype).torch
    cat = Catalog.from_dir()
    print(f"no 2 GPUs here: running the Communicator on the CPU simulator ({world} ranks, {dtype}, "
          f"{len(cat)} shipped plans)")
    bad = 0
    for coll in COLLS:
        for nbytes in sizes:
            numel = nbytes // find_dtype(dtype).itemsize

            def body(comm: Any, coll: str = coll, numel: int = numel) -> tuple:
                g = torch.Generator().manual_seed(comm.rank)
                x = torch.randn(numel if coll == "all_reduce" else numel // world, generator=g).to(dt)
                t0 = time.perf_counter()
                y = comm.all_reduce(x.clone()) if coll == "all_reduce" else comm.all_gather(x)
                return x, y, comm.last.label(), time.perf_counter() - t0

            res, _, fb = run_ranks(world, body, catalog=cat, tuning=load_tuning(), engine="sim",
                                   granule=1, refuse_unaligned=16)
            xs = [r[0] for r in res]
            if coll == "all_reduce":
                want = xs[0].float()
                for x in xs[1:]:
                    want = (want + x.float()).to(dt).float()
                ok = all(torch.equal(r[1].float(), want) for r in res)
            else:
                ok = all(_same_bits(r[1], torch.cat(xs)) for r in res)
            bad += not ok
            print(f"{coll:12s} {format_size(nbytes):>6s} {'ok' if ok else 'WRONG':>6s} "
                  f"{res[0][3] * 1e3:8.1f} ms simulated  {res[0][2]}")
    return 1 if bad else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="allreduce/allgather through the Communicator vs NCCL "
                       "(CPU simulator without GPUs)", description=__doc__)
    p.add_argument("--sizes", "--size", action="sizes", default=None, type=sizes_arg(), metavar="SIZES",
                   help="message sizes: " + SIZES_FORMS + " (default 1K,64K,1M,16M on GPUs; 1K,16K on the CPU)")
    p.add_argument("--dtype", default="bfloat16", type="gpu_dtype",
                   help=f"{', '.join(GPU_DTYPES)} (default bfloat16), or an alias "
                        f"({', '.join(find_dtype(d).aliases[0] for d in GPU_DTYPES)} ...)")  # type: ignore[union-attr]
    p.add_argument("--cpu", action="store_true", help="use the simulator even with GPUs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo on every visible GPU (two or more, unless ``--cpu``), else on the simulator;
    exit status 1 when any output was wrong."""
    try:
        import torch

        ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        ngpu = 0
    Catalog.from_dir(), load_tuning()   # a bad MSCCLANG_PLANS_DIR or MSCCLANG_TUNING: refused before any worker starts
    if ngpu >= 2 and not args.cpu:
        return run_gpus(args.sizes or parse_sizes("1K,64K,1M,16M"), args.dtype, ngpu)
    return run_simulator(args.sizes or parse_sizes("1K,16K"), args.dtype)
