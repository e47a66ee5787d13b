"""``mscclang.sim.verify``: run a plan under many schedules, sizes, dtypes, reduce ops and
packet types, and report deadlocks, races, unsynchronised signals, unbalanced channels and
semaphores, and wrong outputs (numeric and symbolic)."""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from typing import Any, Optional, Sequence

import numpy as np

from mscclang.errors import MscclangError, PlanError
from mscclang.plan.collectives import CollectiveSpec, check_senders, collective, spec_from_plan
from mscclang.plan.models import REDUCE_OP_NAMES, BufferKind, Plan
from mscclang.sim.budget import SYMBOLIC_BUDGET, Deadline, Estimate, Limits, estimate_runs
from mscclang.sim.consistency import (ChunkFindings, check_numeric_consistency, check_symbolic_consistency,
                                      consistency_level, drop_numeric_duplicates)
from mscclang.sim.dtypes import accumulates, dtype_name, parse_dtype
from mscclang.sim.engine import SCHEDULES, Simulation
from mscclang.sim.fused import default_cases, prove_fused_consistent, verify_fused
from mscclang.sim.diagnosis import (Findings, annotate_sources, attribute_writers, chunk_notes, plan_uses,
                                    protocol_warnings)
from mscclang.sim.invariance import (KIND as INVARIANCE_KIND, InvarianceCheck, InvarianceProof,
                                     check_symbolic_invariance, forms_for)
from mscclang.sim.postcondition import check_numeric, check_symbolic, derive_senders, random_inputs
from mscclang.sim.program import Program, sim_program
from mscclang.sim.report import Deadlock, Problem, Report
from mscclang.sim.state import MAX_SYMBOLIC_GRANULE, granule_of
from mscclang.sim.runner import (PlanLike, VerifyOptions, as_plan, check_arguments, default_launches,
                                 message_to_bytes, nothing_to_verify, resolve_reduce_op)

DEFAULT_DTYPES = ("float16", "bfloat16", "float32", "int32")


def _grain(plan: Plan) -> tuple[int, int, int]:
    """(blocks per message, chunks per block (at least 1), alignment unit (at least 4 bytes)): what
    every size the sizes below choose is a multiple of."""
    row, g = collective(plan.collective), plan.gpus[0]
    return (max(row.blocks(len(plan.gpus))), max(row.block_chunks(len(plan.gpus), g.input_chunks, g.output_chunks), 1),
            max(plan.buffer_alignment, 4))


