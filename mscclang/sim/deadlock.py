"""Deadlock diagnosis of a simulation: when nothing can run while some task waits, find who
could end each wait and report the wait-for cycle."""

from __future__ import annotations

from mscclang.plan.models import PUT_SIGNAL_OPS, SIGNAL_OPS, OpName
from mscclang.sim.packets import PKT_WRITERS
from mscclang.sim.program import COp
from mscclang.sim.report import Problem
from mscclang.sim.tasks import Task, Wait


class DeadlockMixin:
    """Wait-for analysis; mixed into :class:`mscclang.sim.engine.Simulation`, whose ``tasks_of``,
    ``waiting``, ``pair``, ``barriers``, ``plan`` and ``_peer_of`` it uses."""

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
            out = [t for t in live if t.rank == srank and any(
                c.op.name in SIGNAL_OPS | PUT_SIGNAL_OPS and c.op.channel_type.value == stype
                and sch in (c.channels or [g.channel for g in c.groups]) for c in self._remaining(t))]
            return out, "" if out else f"no block of rank {srank} will signal its {stype} channel {sch} again"
        if info[0] == "flag":
            r = info[1]
            out = [t for t in live if any(c.op.name in PKT_WRITERS and any(
                d.rank == r and d.packet for g in c.groups for d in g.dsts) for c in self._remaining(t))]
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
