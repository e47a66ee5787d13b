"""How much memory and time a simulation will take, estimated before it starts, and the limits
it must stay within.

The simulator keeps every byte of every rank's buffers (inputs, outputs, scratch with LL packets
at twice their payload and double scratch twice again), a copy of every output per launch, and
the resolved program (one object per op and pipeline iteration) of every message size; its time
grows with the ops and operands it executes, the bytes it moves, the chunks it resolves and the
number of actors whose vector clocks it keeps. :func:`estimate_verify` adds these up from the plan
alone (no allocation), so a run that cannot fit is refused at once, with a message that says what
it would need, which limit it exceeds and the environment variable that raises the limit:

* ``MSCCLANG_SIM_MAX_MEMORY``: bytes a simulation may use (default: three quarters of the
  machine's memory; suffixes K, M, G, T);
* ``MSCCLANG_SIM_MAX_SECONDS``: seconds a ``verify`` (or one ``run``) may take (default 600).

The time estimate is deliberately optimistic (it refuses only what clearly cannot finish in
time); a simulation that runs past the time limit anyway stops there with a
:class:`~mscclang.errors.LimitError` (:class:`Deadline`). The memory estimate errs the other way.
The coefficients were fitted to measured runs (see ``notes/reliability_fuzz.md``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from mscclang.errors import LimitError, MscclangError
from mscclang.plan.collectives import spec_from_plan
from mscclang.plan.layout import make_layout, make_layouts
from mscclang.config import Settings, settings
from mscclang.plan.models import PACKET_OPS, SIGNAL_OPS, ChannelType, Plan
from mscclang.units import format_bytes

__all__ = ["Limits", "SizeCost", "Estimate", "size_cost", "estimate_runs", "check_runs", "Deadline"]

# --- coefficients fitted to 38 verify runs of library and synthetic plans (2 KiB .. 16 MiB, 2 to
# 32 ranks, pipelines down to 16-byte units) on CPython 3.11 / numpy 2; memory with a margin
# (measured/estimated 0.5 .. 0.9), time without one (measured/estimated 0.9 .. 5 for runs over
# 0.1 s; runs of a few milliseconds are mostly fixed cost).
_MEM_BASE = 72 << 20             # the interpreter, numpy, pydantic and the plan
_MEM_PER_FOOTPRINT_BYTE = 2.5    # buffers, plus packet, read and reduce temporaries
_MEM_PER_INDEX_ENTRY = 8 * 1.6   # postcondition index arrays: int64 per output element and source
_MEM_PER_DRAWN = 8 * 1.5         # random inputs are drawn as float64
_MEM_PER_OP_OBJECT = 1000        # one resolved op (COp, groups, pieces) of a compiled program
_MEM_PER_ACTOR_PAIR = 8 * 4 * 1.25  # vector clocks: 4 per actor (vc, rvc and their published copies),
#                                   one int64 entry per actor, plus the wait edges' joins (was 450,
#                                   fitted at 32 ranks or fewer where clocks are small: 10x too high
#                                   at 128 ranks, where they dominate)
_MEM_PER_ACCESS = 256            # one access in the race log (kept until overwritten)
_SEC_PER_OP = 4e-6               # one op executed (generator step, scheduling)
_SEC_PER_OPERAND = 3.5e-6        # one operand of an executed op (read/write, race log)
_SEC_PER_BYTE = 0.35e-9          # one byte of buffer per launch
_SEC_PER_CHECKED = 15e-9         # one source element of one output element checked per launch
_SEC_PER_CHUNK_REF = 7e-6        # one chunk of an operand resolved at compile time
_SEC_PER_CLOCK_ENTRY = 1.2e-7    # one actor's vector clock entry, per op executed
_SEC_PER_CLOCK_COPY = 1e-9       # one entry of a clock copied (per signalled channel, packet write)


@dataclass(frozen=True)
class Limits:
    """The simulator's budget: bytes of memory and seconds of time."""

    memory_bytes: int
    seconds: float

    @classmethod
    def from_env(cls) -> "Limits":
        """The limits the environment sets (``MSCCLANG_SIM_MAX_MEMORY``,
        ``MSCCLANG_SIM_MAX_SECONDS``), else the defaults."""
        return cls(settings.sim_max_memory, settings.sim_max_seconds)


