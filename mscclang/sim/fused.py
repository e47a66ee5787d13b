"""Running and verifying fused (plan/2, ``allreduce_add_rms_norm``) plans in the simulator.

A case is a row count and a hidden size (the message is ``rows * hidden`` elements of the
activation dtype). :func:`verify_fused` takes the options of :func:`mscclang.sim.verify` (which
hands fused plans to it) and is as thorough: per case, every activation dtype crossed with every
packet type, the schedules in turn, several eps values, FP8 scales and both FP8 output types for
a quantising plan, weights of fp32 and of the activation dtype, and different residuals per rank
where the plan's contract allows them (``replicated_residual`` not set); each run checks races
(with the row-wise mapping of ``rmsnorm``), the postcondition of every launch
(:func:`mscclang.sim.postcondition.check_fused`) and, with one residual for all ranks, that every
rank holds the same bits; one symbolic run per case checks early norm reads and the reduction
trees. Everything is estimated and bounded by the budget of :mod:`mscclang.sim.budget` before it
runs, and every execution parameter is checked first (PlanError naming it).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import numpy as np

from mscclang.errors import MscclangError, PlanError, VerificationError
from mscclang.plan.collectives import spec_from_plan
from mscclang.plan.dtypes import EPILOGUE_DTYPES
from mscclang.plan.models import OpName, Plan
from mscclang.sim.budget import COMPILE_TERMS, SECONDS_PER, Deadline, Estimate, Limits, estimate_runs
from mscclang.sim.consistency import (ChunkFindings, check_numeric_consistency, check_symbolic_consistency,
                                      consistency_level, drop_numeric_duplicates)
from mscclang.sim.diagnosis import Findings, annotate_sources
from mscclang.sim.invariance import (KIND as INVARIANCE_KIND, InvarianceCheck, InvarianceProof,
                                     check_symbolic_invariance)
from mscclang.sim.dtypes import dtype_name, parse_dtype
from mscclang.sim.engine import Simulation, check_count
from mscclang.sim.epilogue import MAX_HIDDEN, MIN_HIDDEN, PARTIAL, EpilogueParams, check_hidden
from mscclang.sim.postcondition import check_fused
from mscclang.sim.program import sim_program
from mscclang.sim.report import Deadlock, Problem, Report
from mscclang.sim.runner import (VerifyOptions, check_arguments, check_message_range, check_run_arguments,
                                 default_launches, nothing_to_verify)
from mscclang.sim.schedules import SCHEDULES

__all__ = ["Case", "FusedRun", "plan_quantises", "run_fused", "verify_fused", "estimate_fused", "default_cases",
           "ACT_DTYPES", "prove_fused_invariant"]

#: where a PlanError of a run names its op ("rank 0 tb 0 op 5")
_OP_AT = re.compile(r"rank \d+ tb \d+ op [\d.]+")
#: the activation dtypes of the fused collective
ACT_DTYPES = EPILOGUE_DTYPES
#: what the runs take in turn: eps values, FP8 scales and FP8 output types
EPS_VALUES = (1e-6, 1e-5, 0.25)
SCALES = (0.05, 1.0, 3.0)
FP8_TYPES = ("float8_e4m3", "float8_e5m2")


@dataclass
class FusedRun:
    """What one run left: per rank, the outputs and residuals of the last launch (activation
    dtype; the outputs FP8 when the plan quantises), and the problems found (with ``symbolic``,
    the rank-consistency findings of its expressions among them)."""

    outputs: list[np.ndarray]
    residuals: list[np.ndarray]
    problems: list[Problem] = field(default_factory=list)
    #: a symbolic run whose data moves were followed to the end
    symbolic_ok: bool = False


def plan_quantises(plan: Plan) -> bool:
    """Whether the plan's norms write FP8 (``quant``)."""
    return any(op.name == OpName.rmsnorm and op.quant for _, op in plan.epilogue_ops())


