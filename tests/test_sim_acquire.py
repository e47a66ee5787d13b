"""Acquisitions are per thread (issue 33 item 1; docs/semantics.md, "Does a wait synchronise the
whole block?"): thread ``k`` of a block handles the op's ``k``-th channel, semaphore or port
entry, and what its wait acquires reaches the block's other threads only at a later ``nop`` or
barrier. A port request's entry ``k``, a memory signal's channel ``k`` and a semaphore release
carry what thread ``k`` acquired plus the block as of its last nop, and verify names the thread
and the wait it did not make when that misses a race."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from mscclang.plan import load_plan
from mscclang.sim import verify
from mscclang.sim.races import Actor
from tests.harness.acquire_plans import RELAY_WAIT, mutants, relay_allgather

PLANS = Path(__file__).resolve().parent.parent / "plans"


def _report(doc: dict):
    return verify(load_plan(json.dumps(doc)))


def _clock(n: int, at: int, value: int) -> np.ndarray:
    c = np.zeros(n, dtype=np.int64)
    c[at] = value
    return c


def test_an_acquisition_reaches_its_own_thread_until_the_nop() -> None:
    a = Actor(0, 4)
    a.start(np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int64))
    a.acquire(_clock(4, 1, 5), _clock(4, 1, 5), thread=0)   # a strong wait by thread 0
    a.acquire(None, _clock(4, 2, 7), thread=1)              # a relaxed wait by thread 1
    vc0, rvc0 = a.publish(0)
    assert vc0[1] == 5 and rvc0[2] == 0
    vc1, rvc1 = a.publish(1)
    assert vc1[1] == 0 and vc1[2] == 0 and rvc1[2] == 7     # relaxed: execution order only
    vc2, rvc2 = a.publish(2)
    assert vc2[1] == 0 and rvc2[2] == 0
    assert [e.thread for e in a.missing(2, vc2, rvc2)] == [0, 1]
    assert a.vc[1] == 0   # a data op (every thread) is not ordered after either wait yet
    a.nop()
    vc2, rvc2 = a.publish(2)
    assert vc2[1] == 5 and vc2[2] == 0 and rvc2[2] == 7 and not a.acquired
    assert a.vc[1] == 5


PIPELINED = ["allreduce_port_pipelined.r2.i1.steps4.json", "allreduce_port_pipelined.r4.i1.steps4.json",
             "allreduce_port_pipelined.r8.i1.steps4.json"]

#: entry k of a port request is posted by thread k, which lacks a wait thread j made
_TRIGGER = re.compile(r"entry (\d+) \(port channel \d+, to rank (\d+)\) of rank 0 tb 0 op (\d+) (\(\S+\) )?pws "
                      r"\(launch \d+\) is sent by thread (\d+) of its block, which did not make the wait of "
                      r"rank 0 tb 0 op (\d+) (\(\S+\) )?rlxwait \(launch \d+\) on memory channel \d+ "
                      r"\(from rank (\d+)\): thread (\d+) did")


@pytest.mark.parametrize("kind", ["drop", "swap"])
@pytest.mark.parametrize("name", PIPELINED)
def test_port_request_without_nop_after_the_ready_wait_fails(name: str, kind: str) -> None:
    """The issue's case: the ready handshake (``rlxsignal``/``rlxwait`` on every peer's memory
    channel) then one multi-entry ``pws``, with the nop between them deleted or swapped with the
    wait: an entry's thread posts into a peer's scratch that only another thread waited on."""
    doc = json.loads((PLANS / name).read_text())
    ops = doc["gpus"][0]["threadblocks"][0]["ops"]
    assert [o["name"] for o in ops[:4]] == ["rlxsignal", "rlxwait", "nop", "pws"]
    rep = _report(mutants(doc, 0, 0, 1)[kind])
    assert rep.failed
    found = [m for p in rep.problems if p.kind == "race" for m in _TRIGGER.finditer(p.message)]
    assert found, [p.message for p in rep.problems]
    wait_at, pws_at = (1, 2) if kind == "drop" else (2, 3)
    for m in found:
        entry, to, op, thread, wait, frm, waiter = (int(m.group(i)) for i in (1, 2, 3, 5, 6, 8, 9))
        assert (op, wait) == (pws_at, wait_at)
        assert entry == thread and thread != waiter and to == frm   # the peer it posts to


def test_port_request_whose_threads_made_their_own_waits_needs_no_nop() -> None:
    """allgather_port: thread k waits on peer k's ready signal and posts entry k to peer k, so
    the nop between them orders nothing that entry needs (an equivalent mutant)."""
    doc = json.loads((PLANS / "allgather_port.r4.i1.json").read_text())
    ops = doc["gpus"][0]["threadblocks"][0]["ops"]
    assert [o["name"] for o in ops[1:4]] == ["rlxwait", "nop", "pws"]
    assert ops[1]["channel_ids"] == ops[3]["channel_ids"] == [0, 1, 2]
    for rank in range(4):
        doc = mutants(doc, rank, 0, 1)["drop"]
    rep = _report(doc)
    assert rep.ok, rep.render()


@pytest.mark.parametrize("semaphore,port", [(False, False), (False, True), (True, False)],
                         ids=["signal", "port signal", "sem_release"])
def test_relay_verifies(semaphore: bool, port: bool) -> None:
    rep = _report(relay_allgather(semaphore, port))
    assert rep.ok, rep.render()


@pytest.mark.parametrize("port", [False, True], ids=["memory", "port"])
@pytest.mark.parametrize("kind", ["drop", "swap"])
def test_signal_after_a_two_channel_wait_without_nop_fails(kind: str, port: bool) -> None:
    """Rank 0 waits on ranks 1 and 2 in one op and signals both in one op (memory channels, or
    port channels: one request per channel): thread 0's signal to rank 1 does not carry rank 2's
    put, which thread 1 waited for."""
    tb, wait = RELAY_WAIT[False]
    rep = _report(mutants(relay_allgather(port=port), 0, tb, wait)[kind])
    assert rep.failed
    at = wait if kind == "drop" else wait + 1
    msgs = [p.message for p in rep.problems if p.kind == "race"]
    for thread, to, other, frm in ((0, 1, 1, 2), (1, 2, 0, 1)):
        want = (f"{'port' if port else 'memory'} channel {thread} (to rank {to}) of rank 0 tb 0 op {at + 1} "
                f"signal (launch 1) is sent by "
                f"thread {thread} of its block, which did not make the wait of rank 0 tb 0 op {at} wait "
                f"(launch 1) on memory channel {other} (from rank {frm}): thread {other} did")
        assert any(want in m and f"rank {frm} tb 0 op 2 put" in m and f"rank {to} tb 0 op 8 get" in m
                   for m in msgs), (want, msgs)


@pytest.mark.parametrize("kind", ["drop", "swap"])
def test_semaphore_release_after_a_two_channel_wait_without_nop_fails(kind: str) -> None:
    """Rank 0's block 0 waits on ranks 1 and 2 in one op and releases block 1, which copies
    what both put into its scratch: thread 0's release does not carry rank 2's put."""
    tb, wait = RELAY_WAIT[True]
    rep = _report(mutants(relay_allgather(True), 0, tb, wait)[kind])
    assert rep.failed
    at = wait if kind == "drop" else wait + 1
    want = (f"semaphore 0 of rank 0 tb 0 op {at + 1} sem_release (launch 1) is sent by thread 0 of its block, "
            f"which did not make the wait of rank 0 tb 0 op {at} wait (launch 1) on memory channel 1 (from "
            "rank 2): thread 1 did")
    msgs = [p.message for p in rep.problems if p.kind == "race"]
    assert any(want in m and "rank 2 tb 0 op 2 put" in m and "rank 0 tb 1 op 4 copy" in m for m in msgs), msgs
