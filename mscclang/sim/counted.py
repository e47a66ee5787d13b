"""Running and verifying plans with segmented buffers (plan/3: data-dependent counts).

A plan with segments is resolved for one call (:class:`~mscclang.plan.segments.CountedCall`: the
count matrix and the sizes), then simulated like any plan: every schedule, the race and
deadlock checks, packets and port channels. Its postcondition is per segment: a counted
collective's output segment ``k`` of rank ``r`` holds exactly the rows of the input segment its
row of the collective table names
(:meth:`~mscclang.plan.collectives.Collective.segment_source`), and no byte of the output past
the received rows is written. :func:`verify_counted` runs the plan over the count matrices of
:func:`~mscclang.plan.segments.count_cases` and two row widths, and adds the capacity proof
(:func:`~mscclang.plan.segments.prove_capacity`).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np

from mscclang.errors import MscclangError, PlanError, VerificationError
from mscclang.plan.collectives import TABLE
from mscclang.plan.models import BufferKind, Plan
from mscclang.plan.segments import CountedCall, count_cases, counted_call, prove_capacity, row_alignment, segment_span
from mscclang.sim.budget import Deadline, check_runs, counted_cost
from mscclang.sim.diagnosis import Findings
from mscclang.sim.engine import Simulation, check_run_arguments
from mscclang.sim.program import sim_program
from mscclang.sim.report import Deadlock, Problem, Report
from mscclang.sim.runner import VerifyOptions, check_arguments, default_launches
from mscclang.sim.schedules import SCHEDULES

#: the row widths (bytes) a verify runs: one packet word's multiple and a wider odd one
ROW_WIDTHS = (8, 24)
#: what an output byte holds before the launch (the poison): the rows past the received ones keep it
POISON = 0xFF


def check_row_bytes(plan: Plan, row_bytes: int) -> None:
    """``row_bytes`` is a positive multiple of :func:`~mscclang.plan.segments.row_alignment`
    (VerificationError naming the multiple otherwise)."""
    a = row_alignment(plan)
    if isinstance(row_bytes, bool) or not isinstance(row_bytes, int) or row_bytes < 1 or row_bytes % a:
        raise VerificationError(f"plan {plan.name!r}: a row must be a positive multiple of {a} bytes"
                                f"{' (it moves LL packets)' if a == 8 else ''}, got {row_bytes!r}")


def counted_inputs(call: CountedCall, seed: int) -> list[np.ndarray]:
    """Random bytes for every rank's input (``in_rows[r] * row_bytes`` each)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=rows * call.row_bytes, dtype=np.uint8) for rows in call.in_rows]


