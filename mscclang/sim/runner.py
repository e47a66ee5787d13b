"""``mscclang.sim.run``: execute a plan on concrete inputs and return the outputs."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np

from mscclang.errors import PlanError, VerificationError
from mscclang.plan.collectives import CollectiveSpec, collective
from mscclang.plan.io import load_plan
from mscclang.plan.dtypes import ACCUM_DTYPES
from mscclang.plan.models import PACKET_TYPES, REDUCE_OP_NAMES, REDUCE_OPS, OpName, Plan
from mscclang.sim.budget import Deadline, Limits, check_runs
from mscclang.sim.dtypes import DtypeLike, dtype_name, parse_dtype
from mscclang.sim.engine import Simulation, check_choice, check_count, check_run_arguments
from mscclang.sim.program import sim_program

PlanLike = Union[Plan, str, Path, dict]


def as_plan(plan: PlanLike) -> Plan:
    """Accept a Plan, a path, a JSON string or a parsed dict."""
    return plan if isinstance(plan, Plan) else load_plan(plan)


def resolve_reduce_op(plan: Plan, override: Optional[str] = None) -> str:
    """The launch's reduce op: the caller's, else the plan's, else the ops' (which must
    agree), else sum."""
    if override is not None:
        if override not in REDUCE_OP_NAMES:
            raise VerificationError(f"unknown reduce op {override!r} (sum, min, max)")
        return override
    if plan.reduce_op is not None:
        return plan.reduce_op.value
    seen: dict[str, str] = {}
    for g in plan.gpus:
        for tb in g.threadblocks:
            for i, op in enumerate(tb.ops):
                for j, inner in enumerate(op.ops or [op]):
                    if inner.name in REDUCE_OPS and inner.reduce_op is not None:
                        where = f"gpus[{g.id}].threadblocks[{tb.id}].ops[{i}]" + (f".ops[{j}]" if op.ops else "")
                        seen.setdefault(inner.reduce_op.value, where)
    if len(seen) > 1:
        (a, wa), (b, wb) = list(seen.items())[:2]
        raise PlanError(f"reductions disagree on the reduce op: {a} at {wa}, {b} at {wb}")
    return next(iter(seen), "sum")


def default_launches(plan: Plan) -> int:
    """Consecutive launches a default verify simulates: enough for every scratch area to be
    reused by a later launch, so that what orders the reuse is checked. Two launches reuse a
    single scratch; a double scratch alternates halves, so its halves are reused from the third
    launch on."""
    return 3 if plan.use_double_scratch_buffer else 2


@dataclass(frozen=True)
class VerifyOptions:
    """What one verify runs, the one home of its options and their defaults:
    :func:`mscclang.sim.verify` takes them as keywords (or this record as ``options``) and hands
    the record whole to :func:`~mscclang.sim.fused.verify_fused` for a fused plan. ``sizes``:
    message sizes in bytes (default: the plan's default sizes); ``dtypes``, ``reduce_ops`` and
    ``packet_types`` taken in rotation over the ``schedules`` runs of each size (seeded from
    ``seed``); ``launches`` per run (default: :func:`default_launches`); ``symbolic``: the
    symbolic postcondition run; ``max_problems``: stop starting runs once that many distinct
    problems are known; ``senders``: sendrecv's sender of each rank; ``progress(done, total)``
    after every run; ``limits``: the budget (default: the environment's). Values are checked by
    the verify that takes them (:func:`check_arguments`), never here."""

    sizes: Optional[Sequence[int]] = None
    dtypes: Optional[Sequence[str]] = None
    schedules: int = 10
    seed: int = 0
    launches: Optional[int] = None
    reduce_ops: Optional[Sequence[str]] = None
    packet_types: Sequence[str] = ("LL16", "LL8")
    symbolic: bool = True
    max_problems: Optional[int] = None
    senders: Optional[Sequence[int]] = None
    progress: Optional[Callable[[int, int], None]] = None
    limits: Optional[Limits] = None

    def check_senders(self, spec: CollectiveSpec) -> None:
        """``senders`` only for a collective that has them (VerificationError otherwise)."""
        if self.senders is not None and not spec.row.has_senders:
            raise VerificationError(f"senders are only meaningful for sendrecv plans, not {spec.name}")


def check_arguments(sizes: Optional[Sequence[int]], schedules: int, seed: int, launches: int,
                    packet_types: Sequence[str] = (), max_problems: Optional[int] = None,
                    reduce_ops: Optional[Sequence[str]] = None) -> None:
    """Refuse verify arguments no run can take, before any work (VerificationError naming the
    argument): ``schedules`` and ``launches`` at least 1, ``seed`` not negative, known packet
    types and reduce ops, ``max_problems`` (when given) at least 1, and ``sizes`` (when given) a
    non-empty list of positive byte counts: arguments that leave nothing to run are refused,
    never reported OK."""
    for name, value, low in (("schedules", schedules, 1), ("launches", launches, 1), ("seed", seed, 0)):
        check_count(name, value, low)
    if max_problems is not None:
        check_count("max_problems", max_problems, 1)
    for name, values, known in (("packet type", packet_types, PACKET_TYPES), ("reduce op", reduce_ops, REDUCE_OP_NAMES)):
        for v in values or ():
            check_choice(name, v, known)
    if sizes is not None and not len(sizes):
        raise VerificationError("sizes is empty: nothing to verify")
    for s in sizes or ():
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s <= 0:
            raise VerificationError(f"message sizes must be positive integers (bytes), got {s!r}")


def check_message_range(plan: Plan, nbytes: int, what: str) -> None:
    """The one home of the rule that a run's message (``nbytes``, the plan's message size)
    lies in the plan's message size range: VerificationError naming ``what`` otherwise."""
    if not plan.min_message_size <= nbytes <= plan.max_message_size:
        raise VerificationError(f"{what} is {nbytes} bytes, outside the plan's message sizes "
                                f"[{plan.min_message_size}, {plan.max_message_size}]")


def nothing_to_verify(plan: Plan, what: str) -> VerificationError:
    """The error of a verify none of whose runs would run (never an OK over no runs)."""
    return VerificationError(f"plan {plan.name!r}: nothing to verify: {what} in the plan's message sizes "
                             f"[{plan.min_message_size}, {plan.max_message_size}]")


_PARTS = ("input", "output", "block for each peer")


def _parts(plan: Plan) -> list[tuple[str, Fraction]]:
    """What one rank's buffers are, as fractions of the message (input bytes; allgather: output
    bytes): the input first, the output second, then alltoall's block for each peer."""
    one, g, row = Fraction(1), plan.gpus[0], collective(plan.collective)
    if not row.sized and g.input_chunks:
        return list(zip(_PARTS, (one, Fraction(g.output_chunks, g.input_chunks))))
    bi, bo = row.blocks(len(plan.gpus))
    parts = (Fraction(bi, bo), one) if row.message == "output" else (one, Fraction(bo, bi))
    return list(zip(_PARTS, parts + ((Fraction(1, bi),) if bi > 1 and bo > 1 else ())))


def message_unit(plan: Plan, dtype: DtypeLike = "uint8") -> int:
    """The smallest message size (bytes) that is whole elements of ``dtype`` in every buffer and
    share of every rank (:func:`message_to_bytes`); every valid size is a multiple of it."""
    return parse_dtype(dtype).itemsize * math.lcm(*(r.denominator for _, r in _parts(plan)))


def message_to_bytes(plan: Plan, size: int, dtype: DtypeLike = "uint8") -> tuple[int, int]:
    """(input bytes, output bytes) of one rank for a message of ``size`` bytes: the plan's
    message size, input bytes (allgather: output bytes, ``ranks`` x the input). The one home of
    the rule that a message is whole elements of ``dtype`` on every rank, in each buffer and,
    where the collective splits it over the ranks (allgather's inputs, reducescatter's outputs,
    alltoall's blocks), in each rank's share: :class:`VerificationError` naming the size, the
    dtype, the collective, the rank count and the multiple to use otherwise."""
    dt = parse_dtype(dtype)
    k, parts, unit = dt.itemsize, _parts(plan), message_unit(plan, dtype)
    for what, r in parts:
        part = size * r
        if part.denominator != 1 or part.numerator % k:
            share = f" ({r} of the message)" if r != 1 else ""
            a = "an" if plan.collective[:1] in "aeiou" else "a"
            raise VerificationError(
                f"message size {size} bytes: each rank's {what}{share} of {a} {plan.collective} over {len(plan.gpus)} "
                f"ranks would be {float(part):g} bytes, not a whole number of {dtype_name(dt)} elements ({k} "
                f"byte{'s' * (k != 1)} each); use a multiple of {unit} bytes")
    return int(size * parts[0][1]), int(size * parts[1][1])


def run(plan: PlanLike, inputs: Sequence[np.ndarray], *, output_bytes: Optional[int] = None,
        reduce_op: Optional[str] = None, packet_type: str = "LL16", launches: int = 1,
        schedule: str = "round_robin", seed: int = 0,
        limits: Optional[Limits] = None, accum: Optional[str] = None) -> list[np.ndarray]:
    """Run ``plan`` on all ranks at once and return each rank's output of the last launch.

    ``inputs`` holds one 1-D array per rank, all of one supported dtype and size. For in-place
    plans the input aliases the output as the collective says (``input_in_output`` /
    ``output_in_input``). With ``launches > 1`` the same inputs are written again before every
    launch (scratch, flags and semaphores carry over, as on the GPU). The schedule is
    ``round_robin``, ``random``, ``adversarial`` or ``runahead`` (``seed`` drives the last
    three; ``runahead`` lets rank ``seed % ranks`` run ahead of the others). Raises
    :class:`mscclang.sim.Deadlock` (a :class:`VerificationError`) when the plan deadlocks, and
    :class:`~mscclang.errors.LimitError` when the run would exceed (or runs past) ``limits``
    (default: the environment's, see :mod:`mscclang.sim.budget`). ``accum``: the accumulation
    dtype of fp8 reductions (``float32``, the default, or ``float16``; docs/semantics.md). Every
    parameter is checked before anything is allocated (:func:`check_run_arguments`;
    VerificationError naming it).
    An input whose output (or alltoall share) is not whole elements on every rank, say 3
    float16 elements per rank of a 2-rank reducescatter, is refused (:func:`message_to_bytes`)."""
    p = as_plan(plan)
    n = len(p.gpus)
    check_run_arguments(schedule, seed, launches, packet_type)
    check_choice("accum (accumulation dtype)", ACCUM_DTYPES[0] if accum is None else accum, ACCUM_DTYPES)
    rop = resolve_reduce_op(p, reduce_op)
    if len(inputs) != n:
        raise VerificationError(f"plan {p.name!r} has {n} ranks but {len(inputs)} inputs were given")
    arrs = [np.ascontiguousarray(x) for x in inputs]
    dt = parse_dtype(arrs[0].dtype)
    for r, a in enumerate(arrs):
        if a.ndim != 1 or a.dtype != dt or a.nbytes != arrs[0].nbytes:
            raise VerificationError(f"input of rank {r} must be 1-D {dt} of {arrs[0].nbytes} bytes, "
                                    f"got {a.ndim}-D {a.dtype} of {a.nbytes} bytes")
    ib = arrs[0].nbytes
    ob = message_to_bytes(p, int(ib / _parts(p)[0][1]), dt)[1] if output_bytes is None else output_bytes
    if isinstance(ob, bool) or not isinstance(ob, numbers.Integral) or ob < 0 or ob % dt.itemsize:
        raise VerificationError(f"output_bytes must be a whole number of {dtype_name(dt)} elements "
                                f"({dt.itemsize} bytes each), got {ob!r}")
    check_runs(p, [(ib, ib, ob)], 1, launches, itemsizes=[dt.itemsize], postcondition=False,
               what=f"simulating {p.name} on {ib:,} input bytes with {launches} launch(es)", limits=limits)
    deadline = Deadline(limits, f"simulating {p.name}")
    prog = sim_program(p, ib, ob)
    sim = Simulation(prog, [a.view(np.uint8) for a in arrs], dtype=dt,
                     reduce_op=rop, packet_type=packet_type,
                     launches=launches, accum=accum, schedule=schedule, seed=seed, check_races=False,
                     deadline=deadline)
    sim.run()
    return [o.view(dt).copy() for o in sim.outputs[-1]]


__all__ = ["run", "VerifyOptions", "as_plan", "resolve_reduce_op", "message_to_bytes", "message_unit", "OpName"]
