"""Running and verifying fused (plan/2, ``allreduce_add_rms_norm``) plans in the simulator.

A case is a row count and a hidden size (the message is ``rows * hidden`` elements of the
activation dtype); each run checks races (with the row-wise mapping of ``rmsnorm``), the
postcondition (:func:`mscclang.sim.postcondition.check_fused`) and, in one symbolic run per
case, that no norm reads a row before every rank's contribution reached it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from mscclang.errors import MscclangError, VerificationError
from mscclang.plan.collectives import spec_from_plan
from mscclang.plan.models import OpName, Plan
from mscclang.sim.dtypes import dtype_name, parse_dtype
from mscclang.sim.consistency import check_numeric_consistency, check_symbolic_consistency, consistency_level
from mscclang.sim.engine import Simulation
from mscclang.sim.epilogue import EpilogueParams
from mscclang.sim.postcondition import check_fused
from mscclang.sim.program import sim_program
from mscclang.sim.report import Deadlock, Problem, Report
from mscclang.sim.schedules import SCHEDULES

__all__ = ["FusedRun", "plan_quantises", "run_fused", "verify_fused", "DEFAULT_CASES"]

#: (rows per rank, hidden) cases :func:`verify_fused` runs by default (rows = ranks x the first,
#: so that a two-shot plan's rows split evenly)
DEFAULT_CASES = ((1, 16), (3, 32), (2, 64))


@dataclass
class FusedRun:
    """What one run left: per rank, the outputs and residuals of the last launch (activation
    dtype; the outputs FP8 when the plan quantises), and the problems found (with ``symbolic``,
    the rank-consistency findings of its expressions among them)."""

    outputs: list[np.ndarray]
    residuals: list[np.ndarray]
    problems: list[Problem] = field(default_factory=list)


def plan_quantises(plan: Plan) -> bool:
    """Whether the plan's norms write FP8 (``quant``)."""
    return any(op.name == OpName.rmsnorm and op.quant for _, op in plan.epilogue_ops())


def run_fused(plan: Plan, inputs: Sequence[np.ndarray], residuals: Sequence[np.ndarray],
              params: EpilogueParams, *, schedule: str = "round_robin", seed: int = 0,
              launches: int = 1, check_races: bool = False, symbolic: bool = False,
              packet_type: str = "LL16") -> FusedRun:
    """Run a fused plan: ``inputs`` and ``residuals`` are flat arrays of the activation dtype,
    one per rank, ``rows * params.hidden`` elements each."""
    n = len(plan.gpus)
    if len(inputs) != n or len(residuals) != n:
        raise VerificationError(f"plan {plan.name!r} has {n} ranks: give {n} inputs and {n} residuals")
    act = inputs[0].dtype
    quant = plan_quantises(plan)
    ib = inputs[0].nbytes
    ob = ib // act.itemsize * np.dtype(params.fp8).itemsize if quant else ib
    prog = sim_program(plan, ib, ob, params.hidden * act.itemsize)
    nsym = n * max(plan.gpus[0].input_chunks, 1) if symbolic else 0
    sim = Simulation(prog, [np.ascontiguousarray(x).view(np.uint8) for x in inputs], dtype=act,
                     reduce_op="sum", packet_type=packet_type, launches=launches, schedule=schedule, seed=seed,
                     check_races=check_races, nsym=nsym, poison_outputs=True,
                     residuals=[np.ascontiguousarray(x).view(np.uint8) for x in residuals], epilogue=params)
    try:
        sim.run()
    except Deadlock as e:
        return FusedRun([], [], sim.problems + [e.problem])
    odt = params.out_dtype(act, quant)
    probs = list(sim.problems)
    if symbolic and sim.sym_ok:
        for k in range(len(sim.out_exprs)):
            probs += check_symbolic_consistency(sim.spec, prog.layouts, sim.out_exprs[k], sim.exprs, sim.sym_granule,
                                                k + 1, consistency_level(plan), sim.res_exprs[k])
    return FusedRun([o.view(odt).copy() for o in sim.outputs[-1]],
                    [x.view(act).copy() for x in sim.residual_outputs[-1]], probs)


