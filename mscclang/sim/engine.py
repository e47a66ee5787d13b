"""The simulation: every thread block of every rank (and every port channel's proxy) is a
cooperative task interpreting its ops over :class:`RankMemory`, under a chosen schedule.

A block task is a generator. It yields ``None`` after each op (a scheduling point) and a
:class:`Wait` when it cannot go on; packet ops consume whatever packets are ready and wait for the
rest, so two blocks streaming packets to each other both progress. A waiting task is woken when
the state it waits on (a channel counter, a rank's packets, a barrier, a semaphore, a proxy)
changes. When nothing can run while some task waits, the run is a deadlock and the wait-for
cycle is reported.

:class:`Simulation` holds the state of one run, the op interpreter, channels, barriers,
semaphores and launches, and composes the concepts kept in their own modules:
:mod:`mscclang.sim.tasks` (tasks and what they wait for), :mod:`mscclang.sim.schedules`
(picking and waking tasks), :mod:`mscclang.sim.packets` (data movement and the LL packet model),
:mod:`mscclang.sim.ports` (port channels and their proxies) and :mod:`mscclang.sim.deadlock`
(the wait-for diagnosis).
"""

from __future__ import annotations

import numbers
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np

from mscclang.errors import PlanError, VerificationError
from mscclang.plan.collectives import CollectiveSpec, spec_from_plan
from mscclang.plan.models import PACKET_TYPES, SEMAPHORE_OPS, SIGNAL_OPS, WAIT_OPS, BufferKind, ChannelType, OpName, Plan, channel_ordinals, paired_indices
from mscclang.sim.deadlock import DeadlockMixin
from mscclang.sim.diagnosis import race_problem
from mscclang.sim.epilogue import EpilogueParams
from mscclang.sim.epilogue_exec import EpilogueMixin
from mscclang.sim.exprs import ExprTable
from mscclang.sim.packets import PKT_WRITERS, PacketMixin
from mscclang.sim.ports import PortMixin, Proxy, Trigger
from mscclang.sim.program import COp, Program
from mscclang.sim.budget import Deadline
from mscclang.sim.races import Access, AccessLog, Actor, OpRef, RaceInfo, Unpublished
from mscclang.sim.report import Deadlock, Problem
from mscclang.sim.schedules import REMOTE_WRITERS, SCHEDULES, ScheduleMixin
from mscclang.sim.state import SYM_GRANULE, RankMemory
from mscclang.sim.tasks import ChannelEnd, Task, Wait

__all__ = ["ChannelEnd", "PKT_WRITERS", "Proxy", "REMOTE_WRITERS", "SCHEDULES", "Simulation",
           "Task", "Trigger", "Wait"]



