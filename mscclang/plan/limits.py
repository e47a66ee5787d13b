"""Limits on what mscclang reads and simulates, each with the environment variable that raises it.

Loading a plan is bounded before any validation work: the file size
(``MSCCLANG_MAX_PLAN_BYTES``, default 32 MiB) and the number of ops, pipeline inner ops included
(``MSCCLANG_MAX_PLAN_OPS``, default 100,000). The simulator's limits (memory and time of a run)
live in :mod:`mscclang.sim.budget` and use :func:`env_limit` too.

Values are read from the environment when a limit is needed, never cached, so a program (or a
test) can change them between calls. Sizes accept the suffixes K, M, G, T (powers of 1024).
"""

from __future__ import annotations

import os
import re

from mscclang.errors import LimitError

__all__ = ["env_limit", "max_plan_bytes", "max_plan_ops", "MAX_PLAN_BYTES_ENV", "MAX_PLAN_OPS_ENV",
           "DEFAULT_MAX_PLAN_BYTES", "DEFAULT_MAX_PLAN_OPS", "format_bytes"]

MAX_PLAN_BYTES_ENV = "MSCCLANG_MAX_PLAN_BYTES"
MAX_PLAN_OPS_ENV = "MSCCLANG_MAX_PLAN_OPS"
DEFAULT_MAX_PLAN_BYTES = 32 << 20
DEFAULT_MAX_PLAN_OPS = 100_000

_NUMBER = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*$")
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def env_limit(name: str, default: float) -> float:
    """The limit the environment variable ``name`` sets (a positive number, optionally with a
    K/M/G/T suffix), or ``default`` when it is unset or empty. A malformed value is an error
    that names the variable, not a silent fallback."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    m = _NUMBER.match(raw)
    if not m:
        raise LimitError(f"environment variable {name}={raw!r} is not a positive number "
                         "(e.g. 100000, 8G, 2.5)")
    value = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if value <= 0:
        raise LimitError(f"environment variable {name}={raw!r} must be positive")
    return value


def max_plan_bytes() -> int:
    """Largest plan file (or JSON text) :func:`mscclang.plan.load_plan` reads, in bytes."""
    return int(env_limit(MAX_PLAN_BYTES_ENV, DEFAULT_MAX_PLAN_BYTES))


def max_plan_ops() -> int:
    """Most ops (pipeline inner ops included) a plan may hold."""
    return int(env_limit(MAX_PLAN_OPS_ENV, DEFAULT_MAX_PLAN_OPS))


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (``"1.5 GiB"``)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"
