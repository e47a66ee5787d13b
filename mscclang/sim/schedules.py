"""Schedules of a simulation: which runnable task goes next, and waking waiting tasks.

Schedules (:data:`SCHEDULES`): ``round_robin``; ``random`` (seeded); ``adversarial`` (prefers
readers and waiters, delays writers and the ranks others wait on); ``runahead``: one lead rank
(``lead``, default ``seed % ranks``) always runs when it can, then the next rank in order, and so
on, so the lead runs as many launches ahead as the plan lets it while the last ranks are starved
(a block of a starved rank runs only when no block of a rank before it can progress).
"""

from __future__ import annotations

from typing import Optional

from mscclang.plan.models import PUT_SIGNAL_OPS, SIGNAL_OPS, OpName
from mscclang.sim.tasks import Task

SCHEDULES = ("round_robin", "random", "adversarial", "runahead")
REMOTE_WRITERS = PUT_SIGNAL_OPS | SIGNAL_OPS | frozenset({
    OpName.put, OpName.ppkt, OpName.rppkt, OpName.res, OpName.rres, OpName.respkt, OpName.recspkt,
    OpName.gstore, OpName.gstorepkt, OpName.glres, OpName.sem_release})


class ScheduleMixin:
    """Picking and waking tasks; mixed into :class:`mscclang.sim.engine.Simulation`, whose
    ``schedule``, ``rng``, ``lead``, ``n``, ``rr``, ``runnable``, ``waiting`` and
    ``waited_ranks`` it uses."""

    def _wake(self, key: tuple) -> None:
        lst = self.waiting.pop(key, None)
        if lst:
            for t in lst:
                t.wait = None
                self._make_runnable(t)

    def _make_runnable(self, t: Task) -> None:
        if self.schedule == "round_robin":
            self.rr.append(t)
        else:
            self.runnable.append(t)

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
        order = [(t.rank - self.lead) % self.n for t in lst]
        best = min(order)
        cands = [i for i, pr in enumerate(order) if pr == best]
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
