"""``mscclang run plan.json [--sizes SIZES ...] [--dtype ...] [--graph]``: run a plan on every
visible GPU (one process each, started here), check the output against the simulator (small
sizes) and a torch reference, and print the time per launch. Works for any world size up to the
visible GPUs (a plan for fewer ranks than GPUs runs on the first ones); an MSCCL++ plan is
imported first, as ``verify`` and ``show`` do. The check column says how
the output was checked: ``sim`` bit for bit against the simulator (up to 64 KiB), then ``exact``
(bit for bit against torch: copies, int32, min/max, 2 ranks) or ``bound`` (floating-point sums
over 3+ ranks: within the any-order summation error bound, see mscclang.cli.run_checks). Without
enough GPUs it says so and verifies the plan on the simulator instead, at each requested size
scaled down (with a message) until its simulation fits ``MSCCLANG_SIM_MAX_MEMORY`` and
``MSCCLANG_SIM_MAX_SECONDS`` (see :mod:`mscclang.sim.budget`), then the largest scaled down
further while all of them together do not fit: a size is scaled the same whatever smaller sizes
come with it, with the ``--dtype``, ``--reduce-op`` and ``--packet-type`` given (by default
every reduce op and packet type the plan takes; the report lists those that ran), and a line
naming the flags given that only the GPUs take (``--graph``, ``--iters``, ``--timeout``). The
simulator takes every dtype (``uint8``, fp8 ...); the GPUs take ``GPU_DTYPES``. A size is the
plan's message size (``verify``'s: each rank's input; allgather: the output) and must be whole
elements of the dtype on every rank (:func:`mscclang.sim.runner.message_to_bytes`): anything
else is refused, on either path."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from mscclang.errors import LimitError, MscclangError
from mscclang.plan.models import PACKET_TYPES, REDUCE_OP_NAMES

if TYPE_CHECKING:
    from mscclang.plan.models import Plan
    from mscclang.sim.budget import Estimate, Limits

from mscclang.cli.args import (GPU_DTYPES, MESSAGE_SIZE, SIM_DTYPES, add_progress_flag, add_sizes_option, dtype_arg,
                               int_range_arg, positive_float_arg)


def add_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("run", help="run a plan on all visible GPUs, check it and time it")
    p.add_argument("plan", help="plan JSON file (mscclang or MSCCL++ format; '-' reads standard input)")
    add_sizes_option(p, MESSAGE_SIZE, "1K and 1M, clipped to the plan's message range")
    p.add_argument("--dtype", default="float16", type=dtype_arg(SIM_DTYPES),
                   help=f"on GPUs {', '.join(GPU_DTYPES)}, on the simulator also "
                        f"{', '.join(d for d in SIM_DTYPES if d not in GPU_DTYPES)}, or an alias "
                        "(fp16, bf16, fp32, i32, u8 ...); default float16")
    p.add_argument("--packet-type", default=None, choices=PACKET_TYPES)
    p.add_argument("--reduce-op", default=None, choices=REDUCE_OP_NAMES)
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager calls (GPUs only)")
    p.add_argument("--iters", type=int_range_arg(1, 1_000_000), default=None,
                   help="timed launches per size (GPUs only; default 200)")
    p.add_argument("--timeout", type=positive_float_arg(), default=None,
                   help="bound of every GPU spin, seconds (GPUs only; default 30)")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="also run one traced launch per size and write its per-op GPU timeline to FILE "
                        "(Chrome trace-event JSON, one process per rank, one thread per block; Perfetto loads it)")
    add_progress_flag(p)
    p.set_defaults(func=run)


#: schedules per size when ``run`` falls back to the simulator
SIM_SCHEDULES = 3


def _fitting_sizes(plan: "Plan", wants: list[int], unit: int, dtype: str, limits: "Limits") -> list[int]:
    """``wants`` (multiples of ``unit``), each halved (kept a multiple of ``unit``) until its
    verification alone fits ``limits``, then the largest halved until all of them together fit;
    a message on stderr for each size scaled, saying in full why. LimitError when even ``unit``
    bytes do not fit."""
    from mscclang.sim.dtypes import parse_dtype
    from mscclang.sim.verify import estimate_verify
    from mscclang.units import format_bytes

    dts = [parse_dtype(dtype)]

    def estimate(sizes: list[int]) -> "Estimate":
        return estimate_verify(plan, sizes, dts, SIM_SCHEDULES, 2)

    floor = max(unit, plan.min_message_size)   # a size scaled down stays inside the plan's range

    def halve(size: int, est: "Estimate") -> int:
        smaller = (size // 2) // unit * unit
        if smaller < floor:
            raise LimitError(f"{est.what} would take {' and '.join(est.problems(limits))}, and so would "
                             f"any size down to {floor} bytes")
        return smaller

    chosen: list[int] = []
    for want in wants:
        got, first = want, estimate([want])
        est = first
        while not est.fits(limits):
            got = halve(got, first)
            est = estimate([got])
        if got != want:
            print(f"mscclang run: simulating {format_bytes(got)} instead of {format_bytes(want)}: "
                  f"{format_bytes(want)} would take {' and '.join(first.problems(limits))}", file=sys.stderr)
        chosen.append(got)
    together = estimate(chosen)
    while not together.fits(limits):
        i = max(range(len(chosen)), key=chosen.__getitem__)
        old, chosen[i] = chosen[i], halve(chosen[i], together)
        print(f"mscclang run: simulating {format_bytes(chosen[i])} instead of {format_bytes(old)}: the "
              f"{len(chosen)} sizes together would take {' and '.join(together.problems(limits))}",
              file=sys.stderr)
        together = estimate(chosen)
    return chosen


def _simulate_counted(plan: "Plan", args: argparse.Namespace) -> int:
    """A plan with segmented buffers: its sizes are a count matrix, not message sizes, so verify it
    on the simulator over its count matrices (a size or reduce op given is refused)."""
    from mscclang.sim.verify import verify

    given = [f for f, v in (("--sizes", args.sizes), ("--reduce-op", args.reduce_op)) if v]
    if given:
        raise MscclangError(f"{', '.join(given)}: plan {plan.name!r} moves segments whose sizes are its count matrix; "
                            "run it without them")
    print(f"mscclang run: plan {plan.name!r} has segmented buffers (data-dependent counts): verifying it on the "
          "simulator over its count matrices (on GPUs it runs through Communicator.all_to_all_v)", file=sys.stderr)
    rep = verify(plan, schedules=SIM_SCHEDULES, **({"packet_types": [args.packet_type]} if args.packet_type else {}))
    print(rep)
    return rep.exit_code()


def _simulate_instead(plan: "Plan", sizes: list[int], args: argparse.Namespace) -> int:
    """Without GPUs: verify the plan on the simulator at the requested sizes, scaled down (with
    a message) until their simulation fits the simulator's limits (``MSCCLANG_SIM_MAX_MEMORY`` /
    ``MSCCLANG_SIM_MAX_SECONDS``; see :func:`_fitting_sizes`), with the dtype, reduce op and
    packet type asked for (by default every reduce op and packet type the plan takes); one line
    names the flags given that only the GPUs take."""
    from mscclang.sim.budget import Limits
    from mscclang.sim.runner import message_unit
    from mscclang.sim.verify import verify

    gpu_only = [flag for flag, given in (("--graph", args.graph), ("--iters", args.iters is not None),
                                         ("--timeout", args.timeout is not None)) if given]
    if gpu_only:
        print(f"mscclang run: {', '.join(gpu_only)}: not applied on the simulator (GPU launches only: "
              "their timing and the bound of their waits)", file=sys.stderr)
    limits = Limits.from_env()
    chosen = _fitting_sizes(plan, sizes, message_unit(plan, args.dtype), args.dtype, limits)
    from mscclang.cli.progress import Progress

    with Progress(None, f"simulate {plan.name}", unit="run", enabled=args.progress) as bar:
        def step(done: int, total: int) -> None:
            bar.set_total(total)
            bar.update(done - bar.n)

        rep = verify(plan, sizes=sorted(set(chosen)), dtypes=[args.dtype], schedules=SIM_SCHEDULES, limits=limits,
                     reduce_ops=[args.reduce_op] if args.reduce_op else None, progress=step,
                     **({"packet_types": [args.packet_type]} if args.packet_type else {}))
    print(rep)
    return rep.exit_code()  # NO POSTCONDITION (test/custom plans) and warnings: 0


def run(args: argparse.Namespace) -> int:
    from mscclang.cli.show_cmd import read_plan_any
    from mscclang.plan.dtypes import dtype_info
    from mscclang.plan.io import plan_to_json

    plan, was_mscclpp = read_plan_any(args.plan)
    if was_mscclpp:
        print(f"note: {args.plan} is an MSCCL++ plan; running it as imported "
              "(`mscclang import-mscclpp` writes the converted plan)", file=sys.stderr)
    if plan.has_segments():   # data-dependent counts: the simulator, over its count matrices
        return _simulate_counted(plan, args)
    # the default sizes, 1K and 1M, clipped to the plan's message range (a size given is checked as given)
    sizes = args.sizes or sorted({min(max(nb, plan.min_message_size), plan.max_message_size) for nb in (1024, 1 << 20)})
    from mscclang.sim.runner import message_to_bytes

    inputs = [message_to_bytes(plan, nb, args.dtype)[0] for nb in sizes]   # refuses a size of split elements
    try:   # ranks the GPUs here can hold: visible GPUs x MSCCLANG_RANKS_PER_GPU (two ranks may share one)
        from mscclang.runtime.workers import worker_capacity

        ngpu = worker_capacity()
    except Exception:  # noqa: BLE001 - no torch CUDA here: the simulator
        ngpu = 0
    if ngpu < plan.world_size:
        print(f"mscclang run: {ngpu} GPU(s) visible, the plan needs {plan.world_size}; verifying on the "
              "simulator instead", file=sys.stderr)
        if args.trace:
            print(f"mscclang run: no GPU trace written to {args.trace} (it needs the GPUs); `mscclang predict "
                  f"{args.plan} --trace FILE` writes the cost model's predicted timeline", file=sys.stderr)
        return _simulate_instead(plan, sizes, args)
    if not dtype_info(args.dtype).gpu:
        raise MscclangError(f"--dtype {args.dtype} runs on the simulator only; on GPUs use {', '.join(GPU_DTYPES)}")
    from mscclang.runtime.workers import WorkerPool

    j = plan_to_json(plan)
    op = args.reduce_op or "sum"
    C = "mscclang.cli.run_checks"
    failed = False
    iters = args.iters or 200
    with WorkerPool(world_size=plan.world_size, timeout_s=args.timeout or 30.0) as pool:
        print(f"{plan.name}: {plan.collective} on {pool.world_size} GPUs, {args.dtype}, "
              f"{'CUDA graph' if args.graph else 'eager'}")
        print(f"{'bytes':>12} {'check':>14} {'us/launch':>10}")
        for nb, ib in zip(sizes, inputs):   # the workers take input bytes
            res = pool.run(f"{C}:run_plan_check", j, ib, args.dtype, args.packet_type, op)
            bad = sum(r["bad"] for r in res)
            mode = res[0].get("ref_mode", "exact")
            via = f"sim+{mode}" if res[0].get("sim_bad") is not None else mode
            if args.graph:
                t = pool.run(f"{C}:time_graph", j, ib, max(iters // 10, 1), 10, args.dtype, args.packet_type)
                us = max(r["us_per_launch"] for r in t)
            else:
                t = pool.run(f"{C}:time_eager", j, ib, iters, args.dtype, args.packet_type)
                us = max(r["us_per_call"] for r in t)
            failed |= bad > 0
            print(f"{nb:>12} {('ok ' + via) if bad == 0 else f'{bad} BAD ({via})':>14} {us:>10.2f}")
        if args.trace:
            failed |= _trace(pool, plan, j, sizes, inputs, args, op)
    return 1 if failed else 0


def _trace(pool: "object", plan: "Plan", plan_json: str, sizes: list[int], inputs: list[int],
           args: argparse.Namespace, op: str) -> bool:
    """One traced launch per size on every rank, written to ``args.trace`` as one Chrome trace
    (a process per rank and size, a thread per block; each size on its own time base); a line per
    size saying whether the results were right, whether every block ran its ops in the plan's
    order, and what tracing cost. True when something was wrong."""
    import json

    from mscclang.runtime.trace import RankTrace, align, chrome_trace
    from mscclang.units import format_bytes

    events: list[dict] = []
    failed = False
    for k, (nb, ib) in enumerate(zip(sizes, inputs)):
        res = pool.run("mscclang.cli.run_checks:trace_plan", plan_json, ib, args.dtype, args.packet_type, op)  # type: ignore[attr-defined]
        ranks = [RankTrace(r["rank"], r["t0_ns"], r["events"], r["problems"]) for r in res]
        for e in align(ranks):
            e["pid"] = e["pid"] + k * plan.world_size
            events.append(e)
        bad = sum(r["bad"] for r in res)
        problems = [p for r in res for p in r["problems"]]
        failed |= bad > 0 or bool(problems)
        traced, plain = max(r["traced_us"] for r in res), max(r["untraced_us"] for r in res)
        print(f"trace {format_bytes(nb)}: {sum(len(r['events']) for r in res)} op events, results "
              f"{'exact' if bad == 0 else f'{bad} BAD'}, op order "
              f"{'as planned' if not problems else '; '.join(problems[:3])}; a traced call {traced:.1f} us "
              f"against {plain:.1f} us untraced (each waited for, the trace read back)")
    tr = chrome_trace(events, plan)
    names = {e["pid"]: f"rank {e['pid'] % plan.world_size}" + (f" @ {format_bytes(sizes[e['pid'] // plan.world_size])}"
                                                                 if len(sizes) > 1 else "")
             for e in events}
    for m in tr["traceEvents"]:
        if m.get("ph") == "M" and m["pid"] in names:
            m["args"]["name"] = names[m["pid"]]
    try:
        with open(args.trace, "w") as f:
            json.dump(tr, f)
    except OSError as e:
        raise MscclangError(f"cannot write the trace to {args.trace}: {e.strerror or e}") from e
    draw = (f"`mscclang show {args.plan} --png FILE --trace {args.trace}` draws the plan on its time axis"
            if len(sizes) == 1 else "a trace of one size draws with `mscclang show PLAN --png FILE --trace FILE`")
    print(f"trace written to {args.trace} ({len(events)} events; {draw})")
    return failed
