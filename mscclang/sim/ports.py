"""The port channel model of a simulation: triggers, proxies, and what they order.

A port ``put``/``pws``/``pwsf``/``signal`` posts a trigger to the channel's proxy (a task of its
own, processing its queue in order, with the clocks the block published). The proxy reads the
sources and writes the peer when it gets to the trigger, so a plain ``pws`` orders nothing on the
sending rank: reusing its source (even after the block ended: the next launch's inputs) races
with the proxy's read until a flush or a signal from the receiver says otherwise. ``flush`` and
``pwsf`` make the whole block wait until the proxy finished every request posted on the channel:
the proxy's reads and writes then precede every later op of the block, with no ``nop`` needed
(:meth:`mscclang.sim.races.Actor.complete`). The proxy's queue persists across launches and a
launch's end does not wait for it; each launch after the first starts with the host handing it
the scratch (only the half it uses with double scratch), which races with any earlier proxy
access of those bytes that no flush or edge ordered before it.

The entries of one op are posted by different threads, entry ``k`` by thread ``k`` (as MSCCL++
does), so a request carries what its own thread acquired since the block's last ``nop``, not what
the others did; and since a thread that did not wait may post before one that did, what one
entry's thread acquired does not reach the proxy's processing of the channel's later requests
either (only the block as of its last ``nop``, the ``base`` of the trigger, does).

A flush is ordered after the requests posted on the channel before it, and after nothing the
proxy did later: when the proxy is behind, the flush takes the proxy's clocks as of the request
it waits for (a snapshot), not as of the moment the flushing block resumes, by which time the
proxy may have served requests other blocks posted after the flush began.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from mscclang.errors import PlanError
from mscclang.plan.models import OpName
from mscclang.sim.program import COp, Group
from mscclang.sim.races import Actor, OpRef
from mscclang.sim.tasks import Task, Wait


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
    end_key: Optional[tuple] = None
    #: what every thread of the block had (its last nop), when the posting thread had more
    base: Optional[tuple[np.ndarray, np.ndarray]] = None


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
        #: request counts some flush waits for -> how many flushes wait for it
        self.wants: dict[int, int] = {}
        #: the proxy's clocks (vc, rvc) right after it finished the request count in ``wants``
        self.snaps: dict[int, tuple[np.ndarray, np.ndarray]] = {}


class PortMixin:
    """Port channels; mixed into :class:`mscclang.sim.engine.Simulation`, whose ``mem``,
    ``proxies``, ``pair``, ``_exec_group``, ``_end``, ``_signal_clock``, ``_wake`` and
    ``_make_runnable`` it uses."""

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

    def _post(self, task: Task, kind: str, g: Optional[Group], c: int, opref: OpRef, thread: int) -> None:
        """Thread ``thread`` of ``task``'s block posts a request of ``kind`` (``data``: entry
        ``g``, with its signal for a ``pws``/``pwsf``; ``signal``) to the proxy of port channel ``c``."""
        rank, mem, actor = task.rank, self.mem[task.rank], task.actor
        px, peer = self._proxy_for(rank, c), self.pair[(rank, "port", c)][0]
        what = f"entry {thread} (port channel {c}, to rank {peer})" if g else f"port channel {c} (to rank {peer})"
        vc, rvc = self._publish(task, thread, opref, what, px.actor.tid)
        base = (actor.sync_vc.copy(), np.maximum(actor.sync_rvc, actor.sync_vc)) if any(
            a.thread == thread for a in actor.acquired) else None
        for k in ("data", "signal") if g and opref.name in ("pws", "pwsf") else (kind,):
            self._enqueue(px, Trigger(k, g if k == "data" else None, mem.flag, mem.half, task.launch, vc.copy(),
                                      rvc.copy(), opref, end_key=(rank, "port", c), base=base))

    def _port_data(self, task: Task, cop: COp, opref: OpRef) -> Iterator:
        rank = task.rank
        mem = self.mem[rank]
        name = cop.op.name
        for k, g in enumerate(cop.groups):  # entry k, posted by thread k
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
            self._post(task, "data", g, c, opref, k)
        if name == OpName.pwsf:
            for c in sorted({g.channel for g in cop.groups if g.channel is not None}):
                yield from self._flush(task, rank, c)

    def _flush(self, task: Task, rank: int, c: int) -> Iterator:
        """The whole block waits until the proxy of ``rank``'s port channel ``c`` finished every
        request posted so far; the proxy's reads and writes of those requests then precede every
        later op of the block (no ``nop`` needed), and nothing the proxy did after them does."""
        px = self._proxy_for(rank, c)
        want = px.issued
        if px.processed < want:
            px.wants[want] = px.wants.get(want, 0) + 1
            while px.processed < want:
                yield Wait(("proxy", rank, c), f"port proxy of channel {c} to finish {want} requests",
                           ("proxy", rank, c))
            vc, rvc = px.snaps[want]
            px.wants[want] -= 1
            if not px.wants[want]:
                del px.wants[want]
                del px.snaps[want]
        else:
            vc, rvc = px.actor.vc, px.actor.rvc  # caught up: its last request is the one waited for
        task.actor.complete(vc, rvc)

    def _proxy_step(self, task: Task) -> bool:
        """Process one trigger; False when the queue is empty."""
        px = task.proxy
        assert px is not None
        if not px.queue:
            return False
        trig = px.queue.popleft()
        a = px.actor
        a.join(*(trig.base or (trig.vc, trig.rvc)))
        a.tick()
        kept = (a.vc.copy(), a.rvc.copy()) if trig.base else None
        a.join(trig.vc, trig.rvc)  # what the posting thread alone acquired: this request only
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
            self._signal_clock(end, a.vc.copy(), a.rvc.copy(), trig.op)
            self._wake(("ctr", dst))
        if kept:
            a.vc, a.rvc = kept
        px.processed += 1
        if px.processed in px.wants:
            px.snaps[px.processed] = (a.vc.copy(), a.rvc.copy())
        self._wake(("proxy", px.rank, px.channel))
        return bool(px.queue)
