"""``mscclang run plan.json [--size BYTES ...] [--dtype ...] [--graph]``: run a plan on every
visible GPU (one process each, started here), check the output against the simulator (small
sizes) and a torch reference, and print the time per launch. Works for any world size up to the
visible GPUs (a plan for fewer ranks than GPUs runs on the first ones). The check column says how
the output was checked: ``sim`` bit for bit against the simulator (up to 64 KiB), then ``exact``
(bit for bit against torch: copies, int32, min/max, 2 ranks) or ``bound`` (floating-point sums
over 3+ ranks: within the any-order summation error bound, see mscclang.cli.run_checks). Without
enough GPUs it says so and verifies the plan on the simulator instead, at each requested size
scaled down (with a message) until the simulation fits ``MSCCLANG_SIM_MAX_MEMORY`` and
``MSCCLANG_SIM_MAX_SECONDS`` (see :mod:`mscclang.sim.budget`)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Optional

from mscclang.errors import LimitError, MscclangError

if TYPE_CHECKING:
    from mscclang.plan.models import Plan
    from mscclang.sim.budget import Estimate, Limits

from mscclang.cli.args import GPU_DTYPES, SIZES_FORMS, add_progress_flag, dtype_arg, flatten_sizes, sizes_arg


def add_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("run", help="run a plan on all visible GPUs, check it and time it")
    p.add_argument("plan", help="plan JSON file")
    p.add_argument("--size", action="append", type=sizes_arg(), metavar="SIZES",
                   help="message sizes (input bytes; allgather: per rank), repeatable: " + SIZES_FORMS +
                        " (default 1K and 1M)")
    p.add_argument("--dtype", default="float16", type=dtype_arg(GPU_DTYPES),
                   help=f"{', '.join(GPU_DTYPES)} or an alias (fp16, bf16, fp32, i32); default float16")
    p.add_argument("--packet-type", default=None, choices=["LL16", "LL8"])
    p.add_argument("--reduce-op", default=None, choices=["sum", "min", "max"])
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager calls")
    p.add_argument("--iters", type=int, default=200, help="timed launches per size")
    p.add_argument("--timeout", type=float, default=30.0, help="bound of every GPU spin, seconds")
    add_progress_flag(p)
    p.set_defaults(func=run)


#: schedules per size when ``run`` falls back to the simulator
SIM_SCHEDULES = 3


def _fitting_size(plan: "Plan", want: int, unit: int, dtype: str, limits: "Limits",
                  share: int) -> tuple[int, "Estimate"]:
    """The largest size, ``want`` halved as often as needed (kept a multiple of ``unit``), whose
    verification takes at most ``1/share`` of ``limits``; with the estimate of ``want``."""
    from mscclang.sim.budget import Limits
    from mscclang.sim.dtypes import parse_dtype
    from mscclang.sim.verify import estimate_verify

    part = Limits(limits.memory_bytes // share, limits.seconds / share)
    dts = [parse_dtype(dtype)]
    first = est = estimate_verify(plan, [want], dts, SIM_SCHEDULES, 2)
    size = want
    while not est.fits(part):
        size = (size // 2) // unit * unit
        if size < unit:
            raise LimitError(f"{first.what} would take {' and '.join(first.problems(part))}, and so "
                             f"would any size down to {unit} bytes")
        est = estimate_verify(plan, [size], dts, SIM_SCHEDULES, 2)
    return size, first


def _simulate_instead(plan: "Plan", sizes: list[int], dtype: str, progress: "Optional[bool]" = None) -> int:
    """Without GPUs: verify the plan on the simulator at the requested sizes, each scaled down
    (with a message) until its simulation fits the simulator's limits
    (``MSCCLANG_SIM_MAX_MEMORY`` / ``MSCCLANG_SIM_MAX_SECONDS``, shared among the sizes)."""
    from mscclang.plan.dtypes import dtype_info
    from mscclang.units import format_bytes
    from mscclang.sim.budget import Limits
    from mscclang.sim.verify import verify

    esize = dtype_info(dtype).itemsize
    limits = Limits.from_env()
    unit = esize * len(plan.gpus)
    chosen: list[int] = []
    for nb in sizes:
        want = max(nb // unit * unit, unit)
        got, est = _fitting_size(plan, want, unit, dtype, limits, len(sizes))
        if got != want:
            print(f"mscclang run: simulating {format_bytes(got)} instead of {format_bytes(want)}: "
                  f"{format_bytes(want)} would take {' and '.join(est.problems(limits))}",
                  file=sys.stderr)
        chosen.append(got)
    from mscclang.cli.progress import Progress

    with Progress(None, f"simulate {plan.name}", unit="run", enabled=progress) as bar:
        def step(done: int, total: int) -> None:
            bar.set_total(total)
            bar.update(done - bar.n)

        rep = verify(plan, sizes=sorted(set(chosen)), dtypes=[dtype], schedules=SIM_SCHEDULES, limits=limits,
                     progress=step)
    print(rep)
    return rep.exit_code()  # NO POSTCONDITION (test/custom plans) and warnings: 0


def run(args: argparse.Namespace) -> int:
    from mscclang.plan.io import load_plan, plan_to_json

    plan = load_plan(args.plan)
    sizes = flatten_sizes(args.size) or [1024, 1 << 20]
    for nb in sizes:
        if nb <= 0:
            raise MscclangError(f"--size {nb}: message sizes must be positive (bytes)")
    ngpu = 0
    try:
        import torch

        ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        ngpu = 0
    if ngpu < plan.world_size:
        print(f"mscclang run: {ngpu} GPU(s) visible, the plan needs {plan.world_size}; verifying on the "
              "simulator instead", file=sys.stderr)
        return _simulate_instead(plan, sizes, args.dtype, args.progress)
    from mscclang.runtime.workers import WorkerPool

    j = plan_to_json(plan)
    op = args.reduce_op or "sum"
    C = "mscclang.cli.run_checks"
    failed = False
    with WorkerPool(world_size=plan.world_size, timeout_s=args.timeout) as pool:
        print(f"{plan.name}: {plan.collective} on {pool.world_size} GPUs, {args.dtype}, "
              f"{'CUDA graph' if args.graph else 'eager'}")
        print(f"{'bytes':>12} {'check':>14} {'us/launch':>10}")
        for nb in sizes:
            res = pool.run(f"{C}:run_plan_check", j, nb, args.dtype, args.packet_type, op)
            bad = sum(r["bad"] for r in res)
            mode = res[0].get("ref_mode", "exact")
            via = f"sim+{mode}" if res[0].get("sim_bad") is not None else mode
            if args.graph:
                t = pool.run(f"{C}:time_graph", j, nb, max(args.iters // 10, 1), 10, args.dtype, args.packet_type)
                us = max(r["us_per_launch"] for r in t)
            else:
                t = pool.run(f"{C}:time_eager", j, nb, args.iters, args.dtype, args.packet_type)
                us = max(r["us_per_call"] for r in t)
            failed |= bad > 0
            print(f"{nb:>12} {('ok ' + via) if bad == 0 else f'{bad} BAD ({via})':>14} {us:>10.2f}")
    return 1 if failed else 0
