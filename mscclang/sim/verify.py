"""``mscclang.sim.verify``: run a plan under many schedules, sizes, dtypes, reduce ops and
packet types, and report deadlocks, races, unsynchronised signals, unbalanced channels and
semaphores, and wrong outputs (numeric and symbolic)."""

from __future__ import annotations

import numbers
import re
import time
from typing import Optional, Sequence

import numpy as np

from mscclang.errors import MscclangError, PlanError, VerificationError
from mscclang.plan.collectives import spec_from_plan
from mscclang.plan.models import Plan
from mscclang.sim.budget import Deadline, Estimate, Limits, estimate_runs
from mscclang.sim.dtypes import dtype_name, parse_dtype
from mscclang.sim.engine import SCHEDULES, Simulation
from mscclang.sim.postcondition import check_numeric, check_symbolic, random_inputs
from mscclang.sim.program import Program, compile_program
from mscclang.sim.report import Deadlock, Problem, Report
from mscclang.sim.runner import PlanLike, as_plan, resolve_reduce_op

DEFAULT_DTYPES = ("float16", "bfloat16", "float32", "int32")


def _blocks_per_message(plan: Plan) -> int:
    n = len(plan.gpus)
    return n if plan.collective in ("allgather", "reducescatter", "alltoall") else 1


