"""Deliberately broken plans: each must be caught with the right diagnosis (issue 3)."""

from __future__ import annotations

from mscclang.sim import Deadlock, run, verify
from mscclang.sim.planbuilder import L, PlanBuilder, R
from mscclang.sim.report import Report

import os
from pathlib import Path

import numpy as np
import pytest

from tests.harness.sim_plans import (
    ll_allreduce,
    ll_oneshot_allreduce,
    sem_barrier_allgather,
    simple_allgather,
    wait_cycle,
    zero_copy_allreduce,
)


def _verify(plan, **kw) -> Report:
    kw.setdefault("schedules", 3)
    rep = verify(plan, **kw)
    assert not rep.ok, "a broken plan verified"
    return rep


def _messages(rep: Report, kind: str) -> list[str]:
    return [p.message for p in rep.problems if p.kind == kind]


def scratch_allgather(slot: int = 0):
    """2-rank allgather staged through the peer's scratch slot ``slot``; the peer always copies
    slot 0 out (so slot != 0 is a put into the wrong scratch offset)."""
    b = PlanBuilder("scratch_allgather", "allgather", 2, 1, 2, 2)
    for r in range(2):
        p = 1 - r
        b.op(r, 0, "copy", src=[L("i", 0, 1)], dst=[L("o", r, 1)])
        b.nop(r, 0)
        b.op(r, 0, "rlxsignal", channels=[p])
        b.op(r, 0, "rlxwait", channels=[p])
        b.nop(r, 0)
        b.op(r, 0, "put", src=[L("i", 0, 1)], dst=[R(p, "s", slot, 1)])
        b.nop(r, 0)
        b.op(r, 0, "signal", channels=[p])
        b.op(r, 0, "wait", channels=[p])
        b.nop(r, 0)
        b.op(r, 0, "copy", src=[L("s", 0, 1)], dst=[L("o", p, 1)])
        b.nop(r, 0)
    return b.build()


def missing_nop_after_wait():
    """Data read right after a wait, with no nop: the other threads are not ordered after it."""
    b = PlanBuilder("no_nop_after_wait", "allgather", 2, 1, 2, 1)
    for r in range(2):
        p = 1 - r
        b.op(r, 0, "copy", src=[L("i", 0, 1)], dst=[L("o", r, 1)])
        b.nop(r, 0)
        b.op(r, 0, "rlxsignal", channels=[p])
        b.op(r, 0, "rlxwait", channels=[p])
        b.nop(r, 0)
        b.op(r, 0, "put", src=[L("i", 0, 1)], dst=[R(p, "s", 0, 1)])
        b.nop(r, 0)
        b.op(r, 0, "signal", channels=[p])
        b.op(r, 0, "wait", channels=[p])
        b.op(r, 0, "copy", src=[L("s", 0, 1)], dst=[L("o", p, 1)])   # no nop before it
        b.nop(r, 0)
        b.op(r, 0, "signal", channels=[p])
        b.op(r, 0, "wait", channels=[p])
    return b.build()


# 1. a missing wait ---------------------------------------------------------------------------
def test_missing_wait() -> None:
    rep = _verify(simple_allgather(final_wait=False))
    races = _messages(rep, "race")
    assert any("put" in m and "launch end: outputs read" in m for m in races)
    assert any("signals" in m for m in _messages(rep, "unbalanced-channel"))


# 2. a relaxed signal used to publish data ----------------------------------------------------
def test_relaxed_signal_publishing_data() -> None:
    rep = _verify(simple_allgather(relaxed_publish=True))
    races = _messages(rep, "race")
    assert races and all("put" in m for m in races[:2])
    assert "unsynced-signal" not in rep.kinds()
    assert "deadlock" not in rep.kinds()


# 3. a wrong peer chunk -----------------------------------------------------------------------
def test_wrong_peer_chunk() -> None:
    rep = _verify(simple_allgather(wrong_chunk=True))
    sym = _messages(rep, "symbolic")
    assert any("rank 1 output chunk 0" in m and "missing (rank 0, chunk 0)" in m for m in sym), sym
    assert "postcondition" in rep.kinds()


