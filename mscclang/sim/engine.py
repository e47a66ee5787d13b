"""The simulation: every thread block of every rank (and every port channel's proxy) is a
cooperative task interpreting its ops over :class:`RankMemory`, under a chosen schedule.

A block task is a generator. It yields ``None`` after each op (a scheduling point) and a
:class:`Wait` when it cannot go on; packet ops consume whatever packets are ready and wait for the
rest, so two blocks streaming packets to each other both progress. A waiting task is woken when
the state it waits on (a channel counter, a rank's packets, a barrier, a semaphore, a proxy)
changes. When nothing can run while some task waits, the run is a deadlock and the wait-for
cycle is reported.

Port channels: a port ``put``/``pws``/``pwsf``/``signal`` posts a trigger to the channel's proxy
(a task of its own, processing its queue in order, with the clocks the block published). The
proxy reads the sources and writes the peer when it gets to the trigger, so a plain ``pws`` orders
nothing on the sending rank: reusing its source (even after the block ended: the next launch's
inputs) races with the proxy's read until a flush or a signal from the receiver says otherwise.
``flush`` and ``pwsf`` make the whole block wait until the proxy finished every request posted on
the channel: the proxy's reads and writes then precede every later op of the block, with no
``nop`` needed (:meth:`mscclang.sim.races.Actor.complete`). The proxy's queue persists across
launches and a launch's end does not wait for it; each launch after the first starts with the
host handing it the scratch (only the half it uses with double scratch), which races with any
earlier proxy access of those bytes that no flush or edge ordered before it.

Schedules (:data:`SCHEDULES`): ``round_robin``; ``random`` (seeded); ``adversarial`` (prefers
readers and waiters, delays writers and the ranks others wait on); ``runahead``: one lead rank
(``lead``, default ``seed % ranks``) always runs when it can, then the next rank in order, and so
on, so the lead runs as many launches ahead as the plan lets it while the last ranks are starved
(a block of a starved rank runs only when no block of a rank before it can progress).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from mscclang.errors import PlanError
from mscclang.plan.collectives import CollectiveSpec, spec_from_plan
from mscclang.plan.models import BufferKind, ChannelType, OpName, Plan
from mscclang.sim.budget import Deadline
from mscclang.sim.dtypes import reduce_bytes
from mscclang.sim.program import COp, Group, Operand, Program
from mscclang.sim.races import Access, AccessLog, Actor, OpRef, RaceInfo
from mscclang.sim.report import Deadlock, Problem
from mscclang.sim.state import RankMemory

SCHEDULES = ("round_robin", "random", "adversarial", "runahead")
REMOTE_WRITERS = frozenset({OpName.put, OpName.pws, OpName.pwsf, OpName.ppkt, OpName.rppkt,
                            OpName.res, OpName.rres, OpName.respkt, OpName.recspkt,
                            OpName.gstore, OpName.gstorepkt, OpName.glres, OpName.signal,
                            OpName.rlxsignal, OpName.sem_release})
PKT_WRITERS = frozenset({OpName.cpkt, OpName.ppkt, OpName.rppkt, OpName.respkt, OpName.recpkt,
                         OpName.recspkt, OpName.gstorepkt})


class Wait:
    """Why a task cannot go on: ``key`` (what wakes it) and a description for reports."""

    __slots__ = ("key", "what", "info")

    def __init__(self, key: tuple, what: str, info: tuple) -> None:
        self.key = key
        self.what = what
        self.info = info


class ChannelEnd:
    """The inbound counter of one channel end and what each signal published."""

    __slots__ = ("counter", "expected", "clocks", "label")

    def __init__(self, label: str) -> None:
        self.counter = 0
        self.expected = 0
        self.clocks: list[tuple[np.ndarray, np.ndarray]] = []  # prefix joins (vc, rvc)
        self.label = label


class Task:
    __slots__ = ("rank", "tb", "launch", "actor", "gen", "cops", "pos", "cur", "wait", "done",
                 "proxy", "woken")

    def __init__(self, rank: int, tb: int, launch: int, actor: Actor, cops: list[COp]) -> None:
        self.rank = rank
        self.tb = tb
        self.launch = launch
        self.actor = actor
        self.cops = cops
        self.pos = 0
        self.cur: Optional[COp] = None
        self.wait: Optional[Wait] = None
        self.done = False
        self.proxy: Optional["Proxy"] = None
        self.gen: Optional[Iterator] = None
        self.woken = False

    def where(self) -> str:
        if self.proxy is not None:
            return f"rank {self.rank} port proxy {self.proxy.channel}"
        if self.cur is None:
            return f"rank {self.rank} tb {self.tb}"
        return f"rank {self.rank} tb {self.tb} op {self.cur.index} {self.cur.name}"


@dataclass
class Trigger:
    kind: str                  # "data" or "signal"
    group: Optional[Group]
    flag: int
    half: int
    launch: int
    vc: np.ndarray
    rvc: np.ndarray
    op: OpRef
    end: Optional[ChannelEnd] = None
    end_key: Optional[tuple] = None


class Proxy:
    """The host proxy of one port channel: processes triggers in order."""

    def __init__(self, rank: int, channel: int, actor: Actor) -> None:
        self.rank = rank
        self.channel = channel
        self.actor = actor
        self.queue: deque[Trigger] = deque()
        self.issued = 0
        self.processed = 0
        self.task: Optional[Task] = None


class Simulation:
    """One run of a compiled plan on given inputs under one schedule.

    ``inputs`` are byte arrays, one per rank. After :meth:`run`, ``outputs[k][r]`` holds rank
    ``r``'s output bytes after launch ``k`` and ``problems`` what was found (races and the like;
    a deadlock raises :class:`Deadlock` when ``raise_deadlock``)."""

    def __init__(self, program: Program, inputs: list[np.ndarray], *, dtype: np.dtype,
                 reduce_op: str = "sum", packet_type: str = "LL16", launches: int = 1,
                 schedule: str = "round_robin", seed: int = 0, check_races: bool = True,
                 nsym: int = 0, spec: Optional[CollectiveSpec] = None,
                 poison_outputs: bool = False, max_steps: int = 10_000_000,
                 lead: Optional[int] = None, deadline: Optional[Deadline] = None) -> None:
        plan = program.plan
        self.plan: Plan = plan
        self.program = program
        self.n = len(plan.gpus)
        self.dtype = np.dtype(dtype)
        self.reduce_op = reduce_op
        if packet_type not in ("LL8", "LL16"):
            raise PlanError(f"unknown packet type {packet_type!r} (LL8 or LL16)")
        self.ll16 = packet_type == "LL16"
        self.launches = launches
        if schedule not in SCHEDULES:
            raise PlanError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
        self.schedule = schedule
        self.rng = random.Random(seed)
        n = len(plan.gpus)
        if lead is not None and not (isinstance(lead, int) and 0 <= lead < max(n, 1)):
            raise PlanError(f"runahead lead rank {lead!r} is not a rank of the plan ({n} ranks)")
        #: the rank the ``runahead`` schedule lets run ahead (the others in order after it)
        self.lead = (seed % max(n, 1)) if lead is None else lead
        self.spec = spec or spec_from_plan(plan)
        self.nsym = nsym
        self.poison = poison_outputs
        self.max_steps = max_steps
        #: checked at every step: a run past its time limit stops with a LimitError
        self.deadline = deadline
        self.mem = [RankMemory(plan, self.spec, r, program.layouts[r], nsym) for r in range(self.n)]
        self.inputs = inputs
        self.problems: list[Problem] = []
        self._race_keys: set = set()
        self.outputs: list[list[np.ndarray]] = []
        self.out_shadows: list[list[np.ndarray]] = []
        self.sym_ok = True

        # thread ids: blocks, then hosts, then proxies
        self.tid_base: list[int] = []
        t = 0
        for g in plan.gpus:
            self.tid_base.append(t)
            t += len(g.threadblocks)
        self.host_tid = list(range(t, t + self.n))
        t += self.n
        self.port_peers = [g.peers(ChannelType.port) for g in plan.gpus]
        self.proxy_tid: dict[tuple[int, int], int] = {}
        for r in range(self.n):
            for c in range(len(self.port_peers[r])):
                self.proxy_tid[(r, c)] = t
                t += 1
        self.nthreads = t
        self.hosts = [Actor(self.host_tid[r], t) for r in range(self.n)]
        self.block_actors = [[Actor(self.tid_base[r] + i, t) for i in range(len(g.threadblocks))]
                             for r, g in enumerate(plan.gpus)]
        self.proxies: dict[tuple[int, int], Proxy] = {
            k: Proxy(k[0], k[1], Actor(v, t)) for k, v in self.proxy_tid.items()}
        self.log = AccessLog(set(self.host_tid), self._on_race) if check_races else None

        # channel ends and pairing
        self.ends: dict[tuple, ChannelEnd] = {}
        self.pair: dict[tuple, tuple] = {}
        for ctype in (ChannelType.memory, ChannelType.port):
            peers = [g.peers(ctype) for g in plan.gpus]
            for a in range(self.n):
                seen: dict[int, int] = {}
                for gidx, b in enumerate(peers[a]):
                    j = seen.get(b, 0)
                    seen[b] = j + 1
                    if not 0 <= b < self.n:
                        raise PlanError(f"rank {a} {ctype.value} channel {gidx} connects to rank {b}, not in the plan")
                    back = [i for i, x in enumerate(peers[b]) if x == a]
                    key_b = (b, ctype.value, back[j]) if j < len(back) else (b, ctype.value, f"hidden{a}.{j}")
                    self.pair[(a, ctype.value, gidx)] = key_b
        self.sems: dict[tuple[int, int], list] = {}
        for r, g in enumerate(plan.gpus):
            for i, s in enumerate(g.semaphores):
                self.sems[(r, i)] = [s.init_value, None, None]
        self.barriers: dict[tuple[int, int], dict] = {}

        # scheduling
        self.waiting: dict[tuple, list[Task]] = {}
        self.flag_pages: dict[int, dict[int, bool]] = {}
        self.runnable: list[Task] = []
        self.rr: deque[Task] = deque()
        self.live: dict[int, int] = {}
        self.rank_launch = [0] * self.n
        self.tasks_of: list[list[Task]] = [[] for _ in range(self.n)]
        self.waited_ranks: set[int] = set()
        self.steps = 0

    # ---------------------------------------------------------------- problems
    def _on_race(self, info: RaceInfo) -> None:
        a, b = info.first, info.second
        key = (a.op, b.op)
        if key in self._race_keys:
            return
        self._race_keys.add(key)
        kinds = ("write" if a.write else "read", "write" if b.write else "read")
        hint = ""
        handover = (a.host and a.op.name.startswith("launch start: scratch")) or \
            (b.host and b.op.name.startswith("launch start: scratch"))
        other = b if a.host else a
        if handover and other.op.tb <= -2 and other.op.rank == (a if a.host else b).op.rank:
            half = " half" if self.plan.use_double_scratch_buffer else ""
            hint = (f" (the launch that reuses this scratch{half} is not ordered after this "
                    "rank's port proxy's access of an earlier launch: a kernel exit does not wait "
                    "for the proxy; a flush of the channel, in that launch or a later one before "
                    "the reuse, or an edge from a rank that received the proxy's data would order "
                    "it)")
        elif handover:
            pk = a.packet or b.packet
            hint = (" (scratch reused by the next launch while a peer writes it with no edge from "
                    "this rank's current launch" + ("; packet scratch reused across launches needs "
                    "use_double_scratch_buffer" if pk and not self.plan.use_double_scratch_buffer
                                                    else "") + ")")
        elif (a.host and a.op.name.startswith("launch start")) or (b.host and b.op.name.startswith("launch start")):
            hint = " (a peer touches this rank's buffer with no ready edge from its current launch)"
        elif (a.host and a.op.name.startswith("launch end")) or (b.host and b.op.name.startswith("launch end")):
            hint = " (data arrives after the owner may have finished: no signal->wait publishes it)"
        self.problems.append(Problem(
            "race",
            f"{a.op} {kinds[0]}s and {b.op} {kinds[1]}s bytes [{info.start}, {info.end}) of "
            f"{info.storage} with no happens-before order between them{hint}",
            details={"first": a.op, "second": b.op, "storage": info.storage,
                     "range": (info.start, info.end)}))

    def problem(self, kind: str, message: str, **details) -> None:
        self.problems.append(Problem(kind, message, details=details))

    # ---------------------------------------------------------------- access recording
    def _record(self, actor: Actor, rank: int, key: str, a: int, b: int, write: bool,
                op: OpRef, launch: int, delta: int = 0, unit: int = 16, packet: bool = False,
                exempt: bool = False, host: bool = False, single: bool = False,
                touch: bool = False) -> None:
        if self.log is None or b <= a:
            return
        acc = Access(actor.tid, int(actor.vc[actor.tid]), write, op, launch, delta, unit, host,
                     packet, exempt, actor.rvc.copy() if (packet and write) else None)
        self.log.access(f"rank{rank}.{key}", a, b, acc, actor.vc, actor.rvc, single, touch)

    # ---------------------------------------------------------------- data movement
    def _exec_group(self, task: Task, actor: Actor, cop: COp, g: Group, rank: int, flag: int,
                    half: int, launch: int, opref: OpRef, single: bool,
                    raw: bool = False) -> Iterator:
        """Run one group (a copy or a reduction over pieces), consuming ready packets.

        ``raw`` (a port proxy): the block checked the source packets' flags before posting the
        request and the proxy copies the bytes as they are, never waiting. Packets that no
        longer carry the request's flag were overwritten by a later launch before the proxy got
        to them: the proxy still reads them, as a plain read ordered by nothing the flags say
        (so the overwrite, and the hand-over of that scratch, race with it)."""
        mem = self.mem
        nsrc = len(g.srcs)
        pkt_op = any(o.packet for o in g.srcs) or any(o.packet for o in g.dsts)
        unit = (8 if self.ll16 else 4) if pkt_op else 16
        pos = 0
        for piece in g.pieces:
            done = 0
            L0 = piece.length
            while done < L0:
                n = L0 - done
                stale: set[int] = set()
                for i, s in enumerate(g.srcs):
                    if s.packet:
                        r = mem[s.rank].ready_bytes(piece.offsets[i] + done, n, flag, half)
                        if r < n and raw:
                            stale.add(i)
                        elif r < n:
                            n = r
                            if n == 0:
                                addr = half + 8 * ((piece.offsets[i] + done) // 4)
                                yield Wait(("flag", s.rank, addr >> 7),
                                           f"packets of rank {s.rank} scratch at payload offset "
                                           f"{piece.offsets[i] + done} with flag {flag}",
                                           ("flag", s.rank))
                                break
                if n == 0:
                    continue
                datas = []
                shadows = []
                for i, s in enumerate(g.srcs):
                    off = piece.offsets[i] + done
                    m = mem[s.rank]
                    key, base = m.alias[s.kind]
                    if s.kind == BufferKind.scratch:
                        base += half
                    if s.packet:
                        datas.append(m.read_packets(off, n, half))
                        w0 = off // 4
                        w1 = -(-(off + n) // 4)
                        a = half + 8 * w0
                        b = half + 8 * w1
                        if self.log is not None and i not in stale:
                            for c in self.log.packet_clocks(f"rank{s.rank}.scr", a, b):
                                np.maximum(actor.rvc, c, out=actor.rvc)
                        self._record(actor, s.rank, key, a, b, False, opref, launch,
                                     delta=a - 2 * (pos + done), unit=unit,
                                     packet=i not in stale, single=single)
                        if m.shadow is not None:
                            shadows.append(self._sh_pkt(m, key, half, off, n))
                    else:
                        a = base + off
                        datas.append(m.storage[key][a: a + n].copy())
                        self._record(actor, s.rank, key, a, a + n, False, opref, launch,
                                     delta=a - (pos + done), unit=unit, single=single)
                        if m.shadow is not None:
                            shadows.append(self._sh_plain(m, key, a, n))
                if g.reduce and nsrc > 1:
                    result = reduce_bytes(datas, self.dtype, self.reduce_op)
                    sh = None
                    if shadows and all(x is not None for x in shadows):
                        sh = shadows[0].astype(np.int16)
                        for x in shadows[1:]:
                            sh = sh + x
                else:
                    result = datas[0]
                    sh = shadows[0] if shadows else None
                for j, d in enumerate(g.dsts):
                    off = piece.offsets[nsrc + j] + done
                    self._write(actor, rank, d, off, result, sh, flag, half, launch, opref,
                                delta_pos=pos + done, unit=unit, single=single)
                done += n
            pos += L0
        for (k, a, b) in g.pads:
            d = g.dsts[k]
            m = mem[d.rank]
            s0, s1 = m.pad_packets(a, b, flag, self.ll16, half)
            if s1 > s0:
                exempt = d.rank != rank and m.double
                self._record(actor, d.rank, "scr", s0, s1, True, opref, launch, delta=0,
                             unit=unit, packet=True, exempt=exempt, single=single)
                if m.shadow is not None:
                    m.shadow["scr"][s0 // 4: s1 // 4] = 0
                self._wake_flags(d.rank, s0, s1)

    def _write(self, actor: Actor, rank: int, d: Operand, off: int, data: np.ndarray,
               sh: Optional[np.ndarray], flag: int, half: int, launch: int, opref: OpRef,
               delta_pos: int, unit: int, single: bool) -> None:
        m = self.mem[d.rank]
        key, base = m.alias[d.kind]
        n = data.shape[0]
        if d.packet:
            s0, s1 = m.write_packets(off, data, flag, self.ll16, half)
            exempt = d.rank != rank and m.double
            self._record(actor, d.rank, key, s0, s1, True, opref, launch,
                         delta=s0 - 2 * delta_pos, unit=unit, packet=True, exempt=exempt, single=single)
            if m.shadow is not None:
                self._sh_put_pkt(m, half, off, n, sh)
            self._wake_flags(d.rank, s0, s1)
        else:
            if d.kind == BufferKind.scratch:
                base += half
            a = base + off
            m.storage[key][a: a + n] = data
            self._record(actor, d.rank, key, a, a + n, True, opref, launch,
                         delta=a - delta_pos, unit=unit, single=single)
            if m.shadow is not None:
                self._sh_put_plain(m, key, a, n, sh)

    # symbolic shadows (one row of symbol counts per 4-byte word)
    def _sh_plain(self, m: RankMemory, key: str, a: int, n: int) -> Optional[np.ndarray]:
        if a % 4 or n % 4:
            self.sym_ok = False
            return None
        return m.shadow[key][a // 4: (a + n) // 4].copy()  # type: ignore[index]

    def _sh_pkt(self, m: RankMemory, key: str, half: int, off: int, n: int) -> Optional[np.ndarray]:
        if off % 4 or n % 4:
            self.sym_ok = False
            return None
        w0, w1 = off // 4, (off + n) // 4
        h4 = half // 4
        return m.shadow["scr"][h4 + 2 * w0: h4 + 2 * w1: 2].copy()  # type: ignore[index]

    def _sh_put_plain(self, m: RankMemory, key: str, a: int, n: int, sh: Optional[np.ndarray]) -> None:
        if sh is None or a % 4 or n % 4:
            self.sym_ok = False
            return
        m.shadow[key][a // 4: (a + n) // 4] = sh  # type: ignore[index]

    def _sh_put_pkt(self, m: RankMemory, half: int, off: int, n: int, sh: Optional[np.ndarray]) -> None:
        if sh is None or off % 4 or n % 4:
            self.sym_ok = False
            return
        w0, w1 = off // 4, (off + n) // 4
        h4 = half // 4
        m.shadow["scr"][h4 + 2 * w0: h4 + 2 * w1: 2] = sh  # type: ignore[index]

    # ---------------------------------------------------------------- scheduling helpers
    def _wake(self, key: tuple) -> None:
        lst = self.waiting.pop(key, None)
        if lst:
            for t in lst:
                t.wait = None
                self._make_runnable(t)

    def _wake_flags(self, rank: int, s0: int, s1: int) -> None:
        """Wake tasks waiting for packets whose flags lie in scratch bytes [s0, s1) of rank."""
        pages = self.flag_pages.get(rank)
        if not pages:
            return
        p0, p1 = s0 >> 7, (s1 - 1) >> 7
        if p1 - p0 + 1 > len(pages):
            hits = [pg for pg in pages if p0 <= pg <= p1]
        else:
            hits = [pg for pg in range(p0, p1 + 1) if pg in pages]
        for pg in hits:
            pages.pop(pg, None)
            self._wake(("flag", rank, pg))

    def _make_runnable(self, t: Task) -> None:
        if self.schedule == "round_robin":
            self.rr.append(t)
        else:
            self.runnable.append(t)

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
        if name == OpName.nop:
            actor.nop()
            return
        if name == OpName.barrier:
            yield from self._barrier(task, cop)
            return
        if name in (OpName.signal, OpName.rlxsignal):
            if actor.dirty:
                self.problem("unsynced-signal",
                             f"rank {rank} tb {task.tb} op {cop.index} {cop.name} follows data op "
                             f"{actor.dirty_op.index if actor.dirty_op else '?'} "
                             f"{actor.dirty_op.name if actor.dirty_op else ''} with no nop between them: "
                             f"the signalling thread does not publish the other threads' data",
                             op=opref)
                actor.dirty = False
            relaxed = name == OpName.rlxsignal
            if cop.op.channel_type == ChannelType.port:
                for c in cop.channels:
                    self._trigger_signal(task, rank, c, opref)
            else:
                for c in cop.channels:
                    self._signal(actor, (rank, "memory", c), relaxed)
            return
        if name in (OpName.wait, OpName.rlxwait):
            relaxed = name == OpName.rlxwait
            ctype = cop.op.channel_type.value
            targets = []
            for c in cop.channels:
                key = (rank, ctype, c)
                end = self._end(key)
                end.expected += 1
                targets.append((key, end, end.expected))
            for key, end, target in targets:
                while end.counter < target:
                    yield Wait(("ctr", key),
                               f"{ctype} channel {key[2]} (to rank {self._peer_of(key)}) to reach "
                               f"{target} signals, has {end.counter}", ("ctr", key, target))
                vc, rvc = end.clocks[target - 1]
                actor.acquire(None if relaxed else vc, rvc)
            return
        if name == OpName.flush:
            for c in cop.channels:
                px = self.proxies[(rank, c)]
                want = px.issued
                while px.processed < want:
                    yield Wait(("proxy", rank, c), f"port proxy of channel {c} to finish {want} requests",
                               ("proxy", rank, c))
                # the block continues only once the proxy is done: its reads of the sources and
                # its writes precede every later op of the block (a pws without flush: no order)
                actor.complete(px.actor.vc, px.actor.rvc)
            return
        if name in (OpName.sem_acquire, OpName.sem_release):
            for sid in cop.op.semaphore_ids:
                s = self.sems.get((rank, sid))
                if s is None:
                    raise PlanError(f"rank {rank} tb {task.tb} op {cop.index} {cop.name}: semaphore "
                                    f"{sid} does not exist (rank has {len(self.plan.gpus[rank].semaphores)})")
                if name == OpName.sem_release:
                    vc, rvc = actor.publish()
                    s[0] += 1
                    s[1] = vc.copy() if s[1] is None else np.maximum(s[1], vc)
                    s[2] = rvc.copy() if s[2] is None else np.maximum(s[2], rvc)
                    self._wake(("sem", rank, sid))
                else:
                    while s[0] <= 0:
                        yield Wait(("sem", rank, sid), f"semaphore {sid} to become positive (is {s[0]})",
                                   ("sem", rank, sid))
                    s[0] -= 1
                    if s[1] is not None:
                        actor.acquire(s[1], s[2])
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

    def _signal_clock(self, end: ChannelEnd, vc: Optional[np.ndarray], rvc: np.ndarray) -> None:
        if end.clocks:
            pvc, prvc = end.clocks[-1]
            nvc = pvc if vc is None else np.maximum(pvc, vc)
            nrvc = np.maximum(prvc, rvc)
        else:
            nvc = np.zeros(self.nthreads, dtype=np.int64) if vc is None else vc.copy()
            nrvc = rvc.copy()
        end.clocks.append((nvc, nrvc))
        end.counter += 1

    def _signal(self, actor: Actor, key: tuple, relaxed: bool) -> None:
        dst = self.pair[key]
        end = self._end(dst)
        vc, rvc = actor.publish()
        self._signal_clock(end, None if relaxed else vc, rvc)
        self._wake(("ctr", dst))

    # ---------------------------------------------------------------- port channels
    def _proxy_for(self, rank: int, c: int) -> Proxy:
        return self.proxies[(rank, c)]

    def _enqueue(self, px: Proxy, trig: Trigger) -> None:
        px.queue.append(trig)
        px.issued += 1
        if px.task is None:
            t = Task(px.rank, -2 - px.channel, trig.launch, px.actor, [])
            t.proxy = px
            px.task = t
            self._make_runnable(t)

    def _trigger_signal(self, task: Task, rank: int, c: int, opref: OpRef) -> None:
        px = self._proxy_for(rank, c)
        vc, rvc = task.actor.publish()
        mem = self.mem[rank]
        self._enqueue(px, Trigger("signal", None, mem.flag, mem.half, task.launch, vc.copy(),
                                  rvc.copy(), opref, end_key=(rank, "port", c)))

    def _port_data(self, task: Task, cop: COp, opref: OpRef) -> Iterator:
        rank = task.rank
        mem = self.mem[rank]
        name = cop.op.name
        for g in cop.groups:
            # packets to forward must be there before the trigger is posted
            for i, s in enumerate(g.srcs):
                if not s.packet:
                    continue
                for piece in g.pieces:
                    while True:
                        r = self.mem[s.rank].ready_bytes(piece.offsets[i], piece.length, mem.flag, mem.half)
                        if r >= piece.length:
                            break
                        addr = mem.half + 8 * ((piece.offsets[i] + r) // 4)
                        yield Wait(("flag", s.rank, addr >> 7), f"packets of rank {s.rank} scratch at payload offset "
                                   f"{piece.offsets[i] + r} with flag {mem.flag}", ("flag", s.rank))
            c = g.channel if g.channel is not None else (cop.channels[0] if cop.channels else None)
            if c is None:
                raise PlanError(f"rank {rank} tb {task.tb} op {cop.index} {cop.name}: a port op needs a channel id")
            px = self._proxy_for(rank, c)
            vc, rvc = task.actor.publish()
            self._enqueue(px, Trigger("data", g, mem.flag, mem.half, task.launch, vc.copy(), rvc.copy(), opref))
            if name in (OpName.pws, OpName.pwsf):
                self._enqueue(px, Trigger("signal", None, mem.flag, mem.half, task.launch, vc.copy(),
                                          rvc.copy(), opref, end_key=(rank, "port", c)))
        if name == OpName.pwsf:
            for c in sorted({g.channel for g in cop.groups if g.channel is not None}):
                px = self._proxy_for(rank, c)
                want = px.issued
                while px.processed < want:
                    yield Wait(("proxy", rank, c), f"port proxy of channel {c} to finish {want} requests",
                               ("proxy", rank, c))
                task.actor.complete(px.actor.vc, px.actor.rvc)

    def _proxy_step(self, task: Task) -> bool:
        """Process one trigger; False when the queue is empty."""
        px = task.proxy
        assert px is not None
        if not px.queue:
            return False
        trig = px.queue.popleft()
        a = px.actor
        a.join(trig.vc, trig.rvc)
        a.tick()
        if trig.kind == "data":
            assert trig.group is not None
            popref = OpRef(px.rank, -2 - px.channel, trig.op.index, f"proxy for tb {trig.op.tb} {trig.op.name}", trig.launch)
            gen = self._exec_group(task, a, None, trig.group, px.rank, trig.flag, trig.half,  # type: ignore[arg-type]
                                   trig.launch, popref, True, raw=True)
            for w in gen:
                if isinstance(w, Wait):  # cannot happen: a raw copy never waits
                    raise PlanError(f"{trig.op}: port proxy found packets not ready")
        else:
            dst = self.pair[trig.end_key]  # type: ignore[index]
            end = self._end(dst)
            self._signal_clock(end, a.vc.copy(), a.rvc.copy())
            self._wake(("ctr", dst))
        px.processed += 1
        self._wake(("proxy", px.rank, px.channel))
        return bool(px.queue)

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
        vcs = [v for v, _ in arr.values()]
        rvcs = [r for _, r in arr.values()]
        actor.acquire(np.maximum.reduce(vcs), np.maximum.reduce(rvcs))
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
        if mem.shadow is not None:
            mem.shadow[okey][obase // 4: (obase + ob + 3) // 4] = 0
        data = self.inputs[rank]
        mem.storage[ikey][ibase: ibase + ib] = data
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
        sh[ibase // 4: (ibase + mem.layout.input_bytes + 3) // 4] = 0
        for c in range(cin):
            off, ln = mem.layout.span(BufferKind.input, c)
            if ln == 0:
                continue
            if (ibase + off) % 4 or ln % 4:
                self.sym_ok = False
                continue
            sh[(ibase + off) // 4: (ibase + off + ln) // 4, rank * cin + c] = 1

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
        if mem.shadow is not None:
            self.out_shadows[k - 1][rank] = mem.shadow[okey][obase // 4: (obase + ob) // 4].copy()
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
                peer = self._peer_of_end(key)
                self.problem("unbalanced-channel",
                             f"{end.label} received {end.counter} signals from rank {peer} but its "
                             f"blocks waited for {end.expected}: signals and waits do not pair up on "
                             f"this channel", end=key)

    def _peer_of_end(self, key: tuple) -> int:
        for a, b in self.pair.items():
            if b == key:
                return a[0]
        return -1

    def _pick(self) -> Optional[Task]:
        if self.schedule == "round_robin":
            return self.rr.popleft() if self.rr else None
        lst = self.runnable
        if not lst:
            return None
        if self.schedule == "random":
            i = self.rng.randrange(len(lst))
        elif self.schedule == "runahead":
            i = self._runahead_index(lst)
        else:
            i = self._adversarial_index(lst)
        lst[i], lst[-1] = lst[-1], lst[i]
        return lst.pop()

    def _runahead_index(self, lst: list[Task]) -> int:
        """A runnable task of the first rank, counting from the lead rank, that has one (a
        seeded pick among that rank's blocks and proxies): the lead runs as far ahead as the
        plan lets it, launch after launch, and a rank runs only when every rank before it is
        blocked or finished."""
        n = self.n
        best = n
        cands: list[int] = []
        for i, t in enumerate(lst):
            pr = (t.rank - self.lead) % n
            if pr < best:
                best = pr
                cands = [i]
            elif pr == best:
                cands.append(i)
        return cands[self.rng.randrange(len(cands))] if len(cands) > 1 else cands[0]

    def _adversarial_index(self, lst: list[Task]) -> int:
        """Prefer blocks that read or wait; delay writers and the blocks others wait on."""
        rng = self.rng
        if rng.random() < 0.9:
            for _ in range(8):
                i = rng.randrange(len(lst))
                t = lst[i]
                if t.proxy is not None or t.rank in self.waited_ranks:
                    continue
                nxt = t.cops[t.pos].op.name if t.pos < len(t.cops) else None
                if nxt is not None and nxt in REMOTE_WRITERS:
                    continue
                return i
        return rng.randrange(len(lst))

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

    # ---------------------------------------------------------------- deadlock diagnosis
    def _remaining(self, t: Task) -> list[COp]:
        out = []
        for c in t.cops[t.pos:]:
            if c.op.name == OpName.pipeline:
                for it in c.iterations:
                    out.extend(it)
            else:
                out.append(c)
        return out

    def _could_unblock(self, w: Wait) -> tuple[list[Task], str]:
        """Live tasks that could end wait ``w``, and a note when none can."""
        info = w.info
        live = [t for r in range(self.n) for t in self.tasks_of[r] if not t.done]
        if info[0] == "ctr":
            key = info[1]
            src = next((a for a, b in self.pair.items() if b == key), None)
            if src is None:
                return [], f"no channel of rank {self._peer_of(key)} is paired with it"
            srank, stype, sch = src
            out = []
            for t in live:
                if t.rank != srank:
                    continue
                for c in self._remaining(t):
                    n = c.op.name
                    if n in (OpName.signal, OpName.rlxsignal, OpName.pws, OpName.pwsf) and \
                            c.op.channel_type.value == stype and sch in (c.channels or [g.channel for g in c.groups]):
                        out.append(t)
                        break
            return out, "" if out else f"no block of rank {srank} will signal its {stype} channel {sch} again"
        if info[0] == "flag":
            r = info[1]
            out = []
            for t in live:
                for c in self._remaining(t):
                    if c.op.name in PKT_WRITERS and any(d.rank == r and d.packet for g in c.groups for d in g.dsts):
                        out.append(t)
                        break
            return out, "" if out else f"no block will write packets into rank {r}'s scratch again"
        if info[0] == "bar":
            _, r, bid, g, need, members = info
            arrived = self.barriers.get((r, bid), {}).get("arrivals", {}).get(g, {})
            ntb = len(self.plan.gpus[r].threadblocks)
            out = []
            notes = []
            cands = members if members else range(ntb)
            for m in cands:
                if m in arrived:
                    continue
                if m >= ntb:
                    notes.append(f"tb {m} does not exist on rank {r}")
                    continue
                t = self.tasks_of[r][m]
                if t.done:
                    notes.append(f"tb {m} finished without reaching it")
                elif any(c.op.name == OpName.barrier and c.op.barrier_id == bid for c in self._remaining(t)):
                    out.append(t)
                else:
                    notes.append(f"tb {m} never reaches barrier {bid}")
            return out, "; ".join(notes)
        if info[0] == "sem":
            _, r, sid = info
            out = [t for t in live if t.rank == r and any(
                c.op.name == OpName.sem_release and sid in c.op.semaphore_ids for c in self._remaining(t))]
            return out, "" if out else f"no block of rank {r} will release semaphore {sid} again"
        return [], ""

    def _deadlock_problem(self) -> Problem:
        blocked = [t for lst in self.waiting.values() for t in lst]
        edges: dict[int, list[Task]] = {}
        notes: dict[int, str] = {}
        for t in blocked:
            outs, note = self._could_unblock(t.wait)  # type: ignore[arg-type]
            edges[id(t)] = [o for o in outs if o.wait is not None and o is not t]
            if note:
                notes[id(t)] = note
        # find a cycle
        cycle: list[Task] = []
        color: dict[int, int] = {}
        stack: list[Task] = []

        def dfs(t: Task) -> bool:
            color[id(t)] = 1
            stack.append(t)
            for o in edges.get(id(t), []):
                c = color.get(id(o), 0)
                if c == 1:
                    i = next(k for k, s in enumerate(stack) if s is o)
                    cycle.extend(stack[i:])
                    return True
                if c == 0 and dfs(o):
                    return True
            stack.pop()
            color[id(t)] = 2
            return False

        for t in sorted(blocked, key=lambda x: (x.rank, x.tb)):
            if color.get(id(t), 0) == 0 and dfs(t):
                break
        lines = []
        if cycle:
            lines.append("wait-for cycle: " + " -> ".join(f"(rank {t.rank}, tb {t.tb}, op {t.cur.index if t.cur else '-'})" for t in cycle + cycle[:1]))
            for t in cycle:
                lines.append(f"  {t.where()} (launch {t.launch}) waits for {t.wait.what}")  # type: ignore[union-attr]
        else:
            lines.append("no wait-for cycle: blocks wait for something that will never happen")
        for t in sorted(blocked, key=lambda x: (x.rank, x.tb)):
            if id(t) in notes or not cycle:
                if cycle and t in cycle:
                    continue
                lines.append(f"  {t.where()} (launch {t.launch}) waits for {t.wait.what}"  # type: ignore[union-attr]
                             + (f": {notes[id(t)]}" if id(t) in notes else ""))
        first = (cycle[0] if cycle else sorted(blocked, key=lambda x: (x.rank, x.tb))[0])
        msg = (f"all {len(blocked)} live blocks wait; first {first.where()}\n" + "\n".join(lines[:14]))
        return Problem("deadlock", msg, details={
            "cycle": [(t.rank, t.tb, t.cur.index if t.cur else None, t.wait.what) for t in cycle],  # type: ignore[union-attr]
            "blocked": [(t.rank, t.tb, t.cur.index if t.cur else None, t.wait.what) for t in blocked],  # type: ignore[union-attr]
        })
