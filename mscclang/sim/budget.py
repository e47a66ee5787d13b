"""How much memory and time a simulation will take, estimated before it starts, and the limits
it must stay within.

The simulator keeps every byte of every rank's buffers (inputs, outputs, scratch with LL packets
at twice their payload and double scratch twice again), a copy of every output per launch, and
the resolved program (one object per op and pipeline iteration) of every message size, the
state of every channel end the plan declares, and in a symbolic run a shadow row per granule of
every buffer; its time grows with the ops and operands it executes, the bytes it moves, the
chunks it resolves, the channel ends it pairs and the number of actors whose vector clocks it
keeps. :func:`estimate_verify` adds these up from the plan
alone (no allocation), so a run that cannot fit is refused at once, with a message that says what
it would need, which limit it exceeds and the environment variable that raises the limit:

* ``MSCCLANG_SIM_MAX_MEMORY``: bytes a simulation may use (default: three quarters of the
  machine's memory; suffixes K, M, G, T);
* ``MSCCLANG_SIM_MAX_SECONDS``: seconds a ``verify`` (or one ``run``) may take (default 600).

Both estimates aim within 2x of the measured run (its CPU time and peak memory) on the machine
class CI uses (2 cores, CPython 3.11); a simulation that runs past the time limit anyway stops there with a
:class:`~mscclang.errors.LimitError` (:class:`Deadline`). The time is a weighted sum of counted
terms (:attr:`Estimate.terms`: steps, accesses, channel and clock work, compile and checks) whose
weights (:data:`SECONDS_PER`) ``tools/budget_table.py --fit`` fits to measured runs; the table of
estimates against measurements is in ``notes/budget.md``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from mscclang.errors import LimitError, MscclangError
from mscclang.plan.collectives import spec_from_plan
from mscclang.plan.layout import make_layout, make_layouts, near_equal_split, scratch_factor
from mscclang.config import Settings, settings
from mscclang.plan.models import (PACKET_DST_FROM, PACKET_OPS, PACKET_SRC_FROM, PUT_SIGNAL_OPS, REDUCE_OPS, SIGNAL_OPS,
                                  SYNC_OPS, WAIT_OPS, ChannelType, Op, OpName, Plan)
from mscclang.sim.postcondition import CHUNKWISE_ELEMENTS
from mscclang.sim.state import SYM_GRANULE, granule_of
from mscclang.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from mscclang.plan.segments import CountedCall

__all__ = ["Limits", "Work", "SizeCost", "Estimate", "size_cost", "counted_cost", "estimate_runs", "check_runs", "Deadline"]

# --- memory coefficients, fitted to measured verify runs (tracemalloc and ru_maxrss peaks) of
# library and synthetic plans up to 128 ranks on CPython 3.11 / numpy 2, with a margin
_MEM_BASE = 80 << 20             # the interpreter, numpy, pydantic, the plan (small runs peak at 75-78 MiB)
_MEM_PER_FOOTPRINT_BYTE = 2.5    # buffers, plus packet, read and reduce temporaries
_MEM_PER_INDEX_ENTRY = 8 * 1.6   # postcondition index arrays: int64 per output element and source
_MEM_PER_DRAWN = 8 * 1.5         # random inputs are drawn as float64
_MEM_PER_OP_OBJECT = 1000        # one resolved op (COp, groups, pieces) of a compiled program
_MEM_PER_ACTOR_PAIR = 8 * 4 * 1.25  # vector clocks: 4 per actor (vc, rvc and their published copies),
#                                   one int64 entry per actor, plus the wait edges' joins (was 450,
#                                   fitted at 32 ranks or fewer where clocks are small: 10x too high
#                                   at 128 ranks, where they dominate)
_MEM_PER_ACCESS = 256            # one access in the race log (kept until overwritten)
_MEM_PER_CHANNEL_END = 300       # a declared channel end: its pairing entries and the plan's lists

#: seconds per unit of each term of the time estimate (:attr:`Estimate.terms`), fitted by
#: ``tools/budget_table.py --fit`` to the CPU time of 55 measured verify runs (2 to 1000 ranks,
#: 16 B to 4 MiB, fused plans; see ``notes/budget.md``); a weight of 0 is a term the fit finds
#: inside the others' at the shapes measured (kept: it is counted, and a refit may weigh it)
SECONDS_PER: dict[str, float] = {
    "steps": 4.9e-6,              # a scheduler step (an op executed, a wait)
    "accesses": 1.7e-5,           # a data operand touched: its race-log entry, copy and packets
    "channels": 4.2e-6,           # a channel signalled or waited on
    "channel_ends": 1.8e-6,       # a channel end the plan declares, per run (paired, its state kept)
    "channel_entries": 2.6e-9,    # one actor's clock entry, per channel signalled or waited on
    "nop_entries": 3.5e-8,        # one actor's clock entry, per nop (merging what was acquired)
    "reduced_bytes": 0.0,         # a byte of a reduction's operands
    "moved_bytes": 0.0,           # a byte of a data op's operands
    "packet_bytes": 1.1e-9,       # a byte of a packet op's operands (flags written and polled)
    "clock_pairs": 1.4e-7,        # an actor pair of a run's vector clocks (made once per run)
    "compiled_ops": 4.3e-6,       # an op (pipeline iteration) resolved when compiling a size
    "chunk_refs": 2.7e-6,         # a chunk of an operand resolved when compiling a size
    "checked": 9.9e-9,            # a source element of an output element checked, per launch
    "symbolic_reductions": 8.0e-4,  # a reduction of the symbolic run (its expressions, vectorised)
}

#: the terms paid once per compiled program (a size of ``verify``; every run of a fused verify)
COMPILE_TERMS = frozenset({"compiled_ops", "chunk_refs"})


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



@dataclass
class Work:
    """What the simulator does for one message size, per launch: the counts follow it. A step
    per op executed (pipeline iterations expanded) and per wait; a race-log access per data
    operand a thread block's share of the op touches (a thread-block group splits an op, and
    members whose share is empty touch nothing) and per host hand-over; clock work per channel
    signalled or waited on and per nop."""

    op_execs: int = 0       # ops executed, pipeline iterations expanded (each a resolved object)
    operand_execs: int = 0  # operands of those ops (buffers and channels)
    chunk_refs: int = 0     # chunks resolved when compiling the plan for this size (once)
    signal_execs: int = 0   # channels signalled (each keeps a copy of the clocks)
    packet_writes: int = 0  # destinations written as packets (each keeps a clock copy)
    op_bytes: int = 0       # the largest op's operand bytes (copies and reduce temporaries)
    steps: int = 0          # scheduler steps: ops executed plus waits
    accesses: int = 0       # race-log accesses: data operands touched, host hand-overs
    channel_execs: int = 0  # channels of signals, waits, puts with signal, flushes, semaphores
    nops: int = 0           # nops and barriers executed (each merges the clocks acquired)
    reduced_bytes: int = 0  # operand bytes of reductions
    reductions: int = 0     # reductions executed by a thread block with a share to reduce
    moved_bytes: int = 0    # operand bytes of every data op (copies, packets, reductions)
    packet_bytes: int = 0   # operand bytes of packet ops (flags written and polled per word)

    def add(self, op: Op, iters: int, chunk_bytes: int, unit: Optional[int], alignment: int,
            lens: Optional[list[int]] = None) -> None:
        """``op`` executed ``iters`` times (a pipeline's inner op: ``unit`` bytes per iteration;
        the pipeline, not its inner ops, takes a step per iteration). ``lens``: each operand's
        bytes where they are not its chunks times ``chunk_bytes`` (segments)."""
        refs = op.src_buff + op.dst_buff
        self.op_execs += iters
        self.steps += 0 if unit else iters
        self.operand_execs += iters * (len(refs) + len(op.channel_ids))
        self.chunk_refs += sum(x.size for x in refs) + (iters if unit else 0)
        if op.name in SIGNAL_OPS:
            self.signal_execs += iters * len(op.channel_ids)
        if op.name in PACKET_DST_FROM:
            self.packet_writes += iters * len(op.dst_buff[PACKET_DST_FROM[op.name]:])
        if op.name in WAIT_OPS or op.name == OpName.sem_acquire or op.name in PACKET_SRC_FROM:
            self.steps += iters   # a wait (for a signal, a semaphore, packets) takes a step of its own
        if op.name in (OpName.nop, OpName.barrier):
            self.nops += iters
        if op.name in SYNC_OPS or op.name in PUT_SIGNAL_OPS:
            self.channel_execs += iters * len(op.channel_ids)
        if lens is None:
            lens = [min(x.size * chunk_bytes, unit) if unit else x.size * chunk_bytes for x in refs]
        if lens:
            self.op_bytes = max(self.op_bytes, (len(refs) + 2) * max(lens))
            if (part := _share(op, max(lens), alignment)):
                self.accesses += iters * len(refs)
                moved = iters * sum(min(x, part) for x in lens)
                self.moved_bytes += moved
                if op.name in REDUCE_OPS:
                    self.reduced_bytes += moved
                    self.reductions += iters
                if op.name in PACKET_OPS:
                    self.packet_bytes += moved


@dataclass(frozen=True)
class SizeCost:
    """What simulating one message size costs: every rank's buffers and the :class:`Work` of a
    launch."""

    size: int
    input_bytes: int
    output_bytes: int
    footprint: int          # bytes of every rank's buffers (in, out, scratch as allocated)
    buffers: int            # bytes of every rank's input, output and residual
    scratch: int            # bytes of every rank's plain scratch slots (a launch's packets touch
    #                         these many: one half of a double scratch, flags interleaved)
    outputs: int            # bytes of every rank's output (copied after each launch)
    inputs: int             # bytes of every rank's input (drawn at random once per run)
    checked: int            # output bytes times sources per output element, over every rank
    work: Work


def _share(op: Op, nbytes: int, alignment: int) -> int:
    """Bytes of an op of ``nbytes`` its thread block handles: all of them, or its share of a
    thread-block group's split (:func:`mscclang.plan.layout.group_slice`)."""
    if op.tbg_info is None or op.tbg_info.tbg_size <= 1:
        return nbytes
    unit = max(alignment, 8)
    s, e = near_equal_split(_ceil_div(nbytes, unit), op.tbg_info.tbg_size, op.tbg_info.tb_id)
    return min(e * unit, nbytes) - min(s * unit, nbytes)