# 4. a double reduction -----------------------------------------------------------------------
def test_double_reduction() -> None:
    rep = _verify(zero_copy_allreduce(double_src=True))
    sym = _messages(rep, "symbolic")
    assert any("counted more than once (rank 1, chunk 0) x2" in m for m in sym), sym
    assert "postcondition" in rep.kinds()


# 5. packet scratch reused across launches without double buffering ------------------------------
def test_packet_reuse_without_double_scratch() -> None:
    """A one-shot LL allreduce on a single scratch: a rank's next launch overwrites packets the
    peer may not have read (nothing the peer does after reading reaches the writer)."""
    rep = _verify(ll_oneshot_allreduce(double=False))
    races = _messages(rep, "race")
    assert any("use_double_scratch_buffer" in m and "(launch 1) reads" in m and "(launch 2) writes" in m
               for m in races), races
    # round robin alone finds it (deterministically, no lucky schedule needed)
    assert not verify(ll_oneshot_allreduce(double=False), schedules=1).ok
    # one launch alone is fine, and so is the double-buffered plan over several launches
    assert verify(ll_oneshot_allreduce(double=False), launches=1, schedules=3).ok
    assert verify(ll_oneshot_allreduce(double=True), launches=4, schedules=3).ok


def test_single_scratch_reuse_ordered_by_a_chain_of_edges_is_not_a_race() -> None:
    """Fidelity item 1 (issue 14): a two-step LL allreduce on a single scratch is correct. The
    peer sends its reduced block after reading my packets, and I unpack it before my launch ends,
    so my next launch's packets reach the peer's slot only after the peer read it (a chain of
    packet-flag edges, execution order only). The host hand-over of the scratch at each launch
    start used to be ordered against packet writes by the strong clock alone and reported it."""
    for launches in (2, 4):
        rep = verify(ll_allreduce(double=False), launches=launches, schedules=6)
        assert rep.ok, str(rep)


# 6. a barrier naming a block that never arrives ----------------------------------------------
def test_barrier_with_absent_block() -> None:
    rep = _verify(sem_barrier_allgather(bad_barrier=True))
    dl = _messages(rep, "deadlock")
    assert dl and "barrier 0" in dl[0] and "tb 3 finished without reaching it" in dl[0], dl
    with pytest.raises(Deadlock):
        run(sem_barrier_allgather(bad_barrier=True), [np.zeros(8, np.float32)] * 2)


# 7. an unbalanced semaphore ------------------------------------------------------------------
def test_unbalanced_semaphore_release() -> None:
    rep = _verify(sem_barrier_allgather(extra_release=True))
    msgs = _messages(rep, "unbalanced-semaphore")
    assert any("semaphore 0 is 1 after launch 1" in m for m in msgs)


def test_unbalanced_semaphore_acquire_deadlocks() -> None:
    rep = _verify(sem_barrier_allgather(double_acquire=True))
    dl = _messages(rep, "deadlock")
    assert dl
    assert ("no block of rank 0 will release semaphore 0" in dl[0]
            or "no block of rank 1 will release semaphore 0" in dl[0]), dl[0]


# 8. a put into the wrong scratch offset ------------------------------------------------------
def test_put_into_wrong_scratch_offset() -> None:
    assert verify(scratch_allgather(0), schedules=3).ok
    rep = _verify(scratch_allgather(1))
    sym = _messages(rep, "symbolic")
    assert any("output chunk 1" in m and "missing (rank 1, chunk 0)" in m for m in sym), sym


# 9. reading a peer's buffer with no ready handshake from that peer in the same launch ---------
def test_read_peer_without_handshake() -> None:
    rep = _verify(zero_copy_allreduce(handshake=False))
    races = _messages(rep, "race")
    assert any("rres" in m and "inputs written" in m and "no ready edge" in m for m in races), races


def test_put_into_peer_without_handshake() -> None:
    rep = _verify(simple_allgather(handshake=False))
    races = _messages(rep, "race")
    assert any("put" in m and "no ready edge" in m for m in races), races