def prove_fused_consistent(plan: Plan) -> list[Problem]:
    """:func:`mscclang.sim.verify.prove_consistent` of a fused plan: one symbolic run of one row
    per rank of 16 elements."""
    n = len(plan.gpus)
    xs, res, _ = _inputs(n, n * 16, np.dtype(np.float32), 0)
    params = EpilogueParams(16, np.ones(16, dtype=np.float32), 1e-6, scale=1.0 if plan_quantises(plan) else None)
    run = run_fused(plan, xs, res, params, symbolic=True)
    return [p for p in run.problems if p.kind == "inconsistent"]


def _inputs(n: int, count: int, dt: np.dtype, seed: int) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    xs = [rng.uniform(-1, 1, count).astype(np.float32).astype(dt) for _ in range(n)]
    res = [rng.uniform(-1, 1, count).astype(np.float32).astype(dt)] * n
    return xs, res, rng


def verify_fused(plan: Plan, *, cases: Optional[Sequence[tuple[int, int]]] = None,
                 dtypes: Sequence[str] = ("bfloat16", "float16"), schedules: int = 4, seed: int = 0,
                 launches: int = 2, symbolic: bool = True, eps: float = 1e-6,
                 scale: float = 0.05) -> Report:
    """Verify a fused plan over ``cases`` (rows, hidden; default :data:`DEFAULT_CASES` with the
    rows times the rank count): ``schedules`` runs per case (the
    schedules and dtypes in rotation) with races checked and the postcondition of every launch,
    plus one symbolic round-robin run per case for early norm reads. Returns a :class:`Report`
    whose problems are grouped by kind and message."""
    t0 = time.perf_counter()
    n = len(plan.gpus)
    if cases is None:
        cases = [(k * n, h) for k, h in DEFAULT_CASES]
    rep = Report(plan.name, launches=launches)
    rep.postcondition = True
    dts = [parse_dtype(d) for d in dtypes]
    rep.dtypes = [dtype_name(d) for d in dts]
    rep.sizes = [r * h * dts[0].itemsize for r, h in cases]
    scheds = [SCHEDULES[i % len(SCHEDULES)] for i in range(max(schedules, 1))]
    rep.schedules = scheds
    rep.reduce_ops = ["sum"]
    rep.packet_types = ["LL16", "LL8"]
    quant = plan_quantises(plan)
    seen: dict[tuple, Problem] = {}

    def add(probs: list[Problem], ctx: str) -> None:
        for pr in probs:
            key = (pr.kind, pr.message)
            if key in seen:
                seen[key].seen(ctx)
                continue
            pr.context = ctx
            pr.add_case(ctx)
            seen[key] = pr
            rep.problems.append(pr)

    for ci, (rows, hidden) in enumerate(cases):
        for i, sched in enumerate(scheds + (["symbolic"] if symbolic else [])):
            dt = dts[i % len(dts)]
            pt = rep.packet_types[i % 2]
            xs, res, rng = _inputs(n, rows * hidden, dt, seed * 1000 + ci * 97 + i)
            params = EpilogueParams(hidden, rng.uniform(0.5, 1.5, hidden).astype(np.float32), eps,
                                    scale=scale if quant else None)
            sym = sched == "symbolic"
            ctx = f"{rows} rows x {hidden}, {dtype_name(dt)}, {pt}, " + (
                "symbolic run" if sym else f"{sched} schedule seed {seed + i}")
            rep.runs += 1
            try:
                run = run_fused(plan, xs, res, params, schedule="round_robin" if sym else sched, seed=seed + i,
                                launches=1 if sym else launches, check_races=not sym, symbolic=sym,
                                packet_type=pt)
            except MscclangError as e:
                add([Problem("plan", f"{rows} rows x {hidden}: {e}")], ctx)
                continue
            add(run.problems, ctx)
            if run.outputs and not sym:
                add(check_fused(xs, res, run.residuals, run.outputs, params, quant, launches), ctx)
                if consistency_level(plan) is not None:
                    add(check_numeric_consistency(spec_from_plan(plan), [], run.outputs, launches,
                                                  consistency_level(plan), run.residuals), ctx)
    rep.problems = rep.ranked()
    rep.seconds = time.perf_counter() - t0
    return rep
