"""The port-channel proxy model: what a flush (and ``pwsf``) orders and what a plain ``pws``
does not.

A port put is done by the rank's proxy, after the block posted it. ``flush`` and ``pwsf`` make
the block wait until the proxy finished: the proxy's reads of the sources and its writes then
precede every later op of the block (no ``nop`` needed). A ``pws`` without a flush orders
nothing on the sending rank: reusing its source is a race with the proxy's read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mscclang.plan import load_plan
from mscclang.sim import verify
from mscclang.sim.engine import Simulation
from mscclang.sim.planbuilder import L, PlanBuilder, R
from mscclang.sim.program import sim_program
from mscclang.sim.report import Report

GOLDEN = Path(__file__).parent / "golden"


def _races(rep: Report) -> list[str]:
    return [p.message for p in rep.problems if p.kind == "race"]


def staged_port_puts(mode: str, nop_after: bool = False):
    """Rank 0 stages input chunk 0 in scratch slot 0, sends it with a port put, then reuses the
    slot for input chunk 1 and sends that. ``mode``: ``"pwsf"`` (put with signal and flush),
    ``"flush"`` (pws, then a flush op) or ``"pws"`` (no flush: the reuse races the proxy's read).
    Rank 1 waits for both puts; the ready handshake makes the puts into its output legal."""
    b = PlanBuilder(f"staged_{mode}", "test", 2, 2, 2, 1)
    b.set_scratch(1, 0)
    b.op(1, 0, "rlxsignal", channels=[0])
    b.nop(1, 0)
    b.op(1, 0, "wait", channels=[0], ctype="port")
    b.op(1, 0, "wait", channels=[0], ctype="port")
    b.nop(1, 0)
    b.op(0, 0, "rlxwait", channels=[1])
    b.op(0, 0, "copy", src=[L("i", 0, 1)], dst=[L("s", 0, 1)])
    b.nop(0, 0)
    for c in range(2):
        if c:
            b.op(0, 0, "copy", src=[L("i", 1, 1)], dst=[L("s", 0, 1)])   # reuse the slot
            b.nop(0, 0)
        name = "pwsf" if mode == "pwsf" else "pws"
        b.op(0, 0, name, src=[L("s", 0, 1)], dst=[R(1, "o", c, 1)], channels=[1], ctype="port")
        if mode == "flush":
            b.op(0, 0, "flush", channels=[1], ctype="port")
        if nop_after:
            b.nop(0, 0)
    return b.build()


@pytest.mark.parametrize("mode", ["pwsf", "flush"])
def test_flush_orders_the_proxy_reads_before_the_blocks_later_ops(mode):
    # no nop between the (flushed) put and the copy that overwrites its source
    rep = verify(staged_port_puts(mode), schedules=6, launches=3)
    assert rep.passed() and rep.status == "NO POSTCONDITION", str(rep)


def test_pws_without_flush_races_on_its_source():
    for nop_after in (False, True):
        rep = verify(staged_port_puts("pws", nop_after), schedules=6, launches=2)
        races = _races(rep)
        assert any("port proxy 0 (proxy for tb 0 pws" in m and "reads" in m and "copy" in m and "rank0.scr" in m
                   for m in races), str(rep)


def test_golden_pwsf_verifies_and_pws_races_with_the_next_launch():
    """The compiler's one-op goldens: ``pwsf`` is complete (no race over several launches), and
    so is ``pws`` followed by a flush; the same ``pws`` without its flush leaves rank 0's proxy
    reading the input while the next launch rewrites it."""
    import json

    rep = verify(load_plan(GOLDEN / "op_pwsf.json"), schedules=6, launches=3)
    assert rep.passed() and rep.status == "NO POSTCONDITION", str(rep)
    doc = json.loads((GOLDEN / "op_pws.json").read_text())
    assert verify(load_plan(GOLDEN / "op_pws.json"), schedules=6, launches=3).passed()
    ops = doc["gpus"][0]["threadblocks"][0]["ops"]
    assert ops[-1]["name"] == "flush"
    ops.pop()  # pws with no flush
    rep = verify(load_plan(json.dumps(doc)), schedules=3, launches=2, symbolic=False)
    races = _races(rep)
    assert races and all("port proxy" in m and "launch start: inputs written" in m for m in races), str(rep)
    # the hint blames the missing flush, not a peer's missing ready edge
    assert all("a kernel exit does not wait for the proxy" in m and "ready edge" not in m for m in races), races

def shared_channel_plan():
    """Two blocks of rank 0 post puts on one port channel and each flushes. Block 1 writes
    scratch chunk 0 and then sends it; block 0 sent something else and, after its flush, reads
    scratch chunk 0. Nothing orders block 1's write before block 0's read: block 0's flush
    waits for its own request only, not for block 1's later one."""
    b = PlanBuilder("shared_port_channel", "test", 2, 2, 2, 2)
    c = b.channel(0, 1, ctype="port")
    b.op(0, 0, "put", src=[L("i", 0, 1)], dst=[R(1, "s", 0, 1)], channels=[c], ctype="port")
    b.op(0, 0, "flush", channels=[c], ctype="port")
    b.op(0, 0, "copy", src=[L("s", 0, 1)], dst=[L("o", 0, 1)])          # reads what tb 1 writes
    b.op(0, 1, "copy", src=[L("i", 1, 1)], dst=[L("s", 0, 1)])
    b.nop(0, 1)
    b.op(0, 1, "put", src=[L("s", 0, 1)], dst=[R(1, "s", 1, 1)], channels=[c], ctype="port")
    b.op(0, 1, "flush", channels=[c], ctype="port")
    b.set_scratch(1, 2)
    return b.build()


class _DrainingProxySimulation(Simulation):
    """Blocks round robin; a proxy runs only when no block can, and then serves its whole queue
    before any block resumes (so block 0's flush resumes after block 1's request was served)."""

    _draining = None

    def _pick(self):
        if self._draining is not None and self._draining in self.rr:
            self.rr.remove(self._draining)
            return self._draining
        self._draining = None
        for i, t in enumerate(self.rr):
            if t.proxy is None:
                del self.rr[i]
                return t
        if self.rr:
            self._draining = self.rr.popleft()
            return self._draining
        return None


def test_flush_is_ordered_after_its_own_requests_only():
    """The flush of block 0 waits for request 1; the proxy serves request 2 (block 1's, posted
    after the flush began) before block 0 resumes. Block 0 is ordered after request 1 only, so
    its read of scratch chunk 0 still races with block 1's write of it."""
    prog = sim_program(shared_channel_plan(), 64, 64)
    ins = [np.arange(64, dtype=np.uint8) + r for r in range(2)]
    sim = _DrainingProxySimulation(prog, ins, dtype=np.float16, launches=1)
    sim.run()
    races = [p.message for p in sim.problems if p.kind == "race"]
    assert any("rank 0 tb 1 op 0 copy" in m and "rank 0 tb 0 op 2 copy" in m and "rank0.scr" in m
               for m in races), races
    # and under the ordinary schedules too
    rep = verify(shared_channel_plan(), schedules=6, launches=1, symbolic=False)
    assert any("tb 1 op 0 copy" in m and "tb 0 op 2 copy" in m for m in _races(rep)), str(rep)