# 10. a cross-rank wait cycle -----------------------------------------------------------------
def test_cross_rank_wait_cycle() -> None:
    assert verify(wait_cycle(broken=False), schedules=3).ok
    rep = _verify(wait_cycle())
    dl = rep.first("deadlock")
    assert dl is not None and "wait-for cycle" in dl.message
    cycle = dl.details["cycle"]
    assert {(r, tb) for r, tb, _, _ in cycle} == {(0, 0), (1, 0)}
    assert all(idx == "2" for _, _, idx, _ in cycle)


# 11. data published by a signal with no nop before it ----------------------------------------
def test_signal_without_nop() -> None:
    rep = _verify(simple_allgather(nop_before_signal=False))
    msgs = _messages(rep, "unsynced-signal")
    assert any("op 5 signal follows data op 4 put" in m for m in msgs), msgs


# 12. data read after a wait with no nop ------------------------------------------------------
def test_read_after_wait_without_nop() -> None:
    rep = _verify(missing_nop_after_wait())
    races = _messages(rep, "race")
    assert any("put" in m and "copy" in m and "scr" in m for m in races), races


# 13. an LL sender with no ready handshake from its receiver, over several launches -------------
def ll_broadcast(ranks: int = 2, ready: bool = False):
    """LL broadcast from rank 0: rank 0 packs its input into every receiver's double-buffered
    scratch, each receiver unpacks it into its output. Without ``ready`` nothing stops rank 0
    from running two launches ahead of a receiver and overwriting (same half, newer flag) packets
    the receiver has not read yet: the receiver then spins forever on the old flag. With
    ``ready`` every receiver signals rank 0 (relaxed) at the start of each launch and rank 0 waits
    for that before writing, so it is never more than one launch ahead (double buffering covers
    one). This is the library's old broadcast_ll bug."""
    b = PlanBuilder(f"ll_broadcast{'_ready' if ready else ''}", "broadcast", ranks, 1, 1, 1,
                    protocol="LL", use_double_scratch_buffer=True, root=0)
    dsts = [R(q, "s", 0, 1) for q in range(1, ranks)]
    if ready:
        for q in range(1, ranks):
            b.op(q, 0, "rlxsignal", channels=[0])
        b.op(0, 0, "rlxwait", channels=list(range(1, ranks)))
        b.nop(0, 0)
    b.op(0, 0, "ppkt", src=[L("i", 0, 1)], dst=dsts, channels=list(range(1, ranks)))
    b.op(0, 0, "copy", src=[L("i", 0, 1)], dst=[L("o", 0, 1)])
    for q in range(1, ranks):
        b.op(q, 0, "upkt", src=[L("s", 0, 1)], dst=[L("o", 0, 1)])
    return b.build()


@pytest.mark.parametrize("ranks", [2, 3])
def test_ll_sender_runs_two_launches_ahead(ranks: int) -> None:
    """Caught deterministically by the runahead schedule (the sender leads, receivers starved),
    at 2 and 3 ranks, as a deadlock: the receiver waits for flag-1 packets that launch 3
    overwrote. (Round-robin, random and adversarial schedules let the receiver keep up: over 20
    seeds at 4 launches they found it once at 2 ranks and never at 3.) Two launches are not
    enough to show it; the ready handshake fixes it."""
    from mscclang.sim import Simulation, sim_program
    from mscclang.sim.report import Deadlock

    plan = ll_broadcast(ranks)
    prog = sim_program(plan, 64, 64)
    inputs = [np.zeros(64, np.uint8) for _ in range(ranks)]
    for seed in range(5):
        sim = Simulation(prog, inputs, dtype=np.dtype(np.float16), launches=4, schedule="runahead",
                         seed=seed, lead=0)
        with pytest.raises(Deadlock) as e:
            sim.run()
        msg = e.value.problem.message
        assert "rank 0" not in msg.splitlines()[0] and "flag 1" in msg, msg
        assert "no block will write packets into rank" in msg, msg
    # verify(): the first runahead run of the rotation (the 4th) finds it
    rep = _verify(plan, launches=4, schedules=4, symbolic=False)
    dl = [p for p in rep.problems if p.kind == "deadlock"]
    assert dl and all("flag 1" in p.message for p in dl), str(rep)
    assert any("runahead" in p.context and "rank 0 runs ahead" in p.context for p in dl), str(rep)
    # with two launches the sender can be one launch ahead at most: double buffering holds
    assert verify(plan, launches=2, schedules=8).ok
    # the fixed plan is fine however far the schedule lets the sender run
    assert verify(ll_broadcast(ranks, ready=True), launches=5, schedules=8).ok


