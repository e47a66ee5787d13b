"""No result of an aborted collective reaches user code without an exception (found from outside:
after a peer died, 222,909 CUDA-graph replays completed and synchronised with garbage results over
1.26 s before the watchdog's exception reached the replaying thread).

A launch that gives up holds until the host acknowledges the abort; the host acknowledges only
once the exception is on its way. Checked here without a GPU: the kernels' sources hold in every
path that gives up, the acknowledgement word is where the kernel reads it, the launching thread
acknowledges as it raises, and the watchdog acknowledges only after it acted."""

from __future__ import annotations

import ctypes
import re
import threading
import time
import types
from pathlib import Path

import pytest

from mscclang.errors import CollectiveTimeout
from mscclang.runtime import abort as abmod
from mscclang.runtime.structs import ERROR_RECORD
from mscclang.runtime.watchdog import AbortWatchdog

ROOT = Path(__file__).resolve().parent.parent


def test_every_kernel_path_that_gives_up_holds_for_the_host():
    src = "\n".join((ROOT / "executor" / f).read_text() for f in ("primitives.cuh", "interpreter.cuh"))
    body = src[src.index("struct Spin {"):]
    # the bounded spin: both ways of giving up (peer abort, own timeout) hold before returning
    tick = body[:body.index("};")]
    assert len(re.findall(r"hold_for_host\(c\);\s*return true;", tick)) == 2
    # the interpreter's entry check (an earlier launch or a peer aborted)
    entry = src[src.index("if (s_stop) {"):]
    assert entry.index("hold_for_host(c)") < entry.index("return;")
    # the hold is bounded by the launch's timeout and reads the record's acknowledgement word
    hold = src[src.index("void hold_for_host("):]
    hold = hold[:hold.index("\n}\n")]
    assert "c.timeout_ns" in hold and "host_ack" in hold


def test_specialised_kernels_hold_too():
    from mscclang.plan.io import load_plan
    from mscclang.runtime.packing import pack_blocks
    from mscclang.runtime.spec_source import generate

    plan = load_plan(ROOT / "plans" / "allreduce_oneshot_ll.r2.i1.json")
    src = generate(plan, pack_blocks(plan, 0, 4096, 4096), "bf16", "ll16", "sum").source
    assert src.count("record_error(") == src.count("hold_for_host(") > 0


def test_the_acknowledgement_word_is_where_the_kernel_reads_it():
    assert ERROR_RECORD.offsets["host_ack"] == abmod.ACK_OFFSET
    assert ERROR_RECORD.size <= abmod.AREA_BYTES
    layout = (ROOT / "executor" / "plan_layout.cuh").read_text()
    rec = layout[layout.index("struct ErrorRecord {"):]
    assert "u32 host_ack;" in rec[:rec.index("};")]


class _HostMem:
    """Host-mapped memory and a device synchronisation that records the acknowledgement word."""

    def __init__(self) -> None:
        self.buf = (ctypes.c_uint8 * abmod.AREA_BYTES)()
        self.acks_at_sync: list[int] = []

    def host_alloc_mapped(self, n: int):
        return ctypes.addressof(self.buf), 0xD000

    def host_free(self, p: int) -> None:
        pass

    def check(self, r, what=""):
        return r

    def driver(self):
        def sync():
            self.acks_at_sync.append(self.word(abmod.ACK_OFFSET))
            return 0
        return types.SimpleNamespace(cuCtxSynchronize=sync)

    def word(self, off: int) -> int:
        return ctypes.c_uint32.from_address(ctypes.addressof(self.buf) + off).value

    def set_state(self, v: int) -> None:
        ctypes.c_uint32.from_address(ctypes.addressof(self.buf)).value = v


@pytest.fixture
def host(monkeypatch):
    h = _HostMem()
    monkeypatch.setattr(abmod, "cu", h)
    return h


def _state(comm=None):
    comm = comm or types.SimpleNamespace(rank=0, world_size=2)
    return abmod.AbortState(comm, lambda: "allreduce of 2000 B bf16 on plan p", watchdog="log", poll_s=5.0)