def _check_call(plan: Plan, inputs: Sequence[np.ndarray], residuals: Sequence[np.ndarray],
                params: EpilogueParams) -> tuple[int, np.dtype]:
    """(rows, activation dtype) of a fused run, after checking every argument (PlanError naming
    it): one input and one residual per rank, one activation dtype, one length of whole rows,
    and parameters the plan takes (its FP8 scale exactly when it quantises)."""
    n = len(plan.gpus)
    if not isinstance(params, EpilogueParams):
        raise PlanError(f"the epilogue's parameters must be an EpilogueParams, got {type(params).__name__}")
    if len(inputs) != n or len(residuals) != n:
        raise PlanError(f"plan {plan.name!r} has {n} ranks: give {n} inputs and {n} residuals, got "
                        f"{len(inputs)} and {len(residuals)}")
    arrays = ([("input", r, np.asarray(x)) for r, x in enumerate(inputs)]
              + [("residual", r, np.asarray(x)) for r, x in enumerate(residuals)])
    act, count = arrays[0][2].dtype, arrays[0][2].size
    params.check_activation(act)
    for what, r, a in arrays:
        if a.ndim != 1 or a.dtype != act or a.size != count:
            raise PlanError(f"rank {r}'s {what} is {a.dtype} of shape {a.shape}; every input and residual must "
                            f"be one flat array of {count} {act} elements (rank 0's input)")
    if count == 0 or count % params.hidden:
        raise PlanError(f"the inputs hold {count} elements, not whole rows of the hidden size {params.hidden}")
    quant = plan_quantises(plan)
    if quant != (params.scale is not None):
        raise PlanError(f"plan {plan.name!r} {'quantises' if quant else 'does not quantise'} its norm: "
                        + ("pass the fp8 scale" if quant else "pass no fp8 scale"))
    return count // params.hidden, act


def _sizes(plan: Plan, rows: int, params: EpilogueParams, act: np.dtype) -> tuple[int, int, int]:
    """(input bytes, output bytes, input row bytes) of a run."""
    ib = rows * params.hidden * act.itemsize
    ob = rows * params.hidden * np.dtype(params.fp8).itemsize if plan_quantises(plan) else ib
    return ib, ob, params.hidden * act.itemsize


def run_fused(plan: Plan, inputs: Sequence[np.ndarray], residuals: Sequence[np.ndarray],
              params: EpilogueParams, *, schedule: str = "round_robin", seed: int = 0,
              launches: int = 1, check_races: bool = False, symbolic: bool = False,
              packet_type: str = "LL16", deadline: Optional[Deadline] = None,
              limits: Optional[Limits] = None, invariance: Optional[ChunkFindings] = None) -> FusedRun:
    """Run a fused plan: ``inputs`` and ``residuals`` are flat arrays of the activation dtype,
    one per rank, ``rows * params.hidden`` elements each, a message in the plan's message size
    range. Every argument is checked first (PlanError or VerificationError naming it); without a ``deadline`` the run is estimated and refused
    (LimitError) when it exceeds ``limits``, else bounded by their time. A ``symbolic`` run gathers
    its batch-invariance findings (:mod:`mscclang.sim.invariance`) into ``invariance`` when given."""
    n = len(plan.gpus)
    check_run_arguments(schedule, seed, launches, packet_type)
    rows, act = _check_call(plan, inputs, residuals, params)
    ib, ob, row = _sizes(plan, rows, params, act)
    check_message_range(plan, ib, f"a message of {rows} rows x {params.hidden} {dtype_name(act)}")
    if deadline is None:
        estimate_runs(plan, [(ib, ib, ob, row)], 1, launches, itemsizes=[act.itemsize],
                      symbolic_size=(ib, ib, ob, row) if symbolic else None,
                      what=f"running {plan.name} on {rows} rows of {params.hidden}").check(limits)
        deadline = Deadline(limits, f"running {plan.name}")
    prog = sim_program(plan, ib, ob, row)
    nsym = n * max(plan.gpus[0].input_chunks, 1) if symbolic else 0
    sim = Simulation(prog, [np.ascontiguousarray(x).view(np.uint8) for x in inputs], dtype=act,
                     reduce_op="sum", packet_type=packet_type, launches=launches, schedule=schedule, seed=seed,
                     check_races=check_races, nsym=nsym, poison_outputs=True, deadline=deadline,
                     residuals=[np.ascontiguousarray(x).view(np.uint8) for x in residuals], epilogue=params)
    try:
        sim.run()
    except Deadlock as e:
        return FusedRun([], [], sim.problems + [e.problem])
    odt = params.out_dtype(act, plan_quantises(plan))
    probs = list(sim.problems)
    if symbolic and sim.sym_ok:
        for k in range(len(sim.out_exprs)):
            probs += check_symbolic_consistency(sim.spec, prog.layouts, sim.out_exprs[k], sim.exprs, sim.sym_granule,
                                                k + 1, consistency_level(plan), sim.res_exprs[k])
            if invariance is not None:
                check_symbolic_invariance(sim.spec, prog.layouts, sim.out_exprs[k], sim.exprs, sim.sym_granule,
                                          f"{rows} rows x {params.hidden}, launch {k + 1}", invariance.level,
                                          ("flat",), sim.res_exprs[k], plan_quantises(plan), found=invariance)
    return FusedRun([o.view(odt).copy() for o in sim.outputs[-1]],
                    [x.view(act).copy() for x in sim.residual_outputs[-1]], probs, symbolic and sim.sym_ok)


