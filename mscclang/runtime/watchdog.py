"""The abort watchdog: surfaces a GPU-side abort that no host call would report.

Eager calls report an abort at the next call (:meth:`Executor.check`). A CUDA graph replays its
kernels without any host call of ours: after a peer dies, the kernels give up, set the abort
word and exit early, and every later replay returns garbage with no error. The watchdog is a
daemon thread that polls the executor's host-mapped error record (a plain memory read, no CUDA
call) and, when a launch gave up, acts once per abort according to ``MSCCLANG_ASYNC_ERROR``,
then acknowledges the abort, which lets the held launches end (:mod:`mscclang.runtime.abort`):

* ``raise`` (default): log the error and raise :class:`~mscclang.errors.CollectiveTimeout` in
  the thread that launched the collectives (an asynchronous exception, delivered at its next
  Python bytecode, e.g. right after ``graph.replay()`` returns);
* ``abort``: log the error and abort the process (as NCCL's watchdog does with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING``);
* ``log``: log only (the launches then end at once and their results reach the caller: only for
  debugging).

In every mode the next host-side call (a collective, ``synchronize``, ``check``) raises.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Callable, Optional

from mscclang.config import Settings
from mscclang.errors import CollectiveTimeout

log = logging.getLogger("mscclang.runtime")

def raise_in_thread(thread_id: int, message: str) -> bool:
    """Raise ``CollectiveTimeout(message)`` asynchronously in thread ``thread_id``; False when no
    such thread is alive."""
    cls = type("CollectiveTimeout", (CollectiveTimeout,),
               {"__init__": lambda self: CollectiveTimeout.__init__(self, message),
                "__module__": CollectiveTimeout.__module__})
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(cls))
    return n == 1


class AbortWatchdog:
    """Polls ``state()`` (nonzero once a launch gave up) every ``poll_s`` seconds in a daemon
    thread. On an abort that the host has not reported within ``grace_s`` (``reported()`` stays
    false), calls ``describe()`` for the message and acts per ``mode`` on ``target()``, the id of
    the thread that launched the collectives. :meth:`rearm` after a reset; :meth:`stop` to end."""

    def __init__(self, state: Callable[[], int], describe: Callable[[], str], reported: Callable[[], bool],
                 target: Callable[[], Optional[int]], mode: Optional[str] = None, poll_s: float = 0.05,
                 grace_s: float = 0.2, acknowledge: Optional[Callable[[], None]] = None) -> None:
        self.mode = Settings.async_error.or_env(mode)
        self._ack = acknowledge
        self._state, self._describe, self._reported, self._target = state, describe, reported, target
        self.poll_s, self.grace_s = poll_s, grace_s
        self.fired: Optional[str] = None     # the message of the abort acted on (until rearm)
        self._stop = threading.Event()
        self._armed = threading.Event()
        self._armed.set()
        self._thread = threading.Thread(target=self._loop, name="mscclang-watchdog", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            if not self._armed.is_set() or not self._state():
                continue
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline and not self._stop.is_set():
                if self._reported():
                    break
                time.sleep(min(self.poll_s, 0.01))
            if self._stop.is_set():
                return
            self._armed.clear()
            if self._reported():
                continue   # the host already raised it (an eager call, synchronize, check)
            try:
                msg = self._describe()
            except Exception as e:  # noqa: BLE001 - never let the watchdog die silently
                msg = f"a collective launch gave up (the error record could not be read: {e})"
            self.fired = msg
            log.error("mscclang watchdog: %s", msg)
            if self.mode == "abort":
                os.abort()
            elif self.mode == "raise":
                tid = self._target()
                if tid is not None:
                    raise_in_thread(tid, msg)
            if self._ack is not None:
                self._ack()   # the exception is on its way (or only logged): held launches may end

    def rearm(self) -> None:
        """Watch for the next abort (after a collective reset)."""
        self.fired = None
        self._armed.set()

    def stop(self) -> None:
        """End the thread (returns within one poll period)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 4 * self.poll_s))