def _block_chunks(plan: Plan) -> int:
    g = plan.gpus[0]
    n = len(plan.gpus)
    c = plan.collective
    if c == "allgather":
        return g.input_chunks
    if c == "reducescatter":
        return g.output_chunks
    if c == "alltoall":
        return max(1, g.input_chunks // n)
    return g.input_chunks or g.output_chunks or 1


def default_sizes(plan: Plan) -> list[int]:
    """Three message sizes: one where every chunk is one alignment unit, an odd one whose last
    chunk is short, and a larger one; kept inside the plan's message size range."""
    a = max(plan.buffer_alignment, 4)
    bc = max(_block_chunks(plan), 1)
    f = _blocks_per_message(plan)
    block = bc * a
    cands = [block * f, (3 * block + 4) * f, 32 * block * f]
    ok = [s for s in cands if plan.min_message_size <= s <= plan.max_message_size]
    if not ok:
        s = max(plan.min_message_size, 4 * f)
        s -= s % (4 * f)
        ok = [s]
    return ok


def message_to_bytes(plan: Plan, size: int) -> tuple[int, int]:
    """(input bytes, output bytes) of a message of ``size`` bytes (allgather: output size)."""
    n = len(plan.gpus)
    c = plan.collective
    if c == "allgather":
        if size % n:
            raise VerificationError(f"allgather message size {size} is not divisible by {n} ranks")
        return size // n, size
    if c == "reducescatter":
        if size % n:
            raise VerificationError(f"reducescatter message size {size} is not divisible by {n} ranks")
        return size, size // n
    if c in ("allreduce", "alltoall", "sendrecv", "broadcast"):
        return size, size
    g = plan.gpus[0]
    if g.input_chunks:
        return size, size * g.output_chunks // g.input_chunks
    return size, size


_LAUNCH = re.compile(r"launch \d+")
#: the symbolic run's shadow (one int16 per 4 bytes and input chunk) is skipped above this
_SYMBOLIC_MAX = 64 << 20


def _symbolic_fits(p: Plan, ib: int, ob: int) -> bool:
    nsym = len(p.gpus) * max(p.gpus[0].input_chunks, 1)
    return ib % 4 == 0 and nsym * (ib + ob) <= _SYMBOLIC_MAX


def _check_arguments(sizes: Optional[Sequence[int]], schedules: int, seed: int, launches: int) -> None:
    """Refuse arguments no run can take, before any work."""
    for name, value, low in (("schedules", schedules, 1), ("launches", launches, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise VerificationError(f"{name} must be an integer of at least {low}, got {value!r}")
    for s in sizes or ():
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s <= 0:
            raise VerificationError(f"message sizes must be positive integers (bytes), got {s!r}")


def estimate_verify(p: Plan, sizes: Sequence[int], dtypes: Sequence[np.dtype], schedules: int,
                    launches: int, symbolic: bool = True) -> Estimate:
    """What :func:`verify` with these arguments would take (:mod:`mscclang.sim.budget`)."""
    shaped = []
    for s in sizes:
        try:
            shaped.append((s, *message_to_bytes(p, s)))
        except MscclangError:
            continue  # reported by the run itself
    sym = None
    if symbolic and shaped:
        small = min(shaped)
        if _symbolic_fits(p, small[1], small[2]):
            sym = small
    what = (f"verifying {p.name} at {len(sizes)} size(s) up to {max(sizes, default=0):,} bytes with "
            f"{schedules} schedule(s) and {launches} launch(es)")
    return estimate_runs(p, shaped, schedules, launches, itemsizes=[d.itemsize for d in dtypes],
                         symbolic_size=sym, what=what)


def _within_budget(p: Plan, sizes: Sequence[int], dts: Sequence[np.dtype], schedules: int,
                   launches: int, symbolic: bool, limits: Optional[Limits]) -> Deadline:
    """Refuse (LimitError) runs the budget cannot hold; the deadline of the ones it can."""
    estimate_verify(p, sizes, dts, schedules, launches, symbolic).check(limits)
    return Deadline(limits, f"verifying {p.name}")


def verify(plan: PlanLike, *, sizes: Optional[Sequence[int]] = None,
           dtypes: Sequence[str] = DEFAULT_DTYPES, schedules: int = 10, seed: int = 0,
           launches: int = 2, reduce_ops: Optional[Sequence[str]] = None,
           packet_types: Sequence[str] = ("LL16", "LL8"), symbolic: bool = True,
           max_problems: int = 40, limits: Optional[Limits] = None) -> Report:
    """Verify ``plan``. For every message size, ``schedules`` runs are made: run ``i`` uses
    schedule round_robin / random / adversarial / runahead in turn (seeded ``seed + i``; the
    ``runahead`` runs of the ``s``-th size lead with rank ``(s + i // 4) % ranks``, so with the
    default 10 schedules and 3 sizes up to four ranks each get to run ahead), and takes the
    dtype, reduce op and packet type in rotation, so every value of each appears. Each run
    checks races and every launch's outputs; one extra round-robin run per plan checks the
    symbolic postcondition at the smallest size. Returns a :class:`Report`.

    The runs are estimated first (:mod:`mscclang.sim.budget`): what would exceed ``limits``
    (default: ``MSCCLANG_SIM_MAX_MEMORY`` / ``MSCCLANG_SIM_MAX_SECONDS``) raises
    :class:`~mscclang.errors.LimitError` before anything is allocated, and a run that passes the
    time limit anyway stops with one. Sizes must be positive, ``schedules`` and ``launches`` at
    least 1 and ``seed`` not negative (:class:`VerificationError` otherwise)."""
    t0 = time.perf_counter()
    p = as_plan(plan)
    spec = spec_from_plan(p)
    _check_arguments(sizes, schedules, seed, launches)
    rep = Report(p.name, launches=launches)
    if sizes is None:
        sizes = default_sizes(p)
    sizes = list(sizes)
    rep.sizes = sizes
    dts = [parse_dtype(d) for d in dtypes] or [parse_dtype("float16")]
    deadline = _within_budget(p, sizes, dts, schedules, launches, symbolic, limits)
    rep.dtypes = [dtype_name(d) for d in dts]
    try:
        plan_op = resolve_reduce_op(p)
    except PlanError as e:
        rep.problems.append(Problem("plan", str(e)))
        rep.seconds = time.perf_counter() - t0
        return rep
    if reduce_ops is None:
        reduce_ops = ("sum", "min", "max") if spec.is_reduction else (plan_op,)
    rops = list(reduce_ops)
    rep.reduce_ops = rops
    pts = list(packet_types) or ["LL16"]
    rep.packet_types = pts
    scheds = [SCHEDULES[i % len(SCHEDULES)] for i in range(max(schedules, 1))]
    rep.schedules = scheds
    seen: set = set()

    def add(probs: list[Problem], ctx: str) -> None:
        for pr in probs:
            key = (pr.kind, _LAUNCH.sub("launch N", pr.message.splitlines()[0]))
            if key in seen or len(rep.problems) >= max_problems:
                continue
            seen.add(key)
            pr.context = ctx
            rep.problems.append(pr)

    progs: dict[int, Program] = {}
    for size in sizes:
        try:
            ib, ob = message_to_bytes(p, size)
            progs[size] = compile_program(p, ib, ob)
        except MscclangError as e:
            rep.problems.append(Problem("plan", f"message size {size}: {e}"))
    if any(pr.kind == "plan" for pr in rep.problems):
        rep.seconds = time.perf_counter() - t0
        return rep

    for si, size in enumerate(sizes):
        prog = progs[size]
        ib = prog.input_bytes
        for i, sched in enumerate(scheds):
            fitting = [d for d in dts if ib % d.itemsize == 0] or [parse_dtype("uint8")]
            dt = fitting[i % len(fitting)]
            rop = rops[i % len(rops)]
            pt = pts[i % len(pts)]
            lead = (si + i // len(SCHEDULES)) % len(p.gpus) if sched == "runahead" else None
            ctx = f"size {size}, {dtype_name(dt)}, {rop}, {pt}, {sched} schedule seed {seed + i}" + (
                f" (rank {lead} runs ahead)" if lead is not None else "")
            inputs = random_inputs(len(p.gpus), ib, dt, seed * 1000 + i)
            sim = Simulation(prog, [x.view(np.uint8) for x in inputs], dtype=dt, reduce_op=rop,
                             packet_type=pt, launches=launches, schedule=sched, seed=seed + i,
                             spec=spec, poison_outputs=True, lead=lead, deadline=deadline)
            rep.runs += 1
            try:
                sim.run()
            except Deadlock as e:
                add(sim.problems, ctx)
                add([e.problem], ctx)
                continue
            except PlanError as e:
                add([Problem("plan", str(e))], ctx)
                rep.seconds = time.perf_counter() - t0
                return rep
            add(sim.problems, ctx)
            for k, outs in enumerate(sim.outputs):
                add(check_numeric(spec, prog.layouts, inputs, outs, dt, rop, k + 1), ctx)
            if len(rep.problems) >= max_problems:
                break

    if symbolic and sizes:
        size = min(sizes)
        prog = progs[size]
        nsym = len(p.gpus) * max(p.gpus[0].input_chunks, 1)
        ib = prog.input_bytes
        if _symbolic_fits(p, ib, prog.output_bytes):
            dt = parse_dtype("float32")
            inputs = random_inputs(len(p.gpus), ib, dt, seed)
            sim = Simulation(prog, [x.view(np.uint8) for x in inputs], dtype=dt, reduce_op="sum",
                             packet_type=pts[0], launches=launches, schedule="round_robin",
                             seed=seed, spec=spec, check_races=False, nsym=nsym, poison_outputs=True,
                             deadline=deadline)
            rep.runs += 1
            ctx = f"symbolic, size {size}"
            try:
                sim.run()
                if sim.sym_ok:
                    for k, sh in enumerate(sim.out_shadows):
                        add(check_symbolic(spec, prog.layouts, sh, p.gpus[0].input_chunks, k + 1), ctx)
                else:
                    rep.notes.append(f"symbolic check skipped: size {size} moves bytes that are not 4-byte aligned")
            except Deadlock as e:
                add([e.problem], ctx)
        else:
            rep.notes.append(f"symbolic check skipped at size {size}")
    rep.seconds = time.perf_counter() - t0
    return rep