@dataclass
class Estimate:
    """Estimated peak memory and total time of a set of simulation runs."""

    memory_bytes: int
    seconds: float
    what: str
    costs: list[SizeCost] = field(default_factory=list)
    #: the time estimate's terms (units of :data:`SECONDS_PER`'s keys): seconds is their sum
    #: weighted by :data:`SECONDS_PER`
    terms: dict[str, float] = field(default_factory=dict)
    #: the memory estimate's parts in bytes (interpreter base, vector clocks, programs,
    #: postcondition index, and the largest run's buffers, logs, channels, symbolic shadows):
    #: memory_bytes is their sum
    memory_terms: dict[str, float] = field(default_factory=dict)

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
    footprint = outputs = buffers = scratch = 0
    t = Work()
    align = plan.buffer_alignment
    residual = input_bytes if plan.has_epilogue_ops() else 0   # the fused collective's residual
    for g, lay in zip(plan.gpus, make_layouts(plan, input_bytes, output_bytes, row_bytes)):
        footprint += input_bytes + output_bytes + residual + lay.scratch_alloc_bytes
        buffers += input_bytes + output_bytes + residual
        scratch += lay.scratch_bytes
        outputs += output_bytes
        t.accesses += 3 + (1 if residual else 0)   # the host's hand-overs at each launch start
        cb = max(lay.chunk_bytes, 1)
        for tb in g.threadblocks:
            for op in tb.ops:
                if op.ops is not None and op.iter_context is not None:
                    unit = op.iter_context.unit_size
                    longest = max([x.size * cb for inner in op.ops for x in inner.src_buff + inner.dst_buff],
                                  default=0)
                    iters = _ceil_div(longest, unit) if longest else 0
                    t.op_execs += 1
                    t.steps += 1 + iters   # the pipeline, and the step after each iteration
                    for inner in op.ops:
                        t.add(inner, iters, cb, unit, align)
                else:
                    t.add(op, 1, cb, None, align)
    n = len(plan.gpus)
    return SizeCost(size, input_bytes, output_bytes, footprint, buffers, scratch, outputs, n * input_bytes,
                    outputs * _sources_per_element(plan), t)


