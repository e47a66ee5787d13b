"""How much a compile may do and what it will make, checked before the work.

* A program's ranks (``MSCCLANG_COMPILE_MAX_RANKS``) and the ops it records times its instances
  (``MSCCLANG_COMPILE_MAX_OPS``: the compiler's time and memory grow linearly with them, about
  :data:`SECONDS_PER_OP` and :data:`BYTES_PER_OP` each). The DSL checks the ranks when a program
  is created and the ops as they are recorded, the driver again before lowering.
* The plan it will write: :func:`estimate_plan` estimates, from the recording alone, the plan's
  ops and bytes of JSON and the time to compile and write it; the driver refuses, before the
  first pass, a program whose plan would be more than plans are read with
  (``MSCCLANG_MAX_PLAN_BYTES``, ``MSCCLANG_MAX_PLAN_OPS``: ``verify``, ``show`` and ``predict``
  would refuse it).

Each refusal is a :class:`~mscclang.errors.LimitError` that gives the estimate and the setting
that raises the limit. :func:`reporting` and :func:`report` (progress) live in
:mod:`mscclang.compiler.meter`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mscclang.compiler.fuse import may_fuse
from mscclang.compiler.ir import SYNC_AFTER, SYNC_BEFORE, IROp, IRProgram
from mscclang.compiler.meter import report, reporting
from mscclang.config import Settings, settings
from mscclang.errors import LimitError
from mscclang.plan.models import REDUCE_OPS, SYNC_OPS, OpName
from mscclang.units import format_bytes

__all__ = ["check_ranks", "check_ops", "check_plan", "estimate_plan", "PlanEstimate", "reporting", "report",
           "SECONDS_PER_OP", "BYTES_PER_OP", "OP_SECONDS", "BYTE_SECONDS", "ERROR"]

#: compile time per recorded op and instance, recording and writing the plan included (measured:
#: 128-rank all-pairs allreduce, 130,000 ops)
SECONDS_PER_OP = 5e-5
#: peak memory per recorded op and instance (same measurement)
BYTES_PER_OP = 3300

#: seconds of each step of a compile per recorded op: recording (the collector paused, as
#: ``mscclang compile`` does), the passes, the cycle check; and per byte of the plan: emitting it,
#: writing it out (copied, checked and written as JSON text, as ``mscclang compile`` does).
#: Fitted to the 128-rank all-pairs allreduce.
OP_SECONDS = {"record": 7e-6, "validate": 8e-6, "fuse": 10e-6, "syncs": 0.2e-6, "hazards": 1e-6,
              "replicate": 0.1e-6, "cycles": 1.4e-6}
BYTE_SECONDS = {"emit": 0.02e-6, "write": 0.12e-6}

# bytes of JSON (as plan_to_json indents it) per element of a plan
_PLAN = 600       # the plan's own fields
_RANK = 300       # a rank's own fields
_BLOCK = 350      # a thread block's own fields and tables
_OP = 250         # an op's fields, without its operands and its src line
_REF = 130        # a buffer reference of an op
_ID = 20          # a channel, semaphore or barrier member id of an op
_TBG = 105        # an op's thread-block group
_REDUCE = 34      # a reduction's operator
_BARRIER = 120    # a barrier's id and member count (its members are ids)
_CHANNEL = 38     # a channel of a rank per instance (its peer in the rank's table and its block's)
_REMOTE = 135     # a peer's buffer a rank accesses (in the rank's table)
_REMOTE_ID = 22   # the same per instance (in the table of the block that accesses it)
#: the estimate's error, either way, on the programs measured (tests/test_compile_bounds.py): a
#: plan is refused before the work only when it is over a limit by more than this
ERROR = 1.3


def check_ranks(ranks: int, what: str = "the program") -> None:
    """Raise :class:`LimitError` when ``ranks`` exceeds ``MSCCLANG_COMPILE_MAX_RANKS``."""
    limit = settings.compile_max_ranks
    if ranks > limit:
        raise LimitError(f"{what} has {ranks} ranks, more than the compiler takes (at most {limit}; "
                         f"set {Settings.compile_max_ranks.name} to raise it)")


def check_ops(ops: int, instances: int, what: str = "the program", so_far: bool = False) -> None:
    """Raise :class:`LimitError` when ``ops`` recorded ops times ``instances`` exceed
    ``MSCCLANG_COMPILE_MAX_OPS``; the message gives the estimated time and memory (``so_far``:
    the program is still recording, so these are lower bounds)."""
    limit = settings.compile_max_ops
    total = ops * instances
    if total <= limit:
        return
    times = f" x {instances} instances" if instances > 1 else ""
    more = "at least " if so_far else ""
    raise LimitError(f"{what} {'records more than' if so_far else 'records'} {ops:,} ops{times}, {more}"
                     f"{total:,} ops to compile (about {_duration(total * SECONDS_PER_OP)} and "
                     f"{format_bytes(total * BYTES_PER_OP)}), over the limit of {limit:,} ops (set "
                     f"{Settings.compile_max_ops.name} to raise it)")


def _duration(s: float) -> str:
    return f"{s / 60:.3g} min" if s >= 120 else f"{s:.3g} s"


@dataclass(frozen=True)
class PlanEstimate:
    """What compiling a recorded program makes and costs: the ``ops`` it recorded times its
    instances (pipeline inner ops included), the ``plan_ops`` and ``plan_bytes`` (of JSON) of the
    plan, and the seconds of each step (``steps``: the keys of :data:`OP_SECONDS` and
    :data:`BYTE_SECONDS`; microseconds of them are the progress bar's units)."""

    ops: int
    plan_ops: int
    plan_bytes: int
    steps: dict[str, float]

    @property
    def seconds(self) -> float:
        """The seconds still to come once the program is recorded."""
        return sum(self.steps.values()) - self.steps["record"]

    def describe(self) -> str:
        """``a plan of about 89.7 MiB (4,500 ops), about 36 s to compile``"""
        return (f"a plan of about {format_bytes(self.plan_bytes)} ({self.plan_ops:,} ops), about "
                f"{_duration(self.seconds)} to compile")


@dataclass
class _Tally:
    """Counts of one walk over a program's recorded ops (see :func:`estimate_plan`)."""

    ops: int = 0
    plan_ops: int = 0
    refs: int = 0
    ids: int = 0
    bytes: int = 0  # the plan ops' src lines and optional fields


def _kept(head: IROp, op: IROp) -> int:
    """The operands of ``op`` that its merge into the run ``head`` began adds: a reduction merged
    into a reduction adds its other sources (not the accumulator), an op that forwards a
    reduction's result its destinations (not the result again)."""
    if op.name == head.name and op.name in (OpName.re, OpName.repkt, OpName.rre):
        return len(op.src) - 1
    if head.name in REDUCE_OPS and op.name in (OpName.put, OpName.ppkt, OpName.cpkt, OpName.rppkt):
        return len(op.dst)
    return 0 if op.name == OpName.gstore and head.name == OpName.glre else len(op.src) + len(op.dst)


def _tally(ops: list[IROp], fusion: bool, remotes: set, t: _Tally) -> None:
    """Count ``ops`` of one block (or pipeline body) into ``t``: an op starts a plan op unless
    fusion may merge it into the run's first op; a run with a ``before`` data sync gets a nop
    before it, one with ``after`` a nop after it."""
    head: IROp | None = None
    syncs = 0

    def close() -> None:
        if head is not None:
            n = 1 + bool(syncs & SYNC_BEFORE) + bool(syncs & SYNC_AFTER)
            t.plan_ops += n
            t.bytes += n * len(head.source or "") + (_TBG if head.tbg else 0) + (
                _REDUCE if head.name in REDUCE_OPS else 0) + (
                _BARRIER + _ID * len(head.barrier_tbs or ()) if head.name == OpName.barrier else 0)

    for op in ops:
        t.ops += 1
        t.ids += len(op.channels) + len(op.semaphores)
        for ref in op.src + op.dst:
            if ref.remote:
                remotes.add((ref.rank, ref.buffer))
        if op.body is not None:
            _tally(op.body, fusion, remotes, t)
        if head is not None and fusion and may_fuse(head, op) and (  # reductions: into one accumulator
                op.name not in REDUCE_OPS or op.dst[:1] == head.dst[:1]):
            t.refs += _kept(head, op)
        else:
            close()
            head, syncs = op, 0
            t.refs += len(op.src) + len(op.dst)
        if op.name in SYNC_OPS:
            syncs |= op.data_sync
    close()


def estimate_plan(ir: IRProgram) -> PlanEstimate:
    """Estimate, from the recording alone (one walk over its ops), what compiling ``ir`` makes
    and costs (see :class:`PlanEstimate`). Fusion is taken to merge every op into the first op
    of its run whenever their kinds allow (:func:`~mscclang.compiler.fuse.may_fuse`: no operand
    is checked), the sync pass's nops are counted and the hazard pass's are not, so
    ``plan_ops`` is rather low; ``plan_bytes`` is within :data:`ERROR` of the plan's size for the
    programs measured."""
    t = _Tally()
    channels = remotes = blocks = 0
    for r in ir.ranks:
        seen: set = set()
        for ops in r.tbs:
            _tally(ops, ir.instr_fusion, seen, t)
        channels += len(r.memory) + len(r.port) + len(r.switch)
        remotes += len(seen)
        blocks += len(r.tbs)
    n = ir.instances
    plan_bytes = (_PLAN + len(ir.ranks) * _RANK + remotes * _REMOTE
                  + n * (channels * _CHANNEL + remotes * _REMOTE_ID + blocks * _BLOCK + t.plan_ops * _OP + t.bytes
                         + t.refs * _REF + t.ids * _ID))
    ops = t.ops * n
    return PlanEstimate(ops=ops, plan_ops=t.plan_ops * n, plan_bytes=plan_bytes,
                        steps={**{k: v * ops for k, v in OP_SECONDS.items()},
                               **{k: v * plan_bytes for k, v in BYTE_SECONDS.items()}})


def check_plan(estimate: PlanEstimate, what: str = "the program") -> None:
    """Raise :class:`LimitError` when the plan of ``estimate`` would be more than plans are read
    with (``MSCCLANG_MAX_PLAN_BYTES``, ``MSCCLANG_MAX_PLAN_OPS``) by more than the estimate's
    error (:data:`ERROR`); the message gives the estimate and the setting to raise."""
    over = []
    if estimate.plan_bytes > ERROR * settings.max_plan_bytes:
        over.append(f"over the {format_bytes(settings.max_plan_bytes)} limit on plans (set "
                    f"{Settings.max_plan_bytes.name} to raise it)")
    if estimate.plan_ops > ERROR * settings.max_plan_ops:
        over.append(f"over the limit of {settings.max_plan_ops:,} ops in a plan (set "
                    f"{Settings.max_plan_ops.name} to raise it)")
    if over:
        raise LimitError(f"{what} would compile to {estimate.describe()}: {' and '.join(over)}, which "
                         "verify, show and predict enforce")