def prove_fused_consistent(plan: Plan) -> list[Problem]:
    """:func:`mscclang.sim.verify.prove_consistent` of a fused plan: one symbolic run of one row
    per rank of 16 elements."""
    n = len(plan.gpus)
    rng = np.random.default_rng(0)
    xs = [rng.uniform(-1, 1, n * 16).astype(np.float32) for _ in range(n)]
    res = rng.uniform(-1, 1, n * 16).astype(np.float32)
    params = EpilogueParams(16, np.ones(16, dtype=np.float32), 1e-6, scale=1.0 if plan_quantises(plan) else None)
    run = run_fused(plan, xs, [res] * n, params, symbolic=True)
    return [p for p in run.problems if p.kind == "inconsistent"]


def prove_fused_invariant(plan: Plan) -> InvarianceProof:
    """:func:`mscclang.sim.verify.prove_batch_invariant` of a fused plan: one symbolic run of each
    of its :func:`default_cases` (row counts 1 to 5 ranks, row lengths 8 to 40) in its first
    dtype; the activations are never fp8, so the ``flat`` form."""
    proof = InvarianceProof([], [], [])
    found = ChunkFindings("", "error", INVARIANCE_KIND)
    for c in default_cases(plan):
        run = _Run(c.rows, c.hidden, c.dtypes[0], "LL16", "round_robin", 0, EPS_VALUES[0],
                   SCALES[0] if plan_quantises(plan) else None, FP8_TYPES[0], True, False, True)
        xs, res, params = _data(plan, run)
        got = run_fused(plan, xs, res, params, symbolic=True, invariance=found)
        proof.ran(c.rows * c.hidden * c.dtypes[0].itemsize, got.symbolic_ok)
    proof.problems = found.problems()
    for pr in proof.problems:
        annotate_sources(pr, plan)
    return proof


@dataclass(frozen=True)
class Case:
    """One case of a fused verify: ``rows`` rows of ``hidden`` elements, run in each of ``dtypes``
    (those whose message, ``rows * hidden`` elements, lies in the plan's message size range)."""

    rows: int
    hidden: int
    dtypes: tuple[np.dtype, ...]


def _grouped(found: Sequence[tuple[int, int, np.dtype]]) -> list[Case]:
    """(rows, hidden, dtype) triples as cases, one per (rows, hidden) in first-seen order."""
    by: dict[tuple[int, int], list[np.dtype]] = {}
    for rows, h, d in found:
        by.setdefault((rows, h), []).append(d)
    return [Case(rows, h, tuple(dict.fromkeys(ds))) for (rows, h), ds in by.items()]