def run_counted(plan: Plan, inputs: Sequence[np.ndarray], counts: Sequence[Sequence[int]], row_bytes: int, *,
                out_rows: Optional[Sequence[int]] = None, capacity: Optional[int] = None,
                packet_type: str = "LL16", launches: int = 1, schedule: str = "round_robin",
                seed: int = 0) -> list[np.ndarray]:
    """Run a plan with segments on every rank at once and return each rank's output bytes (of
    the last launch). ``inputs``: one byte array per rank, whole rows of ``row_bytes``; ``counts``
    the ``n x n`` count matrix; ``out_rows`` each rank's output rows (default: what it
    receives); ``capacity`` the rows of a scratch slot (default: the largest count). Output bytes
    past the rows received are left as they were (zero here). :class:`~mscclang.errors.CountsError`
    for counts the plan cannot run; VerificationError (a Deadlock) for a plan that deadlocks."""
    check_run_arguments(schedule, seed, launches, packet_type)
    check_row_bytes(plan, row_bytes)
    n = len(plan.gpus)
    if len(inputs) != n:
        raise VerificationError(f"plan {plan.name!r} has {n} ranks but {len(inputs)} inputs were given")
    arrs = [np.ascontiguousarray(x).view(np.uint8).reshape(-1) for x in inputs]
    for r, a in enumerate(arrs):
        if a.nbytes % row_bytes:
            raise VerificationError(f"input of rank {r} is {a.nbytes} bytes, not whole rows of {row_bytes}")
    call = counted_call(plan, counts, row_bytes, [a.nbytes // row_bytes for a in arrs], out_rows, capacity)
    sim = Simulation(sim_program(plan, arrs[0].nbytes, 0, counted=call), arrs, dtype=np.dtype(np.uint8),
                     packet_type=packet_type, launches=launches, schedule=schedule, seed=seed, check_races=False)
    sim.run()
    return [o.copy() for o in sim.outputs[-1]]


def check_counted(plan: Plan, call: CountedCall, inputs: list[np.ndarray], outputs: list[np.ndarray],
                  launch: int) -> list[Problem]:
    """The postcondition of a counted collective for one launch: every output segment holds the
    rows of its source segment, and the output past the received rows still holds the poison."""
    row = TABLE[plan.collective]
    probs: list[Problem] = []
    rb = call.row_bytes
    for r, out in enumerate(outputs):
        segs = plan.gpus[r].segmented(BufferKind.output)
        assert segs is not None   # check_segments: a counted collective segments every output
        end = 0
        for k in range(len(segs.counts)):
            dst = segment_span(plan, call, r, BufferKind.output, k)
            q, j = row.segment_source(r, k)
            src = segment_span(plan, call, q, BufferKind.input, j)
            got = out[dst.start * rb: (dst.start + dst.rows) * rb]
            want = inputs[q][src.start * rb: (src.start + src.rows) * rb]
            end = max(end, (dst.start + dst.rows) * rb)
            if not np.array_equal(got, want):
                bad = int(np.argmax(got != want)) if got.shape == want.shape else 0
                probs.append(Problem("postcondition", f"rank {r} output segment {k} (rows {dst.start}..{dst.start + dst.rows - 1}) "
                                     f"differs from rank {q}'s input segment {j} at byte {bad} of the segment "
                                     f"(launch {launch})", details={"ranks": (r,), "chunks": (k,)}))
        tail = out[end:]
        if tail.size and not np.all(tail == POISON):
            at = end + int(np.argmax(tail != POISON))
            probs.append(Problem("postcondition", f"rank {r} output byte {at} lies past the {end // rb} rows received "
                                 f"but was written (launch {launch}): a write past the counts",
                                 details={"ranks": (r,), "chunks": ()}))
    return probs


def verify_counted(plan: Plan, options: VerifyOptions) -> Report:
    """Verify a plan with segments (see the module docstring): for each count matrix of
    :func:`~mscclang.plan.segments.count_cases` and each row width of :data:`ROW_WIDTHS`,
    ``options.schedules`` runs (schedules and packet types in rotation), each checking races,
    deadlocks and, for a counted collective, the segment postcondition of every launch; then the
    capacity proof. Options that name message sizes or dtypes do not apply (a counted plan's
    sizes are its counts) and are refused."""
    t0 = time.perf_counter()
    if options.sizes is not None or options.dtypes is not None or options.reduce_ops is not None:
        raise VerificationError(f"plan {plan.name!r} moves segments whose sizes are its counts: verify runs it over "
                                "its count matrices, not given message sizes, dtypes or reduce ops")
    launches = default_launches(plan) if options.launches is None else options.launches
    check_arguments(None, options.schedules, options.seed, launches, list(options.packet_types), options.max_problems)
    rep = Report(plan.name, launches=launches)
    row = TABLE.get(plan.collective)
    rep.postcondition = bool(row is not None and row.counted)
    found = Findings(plan, rep)
    proof = prove_capacity(plan)
    for line in proof.problems:
        found.add([Problem("plan", f"capacity: {line}")], "capacity proof")
    rep.notes.append(f"capacity proof: {proof.checked} segment references stay in their buffers for every "
                     f"valid count matrix" if not proof.problems else "capacity proof failed")
    deadline = Deadline(options.limits, f"verifying {plan.name}")
    n = len(plan.gpus)
    pts = list(options.packet_types) or ["LL16"]
    widths = [w for w in ROW_WIDTHS if w % row_alignment(plan) == 0]
    cases = count_cases(n, seed=options.seed)
    calls = {}
    for case in cases:
        for w in widths:
            try:   # a spare row past each rank's rows: a write past the counts lands in the checked tail
                least = counted_call(plan, case.counts, w)
                calls[(case.name, w)] = counted_call(plan, case.counts, w, [v + 1 for v in least.in_rows],
                                                     [v + 1 for v in least.out_rows], least.capacity)
            except MscclangError as e:
                found.add([Problem("plan", f"{case.name}: {e}")], case.name)
    check_runs(plan, [], options.schedules, launches, itemsizes=(1,), what=f"verifying {plan.name}",
               limits=options.limits, costs=[counted_cost(plan, c) for c in calls.values()])
    planned = len(cases) * len(widths) * options.schedules
    rep.row_widths = list(widths)
    rep.schedules = [SCHEDULES[i % len(SCHEDULES)] for i in range(options.schedules)]
    moved = False
    for case in cases:
        for w in widths:
            call = calls.get((case.name, w))
            if call is None:
                continue
            try:
                prog = sim_program(plan, call.in_rows[0] * w, 0, counted=call)
            except MscclangError as e:
                found.add([Problem("plan", f"{case.name}: {e}")], case.name)
                continue
            moved = moved or any(v for row_ in case.counts for v in row_)
            for i in range(options.schedules):
                if options.max_problems is not None and len(rep.problems) >= options.max_problems:
                    break
                sched = SCHEDULES[i % len(SCHEDULES)]
                pt = pts[i % len(pts)]
                ctx = f"counts {case.name!r}, rows of {w} bytes, {pt}, {sched} schedule seed {options.seed + i}"
                inputs = counted_inputs(call, options.seed * 1000 + i)
                sim = Simulation(prog, inputs, dtype=np.dtype(np.uint8), packet_type=pt, launches=launches,
                                 schedule=sched, seed=options.seed + i, poison_outputs=True, deadline=deadline)
                rep.runs += 1
                rep.ran("uint8", None, pt if row_alignment(plan) == 8 else None)
                try:
                    sim.run()
                except Deadlock as e:
                    found.add(sim.problems + [e.problem], ctx)
                    continue
                except PlanError as e:
                    found.add([Problem("plan", str(e))], ctx)
                    continue
                found.add(sim.problems, ctx)
                if rep.postcondition:
                    for k, outs in enumerate(sim.outputs):
                        found.add(check_counted(plan, call, inputs, outs, k + 1), ctx)
                if options.progress is not None:
                    options.progress(rep.runs, planned)
    rep.vacuous = not moved
    rep.notes.append(f"count matrices: {', '.join(c.name for c in cases)}")
    rep.problems = rep.ranked()
    rep.seconds = time.perf_counter() - t0
    return rep