def counted_cost(plan: Plan, call: "CountedCall") -> SizeCost:
    """The cost of simulating a plan with segments for one call (its counts and sizes): every
    rank's input, output and scratch slots, and each op's operands at their segments' bytes."""
    from mscclang.plan.segments import ref_entries

    footprint = outputs = buffers = scratch = inputs = checked = 0
    t = Work()
    rb = call.row_bytes
    factor = scratch_factor(plan)
    for r, g in enumerate(plan.gpus):
        ib, ob = call.in_rows[r] * rb, call.out_rows[r] * rb
        sb = g.scratch_chunks * call.capacity * rb
        footprint += ib + ob + sb * factor
        buffers += ib + ob
        scratch += sb
        outputs += ob
        inputs += ib
        checked += 2 * ob
        t.accesses += 3
        for tb in g.threadblocks:
            for op in tb.ops:
                refs = op.src_buff + op.dst_buff
                ents = [ref_entries(plan, r, tb, op, x) for x in refs]
                lens = [sum(call.rows(e) for e in es) * rb if es is not None else x.size * call.capacity * rb
                        for x, es in zip(refs, ents)]
                t.add(op, 1, call.capacity * rb, None, plan.buffer_alignment, lens)
    return SizeCost(inputs, inputs // max(len(plan.gpus), 1), outputs // max(len(plan.gpus), 1), footprint, buffers,
                    scratch, outputs, inputs, checked, t)


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
    return granule_of(vals)


