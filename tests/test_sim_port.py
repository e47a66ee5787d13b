"""The port-channel proxy model: what a flush (and ``pwsf``) orders and what a plain ``pws``
does not.

A port put is done by the rank's proxy, after the block posted it. ``flush`` and ``pwsf`` make
the block wait until the proxy finished: the proxy's reads of the sources and its writes then
precede every later op of the block (no ``nop`` needed). A ``pws`` without a flush orders
nothing on the sending rank: reusing its source is a race with the proxy's read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mscclang.plan import load_plan
from mscclang.sim import verify
from mscclang.sim.planbuilder import L, PlanBuilder, R
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