def test_the_launching_thread_acknowledges_as_it_raises(host):
    ab = _state()
    try:
        ab.check()                      # nothing gave up
        assert host.word(abmod.ACK_OFFSET) == 0
        host.set_state(1)               # a block is still writing the record: the host waits for it
        with pytest.raises(CollectiveTimeout, match="gave up"):
            ab.check()
        # acknowledged before waiting for the device: the held launches may end, so the wait ends
        assert host.acks_at_sync == [1]
        ab.rearm()
        assert host.word(abmod.ACK_OFFSET) == 0 and not ab.pending()
    finally:
        ab.close()


@pytest.mark.parametrize("kind,i,j,seen,bound,text", [
    (2, -1, -1, 70, 64, "rank 3: its output segments hold 70 rows .the counts it receives., more than its output's 64 rows"),
    (0, 1, 3, -2, 0, r"count \[1\]\[3\] is -2"),
    (1, 1, 3, 4, 5, "rank 1 expects 5 rows from rank 3, rank 3 sends 4"),
])
def test_a_failed_count_check_raises_counts_error(host, kind, i, j, seen, bound, text):
    from mscclang.errors import CountsError

    code = {0: 0, 1: 1, 2: 3}[kind]   # CHECK_NONNEG, CHECK_EXPECT, CHECK_OUTPUT
    rec = ERROR_RECORD.pack(state=2, rank=3 if kind == 2 else i, block=0, op_index=code, what=7,
                            channel=-1 if i < 0 else (i << 16) | j, expected=bound % (1 << 64), seen=seen % (1 << 64))
    ctypes.memmove(host.buf, rec, len(rec))
    ab = _state()
    try:
        with pytest.raises(CountsError, match=r"rank 0: the call's count matrix fails a check, no data moved: " + text):
            ab.check()
        assert host.word(abmod.ACK_OFFSET) == 1
    finally:
        ab.close()


def test_close_lets_held_launches_end(host):
    ab = _state()
    host.set_state(2)
    ab.close()
    assert host.word(abmod.ACK_OFFSET) == 1


@pytest.mark.parametrize("mode", ["raise", "log"])
def test_the_watchdog_acknowledges_only_after_it_acted(mode, monkeypatch):
    from mscclang.runtime import watchdog as wdmod

    state = {"v": 0}
    order: list[str] = []
    real = wdmod.raise_in_thread
    monkeypatch.setattr(wdmod, "raise_in_thread", lambda tid, msg: order.append("posted") or real(tid, msg))
    ready = threading.Event()
    caught: list[BaseException] = []

    def replaying_thread():
        ready.set()
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5:   # a replay loop that never checks
                time.sleep(0.001)
        except CollectiveTimeout as e:
            order.append("raised")
            caught.append(e)

    th = threading.Thread(target=replaying_thread)
    th.start()
    ready.wait()
    wd = AbortWatchdog(state=lambda: state["v"], describe=lambda: "rank 1 thread block 0 op 3 gave up",
                       reported=lambda: False, target=lambda: th.ident, mode=mode, poll_s=0.01, grace_s=0.02,
                       acknowledge=lambda: order.append("ack"))
    try:
        state["v"] = 2
        t0 = time.monotonic()
        while "ack" not in order and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert "ack" in order
        if mode == "raise":
            th.join(5)
            assert caught and order.index("posted") < order.index("ack")
        else:
            assert "posted" not in order
    finally:
        wd.stop()
        th.join(6)


def test_the_watchdog_leaves_the_acknowledgement_to_a_host_that_reported():
    acks: list = []
    wd = AbortWatchdog(state=lambda: 2, describe=lambda: "x", reported=lambda: True, target=lambda: None,
                       mode="raise", poll_s=0.01, grace_s=0.02, acknowledge=lambda: acks.append(1))
    try:
        time.sleep(0.2)
        assert acks == [] and wd.fired is None
    finally:
        wd.stop()