@dataclass(frozen=True)
class SizeCost:
    """What simulating one message size costs, per launch unless stated."""

    size: int
    input_bytes: int
    output_bytes: int
    footprint: int          # bytes of every rank's buffers (in, out, scratch as allocated)
    outputs: int            # bytes of every rank's output (copied after each launch)
    inputs: int             # bytes of every rank's input (drawn at random once per run)
    checked: int            # output bytes times sources per output element, over every rank
    op_execs: int           # ops executed per launch, pipeline iterations expanded
    operand_execs: int      # operands of those ops
    chunk_refs: int         # chunks resolved when compiling the plan for this size (once)
    chunks: int             # chunks of every rank's buffers (walked at each launch start)
    signal_execs: int = 0   # channels signalled per launch (each keeps a copy of the clocks)
    packet_writes: int = 0  # packet destinations written per launch (each keeps a clock copy)
    op_bytes: int = 0       # the largest op's operand bytes (copies and reduce temporaries)


@dataclass
class Estimate:
    """Estimated peak memory and total time of a set of simulation runs."""

    memory_bytes: int
    seconds: float
    what: str
    costs: list[SizeCost] = field(default_factory=list)

    def problems(self, limits: Limits) -> list[str]:
        """Why the estimate does not fit ``limits`` (empty when it fits)."""
        out = []
        if self.memory_bytes > limits.memory_bytes:
            out.append(f"about {format_bytes(self.memory_bytes)} of memory, over the "
                       f"{format_bytes(limits.memory_bytes)} limit (set {Settings.sim_max_memory.name} to raise it)")
        if self.seconds > limits.seconds:
            out.append(f"about {_duration(self.seconds)}, over the {_duration(limits.seconds)} "
                       f"limit (set {Settings.sim_max_seconds.name} to raise it)")
        return out

    def fits(self, limits: Optional[Limits] = None) -> bool:
        return not self.problems(limits or Limits.from_env())

    def check(self, limits: Optional[Limits] = None) -> None:
        """Raise :class:`LimitError` when the estimate exceeds ``limits`` (default: the
        environment's)."""
        lim = limits or Limits.from_env()
        why = self.problems(lim)
        if why:
            raise LimitError(f"{self.what} would take {' and '.join(why)}; choose smaller sizes, "
                             "fewer schedules or launches")


def _duration(s: float) -> str:
    if s >= 86400 * 365:
        return f"{s / (86400 * 365):.3g} years"
    if s >= 7200:
        return f"{s / 3600:.3g} h"
    if s >= 120:
        return f"{s / 60:.3g} min"
    return f"{s:.3g} s"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _sources_per_element(plan: Plan) -> int:
    """Input elements the postcondition gathers per output element."""
    spec = spec_from_plan(plan)
    if spec.name in ("test", "custom"):
        return 0
    return len(plan.gpus) if spec.is_reduction else 1