def default_cases(plan: Plan, dts: Sequence[np.dtype] = ()) -> list[Case]:
    """The cases a default verify runs, per activation dtype of ``dts`` (default: all): one row
    of 8; ranks + 1 rows of 24 (odd row counts; rows of 48 or 96 bytes, which no power-of-two
    alignment divides, so chunks cut at alignment units fall inside rows); 2 ranks + 1 rows of
    40; 5 ranks rows of 24 (10 x 24 on two ranks). The rows grow to the plan's smallest message
    in the narrowest dtype, and every dtype whose message then lies in the plan's range runs
    them; a dtype past the largest runs the rows grown for it alone, or is left out: every run's
    message lies in the plan's range. Empty when the range holds none."""
    n, dts = len(plan.gpus), list(dts) or [parse_dtype(x) for x in ACT_DTYPES]
    found = []
    for rows0, h in ((1, 8), (n + 1, 24), (2 * n + 1, 40), (5 * n, 24)):
        for d in dts:
            for k in (min(x.itemsize for x in dts), d.itemsize):   # the rows every dtype shares, else its own
                rows = max(rows0, -(-plan.min_message_size // (h * k)))
                if rows * h * d.itemsize <= plan.max_message_size:
                    found.append((rows, h, d))
                    break
    return _grouped(found)


def _cases_of_sizes(plan: Plan, sizes: Sequence[int], dts: Sequence[np.dtype]) -> tuple[list[Case], list[str]]:
    """(cases, notes) of message sizes (bytes of x, the same bytes in every dtype): per size and
    dtype, the largest and the smallest hidden size (a multiple of 8 up to 65536) whose rows the
    size's elements fill; a dtype whose elements no such rows fill is left out for that size (a
    note says so), a size no dtype takes or outside the plan's range is refused."""
    found, notes = [], []
    for s in sizes:
        check_message_range(plan, s, f"message size {s}")
        before = len(found)
        for dt in dts:
            elems, rem = divmod(s, dt.itemsize)
            hs = [h for h in range(MIN_HIDDEN, min(elems, MAX_HIDDEN) + 1, PARTIAL) if elems % h == 0] if not rem else []
            found += [(elems // h, h, dt) for h in dict.fromkeys(hs[:1] + hs[-1:])]
            notes += [] if hs else [f"size {s} is not whole rows of {dtype_name(dt)}: not run in it"]
        if len(found) == before:
            raise VerificationError(f"message size {s} bytes is not whole rows of {', '.join(map(dtype_name, dts))}: "
                                    f"a fused message is rows x hidden elements, hidden a multiple of {PARTIAL} "
                                    f"from {MIN_HIDDEN} to {MAX_HIDDEN}")
    return _grouped(found), notes


@dataclass(frozen=True)
class _Run:
    """One run of a fused verify: its case, dtype, packet type, schedule and parameters."""

    rows: int
    hidden: int
    dtype: np.dtype
    packet: str
    schedule: str
    seed: int
    eps: float
    scale: Optional[float]
    fp8: str
    weight_fp32: bool
    own_residuals: bool
    symbolic: bool = False

    def context(self) -> str:
        parts = [f"{self.rows} rows x {self.hidden}", dtype_name(self.dtype), self.packet, f"eps {self.eps:g}"]
        if self.scale is not None:
            parts.append(f"{self.fp8} scale {self.scale:g}")
        parts.append("weight float32" if self.weight_fp32 else "weight of the activation dtype")
        parts.append("per-rank residuals" if self.own_residuals else "one residual")
        return ", ".join(parts + ["symbolic run" if self.symbolic else f"{self.schedule} schedule seed {self.seed}"])


def _plan_runs(plan: Plan, cases: Sequence[Case], pts: Sequence[str], schedules: int, seed: int,
               symbolic: bool) -> list[_Run]:
    """Per case ``max(schedules, its dtypes x packet types)`` runs, the (dtype, packet type) pairs
    crossed and the schedules, eps values, scales, FP8 types, weight dtypes and residual modes in
    turn; then one symbolic run per case."""
    quant = plan_quantises(plan)
    own_ok = not plan.replicated_residual
    runs = []
    for ci, c in enumerate(cases):
        pairs = [(d, p) for d in c.dtypes for p in pts]
        for i in range(max(schedules, len(pairs))):
            d, p = pairs[i % len(pairs)]
            runs.append(_Run(c.rows, c.hidden, d, p, SCHEDULES[i % len(SCHEDULES)], seed + ci * 97 + i,
                             EPS_VALUES[i % len(EPS_VALUES)], SCALES[i % len(SCALES)] if quant else None,
                             FP8_TYPES[i % len(FP8_TYPES)], i % 2 == 0, own_ok and i % 2 == 1))
        if symbolic:
            runs.append(_Run(c.rows, c.hidden, c.dtypes[0], pts[0], "round_robin", seed + ci * 97, EPS_VALUES[0],
                             SCALES[0] if quant else None, FP8_TYPES[0], True, False, True))
    return runs


def _data(plan: Plan, run: _Run) -> tuple[list[np.ndarray], list[np.ndarray], EpilogueParams]:
    n = len(plan.gpus)
    rng = np.random.default_rng(run.seed)
    count = run.rows * run.hidden
    xs = [rng.uniform(-1, 1, count).astype(np.float32).astype(run.dtype) for _ in range(n)]
    res = [rng.uniform(-1, 1, count).astype(np.float32).astype(run.dtype) for _ in range(n if run.own_residuals else 1)]
    w = rng.uniform(0.5, 1.5, run.hidden).astype(np.float32)
    params = EpilogueParams(run.hidden, w if run.weight_fp32 else w.astype(run.dtype), run.eps, scale=run.scale,
                            fp8=run.fp8)
    return xs, res if run.own_residuals else res * n, params


@dataclass
class _Resolved:
    """:func:`verify_fused`'s arguments resolved: its cases, packet types and notes."""

    cases: list[Case]
    pts: list[str]
    notes: list[str]


def _resolve(plan: Plan, o: VerifyOptions, launches: int, cases: Optional[Sequence[tuple[int, int]]]) -> _Resolved:
    """:func:`verify_fused`'s arguments checked (VerificationError, PlanError for the hidden
    rule, naming what is wrong) before anything is allocated, and resolved; arguments that leave
    no case to run are refused (:func:`~mscclang.sim.runner.nothing_to_verify`)."""
    sizes = None if o.sizes is None else list(o.sizes)
    check_arguments(sizes, o.schedules, o.seed, launches, list(o.packet_types), o.max_problems)
    o.check_senders(spec_from_plan(plan))
    if o.reduce_ops is not None and list(o.reduce_ops) != ["sum"]:
        raise VerificationError(f"the fused collective sums: reduce ops {list(o.reduce_ops)} do not apply")
    dts = [parse_dtype(d) for d in (o.dtypes or ACT_DTYPES)]
    bad = [dtype_name(d) for d in dts if dtype_name(d) not in ACT_DTYPES]
    if bad:
        raise VerificationError(f"{', '.join(bad)}: the fused collective's activations are {', '.join(ACT_DTYPES)}")
    pts = list(o.packet_types) or ["LL16"]
    notes: list[str] = []
    if cases is not None:
        found = []
        for case in cases:
            if not isinstance(case, (tuple, list)) or len(case) != 2:
                raise VerificationError(f"a case must be a pair (rows, hidden), got {case!r}")
            rows, h = case
            check_hidden(h)
            check_count("a case's row count", rows, 1)
            for d in dts:
                check_message_range(plan, rows * h * d.itemsize, f"{rows} rows x {h} of {dtype_name(d)}")
                found.append((rows, h, d))
        got = _grouped(found)
    else:
        got, notes = _cases_of_sizes(plan, sizes, dts) if sizes else (default_cases(plan, dts), [])
    if not got:
        raise nothing_to_verify(plan, f"no {'given' if cases is not None else 'default'} case lies")
    return _Resolved(got, pts, notes)


def estimate_fused(plan: Plan, options: Optional[VerifyOptions] = None, *,
                   cases: Optional[Sequence[tuple[int, int]]] = None, **keywords: Any) -> Estimate:
    """What :func:`verify_fused` with these arguments would take (:mod:`mscclang.sim.budget`)."""
    o = replace(options or VerifyOptions(), **keywords)
    launches = default_launches(plan) if o.launches is None else o.launches
    got = _resolve(plan, o, launches, cases)
    runs = _plan_runs(plan, got.cases, got.pts, o.schedules, o.seed, o.symbolic)
    return _estimate(plan, runs, launches, f"verifying {plan.name} over {len(got.cases)} case(s) with {len(runs)} run(s)")


def _estimate(plan: Plan, runs: Sequence["_Run"], launches: int, what: str) -> Estimate:
    """The runs' estimate: each (shape, dtype) with its own count of runs, each run compiling its
    program; the symbolic runs one launch each, with no race log. Memory: the largest."""
    numeric: dict[tuple[int, int, int, int, int], int] = {}
    symbolic: list[tuple[int, int, int, int, int]] = []
    for r in runs:
        params = EpilogueParams(r.hidden, np.ones(r.hidden, np.float32), scale=r.scale, fp8=r.fp8)
        ib, ob, row = _sizes(plan, r.rows, params, r.dtype)
        key = (ib, ib, ob, row, r.dtype.itemsize)
        if r.symbolic:
            symbolic.append(key)
        else:
            numeric[key] = numeric.get(key, 0) + 1
    terms = dict.fromkeys(SECONDS_PER, 0.0)
    memory = 0
    parts = [(key, count, None) for key, count in numeric.items()] + [(key, 0, key[:4]) for key in symbolic]
    for key, count, sym in parts:
        e = estimate_runs(plan, [key[:4]], count, launches if sym is None else 1, itemsizes=[key[4]],
                          symbolic_size=sym, what=what)
        memory = max(memory, e.memory_bytes)
        for k, v in e.terms.items():
            terms[k] += v * (max(count, 1) if k in COMPILE_TERMS else 1)   # a program per run
    return Estimate(memory, sum(SECONDS_PER[k] * v for k, v in terms.items()), what, [], terms)


def verify_fused(plan: Plan, options: Optional[VerifyOptions] = None, *,
                 cases: Optional[Sequence[tuple[int, int]]] = None, **keywords: Any) -> Report:
    """Verify a fused plan (see the module docstring) with ``options``
    (:class:`~mscclang.sim.runner.VerifyOptions`, each keyword replacing that field, as
    :func:`mscclang.sim.verify` takes them) over ``cases`` (rows, hidden), else the
    cases of ``sizes`` (bytes of x, the same bytes in every dtype: per size and dtype the largest
    and smallest hidden size its elements' rows take), else :func:`default_cases` (sized per
    dtype); ``dtypes`` among :data:`ACT_DTYPES` (default: all), ``launches`` by default
    :func:`~mscclang.sim.runner.default_launches` (3 with double scratch); ``reduce_ops`` only
    ``sum`` (the fused collective sums). Every argument is checked before anything is allocated;
    a case or size outside the plan's message size range is refused (VerificationError), and so
    is a verify with no case to run (never an OK over no runs). The runs are estimated first and
    refused (LimitError) past ``limits``, then bounded by their time. Problems are grouped by cause, as
    :func:`mscclang.sim.verify` groups them. Returns a :class:`Report`."""
    t0 = time.perf_counter()
    o = replace(options or VerifyOptions(), **keywords)
    launches = default_launches(plan) if o.launches is None else o.launches
    got = _resolve(plan, o, launches, cases)
    rep = Report(plan.name, launches=launches)
    rep.postcondition = True
    rep.sizes = sorted({c.rows * c.hidden * d.itemsize for c in got.cases for d in c.dtypes})
    rep.notes.extend(got.notes)
    runs = _plan_runs(plan, got.cases, got.pts, o.schedules, o.seed, o.symbolic)
    most = max(len(c.dtypes) for c in got.cases) * len(got.pts)
    rep.schedules = [SCHEDULES[i % len(SCHEDULES)] for i in range(max(o.schedules, most))]
    quant = plan_quantises(plan)
    _estimate(plan, runs, launches,
              f"verifying {plan.name} over {len(got.cases)} case(s) with {len(runs)} run(s)").check(o.limits)
    deadline = Deadline(o.limits, f"verifying {plan.name}")
    found = Findings(plan, rep)
    level = consistency_level(plan)
    spec = spec_from_plan(plan)
    inv = InvarianceCheck(plan, None, [])
    for k, run in enumerate(runs):
        if o.max_problems is not None and len(rep.problems) >= o.max_problems:
            rep.notes.append(f"stopped after {len(rep.problems)} distinct problems (max_problems): counts cover the "
                             "runs made")
            break
        ctx = run.context()
        xs, res, params = _data(plan, run)
        if not run.symbolic:
            rep.ran(dtype_name(run.dtype), "sum", run.packet)
        rep.runs += 1
        try:
            got = run_fused(plan, xs, res, params, schedule=run.schedule, seed=run.seed,
                            launches=1 if run.symbolic else launches, check_races=not run.symbolic,
                            symbolic=run.symbolic, packet_type=run.packet, deadline=deadline,
                            invariance=inv.found if run.symbolic else None)
        except MscclangError as e:
            if not isinstance(e, PlanError):
                raise
            at = _OP_AT.match(str(e))   # the op the plan fails at: one problem per op, over the cases
            found.add([Problem("plan", f"{run.rows} rows x {run.hidden}: {e}",
                               details={"op": at.group(0)} if at else {})], ctx)
            continue
        found.add(got.problems, ctx)
        if run.symbolic:
            inv.proof.ran(run.rows * run.hidden * run.dtype.itemsize, got.symbolic_ok)
        if got.outputs and not run.symbolic:
            found.add(check_fused(xs, res, got.residuals, got.outputs, params, quant, launches), ctx)
            if level is not None and not run.own_residuals:
                found.add(check_numeric_consistency(spec, [], got.outputs, launches, level, got.residuals), ctx)
        if o.progress is not None:
            o.progress(k + 1, len(runs))
    if any(r.symbolic for r in runs):
        inv.report(rep, found)
    rep.problems = drop_numeric_duplicates(rep.ranked())
    rep.seconds = time.perf_counter() - t0
    return rep
