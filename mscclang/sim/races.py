"""Happens-before bookkeeping: vector clocks and per-buffer access logs.

Every actor (a thread block of a rank, a rank's host, a port channel's proxy) has a thread id.
An actor carries two vector clocks:

* ``vc`` (strong): release/acquire edges (signal->wait, barrier, semaphores, launch
  boundaries). An earlier *write* is ordered before a later access only through ``vc``.
* ``rvc`` (execution order, ``rvc >= vc``): also relaxed signal->wait edges. An earlier *read*,
  or anything the host did before a launch started, is ordered before a later access through
  ``rvc`` ("a relaxed wait orders the signaller's earlier reads and its launch start, not its
  writes").

A block's own clock component is its *epoch* and, below it, the op's position in the epoch
(``epoch << EPOCH_SHIFT | op``): the epoch advances at every ``nop``/``barrier``, the op
number at every op. Two accesses of one block in the same epoch are ordered only when the
block's threads split the bytes the same way (same byte-to-stream alignment ``delta`` and
unit); otherwise they race. What the block publishes through a barrier or a signal covers
whole epochs (the block as of its last ``nop``) plus what the publishing thread itself acquired:
an edge that arrives at a block (a wait's channel, a semaphore token) arrives at one thread, the
one handling that channel or semaphore index of the op (:class:`ThreadEdge`), and reaches the
block's other threads only at its next ``nop`` or barrier; what a packet write publishes (its execution
clock, which the packet's reader acquires through the flag) covers the writing op and the ops
before it, not the ops after it in the same epoch, so a race is judged the same way wherever in
the epoch the conflicting op stands.

Accesses are recorded per storage (a rank's input, output or scratch allocation) as byte
intervals: the last write of every byte in an interval map, and reads since then in a list.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np


@dataclass(frozen=True)
class OpRef:
    """Which op made an access: rank, thread block (-1: host, -2: proxy), op index path."""

    rank: int
    tb: int
    index: str
    name: str
    launch: int

    def __str__(self) -> str:
        if self.tb == -1:
            return f"rank {self.rank} host ({self.name}, launch {self.launch})"
        if self.tb <= -2:
            return f"rank {self.rank} port proxy {-self.tb - 2} ({self.name}, launch {self.launch})"
        return f"rank {self.rank} tb {self.tb} op {self.index} {self.name} (launch {self.launch})"


@dataclass(frozen=True)
class Access:
    """One recorded access to a byte interval."""

    tid: int
    clk: int
    write: bool
    op: OpRef
    launch: int
    delta: int = 0          # byte offset minus stream position (thread mapping inside a block)
    unit: int = 16          # bytes a thread handles at once (16 plain, 4/8 packets)
    host: bool = False
    packet: bool = False    # packet-format access (flags synchronise packet reads)
    rvc: Optional[np.ndarray] = field(default=None, compare=False, repr=False)  # packet writes


def ordered(prev: Access, vc: Optional[np.ndarray], rvc: np.ndarray) -> bool:
    """Whether clocks ``vc``/``rvc`` order access ``prev`` before a later conflicting access: a
    kernel's write through ``vc`` (strong edges), a read or anything the host did through ``rvc``."""
    if prev.host or not prev.write:
        return bool(rvc[prev.tid] >= prev.clk)
    return vc is not None and bool(vc[prev.tid] >= prev.clk)


@dataclass
class ThreadEdge:
    """One thread's end of an edge: what thread ``thread`` of a block acquired (``op``, a wait or
    ``sem_acquire``, on channel or semaphore ``what``) or published; ``vc`` is None for a
    relaxed one."""

    thread: int
    vc: Optional[np.ndarray] = field(repr=False)
    rvc: np.ndarray = field(repr=False)
    op: Optional[OpRef] = None
    what: str = ""