def size_cost(plan: Plan, size: int, input_bytes: int, output_bytes: int, row_bytes: int = 0) -> SizeCost:
    """The cost of simulating ``plan`` for one message of ``size`` bytes (``input_bytes`` in,
    ``output_bytes`` out per rank; ``row_bytes``: a row-chunked fused plan's input row). Raises
    the layout's PlanError for sizes the collective does not allow."""
    footprint = outputs = chunks = 0
    op_execs = operand_execs = chunk_refs = signals = packet_writes = op_bytes = 0
    residual = input_bytes if plan.has_epilogue_ops() else 0   # the fused collective's residual
    for r, (g, lay) in enumerate(zip(plan.gpus, make_layouts(plan, input_bytes, output_bytes, row_bytes))):
        footprint += input_bytes + output_bytes + residual + lay.scratch_alloc_bytes
        outputs += output_bytes
        chunks += g.input_chunks + g.output_chunks + g.scratch_chunks
        cb = max(lay.chunk_bytes, 1)
        for tb in g.threadblocks:
            for op in tb.ops:
                if op.ops is not None and op.iter_context is not None:
                    longest = 0
                    inner_operands = inner_signals = inner_packets = 0
                    for inner in op.ops:
                        refs = inner.src_buff + inner.dst_buff
                        inner_operands += len(refs) + len(inner.channel_ids)
                        inner_signals += len(inner.channel_ids) if inner.name in SIGNAL_OPS else 0
                        inner_packets += len(inner.dst_buff) if inner.name in PACKET_OPS else 0
                        chunk_refs += sum(x.size for x in refs)
                        longest = max([longest] + [x.size * cb for x in refs])
                        op_bytes = max([op_bytes] + [(len(refs) + 2) * min(x.size * cb, op.iter_context.unit_size)
                                                     for x in refs])
                    iters = _ceil_div(longest, op.iter_context.unit_size) if longest else 0
                    op_execs += 1 + iters * len(op.ops)
                    operand_execs += iters * inner_operands
                    signals += iters * inner_signals
                    packet_writes += iters * inner_packets
                    chunk_refs += iters * len(op.ops)  # slicing every inner op per iteration
                else:
                    refs = op.src_buff + op.dst_buff
                    op_execs += 1
                    operand_execs += len(refs) + len(op.channel_ids)
                    signals += len(op.channel_ids) if op.name in SIGNAL_OPS else 0
                    packet_writes += len(op.dst_buff) if op.name in PACKET_OPS else 0
                    chunk_refs += sum(x.size for x in refs)
                    op_bytes = max([op_bytes] + [(len(refs) + 2) * x.size * cb for x in refs])
    n = len(plan.gpus)
    return SizeCost(size, input_bytes, output_bytes, footprint, outputs, n * input_bytes,
                    outputs * _sources_per_element(plan), op_execs, operand_execs, chunk_refs,
                    chunks, signals, packet_writes, op_bytes)


#: the most memory the symbolic shadows of one run may take (a larger run is skipped)
SYMBOLIC_BUDGET = 256 << 20


def _granule(plan: Plan, c: SizeCost, row_bytes: int = 0) -> int:
    """The largest power of two (4 .. 4096) dividing the message's buffer and chunk sizes and
    the pipelines' unit sizes: bytes per row of the symbolic shadow, at most what the run uses."""
    lay = make_layout(plan, 0, c.input_bytes, c.output_bytes, row_bytes)
    vals = [c.input_bytes, c.output_bytes, lay.chunk_bytes, lay.input.chunk_bytes, lay.input.block_bytes,
            lay.output.chunk_bytes, lay.output.block_bytes] + [
        op.iter_context.unit_size for g in plan.gpus for tb in g.threadblocks for op in tb.ops
        if op.iter_context is not None]
    g = 4096
    for v in vals:
        while g > 4 and v % g:
            g //= 2
    return g


def _actors(plan: Plan) -> int:
    return sum(len(g.threadblocks) + 1 + len(g.peers(ChannelType.port)) for g in plan.gpus)


