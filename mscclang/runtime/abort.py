"""The abort record and the bounded waits.

A launch that gives up (a bounded spin expired, or a peer aborted) writes the error record in
host-mapped memory, sets the abort words, and then holds (bounded by the timeout) until the host
acknowledges it in the record (``host_ack``). The host acknowledges only once the exception is on
its way to the code that launched the collective: the launching thread raising it
(:meth:`AbortState.check`, at the next call or synchronisation), or the watchdog having raised it
in that thread, aborted the process, or (mode ``log``) logged it. So neither the launch that gave
up nor a later one (a CUDA graph replay) completes while the launching thread could still read
its result without an exception. A collective reset clears the record.

Every host-side wait here is bounded: a stream that does not drain within its limit ends in
:class:`~mscclang.errors.CollectiveTimeout`, never a hang.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import threading
import time
from typing import Any, Callable, Optional

from mscclang.errors import CollectiveTimeout, CountsError
from mscclang.runtime import cuda as cu
from mscclang.runtime.counted import WHAT_COUNTS, counts_error_text
from mscclang.runtime.structs import ERROR_RECORD
from mscclang.runtime.watchdog import AbortWatchdog

log = logging.getLogger("mscclang.runtime.abort")

AREA_BYTES = 256
ACK_OFFSET = ERROR_RECORD.offsets["host_ack"]
_WHAT = {1: "a signal", 2: "LL packets", 3: "a barrier", 4: "a semaphore", 5: "nothing (a peer or another "
         "block aborted)", 6: "a port channel's proxy to finish its copies (flush)"}


class AbortState:
    """The error record of one executor and what the host does with it. ``comm`` names the rank
    and reaches the store (to ask the other ranks what they called last); ``last_call`` returns a
    description of this rank's latest call (or None)."""

    def __init__(self, comm: Any, last_call: Callable[[], Optional[str]], watchdog: Optional[str] = None,
                 poll_s: float = 0.05) -> None:
        self.comm = comm
        self._last_call = last_call
        self.host, self.dev = cu.host_alloc_mapped(AREA_BYTES)
        #: the launches' error word in host-mapped memory, nonzero once one gave up (a plain
        #: read: the memo hit's launch reads it without a call)
        self.word = ctypes.c_uint32.from_address(self.host)
        self.aborted = False
        self.reported = False          # the current abort was raised to the caller by a host call
        self._msg: Optional[str] = None
        self.generation = 0            # resets so far (the same on every rank): names store keys
        self.user_thread: Optional[int] = threading.get_ident()
        self.watchdog: Optional[AbortWatchdog] = AbortWatchdog(
            state=self.state, describe=self.text, reported=lambda: self.reported,
            target=lambda: self.user_thread, mode=watchdog, poll_s=poll_s, acknowledge=self.acknowledge)

    def state(self) -> int:
        """Nonzero once a launch gave up (a plain read of host-mapped memory)."""
        return self.word.value

    def pending(self) -> bool:
        """Whether a launch gave up since the last reset (or a host wait declared it)."""
        return self.aborted or self.state() != 0

    def acknowledge(self) -> None:
        """Let held launches end: the exception is on its way to the caller."""
        if self.host:
            ctypes.c_uint32.from_address(self.host + ACK_OFFSET).value = 1

    def check(self) -> None:
        """Raise CollectiveTimeout if a launch gave up (until :meth:`rearm`); CountsError when
        it gave up because the count matrix failed a check (a plan with segments)."""
        st = self.state()
        if st == 0 and not self.aborted:
            return
        self.aborted = True
        self.reported = True
        self.acknowledge()   # this thread raises now: held launches may end
        if st == 1:
            cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        msg = self.text()
        if self.watchdog is not None and self.watchdog.fired:
            msg += " (reported earlier by the watchdog)"
        raise (CountsError if self._record()["what"] == WHAT_COUNTS else CollectiveTimeout)(msg)

    def _record(self) -> dict[str, int]:
        return ERROR_RECORD.unpack(ctypes.string_at(self.host, ERROR_RECORD.size))

    def text(self) -> str:
        """The current abort's message, built once (the watchdog's thread or the caller's)."""
        if self._msg is None:
            self._msg = self._message()
        return self._msg

    def _message(self) -> str:
        rec = self._record()
        what = _WHAT.get(rec["what"], f"kind {rec['what']}")
        chan = f" on channel {rec['channel']}" if rec["channel"] >= 0 and rec["what"] in (1, 3, 4, 6) else ""
        if rec["state"] == 0:
            head = f"rank {self.comm.rank}: a host-side wait gave up"
        elif rec["what"] == WHAT_COUNTS:   # the kernel's count check (mscclang.runtime.counted)
            ch = rec["channel"]
            head = f"rank {self.comm.rank}: the call's count matrix fails a check, no data moved: " + counts_error_text(
                rec["op_index"], rec["rank"], ch >> 16 if ch >= 0 else -1, ch & 0xFFFF if ch >= 0 else -1,
                _signed(rec["seen"]), _signed(rec["expected"]))
        else:
            head = (f"rank {rec['rank']} thread block {rec['block']} op {rec['op_index']} gave up waiting for "
                    f"{what}{chan} (expected {rec['expected']}, saw {rec['seen']}) after "
                    f"{rec['elapsed_ns'] / 1e9:.3f} s")
        msg = head + "; the collective was aborted on every rank: call reset() on all ranks to continue"
        calls = self.calls_of_ranks()
        if calls:
            msg += "; last calls: " + ", ".join(calls)
        return msg

    def calls_of_ranks(self) -> list[str]:
        """``rank R: <its last call>`` for this rank and the ranks that publish theirs within a
        second (a dead or hung rank does not: it is named as silent)."""
        mine = self._last_call() or "nothing yet"
        comm = self.comm
        out = {comm.rank: mine}
        store = getattr(comm, "store", None)
        prefix = getattr(comm, "prefix", None)
        if store is not None and prefix is not None:
            try:
                store.set(f"{prefix}/lastcall/{self.generation}/{comm.rank}", mine.encode())
            except Exception:  # noqa: BLE001 - the store may be gone with a dead rank 0
                return [f"rank {comm.rank}: {mine}"]
            for q in range(comm.world_size):
                if q == comm.rank:
                    continue
                try:
                    key = f"{prefix}/lastcall/{self.generation}/{q}"
                    store.wait([key], datetime.timedelta(seconds=1))
                    out[q] = bytes(store.get(key)).decode("utf-8", "replace")
                except Exception:  # noqa: BLE001 - silent rank
                    out[q] = "no answer (dead or hung?)"
        return [f"rank {q}: {out[q]}" for q in sorted(out)]

    def rearm(self) -> None:
        """After a collective reset: clear the record (the acknowledgement too) and watch again."""
        ctypes.memset(self.host, 0, AREA_BYTES)
        self.aborted = False
        self.reported = False
        self._msg = None
        self.generation += 1
        if self.watchdog is not None:
            self.watchdog.rearm()

    def close(self) -> None:
        """Stop the watchdog and let held launches end (before the device is synchronised)."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        self.acknowledge()

    def free(self) -> None:
        """Free the record (after the device is idle)."""
        if self.host:
            self.word = ctypes.c_uint32(0)   # nothing reads freed memory
            cu.host_free(self.host)
            self.host = 0


def _signed(v: int) -> int:
    """A u64 field of the error record read as the i64 the kernel stored."""
    return v - (1 << 64) if v >= 1 << 63 else v


class Drainer:
    """Bounded waits for work enqueued on streams (a cuCtxSynchronize with a limit)."""

    def __init__(self) -> None:
        self._event: Any = None

    def drained(self, streams: list, limit_s: float, stop: Optional[Callable[[], bool]] = None) -> bool:
        """Whether the work enqueued so far on ``streams`` finishes within ``limit_s`` and before
        ``stop()`` says to stop waiting."""
        drv = cu.driver()
        ev = self._event
        if ev is None:
            ev = self._event = cu.check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                                        "cuEventCreate")
        t0 = time.monotonic()
        for s in streams:
            cu.check(drv.cuEventRecord(ev, s), "cuEventRecord")
            while True:
                err, = drv.cuEventQuery(ev)
                if int(err) == 0:
                    break
                if int(err) != int(drv.CUresult.CUDA_ERROR_NOT_READY):
                    cu.check(err, "cuEventQuery")
                if time.monotonic() - t0 > limit_s or (stop is not None and stop()):
                    return False
                time.sleep(0.0005)
        return True


class Waits:
    """The executor's bounded waits for its launches, the port proxy's side streams and the
    engine's transfers. ``timeout_ns()`` is the spin bound, ``abort`` the :class:`AbortState`,
    ``launcher`` the launcher (current and last streams), ``proxy()`` and ``engine()`` the port
    proxy and the engine of port channels between nodes."""

    def __init__(self, rank: int, timeout_ns: Callable[[], int], abort: Any, launcher: Any,
                 proxy: Callable[[], Any], engine: Callable[[], Any]) -> None:
        self.rank = rank
        self._timeout_ns = timeout_ns
        self.abort = abort
        self.launcher = launcher
        self._proxy = proxy
        self._engine = engine
        self.drainer = Drainer()

    def synchronize(self) -> None:
        """Wait for the launches and raise CollectiveTimeout if one gave up. A launch that gave
        up is raised at once (it holds until the host has seen it); with engine channels (port
        channels between nodes) an engine receive for a dead peer is ended by aborting the
        engine's communicators."""
        if self._engine().comms:
            self.engine()
            return
        self.ports("synchronize")
        streams = [self.launcher.current_stream()]
        if self.launcher.last_stream is not None:
            streams.append(self.launcher.last_stream)
        # a launch that gave up holds until acknowledged: check() acknowledges, then waits
        self.drainer.drained(streams, 4 * self._timeout_ns() / 1e9 + 10.0, self.abort.pending)
        if not self.abort.pending():
            cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        self.abort.check()

    def _streams(self) -> list:
        streams = list(self._proxy().side_streams()) + [self.launcher.current_stream()]
        if self.launcher.last_stream is not None:
            streams.append(self.launcher.last_stream)
        return streams

    def ports(self, what: str) -> None:
        """Bounded wait for the port proxy's side streams (their ``cuStreamWaitValue32`` has no
        timeout); should one still wait, CollectiveTimeout instead of a hang."""
        if not self._proxy().enqueued:
            return
        streams = self._streams()
        t = self._timeout_ns() / 1e9
        limit = 2 * t + 5.0
        if self.drainer.drained(streams, limit):
            return
        self.abort.aborted = True
        engine = self._engine()
        if engine.comms:
            engine.close(abort=True)   # an engine receive for a dead peer never completes
            if self.drainer.drained(streams, 10.0 + t):
                return
        raise CollectiveTimeout(f"rank {self.rank}: {what}: the port-channel proxy's stream operations "
                                f"did not finish within {limit:.0f} s (a wait for a trigger that no kernel "
                                "posts); this process cannot recover: restart it")

    def engine(self) -> None:
        """Bounded wait with engine channels: their transfers to a dead peer never end, so once a
        kernel gave up (or twice the timeout passed) the engine's communicators are aborted."""
        streams = self._streams()
        t = self._timeout_ns() / 1e9
        limit = 2 * t + 5.0
        if not self.drainer.drained(streams, limit, lambda: self.abort.state() != 0):
            kernel_gave_up = self.abort.state() != 0
            if kernel_gave_up:
                self.abort.acknowledge()
            self._engine().close(abort=True)   # ends engine calls waiting for a dead peer
            self.abort.aborted = True
            if not self.drainer.drained(streams, 10.0 + t):
                raise CollectiveTimeout(f"rank {self.rank}: GPU work still runs after the engine's "
                                        "communicators were aborted (a transfer to or from a dead peer did "
                                        "not end); this process cannot recover: restart it")
            if not kernel_gave_up:
                raise CollectiveTimeout(f"rank {self.rank}: the engine's transfers (NCCL point-to-point "
                                        f"of port channels between nodes) did not finish in {limit:.0f} s; "
                                        "its communicators were aborted")
        self.abort.check()