@dataclass
class Unpublished(ThreadEdge):
    """A signal, semaphore release or port request sent by a thread while other threads of its
    block held acquisitions it lacks (``missing``: no nop or barrier since); ``via``: the proxy
    that carries out a port request."""

    missing: list[ThreadEdge] = field(default_factory=list)
    via: Optional[int] = None


_PAGE_BITS = 12

#: bits of a block's own clock component below its epoch (the op number inside the epoch)
EPOCH_SHIFT = 32


def epoch(clk: int) -> int:
    """The epoch of a clock value (an actor's own component)."""
    return int(clk) >> EPOCH_SHIFT


def _next_epoch(clk: int) -> int:
    return (epoch(clk) + 1) << EPOCH_SHIFT


class IntervalMap:
    """Non-overlapping [start, end) segments, each with a value, sorted by start."""

    __slots__ = ("starts", "ends", "vals")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.vals: list[Access] = []

    def overlapping(self, a: int, b: int) -> list[tuple[int, int, Access]]:
        i = bisect_right(self.ends, a)
        out = []
        n = len(self.starts)
        while i < n and self.starts[i] < b:
            out.append((self.starts[i], self.ends[i], self.vals[i]))
            i += 1
        return out

    def assign(self, a: int, b: int, v: Access) -> None:
        i = bisect_right(self.ends, a)
        j = bisect_left(self.starts, b, lo=i)
        new_s, new_e, new_v = [], [], []
        if i < j:
            if self.starts[i] < a:
                new_s.append(self.starts[i]); new_e.append(a); new_v.append(self.vals[i])
            new_s.append(a); new_e.append(b); new_v.append(v)
            if self.ends[j - 1] > b:
                new_s.append(b); new_e.append(self.ends[j - 1]); new_v.append(self.vals[j - 1])
        else:
            new_s.append(a); new_e.append(b); new_v.append(v)
        self.starts[i:j] = new_s
        self.ends[i:j] = new_e
        self.vals[i:j] = new_v