def estimate_runs(plan: Plan, sizes: Sequence[tuple[int, ...]], runs_per_size: int,
                  launches: int, *, itemsizes: Sequence[int] = (2, 4),
                  symbolic_size: Optional[tuple[int, int, int]] = None, postcondition: bool = True,
                  what: str = "this simulation") -> Estimate:
    """Estimate ``runs_per_size`` runs of ``launches`` launches at each ``(size, input bytes,
    output bytes[, row bytes])`` of ``sizes`` (row bytes: a row-chunked fused plan's input row) with dtypes of ``itemsizes`` bytes in rotation (every size's
    program and postcondition index kept at once, as ``verify`` does), plus one symbolic run at
    ``symbolic_size``; without ``postcondition`` the outputs are not checked (``run``). Sizes the
    collective does not allow are left out (the simulation reports them itself)."""
    costs: list[SizeCost] = []
    for shape in sizes:
        try:
            costs.append(size_cost(plan, *shape))
        except MscclangError:
            continue
    isz = sorted({max(int(x), 1) for x in itemsizes}) or [1]
    actors = _actors(plan)
    runs = max(runs_per_size, 0)
    launches = max(launches, 1)
    used = isz[: max(min(runs, len(isz)), 1)]  # the dtypes the runs rotate through
    mem_kept = _MEM_BASE + actors * actors * _MEM_PER_ACTOR_PAIR
    peak_run = 0.0
    seconds = 0.0
    for c in costs:
        mem_kept += c.op_execs * _MEM_PER_OP_OBJECT
        checked = c.checked if postcondition else 0
        if runs and postcondition:
            # postcondition index arrays (int64 per output element and per source), one per dtype size
            mem_kept += sum((c.checked + 2 * c.outputs) / k * _MEM_PER_INDEX_ENTRY for k in used)
        if runs:
            logs = launches * (c.operand_execs * _MEM_PER_ACCESS
                               + (c.signal_execs * 2 + c.packet_writes) * actors * 8)
            # transients: the largest op's copies (as float64 when reducing), one rank's check
            transient = c.op_bytes * 8 / used[0] + (checked / len(plan.gpus) / used[0] * 16 if plan.gpus else 0)
            peak_run = max(peak_run, c.footprint * _MEM_PER_FOOTPRINT_BYTE + launches * c.outputs
                           + c.inputs / used[0] * _MEM_PER_DRAWN + logs + transient)
        per_launch = (c.op_execs * (_SEC_PER_OP + actors * _SEC_PER_CLOCK_ENTRY)
                      + (c.signal_execs * 2 + c.packet_writes) * actors * _SEC_PER_CLOCK_COPY
                      + c.operand_execs * _SEC_PER_OPERAND + c.footprint * _SEC_PER_BYTE
                      + c.chunks * _SEC_PER_CHUNK_REF + checked / used[-1] * _SEC_PER_CHECKED)
        seconds += c.chunk_refs * _SEC_PER_CHUNK_REF + runs * launches * per_launch
    if symbolic_size is not None:
        try:
            c = size_cost(plan, *symbolic_size)
        except MscclangError:
            c = None
        nsym = len(plan.gpus) * max(plan.gpus[0].input_chunks, 1)
        row = symbolic_size[3] if len(symbolic_size) > 3 else 0
        rows = (c.footprint // _granule(plan, c, row) + 1) if c is not None else 0
        if c is not None and rows * nsym * 2 <= SYMBOLIC_BUDGET:   # else verify skips the symbolic run
            shadow = rows * nsym * 2 * (1 + launches)
            peak_run = max(peak_run, c.footprint * _MEM_PER_FOOTPRINT_BYTE + launches * c.outputs + shadow)
            seconds += launches * (c.op_execs * _SEC_PER_OP + c.operand_execs * _SEC_PER_OPERAND
                                   + shadow * _SEC_PER_BYTE)
    return Estimate(int(mem_kept + peak_run), seconds, what, costs)


def check_runs(plan: Plan, sizes: Sequence[tuple[int, int, int]], runs_per_size: int, launches: int,
               *, itemsizes: Sequence[int] = (2, 4),
               symbolic_size: Optional[tuple[int, int, int]] = None, postcondition: bool = True,
               what: str = "this simulation", limits: Optional[Limits] = None) -> Estimate:
    """:func:`estimate_runs`, then refuse (:class:`LimitError`) what exceeds ``limits``."""
    est = estimate_runs(plan, sizes, runs_per_size, launches, itemsizes=itemsizes,
                        symbolic_size=symbolic_size, postcondition=postcondition, what=what)
    est.check(limits)
    return est


class Deadline:
    """The instant by which a simulation started now must end; :meth:`check` raises
    :class:`LimitError` once it has passed (the simulator calls it at every step)."""

    __slots__ = ("seconds", "at", "what")

    def __init__(self, limits: Optional[Limits] = None, what: str = "the simulation") -> None:
        self.seconds = (limits or Limits.from_env()).seconds
        self.at = time.monotonic() + self.seconds
        self.what = what

    def check(self) -> None:
        """Raise :class:`LimitError` when the deadline has passed."""
        if time.monotonic() > self.at:
            raise LimitError(f"{self.what} ran past the {_duration(self.seconds)} time limit "
                             f"(set {Settings.sim_max_seconds.name} to raise it); choose smaller sizes, fewer "
                             "schedules or launches")