def default_sizes(plan: Plan) -> list[int]:
    """Message sizes a default verify runs: one where every chunk is one alignment unit, an odd
    one whose last chunk is short, and a larger one, kept inside the plan's message size range;
    and, for a plan with pipelines, the smallest size in range at which every pipeline runs at
    least two iterations (:func:`pipeline_size`), so that the slicing is checked. Ascending; empty
    when the plan's range holds none. A fused plan's: the bytes of its default cases
    (:func:`~mscclang.sim.fused.default_cases`), each in the dtypes it is run in."""
    if collective(plan.collective).fused:
        return sorted({c.rows * c.hidden * d.itemsize for c in default_cases(plan) for d in c.dtypes})
    f, bc, a = _grain(plan)
    block = bc * a
    cands = [block * f, (3 * block + 4) * f, 32 * block * f]
    ok = [s for s in cands if plan.min_message_size <= s <= plan.max_message_size]
    if not ok:
        s = -(-max(plan.min_message_size, 4 * f) // (4 * f)) * (4 * f)   # the least multiple of 4f in range
        ok = [s] if s <= plan.max_message_size else []
    ps = pipeline_size(plan)
    if ps is not None and ps not in ok:
        ok = sorted(ok + [ps])
    return ok


def proof_sizes(plan: Plan) -> list[int]:
    """The sizes at which the batch-invariance proof runs (docs/verify.md, ``batch-variant``):
    :func:`default_sizes` and, when none of them has a short last chunk (a plan whose size range
    starts above them), the least size in range whose blocks' last chunk is short by ``d``
    alignment units (``0 < d < block_chunks``), chunks and shortfall multiples of the largest
    power of two (up to :data:`MAX_SYMBOLIC_GRANULE`) that keeps the symbolic run within
    :data:`SYMBOLIC_BUDGET` (none does: the coarsest such size, which the proof then reports as
    not followed). Ascending."""
    sizes = default_sizes(plan)
    if collective(plan.collective).fused:
        return sizes
    f, bc, a = _grain(plan)
    if not sizes or any(s % (bc * a * f) for s in sizes):
        return sizes
    nsym = len(plan.gpus) * max(plan.gpus[0].input_chunks, 1)
    first = None
    g = MAX_SYMBOLIC_GRANULE
    while g >= 4:
        d = max(1, g // a)
        step = g * a // math.gcd(g, a)   # chunk bytes: a multiple of both
        chunk = max(step, -(-(-(-plan.min_message_size // f) + d * a) // (bc * step)) * step)
        size = f * (bc * chunk - d * a)
        if d < bc and size <= plan.max_message_size:
            first = size if first is None else first
            prog = sim_program(plan, *message_to_bytes(plan, size))
            if symbolic_bytes(prog, nsym, symbolic_granule(prog)) <= SYMBOLIC_BUDGET:
                return sorted(sizes + [size])
        g //= 2
    return sizes if first is None else sorted(sizes + [first])


def _pipeline_ops(plan: Plan) -> list:
    return [op for g in plan.gpus for tb in g.threadblocks for op in tb.ops
            if op.name.value == "pipeline" and op.iter_context is not None]


def _fewest_iterations(prog: Program) -> int:
    counts = [len(c.iterations) for blocks in prog.blocks for cops in blocks for c in cops
              if c.name == "pipeline"]
    return min(counts) if counts else 0


def pipeline_size(plan: Plan, max_tries: int = 12) -> Optional[int]:
    """The smallest message size (a multiple of the plan's block, in its size range) at which
    every pipeline of the plan runs at least two iterations; ``None`` for a plan without
    pipelines or when no size in range does. Chunks are then a little over one ``unit_size``
    (by :data:`MAX_SYMBOLIC_GRANULE` bytes, so the symbolic shadows stay coarse)."""
    pipes = _pipeline_ops(plan)
    if not pipes:
        return None
    f, bc, a = _grain(plan)
    unit = max(op.iter_context.unit_size for op in pipes)
    step = bc * f * (a * MAX_SYMBOLIC_GRANULE // math.gcd(a, MAX_SYMBOLIC_GRANULE))
    size = bc * f * (unit + MAX_SYMBOLIC_GRANULE)
    if unit * 16 < MAX_SYMBOLIC_GRANULE:
        # tiny units: a chunk of unit + granule bytes would be hundreds of iterations (slow to
        # compile, and the budget refuses such plans at real sizes anyway): aim at a few
        step = bc * f * a
        size = bc * f * 2 * unit
    size = max(size, plan.min_message_size)
    size = -(-size // step) * step
    least = min(op.iter_context.unit_size for op in pipes)
    for _ in range(max_tries):
        if size > plan.max_message_size:
            return None
        if size // (bc * f) > 4096 * max(least, 1):
            return None   # thousands of iterations per chunk: not a size to compile here (the budget judges it)
        try:
            ib, ob = message_to_bytes(plan, size)
            if _fewest_iterations(sim_program(plan, ib, ob)) >= 2:
                return size
        except MscclangError:
            return None
        size *= 2
    return None


def symbolic_granule(prog: Program) -> int:
    """The largest power of two (at most :data:`MAX_SYMBOLIC_GRANULE`, at least 4) that divides
    every byte offset and length the program moves (chunks, pieces of every op and pipeline
    iteration, slot tails, scratch halves): one row of the symbolic shadow per such granule
    then follows the bytes exactly."""
    plan = prog.plan
    vals: list[int] = [prog.input_bytes, prog.output_bytes]
    for lay in prog.layouts:
        for kind, count in ((BufferKind.input, lay.input.num_chunks),
                            (BufferKind.output, lay.output.num_chunks)):
            for c in range(count):
                vals.extend(lay.span(kind, c))
        sb = lay.scratch_alloc_bytes
        sb += (-sb) % 8
        vals.append(sb // 2 if plan.use_double_scratch_buffer else sb)
    for grp in prog.groups():
        for piece in grp.pieces:
            vals.append(piece.length)
            vals.extend(piece.offsets)
        for (_, x, y) in grp.pads:
            vals.extend((x, y))
    return granule_of(vals)


def symbolic_bytes(prog: Program, nsym: int, granule: int) -> int:
    """Memory the symbolic shadows of a run of ``prog`` take (rows of ``nsym`` int16 counts)."""
    rows = 0
    for lay in prog.layouts:
        sb = lay.scratch_alloc_bytes
        for nbytes in (lay.input_bytes, lay.output_bytes, sb + (-sb) % 8):
            rows += -(-nbytes // granule)
    return rows * nsym * 2


def _moves_bytes(prog: Program) -> bool:
    """Whether any data op of ``prog`` moves at least one byte."""
    return any(g.stream_length() > 0 for g in prog.groups())


def _sendrecv_spec(p: Plan, spec: CollectiveSpec, prog: Program,
                   senders: Optional[Sequence[int]], rep: Report) -> CollectiveSpec:
    """The sendrecv spec with each rank's sender: ``senders`` when given, else taken from the
    plan's data flow (:func:`derive_senders`); problems and notes go to ``rep``."""
    n = len(p.gpus)
    if senders is not None:
        s = check_senders(senders, n)
        return dataclasses.replace(spec, senders=s)
    derived = derive_senders(prog)
    chosen: list[int] = []
    for r, got in enumerate(derived):
        ring = (r - 1) % n
        if len(got) == 1:
            chosen.append(next(iter(got)))
            continue
        if len(got) > 1:
            rep.problems.append(Problem(
                "postcondition",
                f"send/recv: rank {r}'s output receives the inputs of ranks {sorted(got)}, but a "
                f"send/recv rank receives one peer's input (pass senders=[...] / --senders to say "
                f"which one is meant)", details={"rank": r, "senders": sorted(got)}))
        chosen.append(ring if ring in got or not got else min(got))
    if sorted(chosen) != list(range(n)):
        first: dict[int, int] = {}
        for r, q in enumerate(chosen):
            if q in first:
                rep.problems.append(Problem(
                    "postcondition",
                    f"send/recv: ranks {first[q]} and {r} both receive rank {q}'s input: every rank "
                    f"sends to exactly one rank (the senders must be a permutation)",
                    details={"rank": r, "sender": q}))
                break
            first[q] = r
        return spec
    if any(q != (r - 1) % n for r, q in enumerate(chosen)):
        rep.notes.append("send/recv senders taken from the plan: "
                         + ", ".join(f"{r}<-{q}" for r, q in enumerate(chosen)))
    return dataclasses.replace(spec, senders=tuple(chosen))


#: the symbolic run's shadow (one int16 per 4 bytes and input chunk) is estimated up to this
_SYMBOLIC_MAX = 64 << 20


def _symbolic_fits(p: Plan, ib: int, ob: int) -> bool:
    nsym = len(p.gpus) * max(p.gpus[0].input_chunks, 1)
    return ib % 4 == 0 and nsym * (ib + ob) <= _SYMBOLIC_MAX


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


#: a verify estimated at this much memory or more collects the last run's simulation (its
#: reference cycles) before it builds the next, so that two are never alive at once; below it the
#: collection (tens of ms on a large heap, per run) would cost more than the memory it frees
COLLECT_BETWEEN_RUNS = 256 << 20


def _within_budget(p: Plan, sizes: Sequence[int], dts: Sequence[np.dtype], schedules: int,
                   launches: int, symbolic: bool, limits: Optional[Limits]) -> Estimate:
    """Refuse (LimitError) runs the budget cannot hold; the estimate of the ones it can."""
    est = estimate_verify(p, sizes, dts, schedules, launches, symbolic)
    est.check(limits)
    return est


def verify(plan: PlanLike, options: Optional[VerifyOptions] = None, **keywords: Any) -> Report:
    """Verify ``plan`` with ``options`` (:class:`~mscclang.sim.runner.VerifyOptions`; default:
    its defaults), each keyword replacing that field (``verify(plan, schedules=3)``; an unknown
    keyword is a TypeError). For every message size, ``schedules`` runs are made: run ``i`` uses
    schedule round_robin / random / adversarial / runahead in turn (seeded ``seed + i``; the
    ``runahead`` runs of the ``s``-th size lead with rank ``(s + i // 4) % ranks``, so with the
    default 10 schedules and 3 sizes up to four ranks each get to run ahead), and takes the
    dtype, reduce op and packet type in rotation, so every value of each appears. Each run
    checks races and every launch's outputs over ``launches`` consecutive launches (default:
    :func:`default_launches`); one extra round-robin run per plan checks the symbolic
    postcondition at the smallest size.

    Findings are grouped: one :class:`Problem` per bug, whatever the sizes, dtypes, schedules
    and launches it was seen under, with its true ``count`` and its ``cases``. ``max_problems``
    (default: none) stops starting runs once that many distinct problems are known (counts then
    cover the runs made, which a note says). ``senders`` (sendrecv only): per rank, the rank
    whose input it receives; by default taken from the plan's data flow. A plan of a collective
    without a postcondition (``test``, ``custom``) is checked for deadlocks and races only
    (status ``NO POSTCONDITION``). ``progress(done, total)`` is called after every run (``total``
    counts the planned runs; a run that stops early stops short of it). Returns a :class:`Report`.

    The runs are estimated first (:mod:`mscclang.sim.budget`): what would exceed ``limits``
    (default: ``MSCCLANG_SIM_MAX_MEMORY`` / ``MSCCLANG_SIM_MAX_SECONDS``) raises
    :class:`~mscclang.errors.LimitError` before anything is allocated, and a run that passes the
    time limit anyway stops with one. Sizes must be positive and whole elements of every dtype on
    every rank (:func:`~mscclang.sim.runner.message_to_bytes`; a size given may lie outside the
    plan's message size range, which the library never calls: tests verify the large-message
    plans at small sizes), ``schedules`` and ``launches`` at
    least 1, ``seed`` not negative, packet types and reduce ops known and ``max_problems`` at least 1
    (:class:`VerificationError` otherwise, before anything is allocated); a verify with nothing to
    run (``sizes`` empty, or no default size in the plan's message size range) raises
    :class:`VerificationError` (never an OK over no runs). The report lists the
    dtypes, reduce ops (for a plan that reduces) and packet types (for a plan with packet ops) of
    the runs made, and warns (``protocol``) of a plan declaring LL without a packet op."""
    t0 = time.perf_counter()
    o = dataclasses.replace(options or VerifyOptions(), **keywords)
    p = as_plan(plan)
    spec = spec_from_plan(p)
    o.check_senders(spec)
    if spec.row.fused:  # row-shaped cases and its own postcondition, the same options
        return verify_fused(p, o)
    if p.has_segments():  # its sizes are count matrices (mscclang.sim.counted)
        from mscclang.sim.counted import verify_counted
        return verify_counted(p, o)
    user_dtypes = None if o.dtypes is None else [parse_dtype(d) for d in o.dtypes]
    dtypes = DEFAULT_DTYPES if o.dtypes is None else o.dtypes
    launches = default_launches(p) if o.launches is None else o.launches
    sizes = None if o.sizes is None else list(o.sizes)
    schedules, seed, symbolic, max_problems, progress = o.schedules, o.seed, o.symbolic, o.max_problems, o.progress
    check_arguments(sizes, schedules, seed, launches, list(o.packet_types), max_problems, o.reduce_ops)
    rep = Report(p.name, launches=launches)
    rep.postcondition = spec.has_postcondition
    reduces, packets = plan_uses(p)
    rep.problems.extend(protocol_warnings(p, packets))
    given_sizes = sizes is not None
    if sizes is None:
        sizes = default_sizes(p)
        if not sizes:
            raise nothing_to_verify(p, "no default message size lies")
    rep.sizes = sizes
    dts = [parse_dtype(d) for d in dtypes] or [parse_dtype("float16")]
    for size in sizes:   # whole elements of every dtype on every rank, or refused
        for d in dts:
            message_to_bytes(p, size, d)
    collect = _within_budget(p, sizes, dts, schedules, launches, symbolic, o.limits).memory_bytes >= COLLECT_BETWEEN_RUNS
    deadline = Deadline(o.limits, f"verifying {p.name}")
    try:
        plan_op = resolve_reduce_op(p)
    except PlanError as e:
        rep.problems.append(Problem("plan", str(e)))
        rep.seconds = time.perf_counter() - t0
        return rep
    rops = list(o.reduce_ops if o.reduce_ops is not None else REDUCE_OP_NAMES if spec.is_reduction else (plan_op,))
    pts = list(o.packet_types) or ["LL16"]
    scheds = [SCHEDULES[i % len(SCHEDULES)] for i in range(max(schedules, 1))]
    rep.schedules = scheds
    found = Findings(p, rep)
    add = found.add

    level = consistency_level(p)
    disclaimed: set[tuple] = set()

    def consistent(probs: list[Problem], ctx: str) -> None:
        """Rank-consistency findings: problems, or a note when the plan disclaims the promise."""
        if level is not None:
            add(probs, ctx)
            return
        for pr in probs:
            disclaimed.update((pr.details["ranks"], c) for c in pr.details["chunks"])

    def enough() -> bool:
        return max_problems is not None and len(rep.problems) >= max_problems

    progs: dict[int, Program] = {}
    for size in sizes:
        try:
            ib, ob = message_to_bytes(p, size)
            progs[size] = sim_program(p, ib, ob)
        except MscclangError as e:
            rep.problems.append(Problem("plan", f"message size {size}: {e}"))
    if any(pr.kind == "plan" for pr in rep.problems):
        rep.seconds = time.perf_counter() - t0
        return rep
    if progs:
        rep.vacuous = not any(_moves_bytes(pr) for pr in progs.values())
        if spec.row.has_senders:
            spec = _sendrecv_spec(p, spec, progs[max(progs)], o.senders, rep)
            for pr in rep.problems:
                found.known(pr)

    stopped = False
    extra = [] if not (symbolic and spec.is_reduction and spec.has_postcondition and p.batch_invariant) else [
        x for x in (sorted(sizes) if given_sizes else proof_sizes(p)) if x != min(sizes)]
    inv = InvarianceCheck(p, user_dtypes, extra)
    planned = len(sizes) * len(scheds) + (1 + len(inv.extra) if symbolic and sizes and spec.has_postcondition else 0)

    def ran() -> None:
        if progress is not None:
            progress(rep.runs, planned)

    for si, size in enumerate(sizes):
        prog = progs[size]
        ib = prog.input_bytes
        for i, sched in enumerate(scheds):
            if enough():
                stopped = True
                break
            dt = dts[i % len(dts)]
            rop = rops[i % len(rops)] if not accumulates(dt) else "sum"   # fp8 runs the sum only
            pt = pts[i % len(pts)]
            used = (dtype_name(dt), rop if reduces else None, pt if packets else None)
            rep.ran(*used)
            lead = (si + i // len(SCHEDULES)) % len(p.gpus) if sched == "runahead" else None
            ctx = ", ".join([f"size {size}", *filter(None, used), f"{sched} schedule seed {seed + i}"]) + (
                f" (rank {lead} runs ahead)" if lead is not None else "")
            sim = inputs = None   # the last run's simulation is freed before the next is built
            if collect:
                gc.collect()
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
                ran()
                continue
            except PlanError as e:
                add([Problem("plan", str(e))], ctx)
                rep.seconds = time.perf_counter() - t0
                return rep
            add(sim.problems, ctx)
            if spec.has_postcondition:
                for k, outs in enumerate(sim.outputs):
                    probs = check_numeric(spec, prog.layouts, inputs, outs, dt, rop, k + 1)
                    attribute_writers(probs, p, sim)
                    add(probs, ctx)
                    consistent(check_numeric_consistency(spec, prog.layouts, outs, k + 1, level), ctx)
            ran()

    if symbolic and sizes and spec.has_postcondition and not stopped:
        size = min(sizes)
        prog = progs[size]
        nsym = len(p.gpus) * max(p.gpus[0].input_chunks, 1)
        ib = prog.input_bytes
        gran = symbolic_granule(prog)
        if ib % 4 == 0 and symbolic_bytes(prog, nsym, gran) <= SYMBOLIC_BUDGET:
            dt = parse_dtype("float32")
            sim = inputs = None
            if collect:
                gc.collect()
            inputs = random_inputs(len(p.gpus), ib, dt, seed)
            sim = Simulation(prog, [x.view(np.uint8) for x in inputs], dtype=dt, reduce_op="sum",
                             packet_type=pts[0], launches=launches, schedule="round_robin",
                             seed=seed, spec=spec, nsym=nsym, poison_outputs=True,
                             sym_granule=gran, deadline=deadline)
            rep.runs += 1
            ctx = f"symbolic, size {size}"
            try:
                sim.run()
                if sim.sym_ok:
                    for k, sh in enumerate(sim.out_shadows):
                        probs = check_symbolic(spec, prog.layouts, sh, p.gpus[0].input_chunks,
                                               k + 1, granule=gran)
                        attribute_writers(probs, p, sim)
                        add(probs, ctx)
                        consistent(check_symbolic_consistency(spec, prog.layouts, sim.out_exprs[k], sim.exprs,
                                                              gran, k + 1, level), ctx)
                        check_symbolic_invariance(spec, prog.layouts, sim.out_exprs[k], sim.exprs, gran,
                                                  f"size {size}, launch {k + 1}", inv.level, inv.forms, found=inv.found)
                inv.proof.ran(size, sim.sym_ok)
                if not sim.sym_ok:
                    rep.notes.append(f"symbolic check skipped: size {size} moves bytes that are not 4-byte aligned")
            except Deadlock as e:
                add([e.problem], ctx)
            ran()
        else:
            rep.notes.append(f"symbolic check skipped at size {size}")
            inv.proof.ran(size, False)
        sim = inputs = None
        for size in inv.extra:
            if inv.found.found:
                break   # it does not hold: the other sizes add only chunks
            try:
                got = _symbolic_sim(p, spec, size, deadline, progs.get(size))
            except Deadlock:
                got = None   # the runs at this size report it
            rep.runs += 1
            inv.proof.ran(size, got is not None)
            if got is not None:
                check_symbolic_invariance(spec, got[0].layouts, got[1].out_exprs[0], got[1].exprs, got[2],
                                          f"size {size}", inv.level, inv.forms, found=inv.found)
            ran()
        if spec.is_reduction:
            inv.report(rep, found)
    rep.problems = drop_numeric_duplicates(rep.problems)
    if disclaimed:
        rep.notes.append(f"the plan does not promise rank-consistent results (consistent: false): "
                         f"{len(disclaimed)} (rank pair, chunk) results differ between ranks")
    if stopped:
        rep.notes.append(f"stopped after {len(rep.problems)} distinct problems (max_problems): "
                         "counts cover the runs made")
    rep.notes.extend(chunk_notes(rep.problems))
    rep.problems = rep.ranked()
    rep.seconds = time.perf_counter() - t0
    return rep


def _symbolic_sim(p: Plan, spec: CollectiveSpec, size: int, deadline: Optional[Deadline] = None,
                  prog: Optional[Program] = None) -> Optional[tuple[Program, Simulation, int]]:
    """(program, finished simulation, granule) of one symbolic run of ``p`` at ``size`` (fp32, one
    launch, no race checks; ``prog``: the program at that size, when compiled already); None when
    its data moves cannot be followed symbolically there (not 4-byte aligned, or past
    :data:`SYMBOLIC_BUDGET`)."""
    ib, ob = message_to_bytes(p, size)
    prog = sim_program(p, ib, ob) if prog is None else prog
    gran = symbolic_granule(prog)
    nsym = len(p.gpus) * max(p.gpus[0].input_chunks, 1)
    if ib % 4 or symbolic_bytes(prog, nsym, gran) > SYMBOLIC_BUDGET:
        return None
    inputs = random_inputs(len(p.gpus), ib, parse_dtype("float32"), 0)
    sim = Simulation(prog, [x.view(np.uint8) for x in inputs], dtype=parse_dtype("float32"), launches=1, spec=spec,
                     nsym=nsym, sym_granule=gran, check_races=False, deadline=deadline)
    sim.run()
    return (prog, sim, gran) if sim.sym_ok else None


def prove_consistent(plan: PlanLike) -> list[Problem]:
    """The ``inconsistent`` problems of ``plan`` from one symbolic run at its smallest default size
    (no race checks: :func:`verify` does those), whatever the plan promises; ``[]`` for a plan
    that is not a reduction, or whose data moves cannot be followed symbolically at that size. A
    race-free plan's results do not depend on the schedule (module docstring of
    :mod:`mscclang.sim.consistency`); what ``plan generation`` runs on every library plan."""
    p = as_plan(plan)
    spec = spec_from_plan(p)
    if not spec.is_reduction:
        return []
    if spec.row.fused:
        return prove_fused_consistent(p)
    sizes = default_sizes(p)
    got = _symbolic_sim(p, spec, min(sizes)) if sizes else None
    if got is None:
        return []
    prog, sim, gran = got
    return check_symbolic_consistency(spec, prog.layouts, sim.out_exprs[0], sim.exprs, gran, 1, "error")


def prove_batch_invariant(plan: PlanLike, dtypes: Optional[Sequence[str]] = None) -> InvarianceProof:
    """Whether every reduced output element of ``plan`` is the canonical expression
    (:mod:`mscclang.sim.invariance`) in the forms ``dtypes`` demand (default: every dtype, fp8
    included), whatever the plan promises: one symbolic run at each of its :func:`default_sizes`
    (a fused plan's: each of its default cases), which cover every chunk grid the plan has
    (docs/verify.md, ``batch-variant``). No race checks: :func:`verify` does those. A plan that
    is not a reduction holds trivially (no size is run)."""
    from mscclang.sim.fused import prove_fused_invariant

    p = as_plan(plan)
    spec = spec_from_plan(p)
    forms = forms_for(None if dtypes is None else [parse_dtype(d) for d in dtypes])
    if not spec.is_reduction:
        return InvarianceProof([], [], [])
    if spec.row.fused:
        return prove_fused_invariant(p)
    proof = InvarianceProof([], [], [])
    found = ChunkFindings("", "error", INVARIANCE_KIND)
    for size in proof_sizes(p):
        got = _symbolic_sim(p, spec, size)
        proof.ran(size, got is not None)
        if got is None:
            continue
        prog, sim, gran = got
        proof.problems = check_symbolic_invariance(spec, prog.layouts, sim.out_exprs[0], sim.exprs, gran,
                                                   f"size {size}", "error", forms, found=found)
    for pr in proof.problems:
        annotate_sources(pr, p)
    return proof