def _actors(plan: Plan) -> int:
    return sum(len(g.threadblocks) + 1 + len(g.peers(ChannelType.port)) for g in plan.gpus)


def _channel_ends(plan: Plan) -> int:
    """Channel ends the plan declares (every rank's memory and port channels), used or not: the
    simulator pairs each and keeps its state, per run."""
    return sum(len(g.peers(ChannelType.memory)) + len(g.peers(ChannelType.port)) for g in plan.gpus)


def estimate_runs(plan: Plan, sizes: Sequence[tuple[int, ...]], runs_per_size: int,
                  launches: int, *, itemsizes: Sequence[int] = (2, 4),
                  symbolic_size: Optional[tuple[int, ...]] = None, postcondition: bool = True,
                  what: str = "this simulation", costs: Optional[Sequence[SizeCost]] = None) -> Estimate:
    """Estimate ``runs_per_size`` runs of ``launches`` launches at each ``(size, input bytes,
    output bytes[, row bytes])`` of ``sizes`` (row bytes: a row-chunked fused plan's input row)
    with dtypes of ``itemsizes`` bytes in rotation (every size's program and postcondition index
    kept at once, as ``verify`` does), plus one symbolic run at ``symbolic_size``; without
    ``postcondition`` the outputs are not checked (``run``). Sizes the collective does not allow
    are left out (the simulation reports them itself). :attr:`Estimate.memory_terms` names the
    parts of the memory estimate. ``costs``: the sizes' costs where the caller has them (a plan
    with segments: :func:`counted_cost` of each call), ``sizes`` then ignored."""
    if costs is None:
        costs = []
        for shape in sizes:
            try:
                costs.append(size_cost(plan, *shape))
            except MscclangError:
                continue
    isz = sorted({max(int(x), 1) for x in itemsizes}) or [1]
    actors = _actors(plan)
    ends = _channel_ends(plan)
    runs = max(runs_per_size, 0)
    launches = max(launches, 1)
    used = isz[: max(min(runs, len(isz)), 1)]  # the dtypes the runs rotate through
    kept = {"base": float(_MEM_BASE), "clocks": actors * actors * _MEM_PER_ACTOR_PAIR,
            "programs": 0.0, "index": 0.0}
    peak: dict[str, float] = {}
    terms = dict.fromkeys(SECONDS_PER, 0.0)
    for c in costs:
        kept["programs"] += c.work.op_execs * _MEM_PER_OP_OBJECT
        checked = c.checked if postcondition else 0
        if runs and postcondition:
            # postcondition index arrays (int64 per output element and per source), one per dtype
            # size; larger outputs are checked chunk by chunk, with none (one rank's check below)
            kept["index"] += sum((c.checked + 2 * c.outputs) / k * _MEM_PER_INDEX_ENTRY for k in used
                                 if c.output_bytes // k <= CHUNKWISE_ELEMENTS)
        if runs:
            run = _run_memory(c, actors, ends, launches)
            # the race log's accesses, the clocks every signal keeps, and a clock copy per packet
            # written: kept until a later launch overwrites it (a double scratch alternates halves)
            kept_launches = min(launches, 2 if plan.use_double_scratch_buffer else 1)
            run["logs"] = (launches * (c.work.operand_execs * _MEM_PER_ACCESS + c.work.signal_execs * 2 * actors * 8)
                           + kept_launches * c.work.packet_writes * actors * 8)
            # transients: the largest op's copies (as float64 when reducing), one rank's check
            run["transient"] = c.work.op_bytes * 8 / used[0] + (
                checked / len(plan.gpus) / used[0] * 16 if plan.gpus else 0)
            run["drawn"] = c.inputs / used[0] * _MEM_PER_DRAWN
            peak = max(peak, run, key=lambda d: sum(d.values()))
        _add_terms(terms, c, actors, ends, runs, launches)
        terms["compiled_ops"] += c.work.op_execs
        terms["chunk_refs"] += c.work.chunk_refs
        terms["checked"] += runs * launches * checked / used[-1]
    sims = runs * len(costs)
    if symbolic_size is not None:
        sym = _symbolic(plan, symbolic_size, actors, ends, launches, terms)
        sims += 1 if sym else 0
        peak = max(peak, sym, key=lambda d: sum(d.values()))
    memory = {**kept, **peak}
    seconds = sum(SECONDS_PER[k] * v for k, v in terms.items())
    return Estimate(int(sum(memory.values())), seconds, what, costs, terms, memory)


def _run_memory(c: SizeCost, actors: int, ends: int, launches: int) -> dict[str, float]:
    """The memory every run at ``c`` holds: buffers with their temporaries, the outputs' copies,
    the channel ends' state."""
    return {"buffers": c.footprint * _MEM_PER_FOOTPRINT_BYTE + launches * c.outputs,
            "channels": ends * _MEM_PER_CHANNEL_END}


def _symbolic(plan: Plan, shape: tuple[int, ...], actors: int, ends: int, launches: int,
              terms: dict[str, float]) -> dict[str, float]:
    """The symbolic run at ``shape``: its memory (empty when it is not run), its time added to
    ``terms``. ``verify`` uses the coarsest granule the run allows and skips a run whose shadows
    exceed :data:`SYMBOLIC_BUDGET`; a fused plan's run (``run_fused``) keeps the simulator's
    default granule of 4 bytes and is never skipped."""
    try:
        c = size_cost(plan, *shape)
    except MscclangError:
        return {}
    fused = plan.has_epilogue_ops()
    gran = SYM_GRANULE if fused else _granule(plan, c, shape[3] if len(shape) > 3 else 0)
    nsym = len(plan.gpus) * max(plan.gpus[0].input_chunks, 1)
    pad = len(plan.gpus) * 4 * gran   # every buffer (in, out, res, scratch) rounds up to a row
    if not fused and (c.footprint + pad) // gran * nsym * 2 > SYMBOLIC_BUDGET:
        return {}   # verify skips the symbolic run
    _add_terms(terms, c, actors, ends, 1, launches)
    terms["symbolic_reductions"] += launches * c.work.reductions
    # the shadows (nsym int16 counts and an int32 expression id per row: expressions are interned
    # per chunk, few) are allocated for every buffer but resident where a launch touches them;
    # each launch copies the outputs' rows
    halves = min(launches, 2) if plan.use_double_scratch_buffer else 1
    rows = (c.buffers + halves * c.scratch + pad) / gran
    return {**_run_memory(c, actors, ends, launches),
            "symbolic": (rows + launches * c.outputs / gran) * (nsym * 2 + 4)}


def _add_terms(terms: dict[str, float], c: SizeCost, actors: int, ends: int, runs: int, launches: int) -> None:
    """Add ``runs`` runs of ``launches`` launches at ``c`` to the time terms."""
    k = runs * launches
    terms["channel_ends"] += runs * ends
    terms["steps"] += k * c.work.steps
    terms["accesses"] += k * c.work.accesses
    terms["channels"] += k * c.work.channel_execs
    terms["channel_entries"] += k * c.work.channel_execs * actors
    terms["nop_entries"] += k * c.work.nops * actors
    terms["reduced_bytes"] += k * c.work.reduced_bytes
    terms["moved_bytes"] += k * c.work.moved_bytes
    terms["packet_bytes"] += k * c.work.packet_bytes
    terms["clock_pairs"] += runs * actors * actors


def check_runs(plan: Plan, sizes: Sequence[tuple[int, int, int]], runs_per_size: int, launches: int,
               *, itemsizes: Sequence[int] = (2, 4),
               symbolic_size: Optional[tuple[int, ...]] = None, postcondition: bool = True,
               what: str = "this simulation", limits: Optional[Limits] = None,
               costs: Optional[Sequence[SizeCost]] = None) -> Estimate:
    """:func:`estimate_runs`, then refuse (:class:`LimitError`) what exceeds ``limits``."""
    est = estimate_runs(plan, sizes, runs_per_size, launches, itemsizes=itemsizes,
                        symbolic_size=symbolic_size, postcondition=postcondition, what=what, costs=costs)
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
