"""Progress bars with an ETA for the long ``mscclang`` commands (verify, run on the simulator,
build-kernel, tune).

On a terminal (or with ``--progress``) a bar is drawn on stderr: tqdm (the ``plot`` extra) when
it is installed, else a one-line text fallback (``desc: 3/10 runs, 4s elapsed, ETA 9s``) redrawn
at most twice a second; either is redrawn every second, also while one long step runs, and at
each new note (so a step just done shows at once). When stderr is not a terminal (pipes, logs,
CI) the same line is printed as a plain line every :data:`PLAIN_INTERVAL` seconds (none for a
command that ends sooner). ``--no-progress`` prints nothing; a disabled bar costs nothing.

The ETA is the time the work done so far took, scaled to the work left: steps count one unit of
work each unless they say how much (``update(work=...)``, with the total given as ``work=``): a
module of 6 kernels is three of 2, a plan of 64 instances more than one of 1. No ETA is shown
before some work is done (a quick first step that is not part of the work, such as the layout
checks of ``build-kernel``, is a note, not a step).
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import IO, Optional

__all__ = ["Progress", "progress_wanted", "PLAIN_INTERVAL"]

#: seconds between two plain lines when stderr is not a terminal
PLAIN_INTERVAL = 5.0
#: seconds between two redraws of a bar on a terminal
_TTY_INTERVAL = 1.0


def progress_wanted(flag: Optional[bool], stream: Optional[IO[str]] = None) -> bool:
    """Whether to draw a bar: ``flag`` when it is given (``--progress`` / ``--no-progress``),
    else whether ``stream`` (default stderr) is a terminal."""
    if flag is not None:
        return bool(flag)
    s = sys.stderr if stream is None else stream
    try:
        return bool(s.isatty())
    except (AttributeError, ValueError):
        return False


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Progress:
    """A progress bar over ``total`` steps (``total`` may be set later, e.g. by a callback that
    learns it). Use as a context manager, or call :meth:`close`.

    ``enabled``: True draws a bar, False nothing, None a bar when ``stream`` is a terminal and
    plain lines every ``interval`` seconds otherwise; ``use_tqdm=False`` forces the text
    fallback (tests use it). While it is open a daemon thread redraws it (or prints the lines);
    :meth:`close` stops the thread."""

    def __init__(self, total: Optional[int], desc: str, *, unit: str = "step",
                 enabled: Optional[bool] = None, stream: Optional[IO[str]] = None,
                 use_tqdm: bool = True, interval: float = PLAIN_INTERVAL, work: Optional[float] = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = progress_wanted(enabled, self.stream)
        #: plain lines (no terminal, nothing asked) instead of a bar
        self.plain = enabled is None and not self.enabled
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = 0
        #: the work of all the steps (default: one per step) and of those done
        self.work, self.work_done = work, 0.0
        self.note = ""
        self._bar = None
        self._t0 = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False
        self._closed = False
        self._tqdm = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: Optional[threading.Thread] = None
        if self.enabled or self.plain:
            self._ticker = threading.Thread(target=self._tick, args=(interval if self.plain else _TTY_INTERVAL,),
                                            name=f"progress {desc}", daemon=True)
            self._ticker.start()
        if self.enabled and use_tqdm:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm
            except ImportError:
                pass
        if total is not None:
            self._start()

    def _start(self) -> None:
        """Create the tqdm bar (once the total is known, so it never shows a count without one)."""
        if self._tqdm is not None and self._bar is None and not self._closed:
            self._bar = self._tqdm(total=self.total, desc=self.desc, unit=self.unit, file=self.stream,
                                   dynamic_ncols=True, leave=False,   # our ETA (the work's), not tqdm's
                                   bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} {unit}s [{elapsed}{postfix}]")

    def set_total(self, total: int) -> None:
        """Set (or change) the number of steps."""
        if total == self.total:
            return
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()
        else:
            self._start()

    def set_note(self, text: str) -> None:
        """A short note shown after the counts (what is running now); the bar is redrawn."""
        self.note = text[:50]
        if not self.enabled or self._closed:
            return
        self._start()
        if self._bar is not None or self._tqdm is None:
            with self._lock:
                self._draw(time.monotonic())

    def _tick(self, interval: float) -> None:
        """The ticker thread: redraw the bar, or print a plain line, every ``interval`` s."""
        while not self._stop.wait(interval):
            with self._lock:
                if self._closed:
                    return
                if self._bar is not None or self._tqdm is None:  # tqdm draws once the total is known
                    self._draw(time.monotonic())

    def update(self, n: int = 1, work: Optional[float] = None) -> None:
        """``n`` more steps are done, ``work`` units of work (default ``n``)."""
        self.n += n
        self.work_done += n if work is None else work
        if not self.enabled or self._closed:
            return
        self._start()
        if self._bar is not None:
            self._bar.update(n)
            with self._lock:
                self._draw(time.monotonic())
            return
        now = time.monotonic()
        if now - self._last_draw >= 0.5 or (self.total is not None and self.n >= self.total):
            self._last_draw = now
            with self._lock:
                self._draw(now)

    def eta(self, now: float) -> Optional[float]:
        """Seconds left at ``now`` (``time.monotonic()``): the elapsed time per unit of work done,
        times the work left; None before any work is done or once every step is."""
        work = self.work if self.work is not None else self.total
        if not work or not self.total or self.n >= self.total or self.work_done <= 0:
            return None
        return (now - self._t0) / self.work_done * max(work - self.work_done, 0.0)

    def _draw(self, now: float) -> None:
        eta = self.eta(now)
        tail = f", ETA {_clock(eta)}" if eta is not None else ""
        if self._bar is not None:   # tqdm draws the counts and the elapsed time
            self._bar.set_postfix_str(f"{self.note}{tail}" if self.note else tail[2:], refresh=True)
            return
        line = f"{self.desc}: {self.n}"
        if self.total:
            line += f"/{self.total} {self.unit}s"
        else:
            line += f" {self.unit}s"
        line += f" ({self.note})" if self.note else ""
        line += f", {_clock(now - self._t0)} elapsed{tail}"
        self.stream.write(line + "\n" if self.plain else "\r" + line + "\x1b[K")
        self.stream.flush()
        self._drawn = not self.plain

    def close(self) -> None:
        """Remove the bar (it leaves no line behind)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join()
        if self._bar is not None:
            self._bar.close()
        elif self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, et: Optional[type], ev: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()
