"""Where in the user's program a DSL call was made.

Every op the DSL records carries the source line of the call that made it (``"program.py:42"``:
the base name of the file and the line), so diagnoses of the compiled plan can point at the
program. The line is that of the innermost stack frame outside the DSL's own code: frames of
:mod:`mscclang.dsl` and :mod:`mscclang.compiler` are skipped, and so are frames of any module
that declares itself a DSL helper with a module-level ``__mscclang_helper__ = True`` (the
library's :mod:`mscclang.algorithms.common` does, so library plans point at the algorithm's own
file rather than at the shared helper). Only the base name is kept, so a plan compiled from the
same program in another directory is byte-identical.

The same walk gives warnings a ``stacklevel`` that names the user's line, not the compiler's.
"""

from __future__ import annotations

import functools
import os
import sys
from types import FrameType
from typing import Optional

__all__ = ["HELPER_MARKER", "is_internal", "source_line", "user_frame", "user_stacklevel"]

#: module-level name that marks a module's frames as DSL helpers (skipped)
HELPER_MARKER = "__mscclang_helper__"

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL_DIRS = tuple(os.path.join(_PKG, d) + os.sep for d in ("dsl", "compiler"))


def is_internal(frame: FrameType) -> bool:
    """Whether ``frame`` belongs to the DSL's implementation or to a marked helper module."""
    if frame.f_globals.get(HELPER_MARKER) is True:
        return True
    filename = frame.f_code.co_filename
    return filename.startswith(_INTERNAL_DIRS) or (
        not os.path.isabs(filename) and _internal_path(filename, os.getcwd()))


@functools.lru_cache(maxsize=256)
def _internal_path(filename: str, cwd: str) -> bool:
    """Whether the relative ``filename`` (from ``cwd``) lies in the DSL's code (every op the DSL
    records asks this of its caller's file: a cached answer keeps that cheap)."""
    return os.path.normpath(os.path.join(cwd, filename)).startswith(_INTERNAL_DIRS)


def user_frame(start: Optional[FrameType] = None) -> Optional[FrameType]:
    """The innermost frame, from ``start`` (default: the caller's) outwards, outside the DSL."""
    frame = start if start is not None else sys._getframe(1)
    while frame is not None and is_internal(frame):
        frame = frame.f_back
    return frame


def source_line(start: Optional[FrameType] = None) -> Optional[str]:
    """``"file.py:LINE"`` of :func:`user_frame`, or ``None`` when every frame is internal."""
    frame = user_frame(start if start is not None else sys._getframe(1))
    if frame is None:
        return None
    return f"{_basename(frame.f_code.co_filename)}:{frame.f_lineno}"


_basename = functools.lru_cache(maxsize=256)(os.path.basename)


def user_stacklevel() -> int:
    """A ``stacklevel`` for :func:`warnings.warn`, called from the caller of this function, that
    attributes the warning to the innermost frame outside the DSL."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and is_internal(frame):
        frame = frame.f_back
        level += 1
    return level