def check_count(name: str, value: object, low: int) -> None:
    """``value`` is an int (not a bool) of at least ``low``: VerificationError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise VerificationError(f"{name} must be an integer of at least {low}, got {value!r}")


def check_choice(name: str, value: object, known: Sequence[str]) -> None:
    """``value`` is one of ``known``: VerificationError naming ``name`` and listing them otherwise."""
    if not isinstance(value, str) or value not in known:
        raise VerificationError(f"unknown {name} {value!r}; known: {', '.join(known)}")


def check_run_arguments(schedule: str, seed: int, launches: int, packet_type: str) -> None:
    """The one home of the execution parameters of a run (:class:`Simulation`, and
    :func:`~mscclang.sim.runner.run` and :func:`~mscclang.sim.fused.run_fused` before anything
    is allocated): a known schedule and packet type, ``launches`` at least 1, ``seed`` not
    negative (VerificationError naming the parameter)."""
    check_choice("schedule", schedule, SCHEDULES)
    check_choice("packet type", packet_type, PACKET_TYPES)
    check_count("launches", launches, 1)
    check_count("seed", seed, 0)


@dataclass
class RunState:
    """The state one run of a program starts from (:func:`run_state`), which :class:`Simulation`
    takes as its own attributes: each rank's memory, the threads (one actor per thread block,
    rank's host and port channel's proxy, their ids numbered blocks, then hosts, then proxies),
    each channel end's peer end, the semaphores, and the run's progress, empty."""

    mem: list[RankMemory]
    hosts: list[Actor]
    block_actors: list[list[Actor]]
    proxies: dict[tuple[int, int], Proxy]
    host_tids: set[int]
    #: threads in all (the length of every vector clock)
    nthreads: int
    #: (rank, channel type, index) -> the peer's end; an unpaired channel's end no op can reach
    pair: dict[tuple, tuple]
    #: semaphores as tokens: [value, initial tokens left (negative: releases still owed),
    #: queue of (vc, rvc) of the releases not yet acquired]
    sems: dict[tuple[int, int], list]
    rank_launch: list[int]
    tasks_of: list[list[Task]]
    problems: list[Problem] = field(default_factory=list)
    _race_keys: set = field(default_factory=set)
    outputs: list[list[np.ndarray]] = field(default_factory=list)
    out_shadows: list[list[np.ndarray]] = field(default_factory=list)
    #: per launch and rank, the expression ids of the output's granules (symbolic runs) and of
    #: the residual's (fused plans), ids of :attr:`exprs`
    out_exprs: list[list[np.ndarray]] = field(default_factory=list)
    res_exprs: list[list[np.ndarray]] = field(default_factory=list)
    residual_outputs: list[list[np.ndarray]] = field(default_factory=list)
    exprs: ExprTable = field(default_factory=ExprTable)
    sym_ok: bool = True
    ends: dict[tuple, ChannelEnd] = field(default_factory=dict)
    barriers: dict[tuple[int, int], dict] = field(default_factory=dict)
    #: signals, releases and port requests sent without what other threads acquired
    unpublished: list[Unpublished] = field(default_factory=list)
    waiting: dict[tuple, list[Task]] = field(default_factory=dict)
    flag_pages: dict[int, dict[int, bool]] = field(default_factory=dict)
    runnable: list[Task] = field(default_factory=list)
    rr: deque[Task] = field(default_factory=deque)
    live: dict[int, int] = field(default_factory=dict)
    waited_ranks: set[int] = field(default_factory=set)
    steps: int = 0


def _pairing(plan: Plan) -> dict[tuple, tuple]:
    """Each channel end's peer end, (rank, channel type, index) -> the same of the peer; an
    unpaired channel gets an end no op can reach (its waits deadlock). A channel to a rank
    outside the plan is a PlanError."""
    n = len(plan.gpus)
    pair: dict[tuple, tuple] = {}
    for ctype in (ChannelType.memory, ChannelType.port):
        peers = [g.peers(ctype) for g in plan.gpus]
        for a in range(n):
            for gidx, b in enumerate(peers[a]):
                if not 0 <= b < n:
                    raise PlanError(f"rank {a} {ctype.value} channel {gidx} connects to rank {b}, not in the plan")
        table = paired_indices(peers)
        for a in range(n):
            for gidx, c in enumerate(channel_ordinals(peers[a])):
                back = table[a][gidx]
                pair[(a, ctype.value, gidx)] = (c.peer, ctype.value, back if back is not None else f"hidden{a}.{c.ordinal}")
    return pair


def run_state(program: Program, spec: CollectiveSpec, nsym: int, sym_granule: int) -> RunState:
    """The :class:`RunState` a run of ``program`` starts from (``nsym`` symbolic inputs, shadows
    in rows of ``sym_granule`` bytes; PlanError for a channel to a rank outside the plan)."""
    plan = program.plan
    n = len(plan.gpus)
    blocks = [len(g.threadblocks) for g in plan.gpus]
    first = [sum(blocks[:r]) for r in range(n)]   # each rank's first block thread
    host_tids = list(range(sum(blocks), sum(blocks) + n))
    ports = [(r, c) for r, g in enumerate(plan.gpus) for c in range(len(g.peers(ChannelType.port)))]
    base = sum(blocks) + n   # the first proxy's thread
    t = base + len(ports)
    residual = plan.has_epilogue_ops()
    return RunState(
        mem=[RankMemory(plan, spec, r, program.layouts[r], nsym, sym_granule, residual) for r in range(n)],
        hosts=[Actor(tid, t) for tid in host_tids],
        block_actors=[[Actor(first[r] + i, t) for i in range(blocks[r])] for r in range(n)],
        proxies={k: Proxy(k[0], k[1], Actor(base + i, t)) for i, k in enumerate(ports)},
        host_tids=set(host_tids), nthreads=t, pair=_pairing(plan),
        sems={(r, i): [s.init_value, s.init_value, deque()] for r, g in enumerate(plan.gpus)
              for i, s in enumerate(g.semaphores)},
        rank_launch=[0] * n, tasks_of=[[] for _ in range(n)])


class Simulation(ScheduleMixin, PacketMixin, PortMixin, DeadlockMixin, EpilogueMixin):
    """One run of a compiled plan on given inputs under one schedule.

    ``inputs`` are byte arrays, one per rank. After :meth:`run`, ``outputs[k][r]`` holds rank
    ``r``'s output bytes after launch ``k`` and ``problems`` what was found (races and the like;
    a deadlock raises :class:`Deadlock` when ``raise_deadlock``). ``accum``: the accumulation
    dtype of fp8 reductions (``float32``, the default, or ``float16``).

    Plans with epilogue ops (plan/2) take ``residuals`` (byte arrays of the input's size, one
    per rank, written before every launch like the inputs; ``residual_outputs[k][r]`` holds
    them after launch ``k``) and ``epilogue`` (the rmsnorm's execution parameters)."""

    def __init__(self, program: Program, inputs: list[np.ndarray], *, dtype: np.dtype,
                 reduce_op: str = "sum", packet_type: str = "LL16", launches: int = 1,
                 accum: Optional[str] = None,
                 schedule: str = "round_robin", seed: int = 0, check_races: bool = True,
                 nsym: int = 0, spec: Optional[CollectiveSpec] = None,
                 poison_outputs: bool = False, max_steps: int = 10_000_000,
                 lead: Optional[int] = None, sym_granule: int = SYM_GRANULE,
                 deadline: Optional[Deadline] = None,
                 residuals: Optional[list[np.ndarray]] = None,
                 epilogue: Optional[EpilogueParams] = None) -> None:
        plan = program.plan
        self.epilogue = epilogue
        self.residuals = residuals
        self.plan: Plan = plan
        self.program = program
        self.n = len(plan.gpus)
        self.dtype = np.dtype(dtype)
        self.reduce_op = reduce_op
        self.accum = accum
        check_run_arguments(schedule, seed, launches, packet_type)
        self.ll16 = packet_type == "LL16"
        self.launches = launches
        self.schedule = schedule
        self.rng = random.Random(seed)
        n = len(plan.gpus)
        if lead is not None and not (isinstance(lead, int) and 0 <= lead < max(n, 1)):
            raise PlanError(f"runahead lead rank {lead!r} is not a rank of the plan ({n} ranks)")
        #: the rank the ``runahead`` schedule lets run ahead (the others in order after it)
        self.lead = (seed % max(n, 1)) if lead is None else lead
        self.spec = spec or spec_from_plan(plan)
        self.nsym = nsym
        if not (isinstance(sym_granule, int) and sym_granule >= SYM_GRANULE and sym_granule & (sym_granule - 1) == 0):
            raise PlanError(f"symbolic granule must be a power of two of at least {SYM_GRANULE} bytes, "
                            f"got {sym_granule!r}")
        #: bytes per row of the symbolic shadows
        self.sym_granule = sym_granule
        self.poison = poison_outputs
        self.max_steps = max_steps
        #: checked at every step: a run past its time limit stops with a LimitError
        self.deadline = deadline
        self.inputs = inputs
        state = run_state(program, self.spec, nsym, sym_granule)
        vars(self).update(vars(state))   # the run's own attributes: every op's lookup stays one dict hit
        self.log = AccessLog(state.host_tids, self._on_race) if check_races else None

    # ---------------------------------------------------------------- problems
    def _on_race(self, info: RaceInfo) -> None:
        key = (info.first.op, info.second.op)
        if key not in self._race_keys:   # one problem per pair of ops
            self._race_keys.add(key)
            self.problems.append(race_problem(info, self.unpublished, self.plan.use_double_scratch_buffer))

    def problem(self, kind: str, message: str, **details) -> None:
        self.problems.append(Problem(kind, message, details=details))

    # ---------------------------------------------------------------- access recording
    def _record(self, actor: Actor, rank: int, key: str, a: int, b: int, write: bool,
                op: OpRef, launch: int, delta: int = 0, unit: int = 16, packet: bool = False,
                host: bool = False, single: bool = False,
                touch: bool = False) -> None:
        if self.log is None or b <= a:
            return
        acc = Access(actor.tid, int(actor.vc[actor.tid]), write, op, launch, delta, unit, host,
                     packet, actor.rvc.copy() if (packet and write) else None)
        self.log.access(f"rank{rank}.{key}", a, b, acc, actor.vc, actor.rvc, single, touch)

    # ---------------------------------------------------------------- op references
    def _opref(self, task: Task, cop: COp) -> OpRef:
        return OpRef(task.rank, task.tb, cop.index, cop.name, task.launch)

    # ---------------------------------------------------------------- block interpreter
    def _block(self, task: Task) -> Iterator:
        for i, cop in enumerate(task.cops):
            task.pos = i
            task.cur = cop
            yield from self._op(task, cop, None)
            yield None
        task.pos = len(task.cops)

    def _op(self, task: Task, cop: COp, pipe: Optional[COp]) -> Iterator:
        name = cop.op.name
        actor = task.actor
        rank = task.rank
        mem = self.mem[rank]
        opref = self._opref(task, cop)
        if name == OpName.pipeline:
            for it in cop.iterations:
                for inner in it:
                    task.cur = inner
                    yield from self._op(task, inner, cop)
                yield None
            return
        actor.step()
        if name == OpName.nop:
            actor.nop()
            return
        if name == OpName.barrier:
            yield from self._barrier(task, cop)
            return
        if name in SIGNAL_OPS:
            if actor.dirty:
                self.problem("unsynced-signal",
                             f"rank {rank} tb {task.tb} op {cop.index} {cop.name} follows data op "
                             f"{actor.dirty_op.index if actor.dirty_op else '?'} "
                             f"{actor.dirty_op.name if actor.dirty_op else ''} with no nop between them: "
                             f"the signalling thread does not publish the other threads' data",
                             op=opref)
                actor.dirty = False
            relaxed = name == OpName.rlxsignal
            for k, c in enumerate(cop.channels):  # thread k signals the op's k-th channel
                if cop.op.channel_type == ChannelType.port:
                    self._post(task, "signal", None, c, opref, k)
                else:
                    self._signal(task, (rank, "memory", c), relaxed, opref, k)
            return
        if name in WAIT_OPS:
            relaxed = name == OpName.rlxwait
            ctype = cop.op.channel_type.value
            targets = []
            for c in cop.channels:
                key = (rank, ctype, c)
                end = self._end(key)
                end.expected += 1
                end.first_wait = end.first_wait or opref
                targets.append((key, end, end.expected))
            for k, (key, end, target) in enumerate(targets):  # thread k waits on channel k
                while end.counter < target:
                    yield Wait(("ctr", key),
                               f"{ctype} channel {key[2]} (to rank {self._peer_of(key)}) to reach "
                               f"{target} signals, has {end.counter}", ("ctr", key, target))
                vc, rvc = end.clocks[target - 1]
                actor.acquire(None if relaxed else vc, rvc, k, opref,
                              f"{ctype} channel {key[2]} (from rank {self._peer_of(key)})")
            return
        if name == OpName.flush:
            for c in cop.channels:
                # the block continues only once the proxy is done: its reads of the sources and
                # its writes precede every later op of the block (a pws without flush: no order)
                yield from self._flush(task, rank, c)
            return
        if name in SEMAPHORE_OPS:
            for k, sid in enumerate(cop.op.semaphore_ids):  # thread k: the op's k-th semaphore
                s = self.sems.get((rank, sid))
                if s is None:
                    raise PlanError(f"rank {rank} tb {task.tb} op {cop.index} {cop.name}: semaphore "
                                    f"{sid} does not exist (rank has {len(self.plan.gpus[rank].semaphores)})")
                if name == OpName.sem_release:
                    # a release adds a token carrying what it publishes (or pays off a negative
                    # initial value); an acquire takes the oldest token, the initial ones first,
                    # and is ordered after that release only: an acquire that a wrong initial
                    # value lets through orders nothing, whatever the schedule
                    vc, rvc = self._publish(task, k, opref, f"semaphore {sid}")
                    s[0] += 1
                    if s[1] < 0:
                        s[1] += 1
                    else:
                        s[2].append((vc.copy(), rvc.copy()))
                    self._wake(("sem", rank, sid))
                else:
                    while s[0] <= 0:
                        yield Wait(("sem", rank, sid), f"semaphore {sid} to become positive (is {s[0]})",
                                   ("sem", rank, sid))
                    s[0] -= 1
                    if s[1] > 0:
                        s[1] -= 1
                    else:
                        actor.acquire(*s[2].popleft(), k, opref, f"semaphore {sid}")
            return
        if name == OpName.rmsnorm:
            actor.dirty = True
            actor.dirty_op = opref
            self._rmsnorm(task, actor, cop, opref)
            return
        # data ops
        if cop.op.channel_type == ChannelType.port and name in (
                OpName.put, OpName.pws, OpName.pwsf, OpName.ppkt, OpName.rppkt):
            yield from self._port_data(task, cop, opref)
            return
        actor.dirty = True
        actor.dirty_op = opref
        for g in cop.groups:
            yield from self._exec_group(task, actor, cop, g, rank, mem.flag, mem.half,
                                        task.launch, opref, False)

    def _peer_of(self, key: tuple) -> int:
        p = self.pair.get(key)
        return p[0] if p else -1

    def _end(self, key: tuple) -> ChannelEnd:
        e = self.ends.get(key)
        if e is None:
            e = self.ends[key] = ChannelEnd(f"rank {key[0]} {key[1]} channel {key[2]}")
        return e

    def _signal_clock(self, end: ChannelEnd, vc: Optional[np.ndarray], rvc: np.ndarray, op: OpRef) -> None:
        end.first_signal = end.first_signal or op
        if end.clocks:
            pvc, prvc = end.clocks[-1]
            nvc = pvc if vc is None else np.maximum(pvc, vc)
            nrvc = np.maximum(prvc, rvc)
        else:
            nvc = np.zeros(self.nthreads, dtype=np.int64) if vc is None else vc.copy()
            nrvc = rvc.copy()
        end.clocks.append((nvc, nrvc))
        end.counter += 1

    def _signal(self, task: Task, key: tuple, relaxed: bool, opref: OpRef, thread: int) -> None:
        dst = self.pair[key]
        end = self._end(dst)
        vc, rvc = self._publish(task, thread, opref, f"memory channel {key[2]} (to rank {dst[0]})")
        self._signal_clock(end, None if relaxed else vc, rvc, opref)
        self._wake(("ctr", dst))

    def _publish(self, task: Task, thread: int, opref: OpRef, what: str,
                 via: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
        """What thread ``thread`` of ``task``'s block publishes by sending ``what`` of op
        ``opref`` (a signal, a semaphore release, a port request to proxy ``via``): the block as
        of its last nop and what that thread acquired. Remembered, for race reports, when the
        block's other threads acquired more since the nop."""
        vc, rvc = task.actor.publish(thread)
        if len(self.unpublished) < 4096 and (miss := task.actor.missing(thread, vc, rvc)):
            self.unpublished.append(Unpublished(thread, vc.copy(), rvc.copy(), opref, what, miss, via))
        return vc, rvc

    # ---------------------------------------------------------------- barriers
    def _barrier(self, task: Task, cop: COp) -> Iterator:
        op = cop.op
        rank = task.rank
        bid = op.barrier_id
        key = (rank, bid)
        st = self.barriers.setdefault(key, {"passes": {}, "arrivals": {}, "left": {}})
        actor = task.actor
        actor.nop()
        g = st["passes"].get(task.tb, 0)
        st["passes"][task.tb] = g + 1
        arr = st["arrivals"].setdefault(g, {})
        arr[task.tb] = (actor.vc.copy(), actor.rvc.copy())
        need = op.num_threadblocks or 1
        members = set(op.barrier_tbs) if op.barrier_tbs else None
        if members is not None and task.tb not in members:
            raise PlanError(f"rank {rank} tb {task.tb} op {cop.index} barrier {bid}: barrier_tbs "
                            f"{sorted(members)} does not list this thread block")
        self._wake(("bar", rank, bid))
        while len(arr) < need or (members is not None and not members.issubset(arr.keys())):
            yield Wait(("bar", rank, bid),
                       f"barrier {bid} (generation {g}): {len(arr)} of {need} blocks arrived "
                       f"({sorted(arr)})", ("bar", rank, bid, g, need, tuple(sorted(members or ()))))
        actor.acquire(np.maximum.reduce([v for v, _ in arr.values()]), np.maximum.reduce([r for _, r in arr.values()]))
        actor.nop()
        left = st["left"].get(g, 0) + 1
        st["left"][g] = left
        if left >= len(arr):
            st["arrivals"].pop(g, None)
            st["left"].pop(g, None)

    # ---------------------------------------------------------------- launches
    def _host_opref(self, rank: int, launch: int, what: str) -> OpRef:
        return OpRef(rank, -1, "-", what, launch)

    def _start_launch(self, rank: int) -> None:
        k = self.rank_launch[rank] + 1
        self.rank_launch[rank] = k
        mem = self.mem[rank]
        mem.set_launch(k)
        host = self.hosts[rank]
        host.tick()
        op = self._host_opref(rank, k, "launch start: inputs written")
        ikey, ibase = mem.alias[BufferKind.input]
        okey, obase = mem.alias[BufferKind.output]
        ib = mem.layout.input_bytes
        ob = mem.layout.output_bytes
        if self.poison and ob:
            mem.storage[okey][obase: obase + ob] = 0xFF
        g = self.sym_granule
        if mem.shadow is not None:
            mem.shadow[okey][obase // g: -(-(obase + ob) // g)] = 0
            mem.expr[okey][obase // g: -(-(obase + ob) // g)] = 0  # type: ignore[index]
        data = self.inputs[rank]
        mem.storage[ikey][ibase: ibase + ib] = data
        rb = mem.storage["res"].shape[0]
        if rb:
            if self.residuals is None or self.residuals[rank].shape[0] != rb:
                raise PlanError(f"the plan has epilogue ops: rank {rank} needs a residual of {rb} bytes")
            mem.storage["res"][:] = self.residuals[rank]
            if mem.shadow is not None:
                mem.shadow["res"][:] = 0
                self._init_residual_exprs(rank)
            self._record(host, rank, "res", 0, rb, True,
                         self._host_opref(rank, k, "launch start: residual written"), k, host=True, single=True)
        if mem.shadow is not None:
            self._init_input_shadow(rank)
        self._record(host, rank, okey, obase, obase + ob, True,
                     self._host_opref(rank, k, "launch start: outputs handed to the kernel"), k,
                     host=True, single=True)
        self._record(host, rank, ikey, ibase, ibase + ib, True, op, k, host=True, single=True)
        if k >= 2:
            # the scratch is handed to the new launch: with double scratch only the half this
            # launch uses (launch k-1 used the other one), else all of it
            if mem.double:
                s0, s1 = mem.half, mem.half + mem.scratch_half
            else:
                s0, s1 = 0, mem.storage["scr"].shape[0]
            self._record(host, rank, "scr", s0, s1, True,
                         self._host_opref(rank, k, "launch start: scratch reused"), k, host=True,
                         single=True, touch=True)
        tasks = []
        for i, cops in enumerate(self.program.blocks[rank]):
            actor = self.block_actors[rank][i]
            actor.start(host.vc, host.rvc)
            t = Task(rank, i, k, actor, cops)
            t.gen = self._block(t)
            tasks.append(t)
        self.tasks_of[rank] = tasks
        self.live[rank] = len(tasks)
        for t in tasks:
            self._make_runnable(t)
        if not tasks:
            self._end_launch(rank)

    def _init_input_shadow(self, rank: int) -> None:
        mem = self.mem[rank]
        ikey, ibase = mem.alias[BufferKind.input]
        cin = self.plan.gpus[rank].input_chunks
        sh = mem.shadow[ikey]  # type: ignore[index]
        g = self.sym_granule
        sh[ibase // g: -(-(ibase + mem.layout.input_bytes) // g)] = 0
        for c in range(cin):
            off, ln = mem.layout.span(BufferKind.input, c)
            if ln == 0:
                continue
            if (ibase + off) % g or ln % g:
                self.sym_ok = False
                continue
            sh[(ibase + off) // g: (ibase + off + ln) // g, rank * cin + c] = 1
            mem.expr[ikey][(ibase + off) // g: (ibase + off + ln) // g] = self.exprs.leaf("x", rank, c)  # type: ignore[index]

    def _init_residual_exprs(self, rank: int) -> None:
        """The residual's granules hold the leaves ``res[k]``: the same value on every rank (the
        residual stream of tensor parallelism is replicated)."""
        mem = self.mem[rank]
        g = self.sym_granule
        ex = mem.expr["res"]  # type: ignore[index]
        ex[:] = 0
        for c in range(self.plan.gpus[rank].input_chunks):
            off, ln = mem.layout.span(BufferKind.residual, c)
            if ln and not (off % g or ln % g):
                ex[off // g: (off + ln) // g] = self.exprs.leaf("res", c)

    def _end_launch(self, rank: int) -> None:
        k = self.rank_launch[rank]
        host = self.hosts[rank]
        for a in self.block_actors[rank]:
            host.join(a.vc, a.rvc)
        host.tick()
        mem = self.mem[rank]
        okey, obase = mem.alias[BufferKind.output]
        ob = mem.layout.output_bytes
        self._record(host, rank, okey, obase, obase + ob, False,
                     self._host_opref(rank, k, "launch end: outputs read"), k, host=True, single=True)
        while len(self.outputs) < k:
            self.outputs.append([None] * self.n)  # type: ignore[list-item]
            self.out_shadows.append([None] * self.n)  # type: ignore[list-item]
        self.outputs[k - 1][rank] = mem.storage[okey][obase: obase + ob].copy()
        rb = mem.storage["res"].shape[0]
        if rb:
            self._record(host, rank, "res", 0, rb, False,
                         self._host_opref(rank, k, "launch end: residual read"), k, host=True, single=True)
            while len(self.residual_outputs) < k:
                self.residual_outputs.append([None] * self.n)  # type: ignore[list-item]
            self.residual_outputs[k - 1][rank] = mem.storage["res"].copy()
        if mem.shadow is not None:
            g = self.sym_granule
            self.out_shadows[k - 1][rank] = mem.shadow[okey][obase // g: (obase + ob) // g].copy()
            while len(self.out_exprs) < k:
                self.out_exprs.append([None] * self.n)  # type: ignore[list-item]
                self.res_exprs.append([None] * self.n)  # type: ignore[list-item]
            self.out_exprs[k - 1][rank] = mem.expr[okey][obase // g: (obase + ob) // g].copy()  # type: ignore[index]
            self.res_exprs[k - 1][rank] = mem.expr["res"].copy()  # type: ignore[index]
        for (r, sid), s in self.sems.items():
            if r == rank and s[0] != self.plan.gpus[r].semaphores[sid].init_value:
                self.problem("unbalanced-semaphore",
                             f"rank {r} semaphore {sid} is {s[0]} after launch {k}, not its initial "
                             f"value {self.plan.gpus[r].semaphores[sid].init_value}: acquires and "
                             f"releases do not balance", rank=r, semaphore=sid)
        if k < self.launches:
            self._start_launch(rank)

    # ---------------------------------------------------------------- main loop
    def run(self) -> None:
        """Run every launch of every rank to the end. Raises :class:`Deadlock`."""
        for r in range(self.n):
            self._start_launch(r)
        while True:
            t = self._pick()
            if t is None:
                if any(self.waiting.values()):
                    raise Deadlock(self._deadlock_problem())
                break
            self._step(t)
        for key, end in self.ends.items():
            if end.counter != end.expected:
                self._unbalanced(key, end)

    def _unbalanced(self, key: tuple, end: ChannelEnd) -> None:
        """The ``unbalanced-channel`` problem of channel end ``key``: its counts per launch (every
        launch ran to its end, the same ops each time, so the totals divide: the figures of the
        compile warning) and the first op of the side that has more."""
        n, peer = self.launches, next((a[0] for a, b in self.pair.items() if b == key), -1)
        side, op = ("signal", end.first_signal) if end.counter > end.expected else ("wait", end.first_wait)
        first = f" (first {side}: rank {op.rank} tb {op.tb} op {op.index} {op.name})" if op is not None else ""
        self.problem("unbalanced-channel", f"{end.label} received {end.counter // n} signals per launch from rank {peer} "
                     f"but its blocks waited for {end.expected // n} per launch: signals and waits do not pair up on "
                     f"this channel{first}", end=key)

    def _step(self, t: Task) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            raise PlanError(f"simulation exceeded {self.max_steps} steps")
        if self.deadline is not None:
            self.deadline.check()
        if t.proxy is not None:
            if self._proxy_step(t):
                self._make_runnable(t)
            else:
                t.proxy.task = None
            return
        try:
            w = next(t.gen)  # type: ignore[arg-type]
        except StopIteration:
            t.done = True
            t.actor.nop()  # the block has ended: everything it acquired is part of its history
            self.live[t.rank] -= 1
            if self.live[t.rank] == 0:
                self._end_launch(t.rank)
            return
        if w is None:
            self._make_runnable(t)
            return
        t.wait = w
        self.waiting.setdefault(w.key, []).append(t)
        if w.key[0] == "flag":
            self.flag_pages.setdefault(w.key[1], {})[w.key[2]] = True
        if self.schedule == "adversarial":
            wk = w.info
            if wk[0] == "ctr":
                self.waited_ranks.add(self._peer_of(wk[1]))

