"""CPU tests of the trust issue's host-side guards: tensors on the wrong device never reach the
engine; setup exchanges between ranks that make different calls fail with both calls named; a
silent rank is named; the abort watchdog surfaces a GPU-side abort in the launching thread."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from mscclang.comm import Communicator
from mscclang.comm.backend import Engine
from mscclang.comm.errors import CommError
from mscclang.comm.tuning import TuningTable
from mscclang.errors import CallMismatch, CollectiveTimeout, InvalidCall
from mscclang.runtime.bootstrap import Bootstrap as RuntimeComm
from mscclang.config import Settings
from mscclang.runtime.watchdog import AbortWatchdog
from mscclang.comm.sim_ranks import catalog_of, stub_plan


class _GpuLikeParts:
    """The parts of an engine that says it runs on cuda:0: they call no tensor anything and fail
    the test if a call reaches them."""

    traces, mode, cap = False, "off", None

    def __init__(self) -> None:
        self.calls: list[str] = []

    def classify(self, tensor):
        return None

    def _reached(self, what: str) -> None:
        self.calls.append(what)
        raise AssertionError(f"{what}: a CPU tensor reached the engine")

    def run_call(self, *a, **kw):
        self._reached("run_call")

    def prepare_call(self, *a, **kw):
        self._reached("prepare_call")

    def empty(self, *a, **kw):
        self._reached("empty")


@pytest.fixture
def gpu_comm():
    be = _GpuLikeParts()
    plans = [stub_plan(c, 2) for c in ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast",
                                       "sendrecv")]
    engine = Engine(be, be, be, 0, 2, torch.device("cuda", 0))
    comm = Communicator(backend=engine, plans=catalog_of(plans), tuning=TuningTable(), fallback=False)
    return comm, be


@pytest.mark.parametrize("call", [
    lambda c, t: c.all_reduce(t), lambda c, t: c.all_gather(t), lambda c, t: c.reduce_scatter(t),
    lambda c, t: c.all_to_all(t), lambda c, t: c.broadcast(t, root=0), lambda c, t: c.send_recv(t),
    lambda c, t: c.send(t, 1), lambda c, t: c.recv(t, 1), lambda c, t: c.prepare("all_reduce", t),
    lambda c, t: c.all_reduce(torch.empty(0), out=t),
])
def test_cpu_tensor_on_a_gpu_communicator_is_refused_before_the_engine(gpu_comm, call):
    comm, be = gpu_comm
    with pytest.raises(CommError, match=r"rank 0: .* is on cpu, but this communicator runs on cuda:0"):
        call(comm, torch.ones(1024))
    assert be.calls == []
    assert isinstance(CommError("x"), InvalidCall)


def _runtime_comm(store, rank: int, world: int, timeout_s: float = 5.0) -> RuntimeComm:
    """The runtime communicator's store logic without a GPU."""
    c = object.__new__(RuntimeComm)
    c.store, c.rank, c.world_size = store, rank, world
    c.store_timeout_s = timeout_s
    c.prefix, c._seq, c.call = "t/1", 0, ""
    c._sym, c._sym_by_id, c._closed = [], {}, False
    return c


def _on_threads(world: int, fn):
    store = torch.distributed.HashStore()
    out: list = [None] * world

    def body(r: int) -> None:
        try:
            out[r] = fn(_runtime_comm(store, r, world), r)
        except BaseException as e:  # noqa: BLE001
            out[r] = e

    ts = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


def test_setup_exchange_of_different_calls_names_both():
    def fn(c, r):
        c.call = "allreduce of 2048 B bf16 on plan A" if r == 0 else "allreduce of 2097152 B bf16 on plan B"
        return c.exchange(b"x" * (r + 1), "context of plan A" if r == 0 else "symmetric allocation #0")

    res = _on_threads(2, fn)
    for e in res:
        assert isinstance(e, CallMismatch), e
        assert "ranks disagree on the call" in str(e)
        assert "rank 0: allreduce of 2048 B" in str(e) and "rank 1: allreduce of 2097152 B" in str(e)


def test_setup_exchange_of_the_same_call_passes_data():
    res = _on_threads(3, lambda c, r: c.exchange(bytes([r]) * 3, "context"))
    assert res == [[b"\x00" * 3, b"\x01" * 3, b"\x02" * 3]] * 3


def test_a_silent_rank_is_named():
    store = torch.distributed.HashStore()
    c = _runtime_comm(store, 0, 2, timeout_s=0.5)
    c.call = "allreduce of 4 B"
    with pytest.raises(CallMismatch, match=r"rank\(s\) \[1\] did not arrive"):
        c.barrier("context ready")


def test_watchdog_raises_in_the_launching_thread():
    state = {"v": 0}
    me = threading.get_ident()
    wd = AbortWatchdog(state=lambda: state["v"], describe=lambda: "rank 1 thread block 0 op 3 gave up",
                       reported=lambda: False, target=lambda: me, mode="raise",
                       poll_s=0.01, grace_s=0.02)
    try:
        state["v"] = 2
        with pytest.raises(CollectiveTimeout, match="op 3 gave up"):
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5:   # a replay loop that never checks
                time.sleep(0.001)
        assert wd.fired
    finally:
        wd.stop()


def test_watchdog_stays_quiet_when_the_host_reported_it():
    state = {"v": 0}
    hits: list = []
    wd = AbortWatchdog(state=lambda: state["v"], describe=lambda: hits.append(1) or "x",
                       reported=lambda: True, target=threading.get_ident, mode="raise",
                       poll_s=0.01, grace_s=0.02)
    try:
        state["v"] = 2
        time.sleep(0.3)
        assert not hits and wd.fired is None
    finally:
        wd.stop()


def test_watchdog_log_mode_and_rearm(caplog):
    state = {"v": 2}
    wd = AbortWatchdog(state=lambda: state["v"], describe=lambda: "gave up", reported=lambda: False,
                       target=lambda: None, mode="log", poll_s=0.01, grace_s=0.01)
    try:
        t0 = time.monotonic()
        while wd.fired is None and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert wd.fired == "gave up"
        wd.rearm()
        assert wd.fired is None
    finally:
        wd.stop()


def test_watchdog_mode_is_checked(monkeypatch):
    monkeypatch.setenv("MSCCLANG_ASYNC_ERROR", "explode")
    with pytest.raises(Exception, match="MSCCLANG_ASYNC_ERROR"):
        Settings.async_error.or_env()
    assert Settings.async_error.or_env("abort") == "abort"
