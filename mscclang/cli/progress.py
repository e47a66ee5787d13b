"""Progress bars with an ETA for the long ``mscclang`` commands (verify, run on the simulator,
build-kernel, tune).

A bar is drawn on stderr only when asked (``--progress``) or, by default, when stderr is a
terminal: pipes, log files and tests see nothing. It uses tqdm (the ``plot`` extra) when it is
installed, else a one-line text fallback (``desc: 3/10 runs, 4s elapsed, ETA 9s``) redrawn at
most twice a second. A disabled bar costs nothing.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import IO, Optional

__all__ = ["Progress", "progress_wanted"]


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

    ``enabled``: None decides by whether ``stream`` is a terminal; ``use_tqdm=False`` forces the
    text fallback (tests use it)."""

    def __init__(self, total: Optional[int], desc: str, *, unit: str = "step",
                 enabled: Optional[bool] = None, stream: Optional[IO[str]] = None,
                 use_tqdm: bool = True) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = progress_wanted(enabled, self.stream)
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = 0
        self._bar = None
        self._t0 = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False
        self._closed = False
        self._tqdm = None
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
                                   dynamic_ncols=True, leave=False)

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
        """A short note shown after the counts (what is running now)."""
        self._start()
        if self._bar is not None:
            self._bar.set_postfix_str(text[:50], refresh=False)

    def update(self, n: int = 1) -> None:
        """``n`` more steps are done."""
        self.n += n
        if not self.enabled or self._closed:
            return
        self._start()
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last_draw >= 0.5 or (self.total is not None and self.n >= self.total):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = now - self._t0
        line = f"{self.desc}: {self.n}"
        if self.total:
            line += f"/{self.total} {self.unit}s, {_clock(elapsed)} elapsed"
            if 0 < self.n < self.total:
                line += f", ETA {_clock(elapsed / self.n * (self.total - self.n))}"
        else:
            line += f" {self.unit}s, {_clock(elapsed)} elapsed"
        self.stream.write("\r" + line + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Remove the bar (it leaves no line behind)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, et: Optional[type], ev: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()