def test_runahead_schedule_lets_the_lead_rank_run_launches_ahead() -> None:
    """Runahead with lead 0 on the broken broadcast: rank 0 finishes all its launches while
    rank 1 has not finished its first; with lead 1 (receiver first) nothing goes wrong."""
    from mscclang.sim import Simulation, sim_program
    from mscclang.sim.report import Deadlock

    prog = sim_program(ll_broadcast(2), 64, 64)
    inputs = [np.zeros(64, np.uint8)] * 2
    sim = Simulation(prog, inputs, dtype=np.dtype(np.float16), launches=4, schedule="runahead", lead=0)
    with pytest.raises(Deadlock):
        sim.run()
    assert sim.rank_launch == [4, 1] and len(sim.outputs) == 4 and sim.outputs[0][1] is None
    sim = Simulation(prog, inputs, dtype=np.dtype(np.float16), launches=4, schedule="runahead", lead=1)
    sim.run()
    assert sim.rank_launch == [4, 4]


BROKEN_FILES = {
    "missing_wait.json": lambda: simple_allgather(final_wait=False),
    "relaxed_publish.json": lambda: simple_allgather(relaxed_publish=True),
    "wrong_peer_chunk.json": lambda: simple_allgather(wrong_chunk=True),
    "double_reduction.json": lambda: zero_copy_allreduce(double_src=True),
    "ll_single_scratch.json": lambda: ll_oneshot_allreduce(double=False),
    "barrier_absent_block.json": lambda: sem_barrier_allgather(bad_barrier=True),
    "unbalanced_semaphore.json": lambda: sem_barrier_allgather(extra_release=True),
    "wrong_scratch_offset.json": lambda: scratch_allgather(1),
    "read_without_handshake.json": lambda: zero_copy_allreduce(handshake=False),
    "wait_cycle.json": lambda: wait_cycle(),
    "signal_without_nop.json": lambda: simple_allgather(nop_before_signal=False),
    "ll_no_ready.json": lambda: ll_broadcast(2),
}
BROKEN_DIR = Path(__file__).parent / "plans_broken"
#: files whose defect shows only over more than two launches (verify them with --launches 4)
NEEDS_LAUNCHES = {"ll_no_ready.json"}
REGEN = bool(os.environ.get("MSCCLANG_REGEN_BROKEN"))


@pytest.mark.parametrize("fname", sorted(BROKEN_FILES))
def test_broken_plan_files(fname: str) -> None:
    """tests/plans_broken/*.json are these plans, saved (so `mscclang verify` can be shown them);
    each fails verification."""
    from mscclang.plan import load_plan, plan_to_json
    plan = BROKEN_FILES[fname]()
    f = BROKEN_DIR / fname
    if not f.exists() and REGEN:
        f.write_text(plan_to_json(plan))
    assert f.read_text() == plan_to_json(plan), f"{f} is stale; regenerate it from this test"
    kw = {"launches": 4, "schedules": 4} if fname in NEEDS_LAUNCHES else {"schedules": 2}
    assert not verify(load_plan(f), **kw).ok


def test_broken_plan_files_fail_in_cli(tmp_path, capsys) -> None:
    from mscclang.cli.main import main
    from mscclang.plan import save_plan
    f = tmp_path / "bad.json"
    save_plan(wait_cycle(), f)
    assert main(["verify", str(f), "--schedules", "2", "--sizes", "1K"]) == 1
    cap = capsys.readouterr()   # the report on standard output, the verdict on standard error
    assert "deadlock" in cap.out and "wait-for cycle" in cap.out
    assert cap.err == "mscclang verify: wait_cycle: FAILED (1 problem)\n"
    g = tmp_path / "good.json"
    save_plan(wait_cycle(broken=False), g)
    assert main(["verify", str(g), "--schedules", "2", "--sizes", "1K,4K", "--dtype", "fp16"]) == 0
    assert "OK" in capsys.readouterr().out