class Actor:
    """Clock state of one actor (thread block, host or proxy)."""

    __slots__ = ("tid", "vc", "rvc", "sync_vc", "sync_rvc", "acquired", "dirty", "dirty_op")

    def __init__(self, tid: int, nthreads: int) -> None:
        self.tid = tid
        self.vc = np.zeros(nthreads, dtype=np.int64)
        self.rvc = np.zeros(nthreads, dtype=np.int64)
        self.sync_vc = self.vc.copy()      # what a strong signal publishes (as of the last nop)
        self.sync_rvc = self.rvc.copy()
        self.acquired: list[ThreadEdge] = []   # per thread, since the last nop
        self.dirty = False                 # data op since the last nop
        self.dirty_op: Optional[OpRef] = None

    def start(self, vc: np.ndarray, rvc: np.ndarray) -> None:
        """Begin a launch after ``vc``/``rvc`` (the host's clocks at launch start)."""
        self.sync_vc = vc.copy()
        self.sync_rvc = rvc.copy()
        self.vc = vc.copy()
        self.rvc = rvc.copy()
        self.vc[self.tid] = _next_epoch(self.vc[self.tid])
        self.rvc[self.tid] = self.vc[self.tid]
        self.acquired = []
        self.dirty = False

    def acquire(self, vc: Optional[np.ndarray], rvc: np.ndarray, thread: int = 0,
                op: Optional[OpRef] = None, what: str = "") -> None:
        """An edge arrives at thread ``thread`` of the block (``op``'s channel or semaphore
        ``what``); it reaches the other threads at the next nop."""
        self.acquired.append(ThreadEdge(thread, vc, rvc, op, what))

    def complete(self, vc: np.ndarray, rvc: np.ndarray) -> None:
        """The whole block waited for an event (a port flush: the proxy finished the block's
        earlier requests): every thread's later accesses, and what a later signal publishes, are
        ordered after it, with no ``nop`` needed."""
        for mine, got in ((self.vc, vc), (self.rvc, rvc), (self.rvc, self.vc), (self.sync_vc, vc),
                          (self.sync_rvc, rvc), (self.sync_rvc, self.sync_vc)):
            np.maximum(mine, got, out=mine)

    def publish(self, thread: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Clocks a signal by thread ``thread`` publishes: the block as of its last nop, plus
        what that thread itself acquired since (not what the other threads acquired)."""
        vc, rvc = self.sync_vc, self.sync_rvc
        for a in self.acquired:
            if a.thread == thread:
                vc = vc if a.vc is None else np.maximum(vc, a.vc)
                rvc = np.maximum(rvc, a.rvc)
        return vc, np.maximum(rvc, vc)

    def missing(self, thread: int, vc: np.ndarray, rvc: np.ndarray) -> list[ThreadEdge]:
        """What the block's other threads acquired since the last nop that ``vc``/``rvc`` (what
        thread ``thread`` publishes) lack."""
        return [a for a in self.acquired if a.thread != thread and (
            (a.rvc > rvc).any() or (a.vc is not None and (a.vc > vc).any()))]

    def nop(self) -> None:
        """Block barrier: merge what every thread acquired, start a new epoch."""
        for a in self.acquired:
            self.join(self.vc if a.vc is None else a.vc, a.rvc)
        self.acquired = []
        self.sync_vc = self.vc.copy()
        self.sync_rvc = self.rvc.copy()
        self.vc[self.tid] = _next_epoch(self.vc[self.tid])
        self.rvc[self.tid] = self.vc[self.tid]
        self.dirty = False

    def step(self) -> None:
        """The block goes on to its next op (in the same epoch)."""
        self.vc[self.tid] += 1
        self.rvc[self.tid] = self.vc[self.tid]

    def join(self, vc: np.ndarray, rvc: np.ndarray) -> None:
        """Merge clocks directly (for actors made of one thread: host, proxy)."""
        np.maximum(self.vc, vc, out=self.vc)
        np.maximum(self.rvc, rvc, out=self.rvc)
        np.maximum(self.rvc, self.vc, out=self.rvc)

    def tick(self) -> None:
        """One step of a one-thread actor (host, proxy): a new epoch."""
        self.vc[self.tid] = _next_epoch(self.vc[self.tid])
        self.rvc[self.tid] = self.vc[self.tid]
        self.sync_vc = self.vc.copy()
        self.sync_rvc = self.rvc.copy()


@dataclass
class RaceInfo:
    storage: str
    start: int
    end: int
    first: Access
    second: Access
    #: the execution clock (``rvc``: relaxed signal->wait edges too) orders the pair, only the
    #: strong clock does not: the earlier write was published by a relaxed edge alone
    exec_ordered: bool = False
    #: the execution clock of the second access (which edges reached it)
    rvc: Optional[np.ndarray] = field(default=None, repr=False)


class AccessLog:
    """All accesses of one simulation run, keyed by storage name; reports races."""

    def __init__(self, host_tids: set[int], on_race: Callable[[RaceInfo], None]) -> None:
        self.writes: dict[str, IntervalMap] = {}
        self.touches: dict[str, IntervalMap] = {}
        self.reads: dict[str, dict[int, list[tuple[int, int, Access]]]] = {}
        self.host_tids = host_tids
        self.on_race = on_race

    def packet_clocks(self, storage: str, a: int, b: int) -> list[np.ndarray]:
        """Execution clocks of the packet writes a packet read of [a, b) observes: the read is
        ordered after those writes (and what they were ordered after), publishing nothing else."""
        wm = self.writes.get(storage)
        if wm is None:
            return []
        return [v.rvc for _, _, v in wm.overlapping(a, b) if v.packet and v.rvc is not None]

    def _exempt(self, e: Access, c: Access) -> bool:
        if c.packet and not c.write and e.packet and e.write:
            return True  # a packet read is ordered after the write of those bytes by its flag
        return False

    def _same_block_ok(self, prev: Access, c: Access, single: bool) -> bool:
        """Whether two accesses of one block are ordered: by a nop or barrier between them (an
        earlier epoch), by touching each byte from the same thread (same mapping), or ``single``."""
        return (single or epoch(prev.clk) < epoch(c.clk) or (prev.delta == c.delta and prev.unit == c.unit)
                or self._exempt(prev, c))

    def access(self, storage: str, a: int, b: int, c: Access, vc: np.ndarray,
               rvc: np.ndarray, same_thread_ordered: bool, touch: bool = False) -> None:
        """Record access ``c`` of bytes [a, b) and report any unordered conflicting access.

        A ``touch`` (the host handing a reused buffer, or the half of a double scratch, to a new
        launch) is checked like a write and remembered apart, per byte interval (a later touch
        replaces only the bytes it covers, so the two halves of a double scratch keep their own
        hand-overs), so it does not hide the last real writes of those bytes.

        Packet writes and hand-overs are not checked against each other: nothing touches a
        scratch between launches, and LL readers take only packets that carry their launch's
        flag, so reusing a packet slot is a hazard only where a packet write meets an access of
        another launch that no chain of edges orders (a read that has not happened yet, a plain
        write), and the direct checks below find exactly that: a packet write of launch ``k+1``
        against a read of launch ``k`` is ordered when the reader's later actions (packets it
        sent after reading, which the writer's rank consumed before its launch ``k`` ended) lead
        to the writer."""
        if b <= a:
            return
        wm = self.writes.get(storage)
        if wm is None:
            wm = self.writes[storage] = IntervalMap()
            self.reads[storage] = {}
        tm = self.touches.get(storage)
        if tm is not None and not (c.packet and c.write):
            for s, e_, prev in tm.overlapping(a, b):
                if prev.tid != c.tid and not self._exempt(prev, c) and not rvc[prev.tid] >= prev.clk:
                    self.on_race(RaceInfo(storage, max(s, a), min(e_, b), prev, c, rvc=rvc))
        for s, e_, prev in wm.overlapping(a, b):
            if touch and prev.packet:
                continue  # packet writes meet a hand-over only through the accesses it orders
            if prev.tid == c.tid:
                if not self._same_block_ok(prev, c, same_thread_ordered):
                    self.on_race(RaceInfo(storage, max(s, a), min(e_, b), prev, c, rvc=rvc))
                continue
            if self._exempt(prev, c):
                continue
            if not ordered(prev, vc, rvc):
                self.on_race(RaceInfo(storage, max(s, a), min(e_, b), prev, c,
                                      exec_ordered=not prev.host and bool(rvc[prev.tid] >= prev.clk), rvc=rvc))
        pages = self.reads[storage]
        p0, p1 = a >> _PAGE_BITS, (b - 1) >> _PAGE_BITS
        if c.write:
            checked: set[int] = set()
            for pg in range(p0, p1 + 1):
                lst = pages.get(pg)
                if not lst:
                    continue
                keep = []
                for item in lst:
                    s, e_, prev = item
                    if e_ <= a or s >= b:
                        keep.append(item)
                        continue
                    if id(item) not in checked:
                        checked.add(id(item))
                        if prev.tid == c.tid:
                            if not self._same_block_ok(prev, c, same_thread_ordered):
                                self.on_race(RaceInfo(storage, max(s, a), min(e_, b), prev, c, rvc=rvc))
                        elif not self._exempt(prev, c) and not rvc[prev.tid] >= prev.clk:
                            self.on_race(RaceInfo(storage, max(s, a), min(e_, b), prev, c, rvc=rvc))
                    if touch or s < a or e_ > b:
                        keep.append(item)  # a hand-over does not hide the reads before it
                pages[pg] = keep
            if touch:
                self.touches.setdefault(storage, IntervalMap()).assign(a, b, c)
                return
            wm.assign(a, b, c)
        else:
            item = (a, b, c)
            for pg in range(p0, p1 + 1):
                pages.setdefault(pg, []).append(item)
